"""Where the workflow writes runs and evaluations (docs/workflow/stages.md), one place for the loaders
(d3s.analysis.io) and the settings check alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
RESOLVED_CONFIG = "resolved_config.yaml"  # a run's settings as trained, written by `d3s train`


def _seed_dirs(method_dir: Path) -> Iterator[tuple[int, Path]]:
    """(seed, folder) of every ``seed<N>`` folder in ``method_dir``."""
    for seed_dir in sorted(method_dir.glob("seed*")):
        if seed_dir.name[4:].isdigit() and seed_dir.is_dir():
            yield int(seed_dir.name[4:]), seed_dir


def runs(results: Path) -> Iterator[tuple[str, int, Path]]:
    """(method, seed, run directory) of every ``runs/<method>/seed<seed>`` folder."""
    for method_dir in sorted((results / "runs").glob("*")):
        for seed, seed_dir in _seed_dirs(method_dir):
            yield method_dir.name, seed, seed_dir


def run_dir_of_model(model: str | Path) -> Path | None:
    """The d3s run folder whose ``final/`` or ``checkpoint-<N>/`` ``model`` is (it holds RESOLVED_CONFIG);
    None for any other model (a hub id, a base model, a folder of its own)."""
    path = Path(model).expanduser()
    is_run_model = path.name == "final" or (path.name.startswith("checkpoint-") and path.name[11:].isdigit())
    if not is_run_model or not (path.parent / RESOLVED_CONFIG).is_file():
        return None
    return path.parent


@dataclass(frozen=True)
class EvalPoint:
    """One evaluated model: a run's checkpoint (``step<N>``), its final model, or the shared base model."""

    method: str  # "base" for the base model
    seed: int | None
    name: str  # "final", "step<N>" or "base"
    directory: Path

    @property
    def manifest(self) -> Path:
        return self.directory / MANIFEST

    @property
    def step(self) -> int | None:
        return int(self.name[4:]) if self.name.startswith("step") else None


def eval_points(results: Path, file: str = "summary.json") -> Iterator[EvalPoint]:
    """Every evaluation holding ``file``: ``eval/<method>/seed<seed>/{final,step<N>}`` and ``eval/base``."""
    eval_root = results / "eval"
    for method_dir in sorted(p for p in eval_root.glob("*") if p.is_dir() and p.name != "base"):
        for seed, seed_dir in _seed_dirs(method_dir):
            for path in sorted(seed_dir.glob(f"*/{file}")):
                name = path.parent.name
                if name == "final" or (name.startswith("step") and name[4:].isdigit()):
                    yield EvalPoint(method_dir.name, seed, name, path.parent)
    if (eval_root / "base" / file).is_file():
        yield EvalPoint("base", None, "base", eval_root / "base")
