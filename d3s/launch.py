"""How a training job runs, as data: its GPUs, its accelerate config, its vLLM server. Built once from the
workflow config (d3s.orchestration.run_config.train_launch); the commands, the job and the memory plan read
it. Below both d3s.orchestration and d3s.memory_plan, and imports neither."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

# The Snakemake Slurm executor plugin's resource names: ``gpu`` -> --gpus, ``cpus_per_gpu`` -> --cpus-per-gpu.
GPU_RESOURCE = "gpu"


def job_gpus(resources: Mapping[str, Any] | None) -> int:
    """The GPU count a job declares (``resources.gpu``; config/schema.yaml types it and refuses ``gpus``)."""
    return int(dict(resources or {}).get(GPU_RESOURCE, 0))


@dataclasses.dataclass(frozen=True)
class VllmServerSettings:
    """``trl vllm-serve`` options (train.launch.vllm_server); the server gets tp x dp GPUs of the job."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    startup_timeout_s: float = 1200.0
    extra_args: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclasses.dataclass(frozen=True)
class TrainLaunch:
    """How one training job runs: its GPUs, the accelerate config, and the vLLM server it starts (if any)."""

    job_gpus: int
    accelerate_config: Path
    server: VllmServerSettings | None = None

    @property
    def train_gpus(self) -> int:
        return self.job_gpus - (self.server.gpus if self.server else 0)

    @property
    def processes(self) -> int:
        """Training processes: one per training GPU, or one on the CPU."""
        return max(1, self.train_gpus)

    def zero_stage(self) -> tuple[int, bool]:
        """(ZeRO stage, optimizer offloaded to the CPU) of the accelerate config; stage 0: no DeepSpeed."""
        data = yaml.safe_load(Path(self.accelerate_config).read_text()) or {}
        if data.get("distributed_type") != "DEEPSPEED":
            return 0, False
        deepspeed = dict(data.get("deepspeed_config") or {})
        return int(deepspeed.get("zero_stage", 2)), deepspeed.get("offload_optimizer_device", "none") == "cpu"
