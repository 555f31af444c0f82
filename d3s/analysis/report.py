"""report.md: the paper's numbers beside ours, the claims checked, figures and the manifests every number came
from; refuses mixed settings unless ``analysis.allow_mixed_settings`` (d3s.provenance.settings_check)."""

from __future__ import annotations

import json
import math
import os
import platform
import textwrap
from pathlib import Path
from string import Template

import pandas as pd

from d3s.analysis.claims import claims_table
from d3s.analysis.io import load_curve_evals, load_evals, load_metrics
from d3s.analysis.tables import cell, learning_curves, mean_ci, write_table
from d3s.grading.policies import ANSWER_POLICIES
from d3s.markdown import markdown_table
from d3s.methods import method_trainer
from d3s.provenance import layout
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
# main-table column: (efficiency.csv column, digits)
EFFICIENCY = {
    "update tokens/step": ("update_tokens_per_step", 0),
    "s/step": ("seconds_per_step", 3),
    "speedup (time)": ("speedup_time", 2),
    "speedup (steps)": ("speedup_steps", 2),
}
LEMMA_NOTE = (
    "**Lemma 1** (Var(A) of a max-variance kept subset of a standardised group is at least 1): Var(A) of the "
    "kept rollouts / Var(A) of their group, over logged groups with at least 2 kept rollouts and some reward "
    "variance. The lemma binds intra-group max-variance selection (pods, d1s, d3s_i); cross-group selection "
    "(d1s_cross, d2s, d3s) is not bound per group; grpo keeps everything (ratio 1)."
)
PAPER_TABLE3 = ["model", "method", "reference", "avg32_gain_pct", "speedup"]
# the report's text, with $placeholders that write_report fills in
TEMPLATE = Path(__file__).with_name("report_template.md")


def _sidecar(path: Path) -> str:
    """The link to a table's provenance sidecar, where it has one."""
    sidecar = path.with_name(f"{path.stem}.provenance.json")
    return f" (manifests: [{sidecar.name}](tables/{sidecar.name}))" if sidecar.is_file() else ""


def _optional(path: Path, title: str, digits: int) -> str:
    """``title`` and the table at ``path`` rounded to ``digits``, where a notebook wrote it."""
    if not path.is_file():
        return ""
    table = pd.read_csv(path).rename(columns={"Unnamed: 0": "method"}).round(digits)
    return f"{title}\n\n{_md(table)}\n\n"


def _md(df: pd.DataFrame) -> str:
    columns = {str(name): (lambda row, i=i: row[i]) for i, name in enumerate(df.columns)}
    return markdown_table(df.itertuples(index=False), columns)


def _git_commit() -> str:
    """The d3s checkout writing the report (the working directory may be a copy of the workflow)."""
    state = git_state()
    dirty = " with uncommitted changes" if state["dirty"] else ""
    return state["commit"][:7] + dirty if state["commit"] else "unknown"


def _paper_averages(paper_dir: Path) -> pd.DataFrame:
    """The papers' average Pass@1 and Pass@8 rows: D3S Table 1 on Qwen2.5-Math-7B, then Table 2."""
    t1, t2 = (pd.read_csv(paper_dir / f"d3s_table{i}.csv") for i in (1, 2))
    both = pd.concat([t1[t1["model"] == "Qwen2.5-Math-7B"], t2])
    return both[both["benchmark"] == "average"]


def _analysis(config: dict) -> tuple[dict, bool]:
    """The config's analysis section and its allow_mixed_settings."""
    analysis = config.get("analysis") or {}
    return analysis, bool(analysis.get("allow_mixed_settings", False))


def write_claims(results: Path, paper_dir: Path, config: dict) -> pd.DataFrame:
    """``tables/claims.csv`` (d3s.analysis.claims) with its provenance sidecar; returns the table."""
    analysis, allow_mixed = _analysis(config)
    metrics = load_metrics(results, allow_mixed=allow_mixed)
    evals = load_evals(results, allow_mixed=allow_mixed)
    paper = {  # table -> method -> Pass@1
        table: dict(zip(rows["method"], rows["pass_at_1"].astype(float), strict=True))
        for table, rows in _paper_averages(paper_dir).groupby("table", sort=False)
    }
    table = claims_table(
        evals,
        learning_curves(load_curve_evals(results, allow_mixed=allow_mixed), metrics, k=1),
        metrics,
        [m for m in config["methods"] if m in set(evals["method"])],
        analysis.get("reference", "grpo"),
        analysis.get("target_fraction", 0.99),
        paper,
        analysis.get("references", {"gspo_d3s": "gspo"}),
        method_generations(config),
    )
    write_table(table, results / "tables" / "claims.csv", load_provenance(results, allow_mixed=allow_mixed))
    return table


def method_generations(config: dict) -> dict[str, int]:
    """num_generations of each method's runs as the workflow resolves them (trainer, method_overrides)."""
    train = config.get("train") or {}
    return {m: int(method_trainer(train, m).get("num_generations", 8)) for m in config["methods"]}


def _interval(row) -> str:
    digits = {"points": 1, "norm": 3}.get(row["unit"], 2)
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
    protocol = [f" ({p})" if p else "" for p in shown["protocol"].fillna("")]
    detectable = shown["verdict"].eq("inconclusive") & shown["min_detectable_effect"].notna()
    noise = shown["seed_sd"].map("{:.1f}".format) + " / " + shown["eval_se"].map("{:.1f}".format)
    return pd.DataFrame(
        {
            "claim": shown["statement"],
            "method vs reference": shown["method"] + " vs " + shown["reference"] + protocol,
            "estimate [95 % CI]": shown.apply(_interval, axis=1),
            "unit": shown["unit"],
            "verdict": shown["verdict"],
            "Holm": shown["verdict_holm"],
            "min. detectable": shown["min_detectable_effect"].map("{:.2f}".format).where(detectable, ""),
            "noise: seeds / evaluation": noise.where(shown["eval_se"].notna(), ""),
            "seeds": shown["seeds"],
        }
    )


def _model_line(results: Path, config: dict) -> str:
    """The tiny base model as built (base_summary.json), or the configured model's path."""
    path = results / "base_model" / "base_summary.json"
    if not path.is_file():
        return f"`{config['base_model'].get('path')}`"
    base = json.loads(path.read_text())
    return (
        f"tiny Qwen2-architecture model ({base['parameters']:,} parameters) built in code, SFT warm start "
        f"{base['sft_steps']} steps on the synthetic task ({base['min_ops']}-{base['max_ops']} operations on "
        f"0..{base['max_operand']}; target completions {base['completion_tokens_mean']:.1f} tokens on "
        "average)"
    )


def _regime_line(metrics: pd.DataFrame, trainer: dict, methods: list) -> str:
    """The regime the verdicts belong to: prompts and rollouts per step, and each method's mean update tokens
    per step (the logged ``selection/update_tokens``; the papers train on the order of 10^5)."""
    generations = trainer.get("num_generations") or 8
    rollouts = trainer.get("per_device_train_batch_size", 0) * trainer.get("gradient_accumulation_steps", 1)
    line = f"{rollouts // generations} prompts x {generations} rollouts per step"
    column = "selection/update_tokens"
    if column in metrics and not metrics[column].isna().all():
        means = metrics.groupby("method")[column].mean()
        line += "; tokens in the update per step (mean over steps and seeds): " + ", ".join(
            f"{method} {means[method]:,.0f}" for method in methods if method in means.index
        )
    return line


def _main_table(
    long: pd.DataFrame, efficiency: pd.DataFrame, metrics: pd.DataFrame, methods: list, kmax: int
):
    """Ours: Pass@1 and Pass@kmax (mean over benchmarks), gradient norm and the efficiency columns."""
    bench = long[long["benchmark"] != "average"]
    eff = efficiency.set_index("method").reindex(methods)
    grad = metrics.groupby(["method", "seed"])["grad_norm"].mean() if "grad_norm" in metrics else pd.Series()
    rows = []
    for method in [m for m in methods if m in set(long["method"])]:
        sub = bench[bench["method"] == method].groupby("k")[["mean", "ci95"]].mean().reindex([1, kmax])
        rows.append(
            {"method": method}
            | {f"Pass@{k} (%)": cell(mean, half) for k, mean, half in sub.itertuples()}
            | {"grad norm": cell(*mean_ci(grad.get(method, []))[:2], digits=3)}
            | {label: cell(eff.at[method, column], digits=d) for label, (column, d) in EFFICIENCY.items()}
        )
    return pd.DataFrame(rows)


def _base_note(results: Path, ks: list) -> str:
    """The base model's Pass@k (mean over benchmarks), where it was evaluated."""
    path = results / "eval" / "base" / "summary.json"
    if not path.is_file():
        return ""
    values = [b["pass_at_k"] for b in json.loads(path.read_text())["benchmarks"].values()]
    mean = {k: 100 * sum(v[str(k)] for v in values) / len(values) for k in ks if str(k) in values[0]}
    return "Base model before RL: " + ", ".join(f"Pass@{k} {v:.1f} %" for k, v in mean.items()) + "."


def _copied_table(results: Path) -> str:
    """The share of each final model's samples whose answer is an expression copied unevaluated from the
    question (d3s.grading.copied.copied_from_prompt), per benchmark and answer policy; "n/a" for a summary
    written before the flag existed."""
    rows = []
    for point in layout.eval_points(results):
        if point.name != "final":
            continue
        summary = json.loads((point.directory / "summary.json").read_text(encoding="utf-8"))
        for benchmark, info in summary.get("benchmarks", {}).items():
            by_policy = info.get("by_policy") or {}
            rows.append(
                {"model": f"{point.method} seed {point.seed}", "benchmark": benchmark}
                | {
                    f"copied ({policy}, %)": _percent((by_policy.get(policy) or {}).get("copied_fraction"))
                    for policy in ANSWER_POLICIES
                }
            )
    return _md(pd.DataFrame(rows)) if rows else "(no final model evaluated)"


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.2f}"


def _side_by_side(paper_dir: Path, main: pd.DataFrame, kmax: int) -> str:
    """The papers' average Pass@1 / Pass@8 next to ours, for the methods in both (in our order)."""
    paper = _paper_averages(paper_dir).drop_duplicates("method")
    both = main.merge(paper, on="method") if "method" in main else main  # no row of ours: no columns
    if both.empty:
        return "(no method in common with the paper tables)"
    paper = both["pass_at_1"].astype(str) + " / " + both["pass_at_8"].astype(str)
    table = {"method": both["method"], "paper Pass@1 / Pass@8 (Qwen2.5-Math-7B, avg) [N]": paper}
    table["paper source"] = both["table"]
    table[f"ours Pass@1 / Pass@{kmax}"] = both["Pass@1 (%)"] + " / " + both[f"Pass@{kmax} (%)"]
    return _md(pd.DataFrame(table))


def write_report(results: Path, paper_dir: Path, config: dict) -> str:
    """The report's Markdown; raises MixedSettingsError if the results mix settings that must agree and
    ``analysis.allow_mixed_settings`` is not set."""
    tables = results / "tables"
    analysis, allow_mixed = _analysis(config)
    reference = analysis.get("reference", "grpo")
    provenance = load_provenance(results, allow_mixed=allow_mixed)
    methods, seeds = list(config["methods"]), list(config["seeds"])
    metrics = load_metrics(results, allow_mixed=allow_mixed)
    long = pd.read_csv(tables / "pass_at_k.csv")
    ks = sorted(long["k"].unique())
    main = _main_table(long, pd.read_csv(tables / "efficiency.csv"), metrics, methods, max(ks))
    claims = pd.read_csv(tables / "claims.csv")
    headline = [m for m in analysis.get("headline", methods) if m != reference]
    trainer, ev = config["train"]["trainer"], config["eval"]
    ordering = "".join(
        f"Direction test against {row['reference']}: {_interval(row)} of the method pairs ({row['method']}) "
        f"in the paper's order (0.5 = chance; seed bootstrap, {row['seeds']} seeds): **{row['verdict']}**."
        "\n\n"
        for _, row in claims[claims["claim"] == "ordering_agrees_with_paper"].iterrows()
    )
    files = [f"tables/{p.name}" for p in sorted(tables.glob("*.csv"))]
    files += [f"notebooks/{p.name}" for p in sorted((results / "notebooks").glob("*.ipynb"))]
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        {key: trainer.get(key) for key in ("per_device_train_batch_size", "num_generations")}
        | {key: ev.get(key) for key in ("temperature", "top_p", "checkpoint_samples")}
        | {name: getattr(platform, name)() for name in ("machine", "system", "python_version")},
        experiment=config["experiment"],
        banner=f"{provenance.banner()}\n\n" if provenance.mixed else "",  # stated before anything else
        claims=_md(claims_summary(claims, headline, reference)),
        comparisons=len(claims),
        model=_model_line(results, config),
        methods=", ".join(methods),
        n_seeds=len(seeds),
        seeds=", ".join(map(str, seeds)),
        max_steps=trainer["max_steps"],
        regime=_regime_line(metrics, trainer, methods),
        threads=config["train"].get("threads", 1),
        benchmarks=", ".join(ev["benchmarks"]),
        samples=ev["samples"],
        save_steps=trainer.get("save_steps", trainer["max_steps"]),
        cpus=os.cpu_count(),
        commit=_git_commit(),
        sources=textwrap.indent(provenance.summary(), "  "),
        main=_md(main),
        evaluated=", ".join(sorted(long.loc[long["benchmark"] != "average", "benchmark"].unique())),
        reference=reference,
        fraction=f"{analysis.get('target_fraction', 0.99):.0%}",
        base_note=_base_note(results, ks),
        copied=_copied_table(results),
        side_by_side=_side_by_side(paper_dir, main, max(ks)),
        ordering=ordering,
        table3=_md(pd.read_csv(paper_dir / "d3s_table3.csv")[PAPER_TABLE3]),
        ours3=_optional(tables / "table3_layout.csv", "Ours, Table 3 layout:", 2),
        lemma=_optional(tables / "var_after_selection.csv", LEMMA_NOTE, 3),
        figures="".join(
            f"### {caption}\n\n![{caption}](figures/{stem}.png) ([PDF](figures/{stem}.pdf))\n\n"
            for stem, caption in FIGURES
            if (results / "figures" / f"{stem}.png").is_file()
        ),
        provenance=provenance.markdown(),
        files="".join(f"\n- [{f}]({f}){_sidecar(results / f)}" for f in files),
    )
