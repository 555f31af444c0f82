# Stage 3: `d3s eval`, one job per evaluated model, so evaluations run in parallel and fail alone:
# evaluate_checkpoint, every intermediate checkpoint (learning curves: eval.checkpoint_samples per problem on
# eval.checkpoint_limit problems), and evaluate_final, the final model (eval.samples per problem: Pass@1 ..
# Pass@k). A killed or failed job resumes where it stopped: the declared output is only summary.json, which
# `d3s eval` writes last, so the samples.jsonl beside it are not outputs and Snakemake never deletes them
# before a re-run (a directory() output would be deleted whole). workflow/scripts/evaluate.py moves an
# evaluation aside, never deletes it, when the model or the settings it was made with changed. With eval.kl,
# both rules also measure the KL to the initial policy (params.reference) on the run's training prompts
# (input.train_config) and write kl.json beside summary.json (d3s.evaluation.kl).
EV = config["eval"]
# rule: (evaluated point, its model in the run's folder, samples per problem, Pass@k values, problems). A
# checkpoint-<step> folder is not a declared output of rule train (see train.smk): evaluate.py stops with the
# fix when it is missing.
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
            reference=base_model_path(),  # the initial policy of the KL (eval.kl)
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
