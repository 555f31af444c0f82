"""The workflow's glue, one module per job: the commands (accelerate, vLLM server), a job's processes,
GPU slots, the vLLM server's life, the run configs, and one training job."""
