"""report.md: the paper's numbers beside ours, the claims checked, figures and the manifests every number came
from; refuses mixed settings unless ``analysis.allow_mixed_settings`` (d3s.provenance.settings_check)."""

from __future__ import annotations

import json
import math
import os
import platform
import textwrap
from pathlib import Path

import pandas as pd

from d3s.analysis.claims import claims_table
from d3s.analysis.io import load_evals, load_metrics
from d3s.analysis.tables import learning_curves, mean_ci, write_table
from d3s.provenance.manifest import git_state
from d3s.provenance.settings_check import load_provenance

FIGURES = [
    ("training_dynamics", "Training dynamics (gradient norm, entropy, reward, Var(A), kept fractions)"),
    ("grad_norm", "Gradient norm per step"),
    ("kl", "KL to the initial policy at the evaluated checkpoints (eval.kl, measured without gradient)"),
    ("learning_curves", "Held-out Pass@1 against steps, update tokens and wall-clock"),
    ("pass_at_k", "Pass@k of the final models"),
    ("var_after_selection", "Var(A) of the kept rollouts (Lemma 1)"),
    ("token_selection_example", "An example completion coloured by token score"),
]


def _pass_cell(pass_at_k: pd.DataFrame, k: int) -> str:
    if k not in pass_at_k.index:
        return "n/a"
    return _fmt(pass_at_k.loc[k, "mean"], pass_at_k.loc[k, "ci95"])


def _efficiency_cell(efficiency: pd.DataFrame, method: str, column: str, digits: int) -> str:
    return _fmt(efficiency.loc[method, column], digits=digits) if method in efficiency.index else "n/a"


def _fmt(mean: float, half: float = float("nan"), digits: int = 1) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    text = f"{mean:.{digits}f}"
    return text if half is None or math.isnan(half) else f"{text} ± {half:.{digits}f}"


def _md(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _git_commit() -> str:
    """The d3s checkout writing the report (the working directory may be a copy of the workflow)."""
    state = git_state()
    if not state["commit"]:
        return "unknown"
    return state["commit"][:7] + (" with uncommitted changes" if state["dirty"] else "")


def paper_pass_at_1(paper_dir: Path) -> dict[str, dict[str, float]]:
    """The papers' average Pass@1 by method, per table (D3S Table 1 on Qwen2.5-Math-7B, Table 2)."""
    out = {}
    for name, model in (("d3s_table1", "Qwen2.5-Math-7B"), ("d3s_table2", None)):
        table = pd.read_csv(paper_dir / f"{name}.csv")
        rows = table[(table["benchmark"] == "average") & ((table["model"] == model) if model else True)]
        if not rows.empty:
            out[rows["table"].iloc[0]] = dict(
                zip(rows["method"], rows["pass_at_1"].astype(float), strict=True)
            )
    return out


def write_claims(results: Path, paper_dir: Path, config: dict) -> pd.DataFrame:
    """``tables/claims.csv`` (d3s.analysis.claims) with its provenance sidecar; returns the table."""
    analysis = config.get("analysis") or {}
    allow_mixed = bool(analysis.get("allow_mixed_settings", False))
    metrics = load_metrics(results, allow_mixed=allow_mixed)
    evals = load_evals(results, allow_mixed=allow_mixed)
    table = claims_table(
        evals,
        learning_curves(evals, metrics, k=1),
        metrics,
        [m for m in config["methods"] if m in set(evals["method"])],
        analysis.get("reference", "grpo"),
        analysis.get("target_fraction", 0.99),
        paper_pass_at_1(paper_dir),
        analysis.get("references", {"gspo_d3s": "gspo"}),
        method_generations(config),
    )
    write_table(table, results / "tables" / "claims.csv", load_provenance(results, allow_mixed=allow_mixed))
    return table


def method_generations(config: dict) -> dict[str, int]:
    """num_generations of each method's runs, as the workflow resolves them (trainer, then method_overrides)."""
    train = config.get("train") or {}
    trainer, overrides = train.get("trainer") or {}, train.get("method_overrides") or {}
    return {
        m: int((overrides.get(m) or {}).get("num_generations", trainer.get("num_generations", 8)))
        for m in config["methods"]
    }


def _interval(row) -> str:
    digits = 1 if row["unit"] == "points" else 2 if row["unit"] != "norm" else 3
    if math.isnan(row["estimate"]):
        return "n/a"
    text = f"{row['estimate']:.{digits}f}"
    if not math.isnan(row["ci_low"]):
        text += f" [{row['ci_low']:.{digits}f}, {row['ci_high']:.{digits}f}]"
    return text


def claims_summary(table: pd.DataFrame, headline: list[str], reference: str) -> pd.DataFrame:
    """The report's opening table: each claim of the paper for the headline methods, its verdict here and the
    interval (with the smallest effect the run could have detected where the verdict is inconclusive)."""
    shown = table[
        ((table["claim"] == "gain_over_base") & (table["method"] == reference))
        | (table["method"].isin(headline) & (table["reference"] == reference))
        | (table["claim"] == "ordering_agrees_with_paper")
    ]
    return pd.DataFrame(
        {
            "claim": shown["statement"],
            "method vs reference": [
                f"{m} vs {r}" + (f" ({p})" if p else "")
                for m, r, p in zip(
                    shown["method"], shown["reference"], shown["protocol"].fillna(""), strict=True
                )
            ],
            "estimate [95 % CI]": shown.apply(_interval, axis=1),
            "unit": shown["unit"],
            "verdict": shown["verdict"],
            "Holm": shown["verdict_holm"],
            "min. detectable": [
                f"{v:.2f}" if not math.isnan(v) and verdict == "inconclusive" else ""
                for v, verdict in zip(shown["min_detectable_effect"], shown["verdict"], strict=True)
            ],
            "noise: seeds / evaluation": [
                f"{s:.1f} / {e:.1f}" if not math.isnan(e) else ""
                for s, e in zip(shown["seed_sd"], shown["eval_se"], strict=True)
            ],
            "seeds": shown["seeds"],
        }
    )


def write_report(results: Path, paper_dir: Path, config: dict) -> str:
    """The report's Markdown; raises MixedSettingsError if the results mix settings that must agree and
    ``analysis.allow_mixed_settings`` is not set."""
    tables = results / "tables"
    analysis = config.get("analysis") or {}
    reference = analysis.get("reference", "grpo")
    fraction = analysis.get("target_fraction", 0.99)
    allow_mixed = bool(analysis.get("allow_mixed_settings", False))
    provenance = load_provenance(results, allow_mixed=allow_mixed)
    methods = list(config["methods"])
    seeds = list(config["seeds"])
    metrics = load_metrics(results, allow_mixed=allow_mixed)
    long = pd.read_csv(tables / "pass_at_k.csv")
    efficiency = pd.read_csv(tables / "efficiency.csv")
    trainer = config["train"]["trainer"]
    ev = config["eval"]
    out = [f"# Reproduction report: {config['experiment']}", ""]
    if provenance.mixed:  # stated before anything else
        out += [provenance.banner(), ""]
    claims = pd.read_csv(tables / "claims.csv")
    headline = [m for m in analysis.get("headline", methods) if m != reference]
    out += [
        "## The papers' claims at this scale",
        "",
        _md(claims_summary(claims, headline, reference)),
        "",
        "Every comparison is paired by seed. Verdict from the 95 % interval alone: supported (the whole interval "
        "on the paper's side of the null: 0 for differences, 1 for ratios and speedups, 0.5 for the ordering), "
        "refuted (the whole interval on the other side), inconclusive (it holds the null; 'min. detectable' is "
        "the smallest effect this run detects with 80 % power at the observed seed variance). Noise of a Pass@k "
        "difference: its standard deviation across seeds, and the evaluation's own standard error within a seed "
        "(the problem bootstrap): evaluation noise well below seed noise means more seeds, not more samples, "
        "would narrow the interval. Intervals: paired "
        "t for Pass@k gains and run means, paired t on log ratios for costs, a seed bootstrap for speedups "
        "(never reaching the target counts as 0) and the ordering. The intervals are not adjusted for the "
        f"{len(claims)} comparisons; the Holm column is the verdict after Holm's step-down adjustment over all "
        "of them. Every method and claim: [tables/claims.csv](tables/claims.csv).",
        "",
    ]
    base_summary = results / "base_model" / "base_summary.json"
    base = json.loads(base_summary.read_text()) if base_summary.is_file() else None
    model_line = (
        f"tiny Qwen2-architecture model ({base['parameters']:,} parameters) built in code, SFT warm start "
        f"{base['sft_steps']} steps on the synthetic task ({base['min_ops']}-{base['max_ops']} operations on "
        f"0..{base['max_operand']}; target completions {base['completion_tokens_mean']:.1f} tokens on average)"
        if base
        else f"`{config['base_model'].get('path')}`"
    )
    threads = config["train"].get("threads", 1)
    out += [
        f"- Base model: {model_line}.",
        f"- Methods: {', '.join(methods)}; **{len(seeds)} seed(s)** each ({', '.join(map(str, seeds))}); "
        f"{trainer['max_steps']} steps of {trainer.get('per_device_train_batch_size')} rollouts "
        f"({trainer.get('num_generations')} per prompt), {threads} torch thread(s) per run.",
        f"- Evaluation: benchmarks {', '.join(ev['benchmarks'])}; final models {ev['samples']} samples per problem "
        f"(temperature {ev.get('temperature')}, top-p {ev.get('top_p')}); checkpoints every "
        f"{trainer.get('save_steps', trainer['max_steps'])} steps with {ev.get('checkpoint_samples')} samples.",
        "- Intervals: mean across seeds ± half-width of the 95 % Student-t interval across seeds (none for one seed).",
        f"- Report written on {platform.machine()}, {os.cpu_count()} CPU(s), {platform.system()}, Python "
        f"{platform.python_version()}, at git {_git_commit()}; the runs' own commits, hardware and settings "
        "are under [Provenance](#provenance).",
        "- Sources (manifests checked):\n" + textwrap.indent(provenance.summary(), "  "),
        "",
        "## Main table: ours",
        "",
    ]
    ks = sorted(long["k"].unique())
    kmax = max(ks)
    bench = long[long["benchmark"] != "average"]
    eff = efficiency.set_index("method")
    rows = []
    for method in [m for m in methods if m in set(long["method"])]:
        sub = bench[bench["method"] == method].groupby("k")[["mean", "ci95"]].mean()
        grad = (
            metrics[metrics["method"] == method].groupby("seed")["grad_norm"].mean()
            if "grad_norm" in metrics
            else []
        )
        rows.append(
            {
                "method": method,
                "Pass@1 (%)": _pass_cell(sub, 1),
                f"Pass@{kmax} (%)": _pass_cell(sub, kmax),
                "grad norm": _fmt(*mean_ci(grad)[:2], digits=3),
                "update tokens/step": _efficiency_cell(eff, method, "update_tokens_per_step", 0),
                "s/step": _efficiency_cell(eff, method, "seconds_per_step", 3),
                "speedup (time)": _efficiency_cell(eff, method, "speedup_time", 2),
                "speedup (steps)": _efficiency_cell(eff, method, "speedup_steps", 2),
            }
        )
    main = pd.DataFrame(rows)
    base_eval = results / "eval" / "base" / "summary.json"
    base_note = ""
    if base_eval.is_file():
        summary = json.loads(base_eval.read_text())
        vals = [b["pass_at_k"] for b in summary["benchmarks"].values()]
        base_note = (
            "Base model before RL: "
            + ", ".join(
                f"Pass@{k} {100 * sum(v[str(k)] for v in vals) / len(vals):.1f} %"
                for k in ks
                if str(k) in vals[0]
            )
            + "."
        )
    out += [
        _md(main),
        "",
        f"Pass@k on held-out problems (mean over benchmarks: {', '.join(sorted(bench['benchmark'].unique()))}). "
        f"Speedup: {reference}'s time to first reach {fraction:.0%} of its best seed-mean Pass@1 divided by the "
        "method's (PODS definition; n/a when never reached within the run). " + base_note,
        "",
        "## Side by side with the papers",
        "",
    ]
    paper_rows = []
    t1 = pd.read_csv(paper_dir / "d3s_table1.csv")
    t2 = pd.read_csv(paper_dir / "d3s_table2.csv")
    paper_avg = pd.concat(
        [
            t1[(t1["model"] == "Qwen2.5-Math-7B") & (t1["benchmark"] == "average")],
            t2[t2["benchmark"] == "average"],
        ]
    )
    for method in methods:
        p = paper_avg[paper_avg["method"] == method]
        ours = main[main["method"] == method]
        if p.empty or ours.empty:
            continue
        paper_rows.append(
            {
                "method": method,
                "paper Pass@1 / Pass@8 (Qwen2.5-Math-7B, avg) [N]": f"{p['pass_at_1'].iloc[0]} / {p['pass_at_8'].iloc[0]}",
                "paper source": p["table"].iloc[0],
                f"ours Pass@1 / Pass@{kmax}": f"{ours['Pass@1 (%)'].iloc[0]} / {ours[f'Pass@{kmax} (%)'].iloc[0]}",
            }
        )
    out += [
        _md(pd.DataFrame(paper_rows)) if paper_rows else "(no method in common with the paper tables)",
        "",
        "The paper's numbers are for 7B models on competition math; ours for the configured model and task: "
        "compare directions and orderings, not magnitudes. [N]: known only from secondary notes of the D3S paper "
        "(see results/paper/README.md).",
        "",
    ]
    for _, row in claims[claims["claim"] == "ordering_agrees_with_paper"].iterrows():
        out += [
            f"Direction test against {row['reference']}: {_interval(row)} of the method pairs ({row['method']}) "
            f"in the paper's order (0.5 = chance; seed bootstrap, {row['seeds']} seeds): **{row['verdict']}**.",
            "",
        ]
    t3 = pd.read_csv(paper_dir / "d3s_table3.csv")
    out += [
        "Paper, Table 3 [N]:",
        "",
        _md(t3[["model", "method", "reference", "avg32_gain_pct", "speedup"]]),
        "",
    ]
    ours3 = tables / "table3_layout.csv"
    if ours3.is_file():
        out += ["Ours, Table 3 layout:", "", _md(pd.read_csv(ours3).round(2)), ""]
    lemma = tables / "var_after_selection.csv"
    if lemma.is_file():
        lem = pd.read_csv(lemma).rename(columns={"Unnamed: 0": "method"})
        out += [
            "**Lemma 1** (Var(A) of a max-variance kept subset of a standardised group is at least 1): "
            "Var(A) of the kept rollouts / Var(A) of their group, over logged groups with at least 2 kept "
            "rollouts and some reward variance. The lemma binds intra-group max-variance selection "
            "(pods, d1s, d3s_i); cross-group selection (d1s_cross, d2s, d3s) is not bound per group; grpo "
            "keeps everything (ratio 1).",
            "",
            _md(lem.round(3)),
            "",
        ]
    out += ["## Figures", ""]
    for stem, caption in FIGURES:
        if (results / "figures" / f"{stem}.png").is_file():
            out += [f"### {caption}", "", f"![{caption}](figures/{stem}.png) ([PDF](figures/{stem}.pdf))", ""]
    out += ["## Provenance", "", provenance.markdown(), ""]
    out += ["## Tables and notebooks", ""]
    for path in sorted(tables.glob("*.csv")):
        sidecar = path.with_name(f"{path.stem}.provenance.json")
        manifests = f" (manifests: [{sidecar.name}](tables/{sidecar.name}))" if sidecar.is_file() else ""
        out.append(f"- [tables/{path.name}](tables/{path.name}){manifests}")
    out += [
        f"- [notebooks/{p.name}](notebooks/{p.name})" for p in sorted((results / "notebooks").glob("*.ipynb"))
    ]
    return "\n".join(out) + "\n"
