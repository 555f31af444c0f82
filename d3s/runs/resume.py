"""Resume and integrity of a run's output directory: the newest complete checkpoint, verified against its
record (a corrupt one set aside), the config it was made with, a fresh start moving the old run aside, the
logs cut back to the checkpoint's step, and the final model from a checkpoint at the last step."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from d3s.callbacks.checkpoints import (
    CHECKPOINT_ONLY_FILES,
    D3S_STATE_FILE,
    RESUME_STATE_PATTERNS,
    WEIGHT_FILES,
    WEIGHTS_ONLY_FILE,
    has_training_state,
)
from d3s.provenance.config_change import TRAINING_PER_ATTEMPT, config_changes
from d3s.provenance.integrity import (
    check_files,
    record_files,
    reporting_full_disk,
    safetensors_problem,
    set_aside,
)
from d3s.provenance.manifest import atomic_write_text
from d3s.runs.config import TOP_LEVEL_KEYS, ConfigError, coerce_run_config
from d3s.runs.publish import publish_final, wait_for_everyone

# What a fresh start moves aside with the checkpoints, so it never mixes with or overwrites an older run: the
# run's work (its logs, summary and final model) and, when there is work, the files that describe it.
_RUN_WORK = ("train_summary.json", "anatomy.jsonl", "final")
_RUN_DESCRIPTION = ("resolved_config.yaml", "manifest.json")


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint a run can resume from: complete (Trainer's state and ours, written after every
    rank finished), holding the training state, not cut to its weights (docs/gpu/resume.md)."""
    resumable = [
        path
        for path in Path(output_dir).glob("checkpoint-*")
        if path.name.split("-")[-1].isdigit()
        and (path / "trainer_state.json").is_file()
        and (path / D3S_STATE_FILE).is_file()
        and not (path / WEIGHTS_ONLY_FILE).exists()
        and has_training_state(path)
    ]
    return max(resumable, key=lambda path: int(path.name.split("-")[-1]), default=None)


def config_differences(
    output_dir: str | os.PathLike[str], config: dict[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``{key: (previous, current)}`` for every setting that differs from the run that wrote ``output_dir``
    (its resolved_config.yaml; per-attempt values left out: d3s.provenance.config_change)."""
    path = Path(output_dir) / "resolved_config.yaml"
    if not path.is_file():
        return {}
    previous = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    old = {key: value for key, value in previous.items() if key in TOP_LEVEL_KEYS}
    with contextlib.suppress(ConfigError):  # a config this version no longer accepts is compared as written
        old = coerce_run_config(old)
    new = coerce_run_config(config)  # both typed: a "1e-4" written by hand equals the 0.0001 recorded
    return config_changes(old, {**new, "threads": new.get("threads", 1)}, TRAINING_PER_ATTEMPT)


def supersede_run(
    output_dir: str | os.PathLike[str], reason: str, *, label: str, metrics_log: str | None = "metrics.jsonl"
) -> Path | None:
    """Move a previous run's checkpoints, logs, resolved config, manifest and final model into
    ``output_dir/superseded-<UTC time>-<label>/`` with a README.txt giving ``reason``; nothing is deleted.
    Returns the new folder, or None when there was no previous work (checkpoint, log or final model)."""
    output_dir = Path(output_dir)
    checkpoints = sorted(path for path in output_dir.glob("checkpoint-*") if path.is_dir())
    work = checkpoints + [output_dir / name for name in (metrics_log, *_RUN_WORK) if name]
    if not any(path.exists() for path in work):
        return None
    note = f"A new run started in {output_dir}; these files of the previous run were moved here, not deleted:"
    paths = work + [output_dir / name for name in _RUN_DESCRIPTION]
    return set_aside(output_dir, paths, label=label, reason=reason, note=note)


def checkpoint_problem(checkpoint: str | os.PathLike[str]) -> str | None:
    """Why ``checkpoint`` cannot be trusted, in one line naming the file; None when every file its
    completion mark records is there with its recorded size and checksum. A checkpoint marked before marks
    recorded files gets the safetensors length check only."""
    checkpoint = Path(checkpoint)
    try:
        files = json.loads((checkpoint / D3S_STATE_FILE).read_text(encoding="utf-8")).get("files")
    except (ValueError, AttributeError):
        return f"{checkpoint / D3S_STATE_FILE} is not valid JSON"
    if files:
        return check_files(checkpoint, files)
    for path in sorted(checkpoint.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            return problem
    return None


def verified_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest resumable checkpoint (latest_checkpoint) that passes its integrity check. One that fails
    is moved aside into ``output_dir/superseded-<UTC time>-corrupt-checkpoint-<N>/`` (never deleted), with
    the reason in one line, and the next newest is tried."""
    while (checkpoint := latest_checkpoint(output_dir)) is not None:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        note = "This checkpoint failed its integrity check; it was moved here, not deleted:"
        reason = f"{checkpoint.name} failed its integrity check: {problem}"
        label = f"corrupt-{checkpoint.name}"
        moved = set_aside(output_dir, [checkpoint], label=label, reason=reason, note=note)
        print(f"{reason}; moved to {moved}, not resumed", flush=True)
    return None


def cut_logs(output_dir: Path, metrics_log: str, last_step: int) -> None:
    """Cut the run's logs back to the checkpoint's step: the lines after it will be written again. (The logs
    are not workflow outputs, so Snakemake never deletes them before a re-run: docs/workflow/resume.md.)"""
    for name in (metrics_log, "anatomy.jsonl"):
        log = output_dir / name
        if log.is_file():
            kept = []
            for line in log.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line)["step"] <= last_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    break  # a line cut by a crash ends the trustworthy part
            atomic_write_text(log, "".join(line + "\n" for line in kept))


def finish_from_checkpoint(
    output_dir: Path, checkpoint: Path, manifest: dict[str, Any], *, threads: int, is_main: bool
) -> None:
    """final/ and train_summary.json from a checkpoint at the last step: its weight, config and tokenizer
    files are what the final save writes (Trainer.save_model); what is kept only to resume is left out."""
    if is_main:
        step = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))["global_step"]
        if not any((checkpoint / name).is_file() for name in WEIGHT_FILES):
            raise ValueError(
                f"{checkpoint} is the run's last step but holds no weight file (ZeRO-3 without "
                "zero3_save_16bit_model): convert it with its zero_to_fp32.py into final/, or set "
                "zero3_save_16bit_model: true in the accelerate config"
            )
        partial = output_dir / "final.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        counters = json.loads((checkpoint / D3S_STATE_FILE).read_text(encoding="utf-8"))
        copied = []
        with reporting_full_disk(partial, "the final model"):
            for path in checkpoint.iterdir():
                resume_state = any(path.match(pattern) for pattern in RESUME_STATE_PATTERNS)
                if path.is_file() and path.name not in CHECKPOINT_ONLY_FILES and not resume_state:
                    shutil.copy2(path, partial / path.name)
                    copied.append(path.name)
        # the checkpoint's record (verified when it was chosen) checks the copy; mtimes are the copy's
        recorded = counters.get("files") or {}  # none in a checkpoint marked before marks recorded files
        record = {
            name: {**recorded[name], "mtime_ns": (partial / name).stat().st_mtime_ns}
            for name in copied
            if name in recorded
        }
        record |= record_files(partial, exclude=record)  # what the checkpoint's mark did not record
        # train_seconds 0: this attempt trained nothing; the steps' time is in the earlier attempts
        tokens = counters["update_tokens_total"]
        publish_final(output_dir, manifest, record, 0.0, step, threads, tokens, str(checkpoint))
        print(f"{checkpoint.name} is the last step (max_steps): final model written from it", flush=True)
    wait_for_everyone()  # every process returns once the final model exists
