"""The regime sweep's figure and report: the gaps against update tokens per step on a log axis, at equal
steps and at equal wall-clock, with each method's fitted slope and the paper's regime (:func:`gap_figure`),
and ``report.md`` (:func:`report_markdown`): the gap table, the trend claims, each point's own verdicts, the
paper's regime and the provenance across points."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from d3s.analysis.paper_regime import PAPER, PaperRegime
from d3s.analysis.regime_gaps import MEASURES, SLOPE_CLAIMS
from d3s.analysis.regime_provenance import POINT_KEYS
from d3s.markdown import markdown_table
from d3s.methods import METHODS


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
        "Pass@1 (method, ref)": lambda r: f"{r['method_pass_at_1']:.1f}, {r['reference_pass_at_1']:.1f}",
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
        "slope per decade [95 % CI]": lambda r: _fmt(r["estimate"], r["ci_low"], r["ci_high"], 2),
        "unit": "{unit}",
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
        "The points' manifests agree in every setting but the batch and the training set's size "
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
A positive slope means the method gains on the reference as the update grows. `error_ratio_slope` is the slope
of ln(the reference's errors / the method's), errors being 1 - the final models' Pass@1 (floored at 1e-4): a
gap in points must shrink as the reference nears 100 %, and this one asks whether the method closes on the
reference beyond what that ceiling forces (the gap table's `log_error_ratio`, per point).

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
