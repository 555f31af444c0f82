"""Where the workflow writes what (docs/workflow.md): run directories and evaluation points.

One place for the layout so the loaders (io.py) and the settings check (d3s.orchestration.settings_check) read the same
runs and evaluations.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RUN_RE = re.compile(r"^seed(\d+)$")
MANIFEST = "manifest.json"


def runs(results: Path) -> Iterator[tuple[str, int, Path]]:
    """(method, seed, run directory) of every ``runs/<method>/seed<seed>`` folder."""
    for method_dir in sorted((results / "runs").glob("*")):
        for seed_dir in sorted(method_dir.glob("seed*")):
            match = RUN_RE.match(seed_dir.name)
            if match and seed_dir.is_dir():
                yield method_dir.name, int(match.group(1)), seed_dir


@dataclass(frozen=True)
class EvalPoint:
    """One evaluated model: a run's checkpoint (``step<N>``), its final model, or the shared base model."""

    method: str  # "base" for the base model
    seed: int | None
    name: str  # "final", "step<N>" or "base"
    directory: Path

    @property
    def summary(self) -> Path:
        return self.directory / "summary.json"

    @property
    def manifest(self) -> Path:
        return self.directory / MANIFEST

    @property
    def step(self) -> int | None:
        return int(self.name[4:]) if self.name.startswith("step") else None


def eval_points(results: Path) -> Iterator[EvalPoint]:
    """Every evaluation with a summary: ``eval/<method>/seed<seed>/{final,step<N>}`` and ``eval/base``."""
    eval_root = results / "eval"
    for method_dir in sorted(p for p in eval_root.glob("*") if p.is_dir() and p.name != "base"):
        for seed_dir in sorted(method_dir.glob("seed*")):
            match = RUN_RE.match(seed_dir.name)
            if not match:
                continue
            for summary in sorted(seed_dir.glob("*/summary.json")):
                name = summary.parent.name
                if name == "final" or (name.startswith("step") and name[4:].isdigit()):
                    yield EvalPoint(method_dir.name, int(match.group(1)), name, summary.parent)
    base = eval_root / "base"
    if (base / "summary.json").is_file():
        yield EvalPoint("base", None, "base", base)
