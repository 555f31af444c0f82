"""One training job of the workflow (rule train): the run's config written to its train.yaml and ``d3s train``
run, in this process on the CPU, or under accelerate on GPUs of its own with its vLLM server in server mode
(docs/gpu/launch.md, "How a training job starts")."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from d3s.launch import TrainLaunch
from d3s.orchestration.gpu_slots import gpu_job, granted_gpus, job_gpus
from d3s.orchestration.processes import process_group, training_env
from d3s.orchestration.run_config import build_run_config, prepare_training_job, train_launch, write_yaml
from d3s.orchestration.vllm_server import vllm_server
from d3s.ports import LOCALHOST
from d3s.provenance.config_change import describe
from d3s.runs.config import coerce_run_config
from d3s.runs.resume import config_differences, supersede_run
from d3s.vllm_engine import keep_vllm_out_of_this_process


def run_workflow_training_job(
    *,
    name: str,
    variant: Mapping[str, Any],
    seed: int,
    model: str,
    train_cfg: Mapping[str, Any],
    task: Mapping[str, Any],
    config_path: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    threads: int,
    resources: Any,
    accelerate_dir: str | os.PathLike[str],
    rule: str = "train",
) -> None:
    """Train run ``name`` (a method, or a study's ``variant`` of one: {"method", "trainer"}) with ``seed``
    into the folder of ``config_path`` (its train.yaml), on the GPUs Snakemake granted (``resources``)."""
    run_dir = Path(config_path).parent
    granted = granted_gpus(resources, job_gpus(train_cfg.get("resources")), "train")
    launch = train_launch(train_cfg, Path(accelerate_dir), gpus=granted)
    # parsed once here, the job's boundary: compared, written to train.yaml and (on the CPU) trained as parsed
    config = coerce_run_config(
        build_run_config(
            method=variant["method"],
            seed=seed,
            model=model,
            train_cfg=train_cfg,
            task=task,
            output_dir=run_dir,
            threads=threads,
            processes=launch.processes,
            trainer_overrides=variant["trainer"],
        )
    )
    # A job cut off midway resumes from its last checkpoint (resume: auto); one whose configuration really
    # changed (d3s.provenance.config_change, the one rule) starts over, its old files moved aside, never
    # deleted.
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
    Path(log_path).write_text(restart_reason + "\n" if restart_reason else "")
    if launch.job_gpus == 0:
        write_yaml(config_path, config)
        if not config["trainer"].get("use_vllm"):  # else TRL imports it anyway: 7-9 s of every job on the CPU
            keep_vllm_out_of_this_process()
        from d3s.runs.run import train

        with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            train(config)
        return
    label = f"{rule} {name} seed{seed}"
    with gpu_job(log_path, launch.job_gpus, label, mode="a") as gpu_ids:
        print(f"{label}: GPU(s) {gpu_ids}", flush=True)
        run_training_job(
            config, config_path, launch=launch, gpu_ids=gpu_ids, threads=threads, log_path=log_path
        )


def run_training_job(
    run_config: Mapping[str, Any],
    config_path: str | os.PathLike[str],
    *,
    launch: TrainLaunch,
    gpu_ids: Sequence[str],
    threads: int,
    log_path: str | os.PathLike[str],
    python: str = sys.executable,
) -> None:
    """Run ``d3s train`` under accelerate on ``gpu_ids`` (with its vLLM server in server mode).

    Writes the final run config to ``config_path``. Every process started here is stopped on the way out,
    whether training finished, failed or the job was cancelled (call inside ``signals_raise_system_exit``).
    """
    command, config, server_command = prepare_training_job(
        run_config, config_path, launch=launch, gpu_ids=gpu_ids, threads=threads, python=python
    )
    write_yaml(config_path, config)
    train_ids, server_ids = list(gpu_ids[: launch.train_gpus]), list(gpu_ids[launch.train_gpus :])
    server: contextlib.AbstractContextManager = contextlib.nullcontext()
    if server_command is not None:
        server_log = f"{log_path}.vllm-server.log"
        print(f"starting the vLLM server on GPU(s) {server_ids}: log {server_log}", flush=True)
        server = vllm_server(
            server_command,
            host=LOCALHOST,
            port=int(config["trainer"]["vllm_server_port"]),
            gpu_ids=server_ids,
            log_path=server_log,
            startup_timeout_s=launch.server.startup_timeout_s,
        )
    with server:  # up and answering before training starts
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"GPUs {train_ids}: {' '.join(command)}\n")
        with process_group(command, log_path=log_path, env=training_env(train_ids)) as training:
            code = training.wait()
    if code != 0:
        raise RuntimeError(f"training exited with code {code}; see {log_path}")
