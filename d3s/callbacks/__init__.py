"""What D3STrainer adds to TRL's trainer as transformers callbacks: checkpoint state (``checkpoints.py``)
and the run's logs: metrics.jsonl, the anatomy log and the NaN stop (``logs.py``); d3s/runs/ reads them."""
