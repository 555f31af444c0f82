"""Snakemake script of rules base_model and base_model_variant: build the tiny model and SFT-warm-start it,
on the CPU, or on a GPU of its own with base_model.resources.gpu: 1 (config/gpu-smoke.yaml); a thin caller of
d3s.orchestration.base_model_job.run_base_model_job."""

from pathlib import Path

from d3s.orchestration.base_model_job import run_base_model_job

smk = snakemake  # noqa: F821 - injected by Snakemake
run_base_model_job(
    Path(smk.output.config).parent,
    smk.params.cfg,
    smk.params.task,
    threads=int(smk.threads),
    resources=smk.resources,
    log_path=smk.log[0],
    label=smk.rule,
)
