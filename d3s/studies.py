"""A study: a question the papers leave open, declared in YAML (config/studies/<name>.yaml; docs/studies.md).

Its runs (registry methods and named variants, d3s.variants) x the config's paired seeds, its
claims (each run against a reference, a slope against the variants' x, or an interaction of four runs),
its controls (claims that must be supported for the other verdicts to count), its figure and, for a
generalization study, an evaluation on problems unlike the training ones. This module
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
    "ood_pass_at_1": ("final model's Pass@1 on the study's held-out problems (study.ood)", "points"),
    "cross_group_fraction": ("fraction of the steps that selected cross-group", "fraction"),
}
CLAIM_KINDS = ("versus", "slope", "interaction")
# A control is a claim kind, or ``fires``: the adaptive switch fired on a run (cross_group_fraction < 1).
CONTROL_KINDS = (*CLAIM_KINDS, "fires")
# ``reference: base`` in a control: each run's own base model (the default's, or its variant's under
# ``bases``), evaluated once (results/<experiment>/eval/base/, eval/bases/<name>/, eval_ood/<ood>/base/).
BASE = "base"
BASE_MEASURES = ("pass_at_1", "pass_at_k", "ood_pass_at_1")  # the measures a base model has


def base_run(base: str | None) -> str:
    """The name a base model's values carry in a study's measures: ``base`` (the config's base model) or
    ``base:<name>`` (a variant under ``bases``; ``:`` cannot occur in a run's name)."""
    return BASE if base is None else f"{BASE}:{base}"


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
    primary: bool = False  # a claim the study is run to decide (its power: d3s.analysis.studies.power_table)


@dataclass(frozen=True)
class StudyControl:
    """A claim that must be supported for the study's other verdicts to count (docs/studies.md, "Controls").

    ``versus``, ``slope``, ``interaction``: as a StudyClaim, with ``reference: base`` allowed (each run's own
    base model); supported when the 95 % interval lies beyond ``at_least`` (a size in the measure's unit, 0
    when not given) in ``direction``: ci_low > at_least for +1, ci_high < -at_least for -1. No Holm: every
    control must pass, so each is tested at the 5 % level (an intersection-union test).
    ``fires``: on how many of the runs x seeds the adaptive switch fired (cross_group_fraction < 1);
    supported when the data decide it: at least ``at_least`` fired, or at most ``at_most`` did even if
    every run without data had."""

    kind: str
    runs: tuple[str, ...]
    statement: str
    measure: str = "cross_group_fraction"
    reference: str | None = None
    direction: int = 1
    at_least: float | None = None
    at_most: int | None = None

    @property
    def claim(self) -> StudyClaim:
        """The control as a claim (its rows are computed as the claims' are)."""
        return StudyClaim(self.kind, self.measure, self.runs, self.statement, self.reference, self.direction)

    def threshold(self) -> str:
        """What supported means for this control, in words."""
        if self.kind == "fires":
            if self.at_least is not None:
                return f"fired on >= {self.at_least:g}"
            return f"fired on <= {self.at_most}"
        size = self.at_least or 0.0
        return f"CI above {size:g}" if self.direction > 0 else f"CI below {-size:g}"


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
    signal: str = "grad_norm_spike"  # the adaptive switch's (d3s.selection.SWITCH_SIGNALS; the schema's enum)


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    question: str
    runs: tuple[str, ...]
    claims: tuple[StudyClaim, ...]
    controls: tuple[StudyControl, ...] = ()
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
        names = [claim.measure for claim in (*self.claims, *self.controls)] + list(self.figure_measures)
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
            primary=bool(spec.get("primary", False)),
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
    controls = tuple(
        _parse_control(f"controls[{index}]", spec, raw, runs, variants, check_runs, check_measure)
        for index, spec in enumerate(raw.get("controls") or ())
    )
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
            str(spec.get("signal", "grad_norm_spike")),
        )
    return Study(
        name=raw["name"],
        title=raw["title"],
        question=" ".join(str(raw["question"]).split()),
        runs=runs,
        claims=tuple(claims),
        controls=controls,
        setup=" ".join(str(raw.get("setup") or "").split()),
        figure_measures=measures,
        figure_axis=figure.get("axis", "runs"),
        figure_xlabel=str(figure.get("xlabel") or ""),
        figure_groups=groups,
        ood=ood,
        calibration=calibration,
    )


def _has_switch(variant: Any) -> bool:
    """Whether the run's method (with its trainer overrides) runs the adaptive switch."""
    from d3s.methods import METHODS

    method = METHODS.get(variant.method)
    default = method.scope_switch_threshold if method is not None else 0.0
    return float(variant.trainer.get("scope_switch_threshold", default) or 0.0) > 0


def _parse_control(
    key: str,
    spec: Mapping[str, Any],
    raw: Mapping[str, Any],
    runs: tuple[str, ...],
    variants: Mapping[str, Any],
    check_runs: Any,
    check_measure: Any,
) -> StudyControl:
    """One entry of study.controls, checked (docs/studies.md, "Controls"); ValueError naming the key."""
    where = f"study.{key}"
    kind = spec.get("kind")
    if kind not in CONTROL_KINDS:
        raise ValueError(f"{where}.kind: {kind!r} is not a control kind; valid: {', '.join(CONTROL_KINDS)}")
    for required in ("runs", "statement"):
        if not spec.get(required):
            raise ValueError(f"{where}: a control needs {required}")
    names = check_runs(f"{key}.runs", spec["runs"])
    outside = [name for name in names if name not in runs]
    if outside:
        raise ValueError(
            f"{where}.runs: {outside} not among study.runs; add them there (a control reads the study's "
            "runs x seeds, which the workflow trains)"
        )
    at_least, at_most = spec.get("at_least"), spec.get("at_most")
    if kind == "fires":
        for unused in ("measure", "reference", "direction"):
            if unused in spec:
                raise ValueError(
                    f"{where}.{unused}: a fires control reads cross_group_fraction of its runs, with no "
                    f"{unused}; remove it"
                )
        if (at_least is None) == (at_most is None):
            raise ValueError(
                f"{where}: a fires control needs exactly one of at_least (fired on at least that many runs x "
                "seeds) and at_most (on at most that many)"
            )
        if at_least is not None and (int(at_least) != at_least or at_least < 1):
            raise ValueError(f"{where}.at_least: a count of runs x seeds, 1 or more; got {at_least!r}")
        if at_most is not None and (int(at_most) != at_most or at_most < 0):
            raise ValueError(f"{where}.at_most: a count of runs x seeds, 0 or more; got {at_most!r}")
        without = [name for name in names if not _has_switch(variants[name])]
        if without:
            raise ValueError(
                f"{where}.runs: {without} run no adaptive switch (scope_switch_threshold), so it cannot "
                "fire; name runs of d3s_adaptive or a variant that sets the threshold"
            )
        return StudyControl(
            kind,
            names,
            str(spec["statement"]),
            at_least=None if at_least is None else int(at_least),
            at_most=None if at_most is None else int(at_most),
        )
    if "measure" not in spec:
        raise ValueError(f"{where}: a {kind} control needs a measure")
    measure = check_measure(f"{key}.measure", spec["measure"])
    if at_most is not None:
        raise ValueError(
            f"{where}.at_most: only a fires control counts runs; use at_least (a minimum effect)"
        )
    if at_least is not None and (not isinstance(at_least, (int, float)) or at_least < 0):
        raise ValueError(
            f"{where}.at_least: the smallest effect, in the measure's unit, that supports the control (a "
            f"size, 0 or more; the direction gives the sign); got {at_least!r}"
        )
    direction = spec.get("direction", 1)
    if direction not in (1, -1):
        raise ValueError(f"{where}.direction: 1 or -1; got {direction!r}")
    reference = spec.get("reference")
    if kind == "versus":
        if reference is None:
            raise ValueError(
                f"{where}: a versus control needs a reference: a run, or base (each run's base model)"
            )
        if reference == BASE:
            if BASE in variants:
                raise ValueError(
                    f"{where}.reference: base names each run's base model, and a run is also called base; "
                    "rename that run"
                )
            if measure not in BASE_MEASURES:
                raise ValueError(
                    f"{where}.measure: a base model has only {', '.join(BASE_MEASURES)}; {measure} needs a "
                    "run as the reference"
                )
            if measure == "ood_pass_at_1":
                on_variant = [name for name in names if variants[name].base is not None]
                if on_variant:
                    raise ValueError(
                        f"{where}.runs: {on_variant} start from a base variant, and only the config's base "
                        "model is evaluated on the ood problems; compare runs on the default base"
                    )
        else:
            check_runs(f"{key}.reference", [reference])
            if reference not in runs:
                raise ValueError(f"{where}.reference: {reference!r} not among study.runs; add it there")
    elif reference is not None:
        raise ValueError(f"{where}.reference: only a versus control has a reference; remove it")
    if kind == "interaction" and len(names) != 4:
        raise ValueError(f"{where}: an interaction compares four runs, (a - b) - (c - d); got {len(names)}")
    if kind == "slope":
        missing = [name for name in names if getattr(variants[name], "x", None) is None]
        if len(names) < 2 or missing:
            raise ValueError(
                f"{where}: a slope needs two runs or more, each with variants.<name>.x (missing: {missing})"
            )
    if measure == "ood_pass_at_1" and "ood" not in raw:
        raise ValueError(f"{where}: measure ood_pass_at_1 needs a study.ood evaluation")
    return StudyControl(
        kind,
        names,
        str(spec["statement"]),
        measure=measure,
        reference=reference,
        direction=int(direction),
        at_least=None if at_least is None else float(at_least),
    )
