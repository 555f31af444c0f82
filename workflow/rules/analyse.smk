# Stage 4: the provenance check, then the analysis notebooks, executed headless with papermill; they read
# only the logged files (through d3s.analysis) and write tables/*.csv (each with a .provenance.json naming
# the manifests it came from) and figures/*.png|pdf.
import sys

# papermill of the Python running Snakemake (works without an activated virtual environment)
PAPERMILL = f"{sys.executable} -m papermill"

# analysis.allow_mixed_settings: combine results whose manifests differ in settings that must agree
# (d3s.orchestration.settings_check), stating the mix in tables and report, instead of refusing.
ALLOW_MIXED = bool(ANALYSIS.get("allow_mixed_settings", False))
NB_YAML = {
    "headline": ANALYSIS.get("headline", METHODS),
    "ablation": ANALYSIS.get("ablation", METHODS),
    "allow_mixed": ALLOW_MIXED,
}
NB_PARAMS = (
    f"-p results_dir {RESULTS} -p out_dir {RESULTS} -p paper_dir results/paper "
    f"-p reference {ANALYSIS['reference']} -p target_fraction {ANALYSIS['target_fraction']} "
    f"-y '{json.dumps(NB_YAML)}'"
)
TRAIN_LOGS = expand(f"{RESULTS}/runs/{{method}}/seed{{seed}}/metrics.jsonl", method=METHODS, seed=SEEDS)
TRAIN_SUMMARIES = expand(f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json", method=METHODS, seed=SEEDS)
STEP_EVALS = expand(
    f"{RESULTS}/eval/{{method}}/seed{{seed}}/step{{step}}/summary.json", method=METHODS, seed=SEEDS, step=CKPT_STEPS
)
FIG = f"{RESULTS}/figures"
TAB = f"{RESULTS}/tables"
# eval.kl: the KL to the initial policy, measured by the evaluation jobs, plotted by training_dynamics
KL_OUTPUTS = (
    [report_figure("kl", "Training dynamics"), f"{FIG}/kl.pdf", f"{TAB}/kl.csv", f"{TAB}/kl.provenance.json"]
    if config["eval"].get("kl")
    else []
)
PROVENANCE = f"{RESULTS}/provenance.json"
# The provenance file a notebook writes beside tables/<name>.csv (d3s.analysis.tables.write_table).
SIDECAR = f"{TAB}/{{}}.provenance.json"


# Every run's and evaluation's manifest (written beside the summaries below) compared before any
# notebook runs: a mix of settings fails here, with the keys, values and runs in the error.
rule provenance:
    input:
        train=TRAIN_SUMMARIES,
        evals=all_final_evals(),
        steps=STEP_EVALS,
        base=f"{RESULTS}/eval/base/summary.json",
    output:
        json=PROVENANCE,
        md=report(f"{RESULTS}/provenance.md", caption="../report/provenance.rst", category="Provenance"),
    params:
        results=lambda wildcards, output: str(Path(output.json).parent),
        allow_mixed=ALLOW_MIXED,
    log:
        f"{RESULTS}/logs/provenance.log",
    conda:
        ENV
    script:
        "../scripts/check_provenance.py"


rule training_dynamics:
    input:
        notebook="notebooks/training_dynamics.ipynb",
        logs=TRAIN_LOGS,
        provenance=PROVENANCE,
    output:
        notebook=f"{RESULTS}/notebooks/training_dynamics.ipynb",
        dynamics=report_figure("training_dynamics", "Training dynamics"),
        grad_norm=report_figure("grad_norm", "Training dynamics"),
        pdfs=[f"{FIG}/training_dynamics.pdf", f"{FIG}/grad_norm.pdf"],
        table=report(f"{TAB}/dynamics.csv", caption="../report/dynamics_table.rst", category="Tables"),
        sidecars=[SIDECAR.format("dynamics")],
        kl=KL_OUTPUTS,
    log:
        f"{RESULTS}/logs/notebooks/training_dynamics.log",
    params:
        papermill=PAPERMILL,
        notebook_params=NB_PARAMS,
    conda:
        ENV
    shell:
        "{params.papermill} {input.notebook} {output.notebook} -k python3 --no-progress-bar "
        "{params.notebook_params} > {log} 2>&1"


rule pass_at_k:
    input:
        notebook="notebooks/pass_at_k.ipynb",
        logs=TRAIN_LOGS,
        provenance=PROVENANCE,
        evals=all_final_evals(),
        base=f"{RESULTS}/eval/base/summary.json",
    output:
        notebook=f"{RESULTS}/notebooks/pass_at_k.ipynb",
        figure=report_figure("pass_at_k", "Pass@k"),
        pdf=f"{FIG}/pass_at_k.pdf",
        long=report(f"{TAB}/pass_at_k.csv", caption="../report/pass_at_k_table.rst", category="Tables"),
        table1=report(f"{TAB}/table1_layout.csv", caption="../report/table1.rst", category="Tables"),
        table2=report(f"{TAB}/table2_layout.csv", caption="../report/table2.rst", category="Tables"),
        sidecars=[SIDECAR.format(name) for name in ("pass_at_k", "table1_layout", "table2_layout")],
    log:
        f"{RESULTS}/logs/notebooks/pass_at_k.log",
    params:
        papermill=PAPERMILL,
        notebook_params=NB_PARAMS,
    conda:
        ENV
    shell:
        "{params.papermill} {input.notebook} {output.notebook} -k python3 --no-progress-bar "
        "{params.notebook_params} > {log} 2>&1"


rule efficiency:
    input:
        notebook="notebooks/efficiency.ipynb",
        logs=TRAIN_LOGS,
        provenance=PROVENANCE,
        evals=all_final_evals(),
        base=f"{RESULTS}/eval/base/summary.json",
    output:
        notebook=f"{RESULTS}/notebooks/efficiency.ipynb",
        figure=report_figure("learning_curves", "Efficiency"),
        pdf=f"{FIG}/learning_curves.pdf",
        curves=f"{TAB}/learning_curves.csv",
        efficiency=report(f"{TAB}/efficiency.csv", caption="../report/efficiency_table.rst", category="Tables"),
        table3=report(f"{TAB}/table3_layout.csv", caption="../report/table3.rst", category="Tables"),
        sidecars=[SIDECAR.format(name) for name in ("learning_curves", "efficiency", "table3_layout")],
    log:
        f"{RESULTS}/logs/notebooks/efficiency.log",
    params:
        papermill=PAPERMILL,
        notebook_params=NB_PARAMS,
    conda:
        ENV
    shell:
        "{params.papermill} {input.notebook} {output.notebook} -k python3 --no-progress-bar "
        "{params.notebook_params} > {log} 2>&1"


rule selection_anatomy:
    input:
        notebook="notebooks/selection_anatomy.ipynb",
        logs=TRAIN_LOGS,
        provenance=PROVENANCE,
    output:
        notebook=f"{RESULTS}/notebooks/selection_anatomy.ipynb",
        var_after=report_figure("var_after_selection", "Selection anatomy"),
        example=report_figure("token_selection_example", "Selection anatomy"),
        pdfs=[f"{FIG}/var_after_selection.pdf", f"{FIG}/token_selection_example.pdf"],
        table=report(f"{TAB}/var_after_selection.csv", caption="../report/var_table.rst", category="Tables"),
        sidecars=[SIDECAR.format("var_after_selection")],
    log:
        f"{RESULTS}/logs/notebooks/selection_anatomy.log",
    params:
        papermill=PAPERMILL,
        notebook_params=NB_PARAMS,
    conda:
        ENV
    shell:
        "{params.papermill} {input.notebook} {output.notebook} -k python3 --no-progress-bar "
        "{params.notebook_params} > {log} 2>&1"
