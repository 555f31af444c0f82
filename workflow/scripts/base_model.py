"""Snakemake script of rule base_model: build the tiny model and SFT-warm-start it (see build_base.py).

On the CPU by default. With base_model.resources.gpu: 1 (config/gpu-smoke.yaml) the job takes a GPU of its
own, as training and evaluation jobs do (d3s.orchestration.gpu_slots.assign_gpus: a lock on a shared machine, the
allocation's GPU under Slurm), and the SFT runs there.
"""

import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_base import build_base  # noqa: E402

from d3s.orchestration.gpu_slots import assign_gpus, job_gpus
from d3s.orchestration.processes import signals_raise_system_exit  # noqa: E402

smk = snakemake  # noqa: F821 - injected by Snakemake
cfg, task = smk.params.cfg, smk.params.task
declared = job_gpus(cfg.get("resources"), "base_model")
if declared > 1:
    raise SystemExit(f"base_model.resources.gpu = {declared}: the SFT warm start uses one GPU; set it to 1")
# Snakemake scales a job's gpu down to --resources gpu=N (the default profile: the GPUs it sees).
granted = int(getattr(smk.resources, "gpu", 0) or 0)
if declared and not granted:
    raise SystemExit(
        f"base_model.resources.gpu = {declared}, but Snakemake gave this job no GPU (none visible to the "
        "profile, or --resources gpu=0): run on a GPU machine (docs/gpu.md)"
    )
with (
    open(smk.log[0], "w") as log,
    contextlib.redirect_stdout(log),
    contextlib.redirect_stderr(log),
    signals_raise_system_exit(),
    assign_gpus(granted, label=f"{smk.rule}") as gpu_ids,
):
    if granted:  # before torch touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        print(f"GPU(s) {gpu_ids}", flush=True)
    summary = build_base(
        Path(smk.output.config).parent,
        sft_steps=int(cfg.get("sft_steps", 800)),
        sft_problems=int(cfg.get("sft_problems", 4000)),
        min_ops=int(task["min_ops"]),
        max_ops=int(task["max_ops"]),
        max_operand=int(task["max_operand"]),
        seed=int(cfg.get("seed", 0)),
        threads=int(smk.threads),
        model_kwargs=dict(cfg.get("model") or {}),
        learning_rate=float(cfg.get("learning_rate", 3e-3)),
        device="cuda" if granted else "cpu",
        bounded=bool(task.get("bounded", False)),
        sft_box_error=tuple(float(v) for v in cfg.get("sft_box_error", (0.0, 0.0))),
    )
    print(summary)
