"""A study: a question the papers leave open, declared in YAML (config/studies/<name>.yaml; docs/studies.md).

Its runs (registry methods and named variants, d3s.variants) x the config's paired seeds, its
claims (each run against a reference, a slope against the variants' x, or an interaction of four runs),
its figure and, for a generalization study, an evaluation on problems unlike the training ones. This module
parses and checks the section at parse time (no torch, pandas or TRL); d3s.analysis.studies computes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# measure -> (what it is, unit). Points are percentage points of Pass@k on [0, 100].
MEASURES: dict[str, tuple[str, str]] = {
    "pass_at_1": ("final model's held-out Pass@1", "points"),
    "pass_at_k": ("final model's held-out Pass@k (the largest k evaluated)", "points"),
    "early_pass_at_1": ("held-out Pass@1 at the first evaluated checkpoint", "points"),
    "train_reward": ("training reward, mean over the last quarter of the steps", "points"),
    "generalization_gap": ("training reward (last quarter) minus held-out Pass@1", "points"),
    "grad_norm": ("policy-gradient norm, mean over the steps", "norm"),
    "grad_norm_spike": ("gradient-norm spikes: max over the steps / median", "ratio"),
    "entropy": ("policy entropy of the completion tokens, mean over the steps", "nats"),
    "entropy_selected": ("entropy of the tokens that train, mean over the steps", "nats"),
    "kl": ("KL to the initial policy at the last evaluated checkpoint (k3)", "nats"),
    "ood_pass_at_1": ("final model's Pass@1 on the held-out longer problems", "points"),
    "cross_group_fraction": ("fraction of the steps that selected cross-group", "fraction"),
}
CLAIM_KINDS = ("versus", "slope", "interaction")


@dataclass(frozen=True)
class StudyClaim:
    """One claim: ``versus`` (each run minus ``reference``), ``slope`` (the measure against log10 x over
    ``runs``, per seed) or ``interaction`` ((runs[0] - runs[1]) - (runs[2] - runs[3]), per seed)."""

    kind: str
    measure: str
    runs: tuple[str, ...]
    statement: str
    reference: str | None = None
    direction: int = 1


@dataclass(frozen=True)
class OodEvaluation:
    """The final models evaluated on synthetic problems unlike the training ones (``task`` on top of the
    config's task), as results/<experiment>/eval_ood/<name>/."""

    name: str
    task: dict[str, Any]
    max_tokens: int | None = None
    count: int | None = None


@dataclass(frozen=True)
class Calibration:
    """Runs on seeds outside the study's, whose logs choose a setting (the adaptive switch's threshold)."""

    seeds: tuple[int, ...]
    runs: tuple[str, ...]
    thresholds: tuple[float, ...] = ()


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    question: str
    runs: tuple[str, ...]
    claims: tuple[StudyClaim, ...]
    setup: str = ""
    figure_measures: tuple[str, ...] = ("pass_at_1",)
    figure_axis: str = "runs"
    figure_xlabel: str = ""
    figure_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ood: OodEvaluation | None = None
    calibration: Calibration | None = None

    @property
    def measures(self) -> tuple[str, ...]:
        """Every measure the study reads, in first-use order."""
        names = [claim.measure for claim in self.claims] + list(self.figure_measures)
        return tuple(dict.fromkeys(names))


def parse_study(config: Mapping[str, Any], variants: Mapping[str, Any]) -> Study | None:
    """The config's ``study`` section (schema-checked already), checked against its runs; None without one.
    ValueError naming the key and the fix."""
    raw = config.get("study")
    if raw is None:
        return None
    known = set(variants)

    def check_runs(key: str, names: Sequence[str]) -> tuple[str, ...]:
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(
                f"study.{key}: unknown run(s) {unknown}; list them under methods or declare them under "
                f"variants (runs: {', '.join(variants)})"
            )
        return tuple(names)

    def check_measure(key: str, name: str) -> str:
        if name not in MEASURES:
            raise ValueError(f"study.{key}: unknown measure {name!r}; valid measures: {', '.join(MEASURES)}")
        return name

    runs = check_runs("runs", raw["runs"])
    claims = []
    for index, spec in enumerate(raw["claims"]):
        key = f"claims[{index}]"
        claim = StudyClaim(
            kind=spec["kind"],
            measure=check_measure(f"{key}.measure", spec["measure"]),
            runs=check_runs(f"{key}.runs", spec["runs"]),
            statement=spec["statement"],
            reference=spec.get("reference"),
            direction=int(spec.get("direction", 1)),
        )
        if claim.kind == "versus":
            if claim.reference is None:
                raise ValueError(f"study.{key}: a versus claim needs a reference run")
            check_runs(f"{key}.reference", [claim.reference])
        elif claim.reference is not None:
            raise ValueError(f"study.{key}: only a versus claim has a reference; remove it")
        if claim.kind == "interaction" and len(claim.runs) != 4:
            raise ValueError(
                f"study.{key}: an interaction compares four runs, (a - b) - (c - d); got {len(claim.runs)}"
            )
        if claim.kind == "slope":
            if len(claim.runs) < 2:
                raise ValueError(f"study.{key}: a slope needs at least two runs")
            missing = [name for name in claim.runs if getattr(variants[name], "x", None) is None]
            if missing:
                raise ValueError(
                    f"study.{key}: a slope reads each run's x; set variants.<name>.x for {missing}"
                )
        if claim.measure in ("ood_pass_at_1",) and "ood" not in raw:
            raise ValueError(f"study.{key}: measure ood_pass_at_1 needs a study.ood evaluation")
        claims.append(claim)
    figure = dict(raw.get("figure") or {})
    measures = tuple(check_measure("figure.measures", m) for m in figure.get("measures", ["pass_at_1"]))
    groups = {
        label: check_runs(f"figure.groups.{label}", names)
        for label, names in (figure.get("groups") or {}).items()
    }
    if figure.get("axis") == "x":
        missing = [name for name in runs if getattr(variants[name], "x", None) is None]
        if missing:
            raise ValueError(f"study.figure.axis x reads each run's x; set variants.<name>.x for {missing}")
    ood = None
    if raw.get("ood"):
        spec = raw["ood"]
        ood = OodEvaluation(spec["name"], dict(spec["task"]), spec.get("max_tokens"), spec.get("count"))
    calibration = None
    if raw.get("calibration"):
        spec = raw["calibration"]
        overlap = sorted(set(spec["seeds"]) & set(config["seeds"]))
        if overlap:
            raise ValueError(
                f"study.calibration.seeds: {overlap} are also the study's seeds; calibrate on others (the "
                "study's own seeds must not choose its settings)"
            )
        calibration = Calibration(
            tuple(spec["seeds"]),
            check_runs("calibration.runs", spec["runs"]),
            tuple(float(t) for t in spec.get("thresholds") or ()),
        )
    return Study(
        name=raw["name"],
        title=raw["title"],
        question=" ".join(str(raw["question"]).split()),
        runs=runs,
        claims=tuple(claims),
        setup=" ".join(str(raw.get("setup") or "").split()),
        figure_measures=measures,
        figure_axis=figure.get("axis", "runs"),
        figure_xlabel=str(figure.get("xlabel") or ""),
        figure_groups=groups,
        ood=ood,
        calibration=calibration,
    )
