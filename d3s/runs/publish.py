"""Publish a run's results: the tiny model written for the colocated vLLM engine, final/ made whole and
verified, train_summary.json and the manifest's end, the input files the manifest checksums."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from d3s.provenance.integrity import IntegrityError, check_files, reporting_full_disk, write_final_record
from d3s.provenance.manifest import model_files, now, write_json


def save_for_vllm(model, tokenizer, path: Path, *, is_main: bool) -> None:
    """The colocated vLLM engine loads the model from a directory (TRL gives it ``model.name_or_path``): the
    tiny model, built in code and warm-started, is written to ``path`` first (by the main process,
    atomically; every process builds the same model)."""
    if is_main:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(partial, path)
    wait_for_everyone()
    model.name_or_path = model.config.name_or_path = str(path)


def training_finished(checkpoint: str | os.PathLike[str]) -> bool:
    """True when ``checkpoint`` was saved at the run's last step (its trainer_state.json's max_steps, which
    Trainer also computes for an epoch-based run)."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    return 0 < int(state.get("max_steps") or 0) <= int(state["global_step"])


def wait_for_everyone() -> None:
    """Every process of an ``accelerate launch`` waits here (a no-op in a single process)."""
    from accelerate import PartialState

    PartialState().wait_for_everyone()


def publish_final(output_dir: Path, manifest: dict[str, Any], record: dict[str, Any], *summary: Any) -> None:
    """final.partial/ becomes final/ (a crash never leaves a half-written model) with ``record`` (its files'
    sizes and checksums, d3s_files.json), verified against it; then train_summary.json (``summary``:
    seconds, steps, threads, update tokens, resumed from) and the manifest's end time."""
    partial = output_dir / "final.partial"
    with reporting_full_disk(partial, "the final model"):
        write_final_record(partial, record)
    shutil.rmtree(output_dir / "final", ignore_errors=True)
    os.replace(partial, output_dir / "final")
    problem = check_files(output_dir / "final", record)  # read back: the run reports success on a sound model
    if problem:
        raise IntegrityError(
            f"the final model failed its check right after it was written: {problem}; the storage under "
            f"{output_dir} does not keep what is written to it: check it, then run again"
        )
    keys = ("train_seconds", "steps", "threads", "update_tokens_total", "resumed_from")
    write_json(output_dir / "train_summary.json", dict(zip(keys, summary, strict=True)))
    manifest["finished"] = now()
    write_json(output_dir / "manifest.json", manifest)


def input_files(config: dict[str, Any]) -> dict[str, Path]:
    """Files whose checksums go into the manifest: the local benchmark copy and the model config."""
    from d3s.data.benchmarks import local_copy

    dataset = local_copy((config.get("dataset") or {}).get("name", "synthetic"), config.get("data_dir"))
    files = {"dataset": dataset} if dataset is not None else {}
    return files | model_files(str(config.get("model", "tiny")))  # weights, config, tokenizer
