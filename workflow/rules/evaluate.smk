# Stage 3: `d3s eval`, one job per evaluated model (every intermediate checkpoint, the final model); only
# summary.json is declared, so a killed job resumes its samples (docs/workflow.md, "Evaluation resumes").
EV = config["eval"]
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


for name, (point, model, samples, k, limit) in EVAL_POINTS.items():

    rule:
        name:
            name
        input:
            summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",  # the run's models exist
            train_config=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train.yaml",  # the KL probe's prompts
        output:
            summary=f"{RESULTS}/eval/{{method}}/seed{{seed}}/{point}/summary.json",
        params:
            model=f"{RESULTS}/runs/{{method}}/seed{{seed}}/{model}",
            eval=EV,
            task=TASK,
            samples=samples,
            k=k,
            limit=limit,
            reference=BASE_MODEL,  # the initial policy of the KL (eval.kl)
            train=config["train"],
        threads: EV["threads"]
        resources:
            **EV["resources"],
        log:
            f"{RESULTS}/logs/eval/{{method}}_seed{{seed}}_{point}.log",
        conda:
            ENV
        script:
            "../scripts/evaluate.py"
