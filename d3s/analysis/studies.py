"""A study's analysis (docs/studies.md): one value per (run, seed) and measure, read from the run's logs and
evaluations; the study's claims with paired 95 % intervals, Holm over the study's comparisons and the
smallest detectable effect; its controls, which must be supported for the claims' verdicts to count (else the
study is uninformative); its figure; and its report section, written to
``results/<experiment>/studies/<name>/`` (report.md, claims.csv, controls.csv, measures.csv, figure.png|pdf
and, for a calibration, calibration.csv).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from d3s.analysis.claims import COLUMNS, Claim, _row, holm, paired_t, seeds_for_effect, t_interval
from d3s.analysis.figures import save
from d3s.analysis.io import read_jsonl
from d3s.markdown import markdown_table
from d3s.provenance.manifest import atomic_write_text
from d3s.selection import SIGNAL_LOG_KEYS, ScopeSwitch, early_reward, spike_ratios
from d3s.studies import BASE, BASE_MEASURES, MEASURES, Study, StudyClaim, StudyControl, base_run, parse_study
from d3s.variants import Variant, run_variants

KL_FILE = "kl.json"
WARMUP = 3  # steps before the switch reads its signal: ScopeSwitch's default


# ---- one value per (run, seed) -----------------------------------------------------------------------------


def pass_at(summary: Path, k: int | None = None) -> float:
    """Pass@k in points from an evaluation's summary.json (the mean over its benchmarks; k None: the largest
    k evaluated); NaN when the file is missing."""
    if not summary.is_file():
        return math.nan
    benchmarks = json.loads(summary.read_text(encoding="utf-8")).get("benchmarks", {})
    values = []
    for info in benchmarks.values():
        table = {int(key): value for key, value in (info.get("pass_at_k") or {}).items()}
        if table:
            values.append(table[max(table) if k is None else k])
    return 100 * float(np.mean(values)) if values else math.nan


def _metrics(run: Path) -> pd.DataFrame:
    path = run / "metrics.jsonl"
    rows = [r for r in read_jsonl(path) if "loss" in r or "reward" in r] if path.is_file() else []
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).sort_values("step").drop_duplicates("step", keep="last").reset_index(drop=True)


def _column_mean(metrics: pd.DataFrame, column: str) -> float:
    return float(metrics[column].mean()) if column in metrics and metrics[column].notna().any() else math.nan


def _spike(grad_norms: Sequence[float]) -> float:
    norms = np.asarray([g for g in grad_norms if not math.isnan(g)], dtype=float)
    return float(norms.max() / np.median(norms)) if len(norms) and np.median(norms) > 0 else math.nan


def _eval_steps(evals: Path) -> list[int]:
    return sorted(int(p.name[4:]) for p in evals.glob("step*") if p.name[4:].isdigit())


def run_values(results: Path, name: str, seed: int, ood: str | None = None) -> dict[str, float]:
    """Every measure of d3s.studies.MEASURES for run ``name`` at ``seed`` (NaN where it has no data)."""
    run, evals = results / "runs" / name / f"seed{seed}", results / "eval" / name / f"seed{seed}"
    metrics = _metrics(run)
    values = dict.fromkeys(MEASURES, math.nan)
    values["pass_at_1"] = pass_at(evals / "final" / "summary.json", 1)
    values["pass_at_k"] = pass_at(evals / "final" / "summary.json")
    steps = _eval_steps(evals)
    if steps:
        values["early_pass_at_1"] = pass_at(evals / f"step{steps[0]}" / "summary.json", 1)
    kl_points = [evals / "final"] + [evals / f"step{step}" for step in reversed(steps)]
    for point in kl_points:  # the last evaluated checkpoint with a KL record
        if (point / KL_FILE).is_file():
            values["kl"] = float(json.loads((point / KL_FILE).read_text(encoding="utf-8"))["k3"])
            break
    if ood is not None:
        values["ood_pass_at_1"] = pass_at(
            results / "eval_ood" / ood / name / f"seed{seed}" / "summary.json", 1
        )
    if metrics.empty:
        return values
    if "reward" in metrics:
        last_quarter = metrics["reward"].iloc[-max(1, math.ceil(len(metrics) / 4)) :]
        values["train_reward"] = 100 * float(last_quarter.mean())
        values["generalization_gap"] = values["train_reward"] - values["pass_at_1"]
    values["grad_norm"] = _column_mean(metrics, "grad_norm")
    if "grad_norm" in metrics:
        values["grad_norm_spike"] = _spike(metrics["grad_norm"].astype(float).tolist())
    values["entropy"] = _column_mean(metrics, "entropy")
    # a run without a token level trains every token: its selected tokens are all of them
    selected = _column_mean(metrics, "selection/entropy_selected")
    values["entropy_selected"] = values["entropy"] if math.isnan(selected) else selected
    values["cross_group_fraction"] = _column_mean(metrics, "selection/cross_group")
    return values


def base_values(results: Path, base: str | None, ood: str | None = None) -> dict[str, float]:
    """The measures a base model has (d3s.studies.BASE_MEASURES): Pass@1 and Pass@k of its evaluation and,
    for the config's own base model, Pass@1 on the study's ``ood`` problems; NaN where missing."""
    folder = results / "eval" / ("base" if base is None else f"bases/{base}")
    values = dict.fromkeys(BASE_MEASURES, math.nan)
    values["pass_at_1"] = pass_at(folder / "summary.json", 1)
    values["pass_at_k"] = pass_at(folder / "summary.json")
    if ood is not None and base is None:
        values["ood_pass_at_1"] = pass_at(results / "eval_ood" / ood / "base" / "summary.json", 1)
    return values


def study_values(
    results: str | Path, study: Study, seeds: Sequence[int], variants: Mapping[str, Variant] | None = None
) -> pd.DataFrame:
    """Long table: run, seed, measure, value, for the study's runs and seeds; with ``variants``, also the
    base models the runs start from (runs ``base`` and ``base:<name>``, d3s.studies.base_run; one evaluation,
    the same value at every seed, so a control against the base pairs like any other)."""
    results = Path(results)
    ood = study.ood.name if study.ood else None
    rows = [
        {"run": name, "seed": int(seed), "measure": measure, "value": value}
        for name in study.runs
        for seed in seeds
        for measure, value in run_values(results, name, int(seed), ood).items()
        if measure in study.measures
    ]
    bases = sorted({variants[name].base for name in study.runs}, key=lambda b: b or "") if variants else []
    wanted = {"pass_at_1", *study.measures}
    rows += [
        {"run": base_run(base), "seed": int(seed), "measure": measure, "value": value}
        for base in bases
        for measure, value in base_values(results, base, ood).items()
        if measure in wanted
        for seed in seeds
    ]
    return pd.DataFrame(rows, columns=["run", "seed", "measure", "value"])


# ---- claims ------------------------------------------------------------------------------------------------


def _wide(values: pd.DataFrame, measure: str) -> pd.DataFrame:
    """seed x run table of one measure."""
    rows = values[values["measure"] == measure]
    return rows.pivot_table(index="seed", columns="run", values="value", aggfunc="mean", dropna=False)


def _claim(spec: StudyClaim, name: str) -> Claim:
    description, unit = MEASURES[spec.measure]
    kind = "difference"
    if spec.kind == "slope":
        unit = f"{unit} per decade"
    return Claim(name, spec.statement, unit, spec.direction, kind)


def _paired_row(claim: Claim, differences: pd.Series, method: str, reference: str, note: str) -> dict:
    row = _row(claim, method, reference, paired_t(differences), note)
    clean = differences.dropna()
    row["seed_sd"] = float(clean.std(ddof=1)) if len(clean) > 1 else math.nan
    return row


def slope_per_seed(table: pd.DataFrame, runs: Sequence[str], xs: Sequence[float]) -> pd.Series:
    """Per seed, the least-squares slope of the measure against log10 x over ``runs``."""
    logs = np.log10(np.asarray(xs, dtype=float))
    slopes = {}
    for seed, row in table.reindex(columns=list(runs)).iterrows():
        y = row.to_numpy(dtype=float)
        keep = ~np.isnan(y)
        slopes[seed] = float(np.polyfit(logs[keep], y[keep], 1)[0]) if keep.sum() >= 2 else math.nan
    return pd.Series(slopes, dtype=float)


def _spec_rows(spec: StudyClaim, values: pd.DataFrame, variants: Mapping[str, Variant]) -> list[dict]:
    """The rows of one claim (or a control's claim): one per run of a versus, one for a slope or an
    interaction. A versus against ``base`` pairs each run with its own base model."""
    table = _wide(values, spec.measure)
    claim = _claim(spec, f"{spec.measure}_{spec.kind}")
    rows = []
    if spec.kind == "versus":
        for run in spec.runs:
            reference = base_run(variants[run].base) if spec.reference == BASE else spec.reference
            if run == reference:
                continue
            both = table.reindex(columns=[run, reference])
            rows.append(_paired_row(claim, both[run] - both[reference], run, reference, ""))
    elif spec.kind == "slope":
        xs = [variants[run].x for run in spec.runs]
        slopes = slope_per_seed(table, spec.runs, xs)
        note = "least-squares slope per seed against log10 x: " + ", ".join(
            f"{run} {x:g}" for run, x in zip(spec.runs, xs, strict=True)
        )
        rows.append(_paired_row(claim, slopes, "slope", "log10 x", note))
    else:  # interaction: (a - b) - (c - d), per seed
        a, b, c, d = spec.runs
        both = table.reindex(columns=[a, b, c, d])
        contrast = (both[a] - both[b]) - (both[c] - both[d])
        rows.append(_paired_row(claim, contrast, f"({a} - {b})", f"({c} - {d})", "interaction per seed"))
    return rows


def claim_rows(values: pd.DataFrame, study: Study, variants: Mapping[str, Variant]) -> pd.DataFrame:
    """Every claim of the study: a row per comparison (columns of d3s.analysis.claims.COLUMNS), Holm over all
    of them."""
    rows = [row for spec in study.claims for row in _spec_rows(spec, values, variants)]
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    verdicts = zip(table["verdict"], holm(table["p_value"]), strict=True)
    table["verdict_holm"] = [v if rejected else "inconclusive" for v, rejected in verdicts]
    return table


# ---- power (docs/studies/power.md) ---------------------------------------------------------------------

TARGET_EFFECT = 1.5  # points of Pass@1: the smallest detectable effect a primary claim should reach


def power_table(
    values: pd.DataFrame, study: Study, variants: Mapping[str, Variant], effect: float = TARGET_EFFECT
) -> pd.DataFrame:
    """The power calculation of the study's primary claims: each comparison's verdict (after Holm over the
    whole study, as its report), the spread of its paired differences across seeds, the smallest effect its
    seeds detect with 80 % power, and the fewest paired seeds that would detect ``effect`` at that spread
    (``seeds_needed``; the spread includes the evaluation's sampling noise at the study's problems and
    samples). ``enough``: decided already, or the detectable effect is at most ``effect``."""
    claims = claim_rows(values, study, variants)
    primary = [spec.primary for spec in study.claims for _ in _spec_rows(spec, values, variants)]
    table = claims[primary].reset_index(drop=True)
    table["seeds_needed"] = [seeds_for_effect(sd, effect) for sd in table["seed_sd"]]
    decided = table["verdict_holm"] != "inconclusive"
    table["enough"] = decided | (table["min_detectable_effect"] <= effect)
    return table


def power_markdown(power: pd.DataFrame, effect: float = TARGET_EFFECT) -> str:
    """The power table as docs/studies/power.md shows it."""

    def status(row: Any) -> str:
        if row["verdict_holm"] != "inconclusive":
            return f"decided ({row['verdict_holm']})"
        if row["min_detectable_effect"] <= effect:
            return f"detects {effect:g} now"
        needed = row["seeds_needed"]
        return f"{needed:.0f} seeds" if needed is not None and not pd.isna(needed) else "over 1,000 seeds"

    columns = {
        "claim": lambda r: r["claim"],
        "run": lambda r: r["method"],
        "against": lambda r: r["reference"],
        "estimate [95 % CI]": lambda r: f"{_fmt(r['estimate'])} [{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]",
        "seeds": lambda r: r["seeds"],
        "seed SD": lambda r: _fmt(r["seed_sd"]),
        "detectable now": lambda r: _fmt(r["min_detectable_effect"]),
        f"to detect {effect:g}": status,
    }
    return markdown_table((row for _, row in power.iterrows()), columns)


# ---- controls (docs/studies.md, "Controls") ----------------------------------------------------------------

CONTROL_COLUMNS = ["control", "kind", "run", "against", "estimate", "ci_low", "ci_high", "seeds", "unit"]
CONTROL_COLUMNS += ["threshold", "supported", "statement", "note"]
FIRED_BELOW = 1 - 1e-9  # a run whose cross-group fraction is below 1 switched to intra-group at some step


def _fires_row(spec: StudyControl, values: pd.DataFrame) -> dict:
    """How many of the control's runs x seeds the switch fired on: the estimate is the count among those
    with data, the interval the counts the data allow (every run without data fired, or none did)."""
    table = _wide(values, "cross_group_fraction").reindex(columns=list(spec.runs))
    cells = table.to_numpy(dtype=float).ravel()
    missing = int(np.isnan(cells).sum())
    fired = int((cells[~np.isnan(cells)] < FIRED_BELOW).sum())
    if spec.at_least is not None:
        supported = fired >= spec.at_least
    else:
        supported = fired + missing <= int(spec.at_most or 0)
    per_run = "; ".join(
        f"{run}: " + ", ".join(_fmt(v) for v in table[run].to_numpy(dtype=float)) for run in spec.runs
    )
    return {
        "estimate": float(fired),
        "ci_low": float(fired),
        "ci_high": float(fired + missing),
        "seeds": int(len(cells) - missing),
        "unit": f"runs x seeds (of {len(cells)})",
        "run": ", ".join(spec.runs),
        "against": "-",
        "supported": bool(supported),
        "note": f"cross-group fraction per seed: {per_run}"
        + (f"; {missing} without data" if missing else ""),
    }


def control_supported(spec: StudyControl, low: float, high: float) -> bool:
    """A control of an interval kind: the 95 % interval lies beyond ``at_least`` in its direction (a missing
    interval is not support)."""
    if math.isnan(low) or math.isnan(high):
        return False
    size = spec.at_least or 0.0
    return low > size if spec.direction > 0 else high < -size


def control_rows(values: pd.DataFrame, study: Study, variants: Mapping[str, Variant]) -> pd.DataFrame:
    """Every control of the study, a row per comparison (CONTROL_COLUMNS), each ``supported`` or not. No Holm:
    the verdicts count only when every control is supported, so each is tested at the 5 % level."""
    rows = []
    for index, spec in enumerate(study.controls, 1):
        common = {"control": f"control {index}", "kind": spec.kind, "threshold": spec.threshold()}
        common["statement"] = spec.statement
        if spec.kind == "fires":
            rows.append(common | _fires_row(spec, values))
            continue
        for row in _spec_rows(spec.claim, values, variants):
            rows.append(
                common
                | {
                    "run": row["method"],
                    "against": row["reference"],
                    "estimate": row["estimate"],
                    "ci_low": row["ci_low"],
                    "ci_high": row["ci_high"],
                    "seeds": row["seeds"],
                    "unit": row["unit"],
                    "supported": control_supported(spec, row["ci_low"], row["ci_high"]),
                    "note": row["note"],
                }
            )
    return pd.DataFrame(rows, columns=CONTROL_COLUMNS)


def failed_controls(controls: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``controls`` that are not supported (any: the study is uninformative)."""
    if controls.empty:
        return controls
    return controls[~controls["supported"].astype(bool)]


# ---- calibration (the adaptive switch's threshold) ---------------------------------------------------------


# What each calibration run shows of the switch's signal (d3s.selection.ScopeSwitch), and how a candidate
# threshold fires on it: a column named for the signal, one per candidate.
_SIGNAL_COLUMN = {"early_reward": "early_reward", "grad_norm_spike": "max_spike_ratio"}
_FIRES_COLUMN = {"early_reward": "switches_below_{:g}", "grad_norm_spike": "switches_above_{:g}"}


def calibration_table(results: Path, study: Study, variants: Mapping[str, Variant]) -> pd.DataFrame:
    """Per calibration run and seed: what it shows of the switch's signal (the mean reward of its first
    steps, or its largest spike ratio: d3s.selection) and, for each candidate threshold, whether the adaptive
    switch (ScopeSwitch itself) would have fired."""
    assert study.calibration is not None
    signal = study.calibration.signal
    rows = []
    for name in study.calibration.runs:
        for seed in study.calibration.seeds:
            metrics = _metrics(results / "runs" / name / f"seed{seed}")
            key = SIGNAL_LOG_KEYS[signal]
            logged = metrics[key].astype(float).tolist() if key in metrics else []
            row = {"run": name, "base": variants[name].base or "default", "seed": seed}
            if signal == "early_reward":
                row["early_reward"] = early_reward(logged, WARMUP)
            else:
                ratios = spike_ratios(logged, WARMUP)
                row["max_spike_ratio"] = max(ratios) if ratios else math.nan
            for threshold in study.calibration.thresholds:
                fires = ScopeSwitch(threshold, WARMUP, signal).switched(logged)
                row[_FIRES_COLUMN[signal].format(threshold)] = bool(fires)
            rows.append(row)
    return pd.DataFrame(rows)


def chosen_threshold(
    calibration: pd.DataFrame, thresholds: Sequence[float], signal: str = "grad_norm_spike"
) -> float:
    """The rule; NaN when no candidate satisfies it.

    grad_norm_spike: the smallest candidate above every spike ratio the default base model showed (so the
    switch never fires on the calibration runs of a well-aligned model).
    early_reward: of the candidates between the highest early reward of the other (weakly aligned) base
    models and the lowest of the default base model, the one nearest halfway between them (so it fires on
    every calibration run of the weak base and on none of the default, with the widest margin both ways).
    """
    values = calibration[_SIGNAL_COLUMN[signal]]
    aligned = calibration["base"] == "default"
    if signal == "grad_norm_spike":
        above = [t for t in sorted(thresholds) if t > values[aligned].max()]
        return above[0] if above else math.nan
    low, high = values[~aligned].max(), values[aligned].min()
    between = [t for t in sorted(thresholds) if low < t < high]
    return min(between, key=lambda t: abs(t - (low + high) / 2)) if between else math.nan


# ---- figure ------------------------------------------------------------------------------------------------


def _label(variants: Mapping[str, Variant], name: str) -> str:
    return variants[name].label or name


def study_figure(values: pd.DataFrame, study: Study, variants: Mapping[str, Variant]):
    """One panel per figure measure: mean and 95 % t-interval over seeds (points: the seeds), per run, or
    against x on a log axis, or one series per group of runs."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    measures = study.figure_measures
    fig, axes = plt.subplots(1, len(measures), figsize=(4.2 * len(measures), 3.6), squeeze=False)
    groups = study.figure_groups or {"": study.runs}
    for ax, measure in zip(axes[0], measures, strict=True):
        table = _wide(values, measure)
        for offset, (group, runs) in enumerate(groups.items()):
            if study.figure_axis == "x":
                xs = np.asarray([variants[r].x for r in runs], dtype=float)
            else:
                xs = np.arange(len(runs)) + (offset - (len(groups) - 1) / 2) * 0.12
            means, halves = [], []
            for x, run in zip(xs, runs, strict=True):
                seeds = table[run].dropna() if run in table else pd.Series(dtype=float)
                result = t_interval(seeds)
                means.append(result["estimate"])
                halves.append((result["ci_high"] - result["ci_low"]) / 2)
                ax.scatter(np.full(len(seeds), x), seeds, s=9, alpha=0.35, color=f"C{offset}")
            halves = [0.0 if math.isnan(h) else h for h in halves]
            line = "-" if study.figure_axis == "x" else "none"  # runs side by side are not a curve
            ax.errorbar(
                xs,
                means,
                yerr=halves,
                marker="o",
                linestyle=line,
                capsize=3,
                color=f"C{offset}",
                label=group or None,
            )
        if study.figure_axis == "x":
            ax.set_xscale("log")
            runs = list(groups.values())[0]
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks([variants[r].x for r in runs], [f"{variants[r].x:g}" for r in runs], fontsize=8)
            ax.set_xlabel(study.figure_xlabel or "x", fontsize=8)
        else:
            runs = list(groups.values())[0]
            ax.set_xticks(np.arange(len(runs)), [_label(variants, r) for r in runs], fontsize=8, rotation=20)
            # every run's slot whole: a measure only the last runs have (the switch's fraction) would
            # otherwise end the axis at their points and cut the groups drawn beside them
            ax.set_xlim(-0.5, len(runs) - 0.5)
        description, unit = MEASURES[measure]
        ax.set_title(description, fontsize=9)
        ax.set_ylabel(unit)
        if unit == "fraction":  # the whole 0..1 range, so a run at either end is drawn whole
            ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(study.title, fontsize=11)
    fig.tight_layout()
    return fig


# ---- report ------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2, significant: bool = False) -> str:
    """``digits`` decimals; with ``significant``, a float under 1 in size gets 3 significant digits instead
    (entropies and norms, where 2 decimals would read 0.00)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if not isinstance(value, (float, np.floating)):
        return str(value)
    small = significant and value != 0 and abs(value) < 1
    return f"{value:.3g}" if small else f"{value:.{digits}f}"


def claims_markdown(claims: pd.DataFrame) -> str:
    def value(row: Any, key: str) -> str:  # points with 2 decimals, smaller units with 3 significant digits
        return _fmt(row[key], significant=not str(row["unit"]).startswith("points"))

    columns = {
        "claim": lambda r: r["claim"],
        "run": lambda r: r["method"],
        "against": lambda r: r["reference"],
        "estimate [95 % CI]": lambda r: (
            f"{value(r, 'estimate')} [{value(r, 'ci_low')}, {value(r, 'ci_high')}]"
        ),
        "unit": lambda r: r["unit"],
        "seeds": lambda r: r["seeds"],
        "verdict": lambda r: r["verdict"],
        "after Holm": lambda r: r["verdict_holm"],
        "detectable": lambda r: value(r, "min_detectable_effect"),
        "statement": lambda r: r["statement"],
    }
    return markdown_table((row for _, row in claims.iterrows()), columns)


def controls_markdown(controls: pd.DataFrame) -> str:
    """The controls table: each comparison, its estimate and interval, what supports it, and whether it is."""

    def value(row: Any, key: str) -> str:
        return _fmt(row[key], significant=not str(row["unit"]).startswith(("points", "runs")))

    def estimate(row: Any) -> str:
        if row["kind"] == "fires":  # a count: the interval is what the runs without data allow
            low, high = int(row["ci_low"]), int(row["ci_high"])
            return f"{int(row['estimate'])}" + (f" [{low}, {high}]" if high != low else "")
        return f"{value(row, 'estimate')} [{value(row, 'ci_low')}, {value(row, 'ci_high')}]"

    columns = {
        "control": lambda r: r["control"],
        "run": lambda r: r["run"],
        "against": lambda r: r["against"],
        "estimate [95 % CI]": estimate,
        "unit": lambda r: r["unit"],
        "seeds": lambda r: r["seeds"],
        "supported when": lambda r: r["threshold"],
        "status": lambda r: "supported" if _truthy(r["supported"]) else "**NOT SUPPORTED**",
        "statement": lambda r: r["statement"],
    }
    return markdown_table((row for _, row in controls.iterrows()), columns)


def _truthy(value: Any) -> bool:
    """A ``supported`` cell, from the frame (bool) or read back from controls.csv (bool or 'True')."""
    return str(value).strip().lower() in ("true", "1", "1.0")


def control_summary(row: Any) -> str:
    """One failed (or any) control in words: its statement, run, estimate and interval, and the threshold."""
    if row["kind"] == "fires":
        low, high = int(row["ci_low"]), int(row["ci_high"])
        span = f" ({low} to {high} with the runs without data)" if high != low else ""
        return (
            f"'{row['statement']}': the switch fired on {int(row['estimate'])} {row['unit']} of "
            f"{row['run']}{span}; supported when {row['threshold']}"
        )
    unit = str(row["unit"])
    if pd.isna(row["estimate"]):
        return (
            f"'{row['statement']}': {row['run']} against {row['against']} has no data (the run is missing "
            f"or has fewer than 2 seeds); supported when {row['threshold']}"
        )
    small = not unit.startswith("points")
    interval = f"{_fmt(row['estimate'], significant=small)} [{_fmt(row['ci_low'], significant=small)}, "
    interval += f"{_fmt(row['ci_high'], significant=small)}] {unit}"
    return (
        f"'{row['statement']}': {row['run']} against {row['against']}, {interval}; supported when "
        f"{row['threshold']}"
    )


def status_markdown(controls: pd.DataFrame) -> str:
    """The study's standing in one paragraph: uninformative (naming each failed control), or every control
    supported; empty without controls."""
    if controls.empty:
        return ""
    failed = failed_controls(controls)
    if failed.empty:
        return f"**Controls: {len(controls)} of {len(controls)} supported**, so the verdicts below count."
    reasons = "; ".join(control_summary(row) for _, row in failed.iterrows())
    return (
        f"**UNINFORMATIVE.** {len(failed)} of {len(controls)} control comparisons not supported: {reasons}. "
        "The study's verdicts below are shown for the record and do **not** count as evidence."
    )


def _base_value(values: pd.DataFrame, base: str | None, measure: str = "pass_at_1") -> float:
    rows = values[(values["run"] == base_run(base)) & (values["measure"] == measure)]["value"].dropna()
    return float(rows.iloc[0]) if len(rows) else math.nan


def study_report(
    study: Study,
    config: Mapping[str, Any],
    variants: Mapping[str, Variant],
    values: pd.DataFrame,
    claims: pd.DataFrame,
    calibration: pd.DataFrame | None,
    controls: pd.DataFrame | None = None,
) -> str:
    """The study's report section (Markdown): uninformative first when a control failed; the controls
    before the verdicts."""
    controls = pd.DataFrame(columns=CONTROL_COLUMNS) if controls is None else controls
    informative = failed_controls(controls).empty
    seeds = [int(s) for s in config["seeds"]]
    lines = [f"## {study.title}", ""]
    if not informative:
        lines += [status_markdown(controls), ""]
    lines += [f"**The question, as the papers leave it.** {study.question}", ""]
    if study.setup:
        lines += [f"**Setup.** {study.setup}", ""]
    trainer = config["train"]["trainer"]
    lines += [
        f"The testbed: {trainer.get('max_steps')} steps of "
        f"{trainer.get('per_device_train_batch_size')} rollouts (G = {trainer.get('num_generations')}), "
        f"seeds {', '.join(map(str, seeds))} paired across the runs (a seed fixes the data order and the "
        "sampling), every final model evaluated on the held-out problems. Runs:",
        "",
    ]
    run_rows = []
    for name in study.runs:
        variant = variants[name]
        overrides = ", ".join(f"{k}: {v}" for k, v in variant.trainer.items()) or "-"
        table = _wide(values, "pass_at_1")
        result = t_interval(table[name].dropna()) if name in table else {"estimate": math.nan}
        run_rows.append(
            {
                "run": name,
                "label": variant.label or name,
                "method": variant.method,
                "overrides": overrides,
                "base": variant.base or "default",
                "base_pass": _fmt(_base_value(values, variant.base), 1),
                "pass": _fmt(result["estimate"], 1),
            }
        )
    columns = {
        "run": "{run}",
        "label": "{label}",
        "method": "{method}",
        "trainer overrides": "{overrides}",
        "base model (its Pass@1)": "{base} ({base_pass})",
        "final Pass@1 (mean)": "{pass}",
    }
    lines += [markdown_table(run_rows, columns), ""]
    if study.ood is not None:
        task = ", ".join(f"{k} {v}" for k, v in study.ood.task.items())
        ood_base = _base_value(values, None, "ood_pass_at_1")
        lines += [
            f"Held-out problems unlike the training ones ({study.ood.name}): the task with {task}; the base "
            f"model's Pass@1 on them {_fmt(ood_base, 1)}.",
            "",
        ]
    if not controls.empty:
        lines += [
            "**Controls** (claims that must be supported for the verdicts to count; 95 % intervals over the "
            "paired seeds, each at the 5 % level and without Holm, since every one must pass; 'base': each "
            "run's own base model; docs/studies.md, Controls):",
            "",
            controls_markdown(controls),
            "",
        ]
        if informative:
            lines += [status_markdown(controls), ""]
    heading = "**Verdicts**" if informative else "**Verdicts, NOT COUNTING: the study is uninformative**"
    lines += [
        f"![{study.title}](figure.png)",
        "",
        f"{heading} (95 % intervals over the paired seeds; Holm "
        "over the study's comparisons; 'detectable': the smallest true effect the seeds detect with 80 % "
        "power):",
        "",
        claims_markdown(claims),
        "",
    ]
    counts = claims["verdict_holm"].value_counts().to_dict()
    lines += [
        ("After Holm" if informative else "After Holm, not counting")
        + ": "
        + ", ".join(f"{counts.get(v, 0)} {v}" for v in ("supported", "refuted", "inconclusive"))
        + f" of {len(claims)} comparisons.",
        "",
    ]
    if calibration is not None and not calibration.empty:
        assert study.calibration is not None
        lines += _calibration_lines(study, variants, calibration)
    return "\n".join(lines)


# The calibration section's words, by the switch's signal: what each run shows, and the rule.
_CALIBRATION_WORDS = {
    "grad_norm_spike": (
        "the largest spike ratio of each calibration run (a step's gradient norm over the median of the "
        f"earlier ones, after {WARMUP} steps)",
        "the smallest candidate above every ratio the default base model showed",
    ),
    "early_reward": (
        f"the mean reward of each calibration run's first {WARMUP} steps (the switch's signal)",
        "the candidate nearest halfway between the highest early reward of the weak base and the lowest of "
        "the default base, strictly between them",
    ),
}


def _calibration_lines(study: Study, variants: Mapping[str, Variant], calibration: pd.DataFrame) -> list[str]:
    """The report's calibration section: the table, the rule's choice and whether the registry agrees."""
    from d3s.methods import METHODS

    assert study.calibration is not None
    signal = study.calibration.signal
    chosen = chosen_threshold(calibration, study.calibration.thresholds, signal)
    declared = sorted(
        {
            float(variants[r].trainer.get("scope_switch_threshold", math.nan))
            for r in study.runs
            if "scope_switch_threshold" in variants[r].trainer
        }
    )
    registry = sorted(
        {
            m.scope_switch_threshold
            for m in METHODS.values()
            if m.scope_switch_threshold and m.scope_switch_signal == signal
        }
    )
    shows, rule = _CALIBRATION_WORDS[signal]
    return [
        f"**Calibration** (seeds {', '.join(map(str, study.calibration.seeds))}, outside the study's): "
        f"{shows} and whether each candidate threshold would have switched:",
        "",
        _frame_markdown(calibration),
        "",
        f"The rule ({rule}) chooses "
        f"{_fmt(chosen)}; the registry's threshold is {', '.join(map(str, registry)) or '-'}"
        + (f", the study's runs set {declared}" if declared else "")
        + (". They agree." if registry and chosen in registry else ". THEY DIFFER: update d3s/methods.py."),
        "",
    ]


def _frame_markdown(frame: pd.DataFrame) -> str:
    columns = {str(c): (lambda r, c=c: _fmt(r[c]) if isinstance(r[c], float) else str(r[c])) for c in frame}
    return markdown_table((row for _, row in frame.iterrows()), columns)


def write_study(results: str | Path, config: Mapping[str, Any]) -> dict[str, Path]:
    """Everything of the config's study under ``results``/studies/<name>/; returns the files written."""
    results = Path(results)
    variants = run_variants(config)
    study = parse_study(config, variants)
    if study is None:
        raise ValueError("the config has no study section (config/studies/<name>.yaml)")
    values = study_values(results, study, config["seeds"], variants)
    calibration = calibration_table(results, study, variants) if study.calibration else None
    return render_study(results / "studies" / study.name, config, values, calibration)


def render_study(
    out: str | Path, config: Mapping[str, Any], values: pd.DataFrame, calibration: pd.DataFrame | None = None
) -> dict[str, Path]:
    """The study's claims, controls, figure and report from its ``values`` (study_values: its runs and their
    base models, per seed), written to ``out``; returns the files written. Needs no run folder, so a
    committed study's measures.csv renders again under a newer analysis."""
    out = Path(out)
    variants = run_variants(config)
    study = parse_study(config, variants)
    if study is None:
        raise ValueError("the config has no study section (config/studies/<name>.yaml)")
    out.mkdir(parents=True, exist_ok=True)
    written_config = out / "config.yaml"  # what the study ran, resolved (read_study rebuilds it from here)
    atomic_write_text(written_config, yaml.safe_dump(dict(config), sort_keys=False))
    claims = claim_rows(values, study, variants)
    controls = control_rows(values, study, variants)
    written = {"config": written_config, "measures": out / "measures.csv", "claims": out / "claims.csv"}
    written["controls"] = out / "controls.csv"
    written["report"] = out / "report.md"
    atomic_write_text(written["measures"], values.to_csv(index=False))
    atomic_write_text(written["claims"], claims.to_csv(index=False))
    atomic_write_text(written["controls"], controls.to_csv(index=False))
    if calibration is not None:
        written["calibration"] = out / "calibration.csv"
        atomic_write_text(written["calibration"], calibration.to_csv(index=False))
    figure = study_figure(values, study, variants)
    written["figure"], written["pdf"] = save(figure, out / "figure")
    report = study_report(study, config, variants, values, claims, calibration, controls)
    atomic_write_text(written["report"], report)
    return written


# ---- reading a study's folder back (notebooks/studies.ipynb, the index) ------------------------------------


@dataclass(frozen=True)
class StudyResults:
    """A study's folder as write_study left it."""

    folder: Path
    config: dict[str, Any]
    study: Study
    variants: dict[str, Variant]
    values: pd.DataFrame
    claims: pd.DataFrame
    controls: pd.DataFrame

    def figure(self):
        return study_figure(self.values, self.study, self.variants)

    def verdicts(self) -> dict[str, int]:
        """The claims' verdict counts after Holm (whether they count: ``informative``)."""
        counts = self.claims["verdict_holm"].value_counts().to_dict()
        return {verdict: int(counts.get(verdict, 0)) for verdict in ("supported", "refuted", "inconclusive")}

    @property
    def informative(self) -> bool:
        """Every control supported (or none declared): the verdicts count."""
        return failed_controls(self.controls).empty

    def status(self) -> str:
        """The report's paragraph on the controls (status_markdown)."""
        return status_markdown(self.controls)


def read_study(folder: str | Path) -> StudyResults:
    """A study's folder (results/<experiment>/studies/<name>/, or a committed copy) with its spec rebuilt."""
    folder = Path(folder)
    config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    variants = run_variants(config)
    study = parse_study(config, variants)
    assert study is not None, f"{folder}/config.yaml has no study section"
    values = pd.read_csv(folder / "measures.csv")
    claims = pd.read_csv(folder / "claims.csv")
    if (folder / "controls.csv").is_file():
        controls = pd.read_csv(folder / "controls.csv")
        controls["supported"] = controls["supported"].map(_truthy).astype(bool)
    else:  # a folder from before controls: recomputed from its measures (none declared: empty)
        controls = control_rows(values, study, variants)
    return StudyResults(folder, config, study, variants, values, claims, controls)


def study_folders(root: str | Path) -> list[Path]:
    """The study folders under ``root`` (each with a report.md), in the order of docs/studies.md."""
    found = {p.parent.name: p.parent for p in Path(root).glob("*/report.md")}
    order = [name for name in STUDY_ORDER if name in found] + sorted(set(found) - set(STUDY_ORDER))
    return [found[name] for name in order]


STUDY_ORDER = ("token_level", "sample_level", "schedule", "alignment", "adaptive", "generalization")


def index_markdown(root: str | Path, times: Mapping[str, str] | None = None) -> str:
    """A table of the studies under ``root``: each study's controls (an uninformative study names the control
    that failed, with its estimate and interval) and its verdict counts after Holm, which count only when
    every control is supported (and the wall time, where ``times`` gives one)."""
    rows = []
    for folder in study_folders(root):
        result = read_study(folder)
        counts = result.verdicts()
        verdicts = ", ".join(f"{counts[v]} {v}" for v in ("supported", "refuted", "inconclusive"))
        failed = failed_controls(result.controls)
        if result.controls.empty:
            controls = "none declared"
        elif failed.empty:
            controls = f"{len(result.controls)} of {len(result.controls)} supported"
        else:
            controls = "**uninformative**: " + "; ".join(control_summary(r) for _, r in failed.iterrows())
            verdicts = f"not counted ({verdicts})"
        rows.append(
            {
                "study": f"[{result.study.name}]({folder.name}/report.md)",
                "title": result.study.title,
                "controls": controls,
                "verdicts": verdicts,
                "time": (times or {}).get(result.study.name, "-"),
            }
        )
    columns = {
        "study": "{study}",
        "question": "{title}",
        "controls": "{controls}",
        "after Holm": "{verdicts}",
    }
    return markdown_table(rows, columns | {"wall time": "{time}"})
