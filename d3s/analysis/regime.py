"""The regime sweep's analysis (docs/workflow/regime-sweep.md): how the gaps of the methods to the
reference (D3S - GRPO, PODS - GRPO) move with the update tokens per step, from the sweep's points
``results/<experiment>/p<P>/``, each a complete experiment of the workflow.

Writes, under ``results/<experiment>/``: ``tables/regime_gap.csv`` (per point and method: update tokens, the
paired gaps at equal steps and at equal wall-clock, the step-time ratio), ``tables/regime_claims.csv`` (the
trend: the slope of each gap against log10 update tokens, columns of d3s.analysis.claims.COLUMNS),
``figures/regime_gap.png|pdf`` and ``report.md``.
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
    pods_protocol,
    ratio_row,
    verdict,
)
from d3s.analysis.io import load_evals, load_metrics
from d3s.markdown import markdown_table
from d3s.methods import METHODS, Method, method_trainer
from d3s.provenance.manifest import atomic_write_text, write_json
from d3s.provenance.settings_check import MixedSettingsError, compare, load_provenance

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
WALL_CLOCK_GAP = Claim(
    "pass_at_1_wall_clock",
    "higher held-out Pass@1 than the reference at the method's own training wall-clock",
    "points",
    +1,
    "difference",
)
# Settings that differ between the points by design: the batch (the --config values of d3s regime).
POINT_KEYS = (
    "config.resolved_trainer.per_device_train_batch_size",
    "config.resolved_trainer.generation_batch_size",
    "config.resolved_trainer.gradient_accumulation_steps",
    "config.resolved_trainer.steps_per_generation",
)


@dataclass(frozen=True)
class PaperRegime:
    """The paper's update tokens per step, estimated: prompts x G x mean completion tokens x the fraction of
    the rollouts' tokens a method trains on, averaged over the schedule (d3s.methods). Every input is a
    choice of config/paper/qwen2.5-math-7b.yaml or an assumption: the D3S paper gives none of them."""

    prompts_per_step: int = 32  # config/paper/*.yaml [choice]: the paper is silent (paper-notes §8)
    num_generations: int = 32  # G, DESIGN.md [choice]; N runs G/4 -> G (8 -> 32), K 5 % -> 20 % [paper, [S]]
    completion_tokens: tuple[float, float] = (500.0, 1500.0)  # mean completion length: an assumption
    max_completion_length: int = 3000  # config/paper: the cap, the upper bound of the mean

    @property
    def central_completion_tokens(self) -> float:
        low, high = self.completion_tokens
        return math.sqrt(low * high)

    def update_tokens(self, method: str) -> tuple[float, float, float]:
        """(low, central, high) update tokens per step of ``method`` in the paper's regime."""
        rollouts = self.prompts_per_step * self.num_generations * token_fraction(METHODS[method])
        low, high = self.completion_tokens
        return rollouts * low, rollouts * self.central_completion_tokens, rollouts * high

    def inputs(self) -> str:
        low, high = self.completion_tokens
        return (
            f"{self.prompts_per_step} prompts x G = {self.num_generations} rollouts per step "
            "(config/paper/qwen2.5-math-7b.yaml; the paper gives neither), mean completion length "
            f"{low:,.0f}-{high:,.0f} tokens (assumed; the configs cap it at {self.max_completion_length:,}), "
            "the trained fraction of those tokens averaged over the schedule (d3s.methods: D3S N = G/4 -> G "
            "and K = 5 -> 20 % linear, mean 8.75 %; PODS G/4 rollouts, all tokens, 25 %)"
        )


PAPER = PaperRegime()


def token_fraction(method: Method) -> float:
    """The mean fraction of the generated tokens a method trains on over a linear (or constant) schedule:
    the mean over p in [0, 1] of N(p)/G x K(p), rounding of N ignored."""
    n0, n1 = method.keep_per_prompt_fraction_init, method.keep_per_prompt_fraction_final
    k0, k1 = method.token_keep_ratio_init, method.token_keep_ratio_final
    if method.schedule != "linear":
        return n0 * k0
    return n0 * k0 + (n0 * (k1 - k0) + k0 * (n1 - n0)) / 2 + (n1 - n0) * (k1 - k0) / 3


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


# ---- provenance across points ------------------------------------------------------------------------------


def check_points(root: Path, points: Sequence[int], allow_mixed: bool = False) -> dict[str, Any]:
    """Every point's own provenance check (load_provenance), then the points' training and final-evaluation
    manifests compared with each other: they may differ only in the batch (POINT_KEYS). Raises
    MixedSettingsError naming the keys unless ``allow_mixed``."""
    records: dict[str, list] = {"training": [], "final": []}
    for prompts in points:
        provenance = load_provenance(root / f"p{prompts}", allow_mixed=allow_mixed)
        for check in provenance.checks:
            if check["group"] in records:
                for manifest in check["manifests"]:
                    path = root / f"p{prompts}" / manifest["path"]
                    content = _json(path)
                    records[check["group"]].append((f"p{prompts} {manifest['label']}", str(path), content))
    differences = []
    for group, group_records in records.items():
        if group_records:
            result = compare(group, group_records)
            differences += [{"group": group} | d for d in result["mixed"] if d["key"] not in POINT_KEYS]
    base_models = {  # the base model's files, by checksum (an evaluation records every file it read)
        label: json.dumps(
            {
                k: v.get("sha256")
                for k, v in ((content or {}).get("inputs") or {}).items()
                if k.startswith("model/")
            },
            sort_keys=True,
        )
        for label, _, content in records["final"]
        if label.endswith("base model")
    }
    if len(set(base_models.values())) > 1:
        differences.append({"group": "final", "key": "base model weights", "values": base_models})
    if differences and not allow_mixed:
        keys = "; ".join(f"{d['group']} {d['key']}" for d in differences[:8])
        raise MixedSettingsError(
            f"the regime points under {root} differ in more than the batch: {keys}. Re-run the sweep with "
            "one config (d3s regime), or set analysis.allow_mixed_settings: true to combine them anyway"
        )
    return {"points": [f"p{p}" for p in points], "differ_only_in": list(POINT_KEYS), "mixed": differences}


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


# ---- figure and report -------------------------------------------------------------------------------------


def gap_figure(table: pd.DataFrame, claims: pd.DataFrame, paper: PaperRegime = PAPER):
    """The gaps (95 % intervals) against update tokens per step on a log axis, at equal steps and at equal
    wall-clock, with each method's fitted slope, a zero line and the paper's regime per method."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    cmap = plt.get_cmap("tab10")
    methods = list(dict.fromkeys(table["method"]))
    for ax, (measure, label) in zip(axes, MEASURES.items(), strict=True):
        prefix = "pass_at_1" if measure == "steps" else "wall_clock"
        ax.axhline(0, color="black", lw=0.8)
        for i, method in enumerate(methods):
            color = cmap(i % 10)
            at = table[table["method"] == method].sort_values("update_tokens_per_step")
            x, y = at["update_tokens_per_step"], at[f"{prefix}_gap"]
            low = (y - at[f"{prefix}_ci_low"]).fillna(0).clip(lower=0)
            high = (at[f"{prefix}_ci_high"] - y).fillna(0).clip(lower=0)
            ax.errorbar(x, y, yerr=[low, high], fmt="o", color=color, capsize=3, label=method)
            for xi, yi, p in zip(x, y, at["prompts_per_step"], strict=True):
                ax.annotate(f"P={p}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
            slope = claims[(claims["method"] == method) & (claims["claim"] == SLOPE_CLAIMS[measure].name)]
            if len(slope) and not math.isnan(slope["estimate"].iloc[0]):
                b = slope["estimate"].iloc[0]
                lx = np.log10(x)
                a = y.mean() - b * lx.mean()
                grid = np.linspace(lx.min(), lx.max(), 20)
                ax.plot(10**grid, a + b * grid, color=color, lw=1, ls="--")
            if method in METHODS and method != "grpo":
                p_low, p_mid, p_high = paper.update_tokens(method)
                ax.axvspan(p_low, p_high, color=color, alpha=0.12)
                ax.axvline(p_mid, color=color, lw=1, ls=":")
                ax.text(
                    p_mid,
                    0.02,
                    f"paper {method}",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    fontsize=7,
                    color=color,
                    ha="right",
                    va="bottom",
                )
        ax.set_xscale("log")
        ax.set_xlabel("update tokens per step (the method's own; log scale)")
        ax.set_title(f"Pass@1 gap to {table['reference'].iloc[0]} {label}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("gap (points, 95 % CI over paired seeds)")
    axes[0].legend(loc="best", fontsize=8)
    caption = (
        "Shaded: the paper's regime (estimate): "
        + paper.inputs()
        + ". Dashed: the fitted slope of the gap against log10 update tokens."
    )
    fig.text(0.01, -0.02, caption, fontsize=7, wrap=True, va="top")
    fig.tight_layout()
    return fig


def _fmt(value: float, low: float, high: float, digits: int = 1) -> str:
    if math.isnan(value):
        return "n/a"
    text = f"{value:+.{digits}f}"
    return text + ("" if math.isnan(low) else f" [{low:+.{digits}f}, {high:+.{digits}f}]")


def _point_verdicts(root: Path, points: Sequence[int], table: pd.DataFrame) -> str:
    """Each point's own headline verdicts (its tables/claims.csv), labelled with the regime they belong to."""
    rows = []
    for prompts in points:
        path = root / f"p{prompts}" / "tables" / "claims.csv"
        if not path.is_file():
            continue
        claims = pd.read_csv(path)
        chosen = claims[
            claims["claim"].isin(["pass_at_1", "pass_at_k"]) & claims["method"].isin(table["method"])
        ]
        for _, c in chosen.iterrows():
            at = table[(table["prompts_per_step"] == prompts) & (table["method"] == c["method"])]
            tokens = at["update_tokens_per_step"].iloc[0] if len(at) else math.nan
            rows.append(
                {
                    "regime": f"P = {prompts} ({tokens:,.0f} {c['method']} update tokens/step)",
                    "claim": f"{c['claim']}: {c['method']} vs {c['reference']}",
                    "estimate": _fmt(c["estimate"], c["ci_low"], c["ci_high"]),
                    "verdict": c["verdict"],
                    "min. detectable": ""
                    if pd.isna(c["min_detectable_effect"])
                    else f"{c['min_detectable_effect']:.1f}",
                    "source": f"[p{prompts}/tables/claims.csv](p{prompts}/tables/claims.csv)",
                }
            )
    if not rows:
        return "(no per-point claims table found)"
    columns = {name: (lambda row, name=name: row[name]) for name in rows[0]}
    return markdown_table(rows, columns)


def report_markdown(
    root: Path,
    config: Mapping[str, Any],
    points: Sequence[int],
    table: pd.DataFrame,
    claims: pd.DataFrame,
    check: Mapping[str, Any],
    paper: PaperRegime = PAPER,
) -> str:
    """report.md of the sweep."""
    gap_columns = {
        "P": "{prompts_per_step}",
        "method": "{method}",
        "update tokens/step": lambda r: f"{r['update_tokens_per_step']:,.0f}",
        "Pass@1 gap (equal steps)": lambda r: _fmt(
            r["pass_at_1_gap"], r["pass_at_1_ci_low"], r["pass_at_1_ci_high"]
        ),
        "verdict": "{pass_at_1_verdict}",
        "min. det.": lambda r: f"{r['pass_at_1_mde']:.1f}" if not math.isnan(r["pass_at_1_mde"]) else "",
        "Pass@k gap": lambda r: (
            f"k={r['k']}: " + _fmt(r["pass_at_k_gap"], r["pass_at_k_ci_low"], r["pass_at_k_ci_high"])
        ),
        "Pass@1 gap (equal wall-clock)": lambda r: _fmt(
            r["wall_clock_gap"], r["wall_clock_ci_low"], r["wall_clock_ci_high"]
        ),
        "step time / ref": lambda r: _fmt(
            r["step_time_ratio"], r["step_time_ci_low"], r["step_time_ci_high"], 2
        ).lstrip("+"),
        "seeds": "{seeds}",
    }
    trend_columns = {
        "claim": "{claim}",
        "method vs reference": lambda r: f"{r['method']} vs {r['reference']}",
        "slope (points per decade) [95 % CI]": lambda r: _fmt(r["estimate"], r["ci_low"], r["ci_high"], 2),
        "verdict": "{verdict}",
        "Holm": "{verdict_holm}",
        "min. detectable": lambda r: (
            "" if pd.isna(r["min_detectable_effect"]) else f"{r['min_detectable_effect']:.2f}"
        ),
        "seeds": "{seeds}",
    }
    paper_rows = [
        {"method": m, "low": low, "central": mid, "high": high}
        for m in dict.fromkeys(table["method"])
        if m in METHODS
        for low, mid, high in [paper.update_tokens(m)]
    ]
    paper_table = markdown_table(
        paper_rows,
        {
            "method": "{method}",
            "update tokens/step (low)": lambda r: f"{r['low']:,.0f}",
            "central": lambda r: f"{r['central']:,.0f}",
            "high": lambda r: f"{r['high']:,.0f}",
        },
    )
    ours = table.groupby("method")["update_tokens_per_step"].agg(["min", "max"])
    reach = "; ".join(
        f"{m} {row['min']:,.0f}-{row['max']:,.0f}"
        + (
            f" ({math.log10(paper.update_tokens(m)[1] / row['max']):.1f} decades below the paper's)"
            if m in METHODS
            else ""
        )
        for m, row in ours.iterrows()
    )
    mixed = check.get("mixed") or []
    provenance = (
        "The points' manifests agree in every setting but the batch "
        f"({', '.join(f'`{k.rsplit(chr(46), 1)[-1]}`' for k in POINT_KEYS)})."
        if not mixed
        else "**MIXED** (allowed by analysis.allow_mixed_settings): "
        + "; ".join(f"{d['group']} `{d['key']}`" for d in mixed)
    )
    trainer = config["train"]["trainer"]
    methods = ", ".join(m for m in table["method"].unique())
    prompts = ", ".join(map(str, points))
    reports = ", ".join(f"[p{p}](p{p}/report.md)" for p in points)
    seeds, steps = len(config["seeds"]), trainer["max_steps"]
    return f"""# Regime sweep: {config["experiment"]}

The gaps of {methods} to {table["reference"].iloc[0]} at {len(points)} regimes: P = {prompts} prompts per
step x G = {trainer.get("num_generations")} rollouts, every other setting the config's ({seeds} paired seeds,
{steps} steps). Each point is a complete experiment with its own report: {reports}.
Update tokens per step here, smallest to largest point: {reach}; the paper's regime is estimated below.

## The gaps per regime ([tables/regime_gap.csv](tables/regime_gap.csv))

Paired over seeds (95 % t intervals). "Equal wall-clock": the method's final Pass@1 against the reference's
learning curve (checkpoint evaluations, linearly interpolated) at the method's own total training time, seed
by seed, both on the checkpoints' problems (the final models' evaluations rescored on them).

{markdown_table(table.to_dict("records"), gap_columns)}

![regime gap](figures/regime_gap.png) ([PDF](figures/regime_gap.pdf))

## The trend ([tables/regime_claims.csv](tables/regime_claims.csv))

The slope of each gap against log10 update tokens per step (points of Pass@1 per tenfold more update
tokens): ordinary least squares on the points' mean gaps; its interval from the seed variance of each point
(independent runs), t with Welch-Satterthwaite degrees of freedom (docs/workflow/regime-sweep.md).
A positive slope means the method gains on the reference as the update grows.

{markdown_table(claims.to_dict("records"), trend_columns)}

## Which regime each verdict belongs to

Every point's own claims (its `tables/claims.csv`) decide the comparison in that regime only:

{_point_verdicts(root, points, table)}

## The paper's regime (an estimate)

{paper.inputs()}. Central value at a mean completion of {paper.central_completion_tokens:,.0f} tokens:

{paper_table}

## Provenance

{provenance} Each point's report lists its manifests.
"""


def write_regime(
    root: str | Path, config: Mapping[str, Any], points: Sequence[int], paper: PaperRegime = PAPER
) -> list[Path]:
    """Write the sweep's tables, figure and report under ``root`` (results/<experiment>); returns the
    paths."""
    from d3s.analysis.figures import save

    root = Path(root)
    analysis = config.get("analysis") or {}
    allow_mixed = bool(analysis.get("allow_mixed_settings", False))
    reference = analysis.get("reference", "grpo")
    check = check_points(root, points, allow_mixed)
    table, gaps, claims = sweep_tables(root, points, list(config["methods"]), reference, allow_mixed)
    generations = {
        m: int(method_trainer(config["train"], m).get("num_generations", 8)) for m in config["methods"]
    }
    claims["protocol"] = [pods_protocol(m, reference, generations) for m in claims["method"]]
    tables = root / "tables"
    written = [tables / "regime_gap.csv", tables / "regime_gaps_per_seed.csv", tables / "regime_claims.csv"]
    for frame, path in zip((table, gaps, claims), written, strict=True):
        atomic_write_text(path, frame.to_csv(index=False))
    write_json(tables / "regime.provenance.json", check | {"tables": [p.name for p in written]})
    written += save(gap_figure(table, claims, paper), root / "figures" / "regime_gap")
    report = root / "report.md"
    atomic_write_text(report, report_markdown(root, config, points, table, claims, check, paper))
    return [*written, report]
