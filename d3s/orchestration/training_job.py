"""One training job: ``d3s train`` under accelerate on its GPUs, with its vLLM server in server mode."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from d3s.launch import TrainLaunch
from d3s.orchestration.processes import process_group, training_env
from d3s.orchestration.run_config import prepare_training_job, write_yaml
from d3s.orchestration.vllm_server import vllm_server
from d3s.ports import LOCALHOST


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
