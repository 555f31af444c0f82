"""Snakemake script of rule train: write the run's `d3s train` config (train.yaml) and run it, in this process
on the CPU, or under `accelerate launch` on GPUs of its own (docs/gpu.md, "How a training job starts")."""

import contextlib
import os
from pathlib import Path

from d3s.orchestration.gpu_slots import gpu_job, granted_gpus, job_gpus
from d3s.orchestration.run_config import build_run_config, train_launch, write_yaml
from d3s.orchestration.training_job import run_training_job
from d3s.provenance.config_change import describe
from d3s.runs.config import coerce_run_config
from d3s.runs.resume import config_differences, supersede_run
from d3s.vllm_engine import keep_vllm_out_of_this_process

smk = snakemake  # noqa: F821 - injected by Snakemake
name, seed = smk.wildcards.method, int(smk.wildcards.seed)  # a method, or a study's variant of one
method, trainer_overrides = smk.params.variant["method"], smk.params.variant["trainer"]
train_cfg = smk.params.train
run_dir = Path(smk.output.config).parent
accelerate_dir = smk.params.accelerate_dir  # common.smk's ACCELERATE_DIR
granted = granted_gpus(smk.resources, job_gpus(train_cfg.get("resources")), "train")
launch = train_launch(train_cfg, accelerate_dir, gpus=granted)
# parsed once here, the job's boundary: compared, written to train.yaml and (on the CPU) trained as parsed
config = coerce_run_config(
    build_run_config(
        method=method,
        seed=seed,
        model=smk.params.model,
        train_cfg=train_cfg,
        task=smk.params.task,
        output_dir=run_dir,
        threads=int(smk.threads),
        processes=launch.processes,
        trainer_overrides=trainer_overrides,
    )
)
# A job cut off midway resumes from its last checkpoint (resume: auto); one whose configuration really changed
# (d3s.provenance.config_change, the one rule) starts over, its old files moved aside, never deleted.
restart_reason = ""
changes = config_differences(run_dir, config)
if changes:
    metrics_log = config["trainer"].get("metrics_log", "metrics.jsonl")
    reason = f"configuration changed: {describe(changes)}"
    moved = supersede_run(run_dir, reason, label="config-changed", metrics_log=metrics_log)
    restart_reason = f"configuration changed ({', '.join(changes)}): starting over" + (
        f"; the previous run's files are in {moved}" if moved else ""
    )
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A fresh log, opened for appending below: on GPUs the training processes append to it too.
Path(smk.log[0]).write_text(restart_reason + "\n" if restart_reason else "")

if launch.job_gpus == 0:
    write_yaml(smk.output.config, config)
    if not config["trainer"].get("use_vllm"):  # else TRL imports it anyway: 7-9 s of every job on the CPU
        keep_vllm_out_of_this_process()
    from d3s.runs.run import train

    with open(smk.log[0], "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train(config)
else:
    label = f"{smk.rule} {name} seed{seed}"
    with gpu_job(smk.log[0], launch.job_gpus, label, mode="a") as gpu_ids:
        print(f"{label}: GPU(s) {gpu_ids}", flush=True)
        run_training_job(
            config,
            smk.output.config,
            launch=launch,
            gpu_ids=gpu_ids,
            threads=int(smk.threads),
            log_path=smk.log[0],
        )
