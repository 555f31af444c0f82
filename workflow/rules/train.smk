# Stage 2: one RL run per (method, seed) with `d3s train` (metrics.jsonl, anatomy.jsonl, checkpoints,
# resolved_config.yaml, final/). CPU jobs run in parallel with train.threads torch threads each; a job with
# resources.gpu runs under `accelerate launch` on GPUs assigned to it (docs/gpu.md).


rule train:
    input:
        base_model_input(),
    output:
        config=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train.yaml",
        summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",
        final=directory(f"{RESULTS}/runs/{{method}}/seed{{seed}}/final"),
    # Checkpoints and the logs (metrics.jsonl, anatomy.jsonl) are not declared outputs: Snakemake deletes a
    # job's outputs before re-running it, and a killed job re-run with --rerun-incomplete resumes from the
    # checkpoint and cuts the logs back to it (`d3s train`, resume: auto). A job whose configuration changed
    # starts over and moves them aside, never deletes them (workflow/scripts/train_run.py).
    params:
        model=model_param,
        train=config["train"],
        task=TASK,
        data_dir=config["train"].get("data_dir"),
    threads: config["train"]["threads"]
    resources:
        **config["train"]["resources"],
    log:
        f"{RESULTS}/logs/train/{{method}}_seed{{seed}}.log",
    conda:
        ENV
    script:
        "../scripts/train_run.py"
