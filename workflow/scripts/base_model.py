"""Snakemake script of rule base_model: build the tiny model and SFT-warm-start it (build_base.py), on the
CPU, or on a GPU of its own with base_model.resources.gpu: 1 (config/gpu-smoke.yaml)."""

import os
from pathlib import Path

# build_base.py beside this script: Snakemake's preamble puts a local script's folder on sys.path
from build_base import build_base

from d3s.orchestration.gpu_slots import gpu_job, granted_gpus, job_gpus

smk = snakemake  # noqa: F821 - injected by Snakemake
declared = job_gpus(smk.params.cfg.get("resources"))
if declared > 1:
    raise SystemExit(f"base_model.resources.gpu = {declared}: the SFT warm start uses one GPU; set it to 1")
granted = granted_gpus(smk.resources, declared, "base_model")
with gpu_job(smk.log[0], granted, smk.rule) as gpu_ids:
    if granted:  # before torch touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        print(f"GPU(s) {gpu_ids}", flush=True)
    device = "cuda" if granted else "cpu"
    print(
        build_base(Path(smk.output.config).parent, smk.params.cfg, smk.params.task, int(smk.threads), device)
    )
