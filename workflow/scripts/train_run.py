"""Snakemake script of rule train: write the run's `d3s train` config (train.yaml) and run it, in this process
on the CPU, or under `accelerate launch` on GPUs of its own (docs/gpu.md, "How a training job starts"); a thin
caller of d3s.orchestration.training_job.run_workflow_training_job."""

from d3s.orchestration.training_job import run_workflow_training_job

smk = snakemake  # noqa: F821 - injected by Snakemake
run_workflow_training_job(
    name=smk.wildcards.method,  # a method, or a study's variant of one
    variant=smk.params.variant,
    seed=int(smk.wildcards.seed),
    model=smk.params.model,
    train_cfg=smk.params.train,
    task=smk.params.task,
    config_path=smk.output.config,
    log_path=smk.log[0],
    threads=int(smk.threads),
    resources=smk.resources,
    accelerate_dir=smk.params.accelerate_dir,  # common.smk's ACCELERATE_DIR
    rule=smk.rule,
)
