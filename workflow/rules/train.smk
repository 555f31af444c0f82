# Stage 2: one RL run per (method, seed) with `d3s train`, on the CPU or on GPUs of its own (docs/gpu.md).


rule train:
    input:
        run_base_input,
    output:
        config=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train.yaml",
        summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",
        final=directory(f"{RESULTS}/runs/{{method}}/seed{{seed}}/final"),
    # Checkpoints and logs are not outputs: a killed job resumes (docs/workflow.md, "The run logs ...").
    params:
        model=model_param,
        variant=lambda wildcards: variant_of(wildcards.method).as_param(),  # the registry method, overrides
        train=config["train"],
        task=TASK,
        data_dir=config["train"].get("data_dir"),
        accelerate_dir=ACCELERATE_DIR,
    threads: config["train"]["threads"]
    resources:
        **config["train"]["resources"],
    log:
        f"{RESULTS}/logs/train/{{method}}_seed{{seed}}.log",
    conda:
        ENV
    script:
        "../scripts/train_run.py"


# A finished run whose final model no longer loads (a partial copy, a flaky file system) is trained again, not
# evaluated: before the jobs are planned, its final/ and train_summary.json are moved aside (never deleted) and
# the job resumes from the run's newest sound checkpoint (docs/gpu.md, "Faults a run survives"). Only the main
# Snakemake process checks: a cluster job parses this file again.
if workflow.is_main_process:
    for line in set_aside_corrupt_final_models(Path(RESULTS) / "runs"):
        print(line, file=sys.stderr)
