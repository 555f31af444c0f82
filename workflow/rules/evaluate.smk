# Stage 3: `d3s eval` on every intermediate checkpoint (learning curves; checkpoint_samples per problem)
# and on the final model (eval.samples per problem: Pass@1 .. Pass@k). One job per run, one process.


rule evaluate:
    input:
        final=f"{RESULTS}/runs/{{method}}/seed{{seed}}/final",
        summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",  # the run's checkpoints exist
    output:
        final=f"{RESULTS}/eval/{{method}}/seed{{seed}}/final/summary.json",
        steps=[f"{RESULTS}/eval/{{method}}/seed{{seed}}/step{s}/summary.json" for s in CKPT_STEPS],
    params:
        eval=config["eval"],
        task=TASK,
        steps=CKPT_STEPS,
        checkpoints=lambda wc: [f"{RESULTS}/runs/{wc.method}/seed{wc.seed}/checkpoint-{s}" for s in CKPT_STEPS],
    threads: config["eval"].get("threads", 1)
    resources:
        **config["eval"].get("resources", {}),
    log:
        f"{RESULTS}/logs/eval/{{method}}_seed{{seed}}.log",
    conda:
        ENV
    script:
        "../scripts/evaluate.py"
