# Stage 4: the provenance check, once, then the analysis notebooks (notebooks/*.ipynb), one rule each, run
# with papermill on the logged files and provenance.json (docs/workflow/stages.md).

# papermill of the Python running Snakemake (works without an activated virtual environment), its kernel on
# Unix sockets (no TCP port to lose to a job beside it) and without the "iri" format checker's 3-4 s import
PAPERMILL = f"{sys.executable} -m d3s.analysis.run_notebook"

# analysis.allow_mixed_settings: combine results that differ in settings that must agree, stating the mix
ALLOW_MIXED = ANALYSIS["allow_mixed_settings"]
NB_YAML = {key: ANALYSIS.get(key, METHODS) for key in ("headline", "ablation")} | {"allow_mixed": ALLOW_MIXED}
NB_PARAMS = (
    f"-p results_dir {RESULTS} -p out_dir {RESULTS} -p paper_dir results/paper "
    f"-p reference {ANALYSIS['reference']} -p target_fraction {ANALYSIS['target_fraction']} "
    f"-y '{json.dumps(NB_YAML)}'"
)
# a run's train_summary.json stands for its logs (docs/workflow/resume.md, "The run logs are not declared outputs")
RUN = "{method}/seed{seed}"
RUNS = {"method": METHODS, "seed": SEEDS}
TRAIN_SUMMARIES = expand(f"{RESULTS}/runs/{RUN}/train_summary.json", **RUNS)
EVALS = expand(f"{RESULTS}/eval/{RUN}/final/summary.json", **RUNS)
EVALS += expand(f"{RESULTS}/eval/{RUN}/step{{step}}/summary.json", **RUNS, step=CKPT_STEPS)
EVALS.append(f"{RESULTS}/eval/base/summary.json")
PROVENANCE = f"{RESULTS}/provenance.json"
# eval.kl: the KL to the initial policy, measured by the evaluation jobs, plotted by training_dynamics
KL = ["kl"] if config["eval"].get("kl") else []
# notebook: (report category of its figures, figures/<stem>.png|pdf, tables/<stem>.csv with .provenance.json,
# whether it reads the evaluations); HTML report captions: workflow/report/<stem>.rst and tables/<stem>.rst
NOTEBOOKS = {
    "training_dynamics": (
        "Training dynamics", ["training_dynamics", "grad_norm", *KL], ["dynamics", *KL], False
    ),
    "pass_at_k": ("Pass@k", ["pass_at_k"], ["pass_at_k", "table1_layout", "table2_layout"], True),
    "efficiency": (
        "Efficiency", ["learning_curves"], ["learning_curves", "efficiency", "table3_layout"], True
    ),
    "selection_anatomy": (
        "Selection anatomy",
        ["var_after_selection", "token_selection_example"],
        ["var_after_selection"],
        False,
    ),
}


# Every run's and evaluation's manifest compared, once, before any notebook runs: a mix of settings fails
# here, with the keys, values and runs in the error; provenance.json is what the notebooks and report read.
rule provenance:
    input:
        TRAIN_SUMMARIES,
        EVALS,
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


for notebook, (category, figures, tables, reads_evals) in NOTEBOOKS.items():

    rule:
        name:
            notebook
        input:
            notebook=f"notebooks/{notebook}.ipynb",
            provenance=PROVENANCE,
            runs=TRAIN_SUMMARIES,
            evals=EVALS if reads_evals else [],
        output:
            notebook=f"{RESULTS}/notebooks/{notebook}.ipynb",
            figures=[
                report(f"{RESULTS}/figures/{stem}.png", caption=f"../report/{stem}.rst", category=category)
                for stem in figures
            ],
            pdfs=[f"{RESULTS}/figures/{stem}.pdf" for stem in figures],
            tables=[
                report(
                    f"{RESULTS}/tables/{stem}.csv", caption=f"../report/tables/{stem}.rst", category="Tables"
                )
                for stem in tables
            ],
            sidecars=[f"{RESULTS}/tables/{stem}.provenance.json" for stem in tables],
        log:
            f"{RESULTS}/logs/notebooks/{notebook}.log",
        params:
            papermill=PAPERMILL,
            notebook_params=NB_PARAMS,
        conda:
            ENV
        shell:
            "{params.papermill} {input.notebook} {output.notebook} -k python3 --no-progress-bar "
            "{params.notebook_params} > {log} 2>&1"
