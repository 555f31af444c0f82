"""Regenerate notebooks/*.ipynb from the cell sources below (run after editing them):

    .venv/bin/python workflow/scripts/make_notebooks.py

Each notebook reads only logged files through d3s.analysis, writes its tables (CSV) and figures (PNG and
PDF), and takes papermill parameters (results_dir, out_dir, ...); opened in jupyter lab from notebooks/,
the defaults point at ../results/tiny.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

PARAMS = """# Parameters (papermill overrides these; the defaults suit jupyter lab started in notebooks/)
results_dir = "../results/tiny"
out_dir = "../results/tiny"
paper_dir = "../results/paper"
reference = "grpo"
target_fraction = 0.99
headline = ["grpo", "pods", "d3s"]
ablation = ["grpo", "d1s", "d1s_cross", "d2s", "d3s"]
allow_mixed = False  # analysis.allow_mixed_settings: combine results made with different settings, stating it"""

# The manifests each notebook's tables come from (d3s.orchestration.settings_check groups); __SCOPE__ is filled in.
SETUP = """from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from d3s.analysis import figures, io, tables
from d3s.orchestration import settings_check

results, out = Path(results_dir), Path(out_dir)
(out / "tables").mkdir(parents=True, exist_ok=True)
(out / "figures").mkdir(parents=True, exist_ok=True)
# Refuses results made with different settings unless allow_mixed; the tables' sidecars name the manifests.
prov = settings_check.check_results(results, allow_mixed=allow_mixed, groups=__SCOPE__)
display(Markdown("**Provenance** (details: tables/*.provenance.json)\\n\\n" + prov.summary() + "\\n\\n" + prov.banner()))
metrics = io.load_metrics(results, allow_mixed=allow_mixed)
methods = list(dict.fromkeys([m for m in [reference, *headline, *ablation] if m in set(metrics["method"])] + sorted(metrics["method"].unique())))
print(f"{len(metrics)} logged steps; methods: {methods}; seeds: {sorted(metrics['seed'].unique())}")"""


def setup(scope: tuple[str, ...]) -> str:
    """The setup cell of a notebook whose tables come from the manifests of ``scope``."""
    return SETUP.replace("__SCOPE__", repr(scope))


NOTEBOOKS = {
    "training_dynamics": [
        "# Training dynamics\n\nGradient norm, policy entropy (all tokens and the tokens kept by token selection), "
        "reward, advantage variance before and after sample selection, fractions of samples and tokens kept, and "
        "the tokens that enter each update. Mean across seeds (line) and +- one standard deviation (band), "
        "smoothed over 5 steps. These come from each run's `metrics.jsonl`; the KL to the initial policy comes "
        "from the evaluated checkpoints (`kl.json`).",
        setup(("training",)),
        """fig = figures.training_dynamics(metrics, methods)
figures.save(fig, out / "figures" / "training_dynamics")
fig""",
        """fig = figures.grad_norm_figure(metrics, methods)
figures.save(fig, out / "figures" / "grad_norm")
fig""",
        """columns = ["grad_norm", "entropy", "selection/entropy_selected", "reward", "selection/adv_var_before",
           "selection/adv_var_after", "selection/sample_keep_fraction", "selection/token_keep_fraction",
           "selection/update_tokens"]
dynamics = tables.summarise_dynamics(metrics, columns)
tables.write_table(dynamics, out / "tables" / "dynamics.csv", prov)
display(dynamics.round(3))""",
        "## KL to the initial policy\n\nMeasured without gradient at every evaluated checkpoint (config `eval.kl`, "
        "`d3s.evaluation.kl`): the policy's own completions of a fixed probe of training prompts, scored by the "
        "policy and the initial model; k1 and k3 per token. The training objective has no KL term (beta = 0).",
        """kl = io.load_kl(results, allow_mixed=allow_mixed)
if kl.empty:
    display(Markdown("No KL measurements: set `eval.kl` in the config to measure them."))
else:
    tables.write_table(kl, out / "tables" / "kl.csv", prov)
    fig = figures.kl_figure(kl, [m for m in methods if m in set(kl["method"])])
    figures.save(fig, out / "figures" / "kl")
    display(fig)""",
    ],
    "pass_at_k": [
        "# Pass@k\n\nFinal models on the held-out benchmarks, several samples per problem; mean across seeds and "
        "the half-width of the 95 % t-interval across seeds (blank with one seed). The layouts follow the "
        "paper's Table 1 (headline methods, benchmarks as columns, Pass@1 / Pass@k) and Table 2 (ablation).",
        setup(("training", "final")),
        """evals = io.load_evals(results, allow_mixed=allow_mixed)
final = evals[evals["final"]]
ks = sorted(final["k"].unique())
kmax = max(ks)
long = tables.pass_at_k_table(evals, methods)
tables.write_table(long, out / "tables" / "pass_at_k.csv", prov)
base = io.load_base_eval(results, allow_mixed=allow_mixed) if (results / "eval" / "base" / "summary.json").exists() else pd.DataFrame()
if not base.empty:
    base = base.assign(mean=100 * base["value"], ci95=float("nan"), seeds=1, method="base")[long.columns]
display(long.round(2))""",
        """rows = [m for m in ["base", *headline] if m == "base" or m in methods]
table1 = tables.paper_layout(pd.concat([base, long]) if not base.empty else long, ks=(1, kmax))
table1 = table1.loc[[m for m in rows if m in table1.index]]
tables.write_table(table1, out / "tables" / "table1_layout.csv", prov, index=True)
display(Markdown(f"**Table 1 layout** (Pass@1 / Pass@{kmax}, %)"))
display(table1)""",
        """table2 = tables.paper_layout(long[long["method"].isin(ablation)], ks=(1, kmax))
table2 = table2.loc[[m for m in ablation if m in table2.index]]
tables.write_table(table2, out / "tables" / "table2_layout.csv", prov, index=True)
display(Markdown(f"**Table 2 layout** (ablation; Pass@1 / Pass@{kmax}, %)"))
display(table2)""",
        """fig = figures.pass_at_k_figure(long, methods)
figures.save(fig, out / "figures" / "pass_at_k")
fig""",
    ],
    "efficiency": [
        "# Efficiency\n\nHeld-out Pass@1 along training (checkpoints) against steps, the tokens that entered "
        "the updates, and training wall-clock (sum of the logged step times). Speedup (PODS definition): the "
        "time the reference needs to first reach `target_fraction` of its best seed-mean accuracy, divided by "
        "the time the method needs; NaN when a method never reaches it. Table 3 layout: gain in final Pass@1 "
        "over the reference and speedup.",
        setup(("training", "final", "checkpoints")),
        """evals = io.load_evals(results, allow_mixed=allow_mixed)
curves = tables.learning_curves(evals, metrics, k=1)
tables.write_table(curves, out / "tables" / "learning_curves.csv", prov)
fig = figures.learning_curve_figure(curves, methods)
figures.save(fig, out / "figures" / "learning_curves")
fig""",
        """eff = tables.efficiency_table(curves, metrics, reference, target_fraction)
eff = eff.set_index("method").loc[[m for m in methods if m in set(eff["method"])]].reset_index()
tables.write_table(eff, out / "tables" / "efficiency.csv", prov)
display(eff.round(3))""",
        """table3 = pd.DataFrame({
    "comparison": [f"{m} vs {reference}" for m in eff["method"] if m != reference],
    "Pass@1 gain (%)": [g for m, g in zip(eff["method"], eff["gain_vs_reference_pct"]) if m != reference],
    "speedup (time)": [s for m, s in zip(eff["method"], eff["speedup_time"]) if m != reference],
    "speedup (steps)": [s for m, s in zip(eff["method"], eff["speedup_steps"]) if m != reference],
})
tables.write_table(table3, out / "tables" / "table3_layout.csv", prov)
display(Markdown("**Table 3 layout**"))
display(table3.round(2))""",
    ],
    "selection_anatomy": [
        "# Selection anatomy\n\nWhat sample and token selection kept, from `anatomy.jsonl` (written every "
        "`anatomy_every` steps). Lemma 1: the max-variance subset of a standardised group (mean 0, variance 1) "
        "has Var(A) >= 1. TRL standardises with the unbiased standard deviation, so variances here are unbiased "
        "too (a whole group has Var(A) = 1; with population variances the bound would fail for odd subset sizes, "
        "e.g. 5 kept of a group with 4 of 8 correct gives 0.96). Shown: Var(A) of the kept rollouts / Var(A) of "
        "the group, over groups with >= 2 kept and some reward variance. "
        "Max-variance selection within a group (pods, d1s, d3s_i) should sit at or above the red line; "
        "cross-group selection (d1s_cross, d2s, d3s) picks rollouts across prompts, so a single group's "
        "ratio is not bound by the lemma; keeping everything (grpo) gives exactly 1.",
        setup(("training",)),
        """groups, token_records = io.load_anatomy(results, allow_mixed=allow_mixed)
if groups.empty:
    print("no anatomy.jsonl found: set trainer.anatomy_every > 0")
else:
    eligible = groups[(groups["n_kept"] >= 2) & (groups["reward_std"] > 0)]
    lemma = eligible.groupby("method")["var_ratio"].describe()[["count", "min", "25%", "50%", "mean"]]
    lemma["fraction >= 1"] = eligible.assign(ok=eligible["var_ratio"] >= 1 - 1e-6).groupby("method")["ok"].mean()
    tables.write_table(lemma, out / "tables" / "var_after_selection.csv", prov, index=True)
    display(lemma.round(3))
    fig = figures.var_after_figure(groups, methods)
    figures.save(fig, out / "figures" / "var_after_selection")
    display(fig)""",
        """candidates = [r for r in token_records if r.get("examples") and r["method"] in ("d3s", "d2s", "d3s_i")]
if candidates:
    record = candidates[-1]
    example = max(record["examples"], key=lambda e: sum(map(bool, e["selected"])))
    print(f"{record['method']} seed {record['seed']} step {record['step']}, token_keep_ratio {record['token_keep_ratio']}:")
    print("".join(example["tokens"]))
    fig = figures.token_scores_figure(example)
    figures.save(fig, out / "figures" / "token_selection_example")
    display(fig)
else:
    print("no token-level anatomy records of a token-selecting method")""",
    ],
}


def build(name: str, cells: list[str]) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells.append(new_markdown_cell(cells[0]))
    params = new_code_cell(PARAMS)
    params.metadata["tags"] = ["parameters"]
    nb.cells.append(params)
    # a later cell starting with a "## " heading is prose, the rest are code
    nb.cells += [new_markdown_cell(src) if src.startswith("## ") else new_code_cell(src) for src in cells[1:]]
    return nb


def main() -> None:
    root = Path(__file__).resolve().parents[2] / "notebooks"
    root.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        nbformat.write(build(name, cells), root / f"{name}.ipynb")
        print(f"wrote {root / name}.ipynb")


if __name__ == "__main__":
    main()
