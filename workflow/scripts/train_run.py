"""Snakemake script of rule train: write the run's `d3s train` config (train.yaml) and run it.

A job without GPUs trains in this process (the CPU default). A job with `resources.gpu` gets that many
GPUs (d3s.orchestration.gpu_slots.assign_gpus: exclusive on a shared machine, the allocation's own under Slurm) and runs
`d3s train` under `accelerate launch`, one process per training GPU, with `trl vllm-serve` on the
remaining GPUs in vLLM server mode.
"""

import contextlib
import os
from pathlib import Path

from d3s.orchestration.gpu_slots import assign_gpus, job_gpus
from d3s.orchestration.processes import signals_raise_system_exit
from d3s.orchestration.run_config import build_run_config, train_launch, write_yaml
from d3s.orchestration.training_job import run_training_job
from d3s.provenance.config_change import describe
from d3s.runs.config import coerce_run_config
from d3s.runs.run import config_differences, supersede_run

smk = snakemake  # noqa: F821 - injected by Snakemake
method, seed = smk.wildcards.method, int(smk.wildcards.seed)
train_cfg = smk.params.train
run_dir = Path(smk.output.config).parent
# workflow/accelerate/ (Snakemake points __file__ at the script itself)
accelerate_dir = Path(__file__).resolve().parents[1] / "accelerate"
# Snakemake scales a job's gpu down to --resources gpu=N (the default profile: the GPUs it sees).
granted = int(getattr(smk.resources, "gpu", 0) or 0)
declared = job_gpus(train_cfg.get("resources"))
if declared and not granted:
    raise SystemExit(
        f"train.resources.gpu = {declared}, but Snakemake gave this job no GPU (none visible to the profile, or "
        "--resources gpu=0): run on a GPU machine (docs/gpu.md)"
    )
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
        processes=max(1, launch.train_gpus),
    )
)
run_dir.mkdir(parents=True, exist_ok=True)
# A job cut off midway resumes from its last checkpoint (d3s train, resume: auto, which also restores the logs).
# A job rerun because its configuration really changed starts over: the old run's checkpoints and logs are moved
# aside with the reason, never deleted. `config` holds the per-process thread count, as resolved_config.yaml
# does, and per-attempt values never count (d3s.provenance.config_change, the one rule).
restart_reason = None
changes = config_differences(run_dir, config)
if changes:
    metrics_log = config["trainer"].get("metrics_log", "metrics.jsonl")
    reason = f"configuration changed: {describe(changes)}"
    moved = supersede_run(run_dir, reason, label="config-changed", metrics_log=metrics_log)
    restart_reason = f"configuration changed ({', '.join(changes)}): starting over" + (
        f"; the previous run's files are in {moved}" if moved else ""
    )
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if launch.job_gpus == 0:
    write_yaml(smk.output.config, config)
    from d3s.runs.run import train

    with open(smk.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        if restart_reason:
            print(restart_reason, flush=True)
        train(config)
else:
    Path(smk.log[0]).write_text("")  # the training processes append to the same log
    label = f"{smk.rule} {method} seed{seed}"
    with (
        open(smk.log[0], "a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
        signals_raise_system_exit(),
        assign_gpus(launch.job_gpus, label=label) as gpu_ids,
    ):
        print(f"{label}: GPU(s) {gpu_ids}", flush=True)
        if restart_reason:
            print(restart_reason, flush=True)
        run_training_job(
            config,
            smk.output.config,
            launch=launch,
            gpu_ids=gpu_ids,
            threads=int(smk.threads),
            log_path=smk.log[0],
        )
