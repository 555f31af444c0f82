# Stage 3: `d3s eval`, one job per evaluated model, so evaluations run in parallel and fail alone:
# evaluate_checkpoint, every intermediate checkpoint (learning curves: eval.checkpoint_samples per problem on
# eval.checkpoint_limit problems), and evaluate_final, the final model (eval.samples per problem: Pass@1 ..
# Pass@k). A killed or failed job resumes where it stopped: the declared output is only summary.json, which
# `d3s eval` writes last, so the samples.jsonl beside it are not outputs and Snakemake never deletes them
# before a re-run (a directory() output would be deleted whole). workflow/scripts/evaluate.py moves an
# evaluation aside, never deletes it, when the model or the settings it was made with changed. With eval.kl,
# both rules also measure the KL to the initial policy (params.reference) on the run's training prompts
# (input.train_config) and write kl.json beside summary.json (d3s.evaluation.kl).


rule evaluate_checkpoint:
    input:
        summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",  # the run's checkpoints exist
        train_config=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train.yaml",  # the KL probe's prompts
    output:
        summary=f"{RESULTS}/eval/{{method}}/seed{{seed}}/step{{step}}/summary.json",
    params:
        model=checkpoint_path,
        eval=config["eval"],
        task=TASK,
        samples=config["eval"].get("checkpoint_samples", 4),
        k=config["eval"].get("checkpoint_k", [1]),
        limit=config["eval"].get("checkpoint_limit") or config["eval"].get("limit"),
        reference=base_model_path(),  # the initial policy of the KL (eval.kl)
        train=config["train"],
    threads: config["eval"].get("threads", 1)
    resources:
        **config["eval"].get("resources", {}),
    log:
        f"{RESULTS}/logs/eval/{{method}}_seed{{seed}}_step{{step}}.log",
    conda:
        ENV
    script:
        "../scripts/evaluate.py"


rule evaluate_final:
    input:
        final=f"{RESULTS}/runs/{{method}}/seed{{seed}}/final",
        summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",
        train_config=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train.yaml",
    output:
        summary=f"{RESULTS}/eval/{{method}}/seed{{seed}}/final/summary.json",
    params:
        model=lambda wildcards, input: input.final,
        eval=config["eval"],
        task=TASK,
        samples=config["eval"]["samples"],
        k=config["eval"]["k"],
        limit=config["eval"].get("limit"),
        reference=base_model_path(),
        train=config["train"],
    threads: config["eval"].get("threads", 1)
    resources:
        **config["eval"].get("resources", {}),
    log:
        f"{RESULTS}/logs/eval/{{method}}_seed{{seed}}_final.log",
    conda:
        ENV
    script:
        "../scripts/evaluate.py"
