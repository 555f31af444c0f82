# Stage 2: one RL run per (method, seed) with `d3s train`, on the CPU or on GPUs of its own (docs/gpu/launch.md).


rule train:
    input:
        run_base_input,
    output:
        config=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train.yaml",
        summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",
        final=directory(f"{RESULTS}/runs/{{method}}/seed{{seed}}/final"),
    # Checkpoints and logs are not outputs: a killed job resumes (docs/workflow/resume.md, "The run logs ...").
    params:
        model=model_param,
        variant=lambda wildcards: variant_of(wildcards.method).as_param(),  # the registry method, overrides
        train=config["train"],
        task=TASK,
        data_dir=config["train"].get("data_dir"),
        # relative to the working directory, where jobs run: an absolute path in a parameter would re-run
        # every finished run of a workflow copied or moved elsewhere (Snakemake compares parameters)
        accelerate_dir=os.path.relpath(ACCELERATE_DIR),
    threads: config["train"]["threads"]
    resources:
        **config["train"]["resources"],
    log:
        f"{RESULTS}/logs/train/{{method}}_seed{{seed}}.log",
    conda:
        ENV
    script:
        "../scripts/train_run.py"

