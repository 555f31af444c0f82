"""A run killed at any point of its life re-runs to the uninterrupted run's weights, each step logged once.

One uninterrupted single-process run (tiny model, max_steps 5, a checkpoint every 2 steps, so checkpoints 2, 4
and 5: Trainer also saves the last step) is shared by every window. Each window copies it and removes what a
kill at that point leaves missing; the reference keeps every checkpoint's full state, so a copy cut back this
way is what the killed run would hold (with full_state_checkpoints: latest the older ones would have been cut
to their weights, which tests/test_resume.py checks with a real SIGKILL mid-run, as
tests/test_resume_workflow.py does under Snakemake).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_resume import run_config, step_metrics

from d3s.runs.config import read_config_file
from d3s.runs.publish import training_finished
from d3s.runs.resume import latest_checkpoint
from d3s.runs.run import train

STEPS = 5


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("windows")
    train(read_config_file(run_config(tmp_path, "reference", max_steps=STEPS)))
    return tmp_path / "reference"


def _cut_metrics(run: Path, last_step: int) -> None:
    """metrics.jsonl as a kill during step ``last_step + 1`` leaves it."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["step"] <= last_step and "loss" in json.loads(line)]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))


def _killed_copy(reference: Path, run: Path, window: str) -> None:
    shutil.copytree(reference, run)
    after_final_save = window == "after the final save"
    if not after_final_save:
        (run / "train_summary.json").unlink()
        shutil.rmtree(run / "final")
    if window == "during the final save":
        (run / "final.partial").mkdir()  # written halfway when the kill came
        (run / "final.partial" / "model.safetensors").write_bytes(b"cut")
        _cut_metrics(run, STEPS)
    checkpoints_left = {
        "before the first checkpoint": (),
        "between checkpoints": (2,),
        "after the last checkpoint": (2, 4),  # killed during step 5, before its save
    }.get(window)
    if checkpoints_left is not None:
        for path in run.glob("checkpoint-*"):
            if int(path.name.split("-")[-1]) not in checkpoints_left:
                shutil.rmtree(path)
        _cut_metrics(run, max(checkpoints_left, default=0) + 1)


WINDOWS = [
    "before the first checkpoint",
    "between checkpoints",
    "after the last checkpoint",
    "during the final save",
    "after the final save",
]


@pytest.mark.slow
@pytest.mark.parametrize("window", WINDOWS)
def test_a_run_killed_at_any_point_reruns_to_the_uninterrupted_end(tmp_path, uninterrupted, window):
    """Before the fix a run killed during its final save resumed from checkpoint-5, trained a step 6 that
    max_steps does not allow, logged steps 5 and 6 twice and ended with other weights."""
    run = tmp_path / "reference"  # the same output_dir name: the config must match to resume
    _killed_copy(uninterrupted, run, window)
    config = read_config_file(run_config(tmp_path, "reference", max_steps=STEPS))
    train(config)

    assert [m["step"] for m in step_metrics(run)] == list(range(1, STEPS + 1))  # each step logged once
    assert step_metrics(run) == step_metrics(uninterrupted)
    assert not (run / "final.partial").exists() and not (run / f"checkpoint-{STEPS + 1}").exists()
    assert latest_checkpoint(run).name == f"checkpoint-{STEPS}"
    ours, theirs = (load_file(r / "final" / "model.safetensors") for r in (run, uninterrupted))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    summary = json.loads((run / "train_summary.json").read_text())
    reference = json.loads((uninterrupted / "train_summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["update_tokens_total"] == reference["update_tokens_total"] > 0
    manifest = json.loads((run / "manifest.json").read_text())
    resumed = {"before the first checkpoint": None, "between checkpoints": 2, "after the last checkpoint": 4}
    step = resumed.get(window, STEPS)
    assert manifest["resumed_from"] == (None if step is None else str(run / f"checkpoint-{step}"))
    assert manifest["finished"]
    # the final model loads as the uninterrupted one does (weights, config and tokenizer)
    assert {p.name for p in (run / "final").iterdir()} >= {"config.json", "model.safetensors"}
    assert (run / "final" / "tokenizer_config.json").is_file()


def test_training_finished_reads_the_checkpoint_state(tmp_path):
    for step, done in ((4, False), (5, True), (6, True)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 5}))
        assert training_finished(folder) is done
