"""`trainer.report_to: tensorboard` (the paper configs' default) writes every logged metric, D3S's too."""

from __future__ import annotations

import pytest
from helpers import write_run_config

from d3s.cli import main


@pytest.mark.slow
def test_tensorboard_receives_the_trainer_and_selection_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = write_run_config(
        tmp_path,
        trainer={
            "max_steps": 2,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 16,
            "logging_steps": 1,
            "report_to": "tensorboard",
        },
    )
    assert main(["train", "--config", str(path)]) == 0
    # transformers' default logging_dir: <output_dir>/runs/<time>_<host>
    (events,) = (tmp_path / "run" / "runs").glob("*/events.out.tfevents.*")
    scalars = EventAccumulator(str(events.parent)).Reload().Tags()["scalars"]
    for tag in ("train/loss", "train/grad_norm", "train/selection/sample_keep_fraction"):
        assert tag in scalars, sorted(scalars)
    steps = EventAccumulator(str(events.parent)).Reload().Scalars("train/loss")
    assert [point.step for point in steps] == [1, 2]
