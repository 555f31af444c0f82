# Stage 3: `d3s eval` of every intermediate checkpoint and the final model of each run. eval.jobs picks the
# jobs: `run` evaluates a run's models in one process (one start-up of torch and TRL per run: the CPU
# testbed's cost), `model` one job per model (side by side on free GPUs; the paper configs). Only summary.json
# files are declared, so a killed job resumes its samples (docs/workflow/resume.md).
EV = config["eval"]
# the evaluation settings every job reads; eval.jobs only shapes the jobs (a change of it re-runs none)
EV_PARAMS = {key: value for key, value in EV.items() if key != "jobs"}
# rule: (evaluated point, its model in the run's folder, samples per problem, Pass@k values, problems).
EVAL_POINTS = {
    "evaluate_checkpoint": (
        "step{step}",
        "checkpoint-{step}",
        EV["checkpoint_samples"],
        EV["checkpoint_k"],
        EV.get("checkpoint_limit") or EV.get("limit"),
    ),
    "evaluate_final": ("final", "final", EV["samples"], EV["k"], EV.get("limit")),
}
RUN_DIR = f"{RESULTS}/runs/{{method}}/seed{{seed}}"
EVAL_DIR = f"{RESULTS}/eval/{{method}}/seed{{seed}}"
EVAL_INPUT = {
    "summary": f"{RUN_DIR}/train_summary.json",  # the run's models exist
    "train_config": f"{RUN_DIR}/train.yaml",  # the KL probe's prompts
}


if EV["jobs"] == "model":
    for name, (point, model, samples, k, limit) in EVAL_POINTS.items():

        rule:
            name:
                name
            input:
                **EVAL_INPUT,
            output:
                summary=f"{EVAL_DIR}/{point}/summary.json",
            params:
                model=f"{RUN_DIR}/{model}",
                eval=EV_PARAMS,
                task=TASK,
                samples=samples,
                k=k,
                limit=limit,
                reference=run_base_model,  # the initial policy of the KL (eval.kl)
            threads: EV["threads"]
            resources:
                **EV["resources"],
            log:
                f"{RESULTS}/logs/eval/{{method}}_seed{{seed}}_{point}.log",
            conda:
                ENV
            script:
                "../scripts/evaluate.py"

else:
    # the run's points in training order, each as its own rule would evaluate it; outputs in the same order
    RUN_POINTS = [
        {"point": f"step{step}", "model": f"checkpoint-{step}", "samples": checkpoint[2], "k": checkpoint[3]}
        | {"limit": checkpoint[4]}
        for checkpoint in [EVAL_POINTS["evaluate_checkpoint"]]
        for step in CKPT_STEPS
    ]
    RUN_POINTS.append(dict(zip(("point", "model", "samples", "k", "limit"), EVAL_POINTS["evaluate_final"])))

    rule evaluate_run:
        input:
            **EVAL_INPUT,
        output:
            summaries=[f"{EVAL_DIR}/{point['point']}/summary.json" for point in RUN_POINTS],
        params:
            points=RUN_POINTS,
            run=lambda wildcards, input: str(Path(input.summary).parent),  # the run's folder
            eval=EV_PARAMS,
            task=TASK,
            reference=run_base_model,  # the initial policy of the KL (eval.kl)
        threads: EV["threads"]
        resources:
            **EV["resources"],
        log:
            f"{RESULTS}/logs/eval/{{method}}_seed{{seed}}.log",
        conda:
            ENV
        script:
            "../scripts/evaluate.py"
