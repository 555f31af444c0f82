"""The synthetic task a model is evaluated on: the one its d3s run trained on, read from the run's own record.

A model trained on chains of 3-7 one-digit steps and evaluated on the synthetic benchmark's default task
(operands up to 99) scores about 0 %, which reads as a broken model. So where ``d3s eval`` (or
:func:`d3s.evaluation.cli.run_eval`) is given a d3s run's ``final/`` or ``checkpoint-N/`` and no synthetic
options, it evaluates on the task recorded in the run's ``resolved_config.yaml``, and says so in one line."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from d3s.provenance.layout import RESOLVED_CONFIG, run_dir_of_model

# The task's options a run records (its dataset section); count and seed are the evaluation's own.
TASK_KEYS = ("min_ops", "max_ops", "max_operand", "bounded")


@dataclass(frozen=True)
class SyntheticTask:
    """The synthetic options to evaluate with, and the one line that says where they came from."""

    options: dict[str, int]
    note: str


def recorded_task(model: str | Path) -> tuple[Path, dict[str, int] | None] | None:
    """(record, task) of the d3s run ``model`` belongs to: its resolved_config.yaml and the synthetic task it
    trained on (None when it trained on another dataset); None when ``model`` is not a run's model."""
    run_dir = run_dir_of_model(model)
    if run_dir is None:
        return None
    record = run_dir / RESOLVED_CONFIG
    dataset = dict((yaml.safe_load(record.read_text(encoding="utf-8")) or {}).get("dataset") or {})
    if dataset.get("name", "synthetic") != "synthetic":
        return record, None
    return record, {key: int(dataset[key]) for key in TASK_KEYS if key in dataset}


def _defaults() -> dict[str, int]:
    from d3s.data.synthetic import arithmetic_problems

    parameters = inspect.signature(arithmetic_problems).parameters
    return {key: int(parameters[key].default) for key in TASK_KEYS}


def _listed(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in options.items())


def synthetic_task(model: str | Path | None, explicit: Mapping[str, int]) -> SyntheticTask:
    """The synthetic options for ``model``: ``explicit`` (``--synthetic``) over the task the model's run
    trained on; the note names the task, and any explicit option that differs from the run's."""
    explicit = dict(explicit)
    found = recorded_task(model) if model else None
    if found is None or found[1] is None:
        why = "has no d3s run record" if found is None else f"trained on another dataset ({found[0]})"
        task = _defaults() | {k: v for k, v in explicit.items() if k in TASK_KEYS}
        source = "the --synthetic task" if explicit else "the synthetic benchmark's default task"
        return SyntheticTask(explicit, f"synthetic: {source} ({_listed(task)}); the model {why}")
    record, trained = found
    differs = {key: value for key, value in explicit.items() if key in trained and trained[key] != value}
    options = trained | explicit
    if differs:
        was = _listed({key: trained[key] for key in differs})
        note = f"synthetic: --synthetic {_listed(differs)}, not the task the run trained on ({was}; {record})"
    else:
        note = f"synthetic: the task the run trained on ({_listed(trained)}; {record})"
    return SyntheticTask(options, note)
