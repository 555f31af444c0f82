"""The regime sweep's gaps and their trend: per point (``results/<experiment>/p<P>/``, a complete experiment)
and method, the paired Pass@1 and Pass@k gaps to the reference at equal steps, the Pass@1 gap at equal
wall-clock (the reference's learning curve interpolated at the method's own training time) and the step-time
ratio (:func:`point_gaps`, :func:`sweep_tables`); and the slope of each gap against log10 update tokens per
step, with its Welch interval over the points' seeds, as claims rows (:func:`gap_slope`,
:func:`trend_claims`; docs/workflow/regime-sweep.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from d3s.analysis.claims import (
    CLAIMS,
    COLUMNS,
    LEVEL,
    Claim,
    _row,
    detectable_shift,
    holm,
    paired_t,
    per_seed_pass_at_k,
    ratio_row,
    verdict,
)
from d3s.analysis.io import load_evals, load_metrics

UPDATE_TOKENS = "selection/update_tokens"  # the trainer's per-step count (the claims' update_tokens claim)
MEASURES = {"steps": "at equal steps", "wall_clock": "at equal wall-clock"}
SLOPE_CLAIMS = {
    measure: Claim(
        "gap_slope" if measure == "steps" else "gap_slope_wall_clock",
        f"the Pass@1 gap to the reference {label} grows with the update tokens per step",
        "points per decade",
        +1,
        "difference",
    )
    for measure, label in MEASURES.items()
}
# Near 100 % a gap in points must shrink whatever the regime: the ceiling. The log of the reference's errors
# over the method's (errors: 1 - the final models' Pass@1) measures the gap against the room the reference
# leaves; its slope asks whether the method closes on the reference beyond what the ceiling forces.
ERROR_RATIO = "error_ratio"
SLOPE_CLAIMS[ERROR_RATIO] = Claim(
    "error_ratio_slope",
    "the reference's errors over the method's (1 - Pass@1, log) grow with the update tokens per step",
    "ln(error ratio) per decade",
    +1,
    "difference",
)
ERROR_FLOOR = 1e-4  # a seed with no error keeps a finite log ratio


def log_error_ratio(method_pass: Any, reference_pass: Any) -> Any:
    """ln((1 - reference) / (1 - method)) of Pass@1 fractions in [0, 1], errors floored at ERROR_FLOOR:
    positive where the method errs less than the reference, 0 where they err alike."""
    method_errors = np.maximum(1 - np.asarray(method_pass, dtype=float), ERROR_FLOOR)
    reference_errors = np.maximum(1 - np.asarray(reference_pass, dtype=float), ERROR_FLOOR)
    return np.log(reference_errors / method_errors)


WALL_CLOCK_GAP = Claim(
    "pass_at_1_wall_clock",
    "higher held-out Pass@1 than the reference at the method's own training wall-clock",
    "points",
    +1,
    "difference",
)


# ---- statistics ------------------------------------------------------------------------------------------


def value_at(times: Sequence[float], values: Sequence[float], at: float) -> tuple[float, bool]:
    """The learning curve (``times``, ``values``) linearly interpolated at time ``at``, and whether ``at`` lay
    outside the curve's times (then the nearest end's value: the run never trained that long or short)."""
    t, v = np.asarray(times, dtype=float), np.asarray(values, dtype=float)
    keep = ~(np.isnan(t) | np.isnan(v))
    t, v = t[keep], v[keep]
    if not len(t) or math.isnan(at):
        return math.nan, False
    order = np.argsort(t, kind="stable")
    return float(np.interp(at, t[order], v[order])), bool(at > t.max() or at < t.min())


def gap_slope(
    x: Sequence[float], gaps: Sequence[Sequence[float]], level: float = LEVEL, detectable: bool = True
) -> dict[str, float]:
    """The slope of the gap against ``x`` (log10 update tokens per step, one per point) from the per-seed
    gaps of each point: ordinary least squares on the point means (the same slope as OLS on every seed's gap
    when the points have equal seeds), b = sum_j w_j mean_j with w_j = (x_j - mean x) / sum (x - mean x)^2.

    The points are independent runs, each with its own seed variance s_j^2, so Var(b) =
    sum_j w_j^2 s_j^2 / n_j exactly; the interval is t with Welch-Satterthwaite degrees of freedom (a Welch
    test of a linear contrast of means), which needs at least 2 seeds at every point. Returns estimate,
    ci_low, ci_high, p_value, n (seeds in all), se, df and mde (the slope detectable with 80 % power, from
    the noncentral t)."""
    x = np.asarray(x, dtype=float)
    samples = [np.asarray([g for g in s if not math.isnan(g)], dtype=float) for s in gaps]
    keep = [i for i, s in enumerate(samples) if len(s)]
    x, samples = x[keep], [samples[i] for i in keep]
    n = int(sum(len(s) for s in samples))
    result = {"estimate": math.nan, "n": n, "se": math.nan, "df": math.nan}
    result |= {"ci_low": math.nan, "ci_high": math.nan, "p_value": math.nan, "mde": math.nan}
    if len(x) < 2 or np.ptp(x) == 0:
        return result
    w = (x - x.mean()) / ((x - x.mean()) ** 2).sum()
    means = np.array([s.mean() for s in samples])
    result["estimate"] = float(w @ means)
    if min(len(s) for s in samples) < 2:
        return result
    parts = np.array([wj**2 * s.var(ddof=1) / len(s) for wj, s in zip(w, samples, strict=True)])
    se = float(math.sqrt(parts.sum()))
    result["se"] = se
    if se == 0:  # every seed the same gap at every point: the slope is certain
        same = result["estimate"]
        return result | {"ci_low": same, "ci_high": same, "p_value": float(same == 0)}
    df = float(parts.sum() ** 2 / sum(p**2 / (len(s) - 1) for p, s in zip(parts, samples, strict=True)))
    half = stats.t.ppf(1 - (1 - level) / 2, df) * se
    t = result["estimate"] / se
    return result | {
        "df": df,
        "ci_low": result["estimate"] - half,
        "ci_high": result["estimate"] + half,
        "p_value": float(2 * stats.t.sf(abs(t), df)),
        "mde": detectable_shift(df, level) * se if detectable else math.nan,
    }


def wall_clock_gaps(
    curves: pd.DataFrame, final: pd.Series, method: str, reference: str
) -> tuple[dict[Any, float], int]:
    """Per seed of ``final`` (the method's final Pass@1 by seed, on [0, 1], on the problems of the curves'
    other points: io.load_curve_evals): the method's final Pass@1 minus
    the reference's learning curve (``curves``: method, seed, step, value, wall_clock; d3s.analysis.tables.
    learning_curves) interpolated at the method's own training wall-clock (its curve's last step), in points;
    and the number of seeds whose wall-clock lay beyond the reference's run (the reference's final value)."""
    gaps, clamped = {}, 0
    for seed, value in final.items():
        own = curves[(curves["method"] == method) & (curves["seed"] == seed)]
        spent = float(own.loc[own["step"].idxmax(), "wall_clock"]) if len(own) else math.nan
        ref = curves[(curves["method"] == reference) & (curves["seed"] == seed)]
        at, outside = value_at(ref["wall_clock"], ref["value"], spent)
        clamped += outside
        gaps[seed] = 100 * (value - at)
    return gaps, clamped


# ---- the sweep's points ------------------------------------------------------------------------------------


def point_gaps(
    results: Path, methods: Sequence[str], reference: str, allow_mixed: bool = False
) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """One point's rows of the gap table (one per method but the reference) and its per-seed gaps (method,
    seed, measure, gap in points), from the point's own tables, which its notebooks and report wrote from its
    checked manifests: ``learning_curves.csv`` (Pass@1 by method, seed and step on the checkpoints' problems,
    the last step the final model, and the training wall-clock reached) and ``claims.csv`` (the Pass@1 and
    Pass@k rows, taken as they are); the final models' own Pass@1 (the gaps at equal steps), update tokens and
    step times from the point's evaluations and metrics."""
    tables = results / "tables"
    for name in ("learning_curves.csv", "claims.csv", "pass_at_k.csv"):
        if not (tables / name).is_file():
            raise FileNotFoundError(
                f"{tables / name} is missing: run the point's workflow to its report first"
            )
    curves = pd.read_csv(tables / "learning_curves.csv")
    point_claims = pd.read_csv(tables / "claims.csv")
    kmax = int(pd.read_csv(tables / "pass_at_k.csv")["k"].max())
    metrics = load_metrics(results, allow_mixed=allow_mixed)
    run_means = metrics.groupby(["method", "seed"], as_index=False).mean(numeric_only=True)

    def per_seed(column: str) -> pd.DataFrame:
        if column not in run_means:
            return pd.DataFrame(columns=["method", "seed", "value"])
        return run_means[["method", "seed", column]].rename(columns={column: "value"})

    def claim_row(name: str, method: str) -> dict[str, Any]:
        row = point_claims[(point_claims["claim"] == name) & (point_claims["method"] == method)]
        if row.empty:
            raise ValueError(f"{tables / 'claims.csv'} has no {name} row of {method}")
        return row.iloc[0].to_dict()

    tokens = per_seed(UPDATE_TOKENS).groupby("method")["value"].mean()
    totals = curves.loc[curves.groupby(["method", "seed"])["step"].idxmax()].set_index(["method", "seed"])
    # seeds x methods, on [0, 1]: the final models' Pass@1 on their own evaluation (the claims' pairs), and
    # the curves' last points, on the checkpoints' problems as the rest of each curve (io.load_curve_evals)
    evals = load_evals(results, allow_mixed=allow_mixed)
    final = per_seed_pass_at_k(evals, 1).pivot(index="seed", columns="method", values="value")
    curve_end = totals["value"].unstack("method")
    rows, gaps = [], []
    for method in (m for m in methods if m != reference and m in final):
        pairs = final[[method, reference]].dropna()
        step_gaps = 100 * (pairs[method] - pairs[reference])
        ends = curve_end[method].reindex(pairs.index)
        clock_gaps, clamped = wall_clock_gaps(curves, ends, method, reference)
        gaps += [{"method": method, "seed": s, "measure": "steps", "gap": g} for s, g in step_gaps.items()]
        error_gaps = log_error_ratio(pairs[method], pairs[reference])
        gaps += [
            {"method": method, "seed": s, "measure": ERROR_RATIO, "gap": float(g)}
            for s, g in zip(pairs.index, error_gaps, strict=True)
        ]
        gaps += [
            {"method": method, "seed": s, "measure": "wall_clock", "gap": g} for s, g in clock_gaps.items()
        ]
        p1, pk = claim_row("pass_at_1", method), claim_row("pass_at_k", method)
        clock = _row(WALL_CLOCK_GAP, method, reference, paired_t(clock_gaps.values()))
        step_time = ratio_row(CLAIMS["step_time"], per_seed("step_time"), method, reference)
        row = {
            "method": method,
            "reference": reference,
            "seeds": int(p1["seeds"]),
            "update_tokens_per_step": tokens.get(method, math.nan),
            "reference_update_tokens_per_step": tokens.get(reference, math.nan),
            # where the reference stands: near 100 % a gap is bounded by the ceiling, not by the regime
            "reference_pass_at_1": float(100 * pairs[reference].mean()),
            "method_pass_at_1": float(100 * pairs[method].mean()),
            "log_error_ratio": float(np.mean(error_gaps)),
        }
        for prefix, claim in (("pass_at_1", p1), ("pass_at_k", pk), ("wall_clock", clock)):
            row |= {f"{prefix}_gap": claim["estimate"], f"{prefix}_ci_low": claim["ci_low"]}
            row |= {f"{prefix}_ci_high": claim["ci_high"], f"{prefix}_verdict": claim["verdict"]}
            row |= {f"{prefix}_mde": claim["min_detectable_effect"]}
        row["k"] = kmax
        row |= {"step_time_ratio": step_time["estimate"], "step_time_ci_low": step_time["ci_low"]}
        row |= {"step_time_ci_high": step_time["ci_high"]}
        row["method_wall_clock_s"] = float(totals["wall_clock"].xs(method, level="method").mean())
        row["reference_wall_clock_s"] = float(totals["wall_clock"].xs(reference, level="method").mean())
        row["wall_clock_clamped_seeds"] = clamped
        rows.append(row)
    return rows, pd.DataFrame(gaps, columns=["method", "seed", "measure", "gap"])


def sweep_tables(
    root: Path, points: Sequence[int], methods: Sequence[str], reference: str, allow_mixed: bool = False
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(gap table, per-seed gaps, trend claims) of the sweep under ``root`` (points ``root/p<P>``)."""
    rows, seed_gaps = [], []
    for prompts in points:
        folder = root / f"p{prompts}"
        point_rows, gaps = point_gaps(folder, methods, reference, allow_mixed)
        labels = {"prompts_per_step": prompts, "experiment": str(folder)}
        rows += [labels | row for row in point_rows]
        seed_gaps.append(gaps.assign(prompts_per_step=prompts))
    table = pd.DataFrame(rows)
    if table.empty:
        raise ValueError(f"{root}: no point has a method besides the reference {reference!r} evaluated")
    table.insert(2, "log10_update_tokens", np.log10(table["update_tokens_per_step"]))
    gaps = pd.concat(seed_gaps, ignore_index=True)
    claims = trend_claims(table, gaps, reference)
    return table, gaps, claims


def trend_claims(table: pd.DataFrame, gaps: pd.DataFrame, reference: str) -> pd.DataFrame:
    """The slope of each method's gap (equal steps, equal wall-clock) against log10 update tokens per step,
    one claims row each (d3s.analysis.claims.COLUMNS), verdicts Holm-adjusted over these rows."""
    rows = []
    for method in dict.fromkeys(table["method"]):
        at = table[table["method"] == method].sort_values("prompts_per_step")
        for measure, claim in SLOPE_CLAIMS.items():
            chosen = gaps[(gaps["method"] == method) & (gaps["measure"] == measure)]
            if chosen.empty:  # a measure the sweep's tables do not have
                continue
            samples = [chosen.loc[chosen["prompts_per_step"] == p, "gap"] for p in at["prompts_per_step"]]
            result = gap_slope(at["log10_update_tokens"], samples)
            points = ", ".join(f"{p}" for p in at["prompts_per_step"])
            note = (
                f"OLS over {len(at)} points (P = {points}); x = log10 of the method's update tokens per step"
            )
            if not math.isnan(result["df"]):
                note += f"; standard error {result['se']:.2f}, Welch-Satterthwaite df {result['df']:.1f}"
            elif len(at) > 1:
                note += "; no interval: a point has fewer than 2 seeds"
            row = _row(claim, method, reference, result, note)
            row["verdict"] = verdict(row["ci_low"], row["ci_high"], claim.direction, claim.null)
            rows.append(row)
    claims = pd.DataFrame(rows).reindex(columns=COLUMNS)
    claims["protocol"] = ""
    verdicts = zip(claims["verdict"], holm(claims["p_value"]), strict=True)
    claims["verdict_holm"] = [v if rejected else "inconclusive" for v, rejected in verdicts]
    return claims
