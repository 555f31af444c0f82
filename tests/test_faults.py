"""Faults beyond a kill: a corrupt checkpoint or final model is never trusted, a full disk says so in one
line, and the run recovers to the weights of an uninterrupted run (docs/gpu/faults.md).

One uninterrupted run (4 steps, checkpoints 2 and 4 with their full state) is trained once; each case copies
it, breaks what the fault breaks and runs again. ZeRO-3's sharded checkpoint and the workflow's re-runs after
a corrupt final model are in tests/test_resume_workflow.py, which trains ZeRO-3 jobs under Snakemake anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from d3s.cli import main
from d3s.orchestration.evaluation_job import EvalPoint, TrainedRun, check_run_models
from d3s.provenance.integrity import (
    FINAL_RECORD_FILE,
    DiskFullError,
    check_files,
    record_files,
    reporting_full_disk,
)
from d3s.runs.resume import latest_checkpoint

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def write_config(path: Path, model: Path, output_dir: Path) -> Path:
    config = {
        "method": "d3s",
        "model": str(model),
        "seed": 0,
        "threads": 1,
        "output_dir": str(output_dir),
        "dataset": {"name": "synthetic", "count": 200, "max_ops": 1, "max_operand": 9},
        "trainer": {
            "max_steps": 4,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 16,
            "learning_rate": 1e-3,
            "save_strategy": "steps",
            "save_steps": 2,
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def train_cli(config: Path) -> int:
    torch.set_num_threads(1)
    return main(["train", "--config", str(config)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_sft_model) -> Path:
    """An uninterrupted run: checkpoint-2, checkpoint-4 (each with its full state), final/."""
    root = tmp_path_factory.mktemp("faults")
    assert train_cli(write_config(root / "reference.yaml", tiny_sft_model, root / "reference")) == 0
    return root / "reference"


def broken_copy(reference: Path, tmp_path: Path, tiny_sft_model: Path, *drop: str) -> tuple[Path, Path]:
    """A copy of the reference run without ``drop`` (names in it), and its config."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for name in drop:
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    return run, write_config(tmp_path / "run.yaml", tiny_sft_model, run)


def cut_to_half(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    """Same size, one byte changed: only the checksum notices."""
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


def assert_ends_like(run: Path, reference: Path) -> None:
    """The run's final model is the reference's, bitwise, and its logs hold each step once, as the
    reference's; final/ carries its record and passes it."""
    ours = load_file(run / "final" / "model.safetensors")
    theirs = load_file(reference / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    def steps(path: Path) -> list[dict]:
        entries = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in entries if "loss" in e]

    assert steps(run) == steps(reference)
    record = json.loads((run / "final" / FINAL_RECORD_FILE).read_text())["files"]
    assert "model.safetensors" in record and check_files(run / "final", record) is None
    assert (run / "train_summary.json").is_file()


def aside(run: Path, label: str) -> Path:
    (folder,) = run.glob(f"superseded-*-{label}")
    return folder


@pytest.mark.slow
def test_corrupt_checkpoint_at_max_steps_is_moved_aside_and_the_run_ends_bitwise(
    reference, tmp_path, tiny_sft_model, capsys
):
    """The issue's case: the newest checkpoint (at max_steps) has its weights cut to half, final/ and the
    summary are gone. Before, the re-run promoted the truncated file to final/ and said "run finished"."""
    run, config = broken_copy(reference, tmp_path, tiny_sft_model, "final", "train_summary.json")
    cut_to_half(run / "checkpoint-4" / "model.safetensors")
    assert train_cli(config) == 0
    out = capsys.readouterr().out
    moved = aside(run, "corrupt-checkpoint-4")
    half = (reference / "checkpoint-4" / "model.safetensors").stat().st_size // 2
    line = next(line for line in out.splitlines() if "failed its integrity check" in line)
    weights = run / "checkpoint-4" / "model.safetensors"
    assert line.startswith(f"checkpoint-4 failed its integrity check: {weights} is {half:,} bytes")
    assert line.endswith(f"moved to {moved}, not resumed") and "final model written from it" not in out
    assert f"resuming from {run / 'checkpoint-2'} (step 2)" in out
    # moved whole, never deleted, with the reason; the re-run wrote a sound checkpoint-4 of its own
    assert (moved / "checkpoint-4" / "model.safetensors").stat().st_size == half
    assert (moved / "checkpoint-4" / "optimizer.pt").is_file()
    assert "model.safetensors is" in (moved / "README.txt").read_text()
    assert latest_checkpoint(run).name == "checkpoint-4"
    assert_ends_like(run, reference)


@pytest.mark.slow
def test_corrupt_mid_run_checkpoint_is_moved_aside_and_the_run_starts_over(
    reference, tmp_path, tiny_sft_model, capsys
):
    """A mid-run checkpoint (the newest, its run killed before checkpoint-4) with one byte of its optimizer
    state changed: before, every re-run crashed in transformers' loader, for ever."""
    dropped = ("checkpoint-4", "final", "train_summary.json")
    run, config = broken_copy(reference, tmp_path, tiny_sft_model, *dropped)
    optimizer = run / "checkpoint-2" / "optimizer.pt"
    flip_a_byte(optimizer)
    assert train_cli(config) == 0
    out = capsys.readouterr().out
    moved = aside(run, "corrupt-checkpoint-2")
    assert f"checkpoint-2 failed its integrity check: {optimizer} does not match" in out
    assert "starting over (no complete checkpoint with training state to resume from)" in out
    assert (moved / "checkpoint-2" / "optimizer.pt").stat().st_size == (
        reference / "checkpoint-2" / "optimizer.pt"
    ).stat().st_size
    assert_ends_like(run, reference)


@pytest.mark.slow
def test_corrupt_final_model_is_refused_by_eval_and_rebuilt_by_the_workflow_check(
    reference, tmp_path, tiny_sft_model, capsys
):
    """A final model cut short or with a changed byte: `d3s eval` refuses it in one line naming the file,
    before any generation; the workflow's evaluation job moves it aside and fails in one line saying to run
    the same command again, whose training job rebuilds final/ from the verified checkpoint at max_steps
    (tests/test_resume_workflow.py runs that under Snakemake, with ZeRO-3)."""
    runs = tmp_path / "runs"
    (runs / "d3s").mkdir(parents=True)
    run, config = broken_copy(reference, runs / "d3s", tiny_sft_model)
    run = run.rename(runs / "d3s" / "seed0")
    config = write_config(config, tiny_sft_model, run)
    weights = run / "final" / "model.safetensors"
    command = ["eval", "--model", str(run / "final"), "--benchmarks", "synthetic", "--samples", "1"]
    command += ["--k", "1", "--backend", "transformers", "--no-progress"]
    for fault in (flip_a_byte, cut_to_half):
        fault(weights)
        out = tmp_path / f"eval-{fault.__name__}"
        assert main([*command, "--out", str(out)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(f"d3s eval: error: --model {run / 'final'}: ")
        assert f"its weights do not load: {weights} " in error and "nothing was generated" in error
        assert not out.exists()  # refused before any sample
        shutil.copy2(reference / "final" / "model.safetensors", weights)  # sound again, for the next fault
        os.utime(weights)
    cut_to_half(weights)

    # the evaluation job of the run's final model (rule evaluate_final or evaluate_run), before its GPU lease
    trained = TrainedRun(run, "d3s", 0)
    points = [EvalPoint(str(run / "final"), tmp_path / "ev", 1, (1,), None)]
    with pytest.raises(SystemExit) as refused:
        check_run_models(trained, points)
    moved, line = aside(run, "corrupt-final"), str(refused.value)
    assert line.startswith(f"the final model of {run} does not load: {weights} is ") and str(moved) in line
    assert "\n" not in line and line.endswith(
        "run the same command again, which trains the run again from "
        "its newest sound checkpoint and then evaluates it"
    )
    assert not (run / "final").exists() and (moved / "final" / "model.safetensors").is_file()
    assert (moved / "train_summary.json").is_file() and not (run / "train_summary.json").exists()
    assert train_cli(config) == 0  # what the re-run training job does
    assert "checkpoint-4 is the last step (max_steps): final model written from it" in capsys.readouterr().out
    assert_ends_like(run, reference)
    check_run_models(trained, points)  # sound again: the evaluation goes ahead


def _mount_tmpfs(folder: Path, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes on ``folder``; the reason when this machine cannot (not root, no
    mount permission in the container)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return "mounting a small tmpfs needs root and mount(8); this test runs as root in CI"
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"mount -t tmpfs failed here: {done.stderr.strip()}"


@pytest.mark.slow
def test_full_disk_is_reported_in_one_line_and_the_run_resumes_once_there_is_room(
    reference, tmp_path, tiny_sft_model, capsys
):
    """A run on a tmpfs with room for one checkpoint: the save of checkpoint-4 runs out of space. One line
    names the checkpoint's path and the space left; checkpoint-4 is not marked complete; with room made, the
    re-run resumes from checkpoint-2 and ends bitwise where the uninterrupted run ends."""
    checkpoint_bytes = sum(p.stat().st_size for p in (reference / "checkpoint-2").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    skipped = _mount_tmpfs(disk, checkpoint_bytes * 3 // 2)
    if skipped:
        pytest.skip(skipped)
    try:
        config = write_config(tmp_path / "run.yaml", tiny_sft_model, disk / "run")
        assert train_cli(config) == 1
        (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # no traceback
        checkpoint = disk / "run" / "checkpoint-4"
        assert error.startswith(f"d3s train: error: out of disk space writing checkpoint-4 to {checkpoint}: ")
        assert " free there (of " in error and "resumes from the newest complete checkpoint" in error
        assert not (checkpoint / "d3s_state.json").exists()  # the half-written checkpoint is not complete
        assert latest_checkpoint(disk / "run").name == "checkpoint-2"

        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert train_cli(config) == 0
        assert f"resuming from {disk / 'run' / 'checkpoint-2'} (step 2)" in capsys.readouterr().out
        assert_ends_like(disk / "run", reference)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_errors_that_are_not_a_full_disk_pass_through_unchanged(tmp_path):
    with pytest.raises(RuntimeError, match="a bug"), reporting_full_disk(tmp_path, "checkpoint-1"):
        raise RuntimeError("a bug")  # plenty of space here: not a full disk
    full = pytest.raises(DiskFullError, match=f"writing checkpoint-1 to {tmp_path / 'x'}: .* free there")
    with full, reporting_full_disk(tmp_path / "x", "checkpoint-1"):
        raise OSError(28, "No space left on device")
    (tmp_path / "a").write_bytes(b"abc")
    record = record_files(tmp_path)
    assert record["a"]["size"] == 3 and check_files(tmp_path, record) is None
    (tmp_path / "a").write_bytes(b"abd")
    assert "does not match the xxh3_128 checksum" in check_files(tmp_path, record)
