"""The commands a workflow job runs: ``accelerate launch`` of ``d3s train`` and ``trl vllm-serve``."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d3s.orchestration.run_config import VllmServerSettings

# Named accelerate configs (workflow/accelerate/<name>.yaml); ``single_gpu`` replaces ``ddp`` for one process.
ACCELERATE_CONFIGS = ("ddp", "zero2", "zero3", "zero3_offload")
SINGLE_PROCESS_CONFIG = "single_gpu"
DEFAULT_ACCELERATE_CONFIG = "ddp"
LOCALHOST = "127.0.0.1"
# The `trl` console script, run by the given interpreter (no PATH lookup; `-m trl.cli.main` warns).
TRL_CLI = "import sys; from trl.cli import main; sys.exit(main())"
# Runs any workflow/accelerate/ config without a GPU: bf16 needs one; accelerate's --cpu would replace the
# DeepSpeed launcher by one plain process (docs/gpu.md, "How a training job starts").
CPU_OVERRIDES = ("--mixed_precision", "no")


def accelerate_config_path(name: str, config_dir: str | os.PathLike[str]) -> Path:
    """The accelerate YAML of a name in ACCELERATE_CONFIGS (or SINGLE_PROCESS_CONFIG), else of the path
    ``name`` (config/schema.yaml allows only these two forms); ValueError when that file is missing."""
    named = name in ACCELERATE_CONFIGS or name == SINGLE_PROCESS_CONFIG
    path = Path(config_dir) / f"{name}.yaml" if named else Path(name).expanduser()
    if not path.is_file():
        raise ValueError(
            f"train.launch.accelerate_config {name!r}: {path} is not a file; use one of "
            f"{', '.join(ACCELERATE_CONFIGS)} (workflow/accelerate/) or the path of an accelerate YAML file"
        )
    return path


def per_process_threads(threads: int, processes: int) -> int:
    """Each training process's share of a job's CPU threads (at least one)."""
    return max(1, int(threads) // max(1, int(processes)))


def accelerate_command(
    target: Sequence[str],
    *,
    num_processes: int,
    config_file: str | os.PathLike[str],
    main_process_port: int,
    threads_per_process: int,
    module: bool = False,
    cpu: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """``accelerate launch`` of ``target`` (a script and its arguments, or a module with ``module=True``).

    The launcher follows the config file's ``distributed_type`` (workflow/accelerate/: DDP, ZeRO-2, ZeRO-3, or
    one process). ``cpu``: the job has no GPU, so the same config file trains on the CPU (CPU_OVERRIDES).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    command = [python, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if cpu:
        command += list(CPU_OVERRIDES)
    command += ["--num_processes", str(num_processes), "--num_machines", "1"]
    command += ["--main_process_port", str(main_process_port)]
    command += ["--num_cpu_threads_per_process", str(threads_per_process)]
    if module:
        command += ["--module"]
    return command + [str(part) for part in target]


def vllm_serve_command(
    model: str, *, host: str, port: int, settings: VllmServerSettings, python: str = sys.executable
) -> list[str]:
    """``trl vllm-serve`` (TRL 1.16's flags) for ``model`` on ``host:port``."""
    command = [python, "-c", TRL_CLI, "vllm-serve", "--model", str(model)]
    command += ["--host", host, "--port", str(port)]
    flags = ("tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "max_model_len")
    for flag in (*flags, "enable_prefix_caching"):
        value = getattr(settings, flag)
        if value is not None:  # booleans as TRL's parser reads them
            command += [f"--{flag}", str(value).lower() if isinstance(value, bool) else str(value)]
    return command + list(settings.extra_args)


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free right now (jobs sharing a machine each need their own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
