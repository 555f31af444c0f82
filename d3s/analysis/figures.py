"""Figures of the reproduction (matplotlib; each returns the Figure).

No backend is chosen here: a Jupyter kernel keeps its inline backend, so notebooks show the figures, and
a script without a display gets matplotlib's own fallback, Agg; ``save`` writes the files either way.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FixedLocator

DYNAMICS = [
    ("grad_norm", "gradient norm"),
    ("entropy", "entropy, all tokens (nats)"),
    ("selection/entropy_selected", "entropy, selected tokens (nats)"),
    ("reward", "reward (accuracy)"),
    ("kl", "KL to the reference policy"),
    ("selection/adv_var_before", "Var(A) before selection"),
    ("selection/adv_var_after", "Var(A) after selection"),
    ("selection/sample_keep_fraction", "fraction of samples kept"),
    ("selection/token_keep_fraction", "fraction of tokens kept"),
    ("selection/update_tokens", "tokens in the update per step"),
]


def save(fig, stem: str | Path) -> list[Path]:
    """Write ``stem``.png and ``stem``.pdf; returns both paths. The figure is released from pyplot (a notebook
    shows it once, where the cell displays it; a script does not accumulate open figures) and can still be
    displayed or saved again."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    for path in paths:
        partial = path.with_name(f".{path.name}.partial")  # renamed when complete: no half-written figure
        fig.savefig(partial, format=path.suffix[1:], dpi=120, bbox_inches="tight")
        partial.replace(path)
    plt.close(fig)
    return paths


def _colors(methods):
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def _laid_out(fig, ax, **legend):
    """``fig`` after a legend on ``ax`` and a tight layout."""
    ax.legend(**legend)
    fig.tight_layout()
    return fig


def band(ax, df: pd.DataFrame, x: str, y: str, methods, smooth: int = 1, colors=None):
    """Mean across seeds with a band of +- one standard deviation, per method."""
    colors = colors or _colors(methods)
    for method in methods:
        sub = df[df["method"] == method]
        if sub.empty or y not in sub or sub[y].isna().all():
            continue
        wide = sub.pivot_table(index=x, columns="seed", values=y)
        if smooth > 1:
            wide = wide.rolling(smooth, min_periods=1).mean()
        mean, std = wide.mean(axis=1), wide.std(axis=1).fillna(0)
        ax.plot(mean.index, mean.values, label=method, color=colors[method], lw=1.4)
        low, high = (mean - std).values, (mean + std).values
        ax.fill_between(mean.index, low, high, color=colors[method], alpha=0.18)


def training_dynamics(metrics: pd.DataFrame, methods, smooth: int = 5):
    """A panel per logged quantity against the training step, mean and band across seeds per method."""
    panels = [(c, label) for c, label in DYNAMICS if c in metrics and metrics[c].notna().any()]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    colors = _colors(methods)
    for ax, (col, label) in zip(axes.flat, panels, strict=False):
        band(ax, metrics, "step", col, methods, smooth=smooth, colors=colors)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def kl_figure(kl: pd.DataFrame, methods):
    """KL to the initial policy at the evaluated checkpoints (d3s.evaluation.kl): k1 and k3 token means
    against the step, mean and band (+- one standard deviation) across seeds per method."""
    fig, axes = plt.subplots(1, 2, figsize=(4.6 * 2, 3.4), squeeze=False)
    colors = _colors(methods)
    for ax, col in zip(axes.flat, ("k1", "k3"), strict=True):
        band(ax, kl, "step", col, methods, colors=colors)
        plt.setp(ax.get_lines(), marker="o", markersize=3)
        ax.axhline(0.0, color="grey", lw=0.6)
        ax.set_title(f"KL to the initial policy, {col} (per token)", fontsize=10)
        ax.set_xlabel("step")
    return _laid_out(fig, axes.flat[0], fontsize=7, ncol=2)


def grad_norm_figure(metrics: pd.DataFrame, methods, smooth: int = 5):
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    band(ax, metrics, "step", "grad_norm", methods, smooth=smooth)
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    return _laid_out(fig, ax, fontsize=8, ncol=2)


def learning_curve_figure(curves: pd.DataFrame, methods):
    """Held-out Pass@1 against steps, update tokens and training wall-clock (mean and band over seeds)."""
    labels = {"step": "step", "update_tokens_cumulative": "update tokens", "wall_clock": "training time (s)"}
    fig, axes = plt.subplots(1, len(labels), figsize=(4.6 * len(labels), 3.4), squeeze=False)
    colors = _colors(methods)
    for ax, (x, label) in zip(axes.flat, labels.items(), strict=True):
        for method in methods:
            sub = curves[curves["method"] == method]
            if sub.empty:
                continue
            agg = sub.groupby("step").agg(x=(x, "mean"), y=("value", "mean"), s=("value", "std")).fillna(0)
            ax.plot(agg["x"], 100 * agg["y"], marker="o", ms=3, label=method, color=colors[method])
            low, high = 100 * (agg["y"] - agg["s"]), 100 * (agg["y"] + agg["s"])
            ax.fill_between(agg["x"], low, high, alpha=0.15, color=colors[method])
        ax.set_xlabel(label)
        ax.set_ylabel("held-out Pass@1 (%)")
        if x == "update_tokens_cumulative":
            _log_axis_from_zero(ax, curves[x])
    return _laid_out(fig, axes.flat[0], fontsize=7, ncol=2)


def _log_axis_from_zero(ax, values: pd.Series) -> None:
    """A logarithmic x axis for counts that start at 0 (the base model's update tokens): linear up to the
    decade of the smallest non-zero count, logarithmic above it, labelled at 0 and at whole decades only, one
    decade apart at least, so no two labels meet."""
    positive = values[values > 0]
    if positive.empty:
        return
    low, high = (math.floor(math.log10(v)) for v in (positive.min(), positive.max()))
    ax.set_xscale("symlog", linthresh=10.0**low)
    decades = [10.0**k for k in range(low, high + 1)]
    ax.xaxis.set_major_locator(FixedLocator([0.0, *decades]))
    ax.xaxis.set_minor_locator(FixedLocator([m * d for d in decades for m in range(2, 10)]))


def pass_at_k_figure(table: pd.DataFrame, methods):
    """Pass@k against k per method (mean and 95 % CI across seeds)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    colors = _colors(methods)
    sub = table[table["benchmark"] != "average"]
    for method in methods:
        rows = sub[sub["method"] == method].groupby("k", as_index=False)[["mean", "ci95"]].mean()
        if rows.empty:
            continue
        style = {"marker": "o", "ms": 3, "capsize": 2, "label": method, "color": colors[method]}
        ax.errorbar(rows["k"], rows["mean"], yerr=rows["ci95"].fillna(0), **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (%)")
    return _laid_out(fig, ax, fontsize=7, ncol=2)


def var_after_figure(groups: pd.DataFrame, methods):
    """Distribution of Var(A of the kept rollouts) / Var(A of the group) over groups with >= 2 kept and
    some reward variance (Lemma 1: >= 1 for a max-variance subset of a standardised group)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    sub = groups[(groups["n_kept"] >= 2) & (groups["reward_std"] > 0)]
    ratios = {m: sub.loc[sub["method"] == m, "var_ratio"].dropna().to_numpy() for m in methods}
    ratios = {m: values for m, values in ratios.items() if len(values)}
    if ratios:
        ax.boxplot(list(ratios.values()), tick_labels=list(ratios), showfliers=True)
    ax.axhline(1.0, color="red", lw=1, ls="--", label="Lemma 1 bound")
    ax.set_ylabel("Var(A) kept / Var(A) group")
    ax.tick_params(axis="x", rotation=30)
    return _laid_out(fig, ax, fontsize=8)


TOKEN_SELECTING_METHODS = ("d3s", "d2s", "d3s_i", "d3s_adaptive", "gspo_d3s", "entropy_8020")


def informative_token_examples(token_records: list[dict], methods=TOKEN_SELECTING_METHODS) -> list[dict]:
    """A rollout with A > 0 and one with A < 0, each with at least one selected token, from the latest
    anatomy token record (of a token-selecting method) that has both; else the latest such rollout of either
    sign. These show what D3S's token level does: a rollout with A = 0 scores 0 on every token (|A| x H) and
    trains nothing. Each example carries where it came from (``where``); none where no record has one."""
    fallback: list[dict] = []
    for record in reversed([r for r in token_records if r.get("method") in methods]):
        where = f"{record['method']} seed {record['seed']} step {record['step']}"
        chosen = []
        for sign in (1, -1):
            informative = [
                e
                for e in record.get("examples", [])
                if sign * e.get("advantage", 0.0) > 0 and any(e["selected"])
            ]
            if informative:
                chosen.append(
                    max(informative, key=lambda e: sum(map(bool, e["selected"]))) | {"where": where}
                )
        if len(chosen) == 2:
            return chosen
        fallback = fallback or chosen
    return fallback


def latest_token_example(token_records: list[dict], methods=TOKEN_SELECTING_METHODS) -> list[dict]:
    """The most-selected rollout of the latest token record of a token-selecting method, whatever its A: what
    to draw, saying so, when informative_token_examples finds none (a short run whose logged rollouts all have
    A = 0). Empty without such a record."""
    records = [r for r in token_records if r.get("method") in methods and r.get("examples")]
    if not records:
        return []
    record = records[-1]
    example = max(record["examples"], key=lambda e: sum(map(bool, e["selected"])))
    return [example | {"where": f"{record['method']} seed {record['seed']} step {record['step']}"}]


def token_scores_figure(example: dict, max_tokens: int = 48, ax=None, per_row: int = 16):
    """One completion, one cell per token, coloured by its score |A| x H, its entropy H (nats) written under
    the token; selected tokens outlined red. Draws on ``ax`` when given (and returns its figure)."""
    tokens = example["tokens"][:max_tokens]
    score = np.asarray(example["score"][:max_tokens], dtype=float)
    selected = list(example["selected"][:max_tokens])
    entropy = example.get("entropy", [])[:max_tokens]
    rows = math.ceil(len(tokens) / per_row)
    if ax is None:
        fig, ax = plt.subplots(figsize=(0.62 * per_row, 0.75 * rows + 0.9))
    fig = ax.figure
    norm = plt.Normalize(0, max(score.max(), 1e-9)) if len(score) else plt.Normalize(0, 1)
    cmap = plt.get_cmap("viridis")
    for i, tok in enumerate(tokens):
        r, c = divmod(i, per_row)
        edge, ink = "red" if selected[i] else "none", "white" if norm(score[i]) < 0.6 else "black"
        ax.add_patch(plt.Rectangle((c, -r), 0.95, 0.9, color=cmap(norm(score[i])), ec=edge, lw=2))
        text = tok.replace(" ", "␣").replace("\n", "⏎").replace("$", r"\$")
        ax.text(c + 0.47, -r + 0.45, text, ha="center", va="center", fontsize=8, color=ink)
        if i < len(entropy):
            ax.text(c + 0.47, -r + 0.08, f"{entropy[i]:.2f}", ha="center", va="bottom", fontsize=5, color=ink)
    ax.set_xlim(0, per_row)
    ax.set_ylim(-max(rows, 1) + 0.9, 1)
    ax.axis("off")
    title = "token score"
    if (adv := example.get("advantage")) is not None:
        kept = sum(map(bool, selected))
        title = f"A = {adv:+.2f}: {kept} of {len(tokens)} tokens selected (outlined red)"
    if example.get("where"):
        title = f"{example['where']}\n{title}"
    ax.set_title(title, fontsize=9)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.03, pad=0.01, label="|A|·H")
    return fig


def token_selection_figure(examples: list[dict], max_tokens: int = 48):
    """The token level side by side: each example (informative_token_examples: A > 0, A < 0) coloured by
    its score |A| x H, with its entropy under every token and the selected tokens outlined."""
    if not examples:
        raise ValueError("no example to draw: informative_token_examples found no rollout with A != 0")
    per_row = 12
    rows = max(math.ceil(min(len(e["tokens"]), max_tokens) / per_row) for e in examples)
    fig, axes = plt.subplots(
        1, len(examples), figsize=(0.62 * per_row * len(examples) + 1, 0.75 * rows + 1.3)
    )
    for ax, example in zip(np.atleast_1d(axes), examples, strict=True):
        token_scores_figure(example, max_tokens, ax=ax, per_row=per_row)
    title = "D3S's token level: score |A|·H (colour), entropy H in nats (small), selected outlined"
    fig.suptitle(title, fontsize=9, y=1.0 + 0.3 / fig.get_figheight())  # above the panels' two-line titles
    return fig
