"""The one "did the configuration change" rule of training and evaluation resume and the provenance check:
configs compared as dotted keys, per-attempt keys left out (docs/workflow/checks.md, "How a setting
travels")."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Trainer fields the workflow sets afresh for each attempt of a job: the run folder and the vLLM server's host
# and ports (d3s.orchestration.training_job; accelerate's main_process_port is a flag, never in the config).
PER_ATTEMPT_TRAINER_KEYS = frozenset(
    {"output_dir", "vllm_server_host", "vllm_server_port", "vllm_group_port"}
)
# A `d3s train` config's per-attempt keys: the resume policy, where the run is, and the fields above.
TRAINING_PER_ATTEMPT = frozenset(
    {"resume", "output_dir"} | {f"trainer.{k}" for k in PER_ATTEMPT_TRAINER_KEYS}
)
# `d3s eval` options that never change the samples: where and how fast they are made, and what is reported
# from them (Pass@k, the primary answer policy: d3s eval relabels kept samples, never regenerates them).
EVALUATION_PER_ATTEMPT = frozenset(
    {"--benchmarks", "--k", "--out", "--grading-workers", "--tensor-parallel-size", "--answer-policy"}
    | {"--batch-size", "--data-dir", "--gpu-memory-utilization", "--no-progress"}
)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``trainer.learning_rate``); an empty mapping adds no key, as absent."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        flat |= flatten(value, f"{name}.") if isinstance(value, Mapping) else {name: value}
    return flat


def plain(value: Any) -> Any:
    """``value`` as plain JSON/YAML data (tuples as lists, other objects as strings), as it reads back."""
    return json.loads(json.dumps(value, default=str))


def config_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], per_attempt: frozenset[str] = frozenset()
) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old, new)}`` for every setting that differs (a missing key counts as None), sorted;
    keys in ``per_attempt`` (and those under them) are left out."""
    flat_old, flat_new = flatten(old), flatten(new)
    pairs = {key: (plain(flat_old.get(key)), plain(flat_new.get(key))) for key in flat_old.keys() | flat_new}
    return {
        key: pair
        for key, pair in sorted(pairs.items())
        if pair[0] != pair[1] and not any(key == p or key.startswith(f"{p}.") for p in per_attempt)
    }


def describe(changes: Mapping[str, tuple[Any, Any]], *, by_name_only: tuple[str, ...] = ()) -> str:
    """The reason printed: ``key old -> new`` per change; keys starting with ``by_name_only`` (checksums,
    which say nothing to the reader) by name only."""
    return "; ".join(
        key if key.startswith(by_name_only) else f"{key} {old} -> {new}"
        for key, (old, new) in changes.items()
    )


def keep_or_move_aside(out: Path, key: Mapping[str, Any], key_file: str) -> str | None:
    """Leave ``out`` to be resumed if its work was made under ``key`` (recorded in ``out/key_file``);
    otherwise move it aside to ``<out>.superseded-<UTC time>`` (never delete it). Returns what happened, for
    the log, or None (nothing there). The caller writes the new key."""
    if not out.is_dir() or not any(out.iterdir()):
        return None
    path = out / key_file
    previous = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    changes = config_changes(previous, key) if previous is not None else None
    if changes == {}:
        return f"resuming the evaluation in {out}"
    why = describe(changes, by_name_only=("model_files.",)) if changes else f"no {key_file}: unknown settings"
    aside = out.with_name(f"{out.name}.superseded-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    out.rename(aside)
    return f"moved the previous evaluation aside to {aside} ({why}); starting over"
