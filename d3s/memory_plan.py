"""The per-GPU memory plan of a workflow config's training and evaluation jobs (`d3s plan`).

1- and 2-layer traces (d3s.memory_trace) scaled linearly to the layer count, plus formulas for DeepSpeed's
sharding, the reference model, DDP's buckets and vLLM (docs/gpu/memory-plan.md). How the training jobs
run (their GPUs, the vLLM server's, the accelerate config) is the caller's TrainLaunch, the one the workflow
launches with. Traces are cached in d3s/memory_plan_cache.json; ``check_fit`` reads only that cache (no
torch): the parse-time check stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from d3s.architectures import ARCHITECTURES, CONFIG_KEYS, MODEL_ARCHITECTURES
from d3s.launch import TrainLaunch, job_gpus
from d3s.methods import get_method, method_trainer

GIB = 2**30
CACHE_PATH = Path(__file__).with_name("memory_plan_cache.json")
CACHE_VERSION = 1

# train.memory_plan and its defaults
MEMORY_PLAN_DEFAULTS = {
    "check": True,
    "gpu_memory_gib": 79.6,  # an H100 / A100 80 GB as CUDA reports it (81,559 MiB)
    "margin": 0.10,
    "prompt_tokens": 512,  # TRL 1.16 does not truncate prompts: the planned longest prompt of a batch
}
VLLM_ASLEEP_GIB = 1.0  # what a colocated vLLM keeps asleep (level 2): CUDA graphs and context, not weights


class PlanError(ValueError):
    """A config the planner cannot plan, with the setting to change."""


@dataclasses.dataclass
class JobPlan:
    """One job's per-GPU peak (GiB) by component."""

    job: str
    gpus: int
    components: dict[str, float]
    notes: str = ""

    @property
    def peak(self) -> float:
        return sum(self.components.values())


@dataclasses.dataclass
class ConfigPlan:
    experiment: str
    gpu_memory_gib: float
    margin: float
    jobs: list[JobPlan]

    @property
    def limit(self) -> float:
        return self.gpu_memory_gib * (1 - self.margin)

    def too_big(self) -> list[JobPlan]:
        return [job for job in self.jobs if job.peak > self.limit + 1e-9]


# ---- settings ---------------------------------------------------------------------------------------------


def plan_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """train.memory_plan with its defaults (config/schema.yaml refused unknown keys)."""
    return MEMORY_PLAN_DEFAULTS | dict((config.get("train") or {}).get("memory_plan") or {})


def architecture_of(base_model: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture to plan for base_model: a known hub id, or a local directory's config.json."""
    path = str(base_model.get("path") or "")
    if path in MODEL_ARCHITECTURES:
        return ARCHITECTURES[MODEL_ARCHITECTURES[path]]
    config_file = Path(path).expanduser() / "config.json"
    if path and config_file.is_file():
        raw = json.loads(config_file.read_text())
        family = raw.get("model_type")
        if family not in ("qwen2", "llama"):
            raise PlanError(
                f"base_model.path {path}: model_type {family!r} is not planned (qwen2, llama); "
                "set train.memory_plan.check: false to run without a plan"
            )
        defaults = {"tie_word_embeddings": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}
        raw = defaults | {"num_key_value_heads": raw["num_attention_heads"]} | raw
        arch = {"family": family} | {name: raw[key] for name, key in CONFIG_KEYS.items()}
        return arch | {"tied": bool(arch["tied"])}
    raise PlanError(
        f"base_model.path {path!r}: unknown architecture for the memory plan (known: "
        f"{', '.join(sorted(MODEL_ARCHITECTURES))}, or a local directory with config.json); "
        "set train.memory_plan.check: false to run without a plan"
    )


def parameter_count(arch: Mapping[str, Any]) -> int:
    """Parameters of the architecture (Qwen2 has q/k/v biases, Llama none)."""
    h, kv = arch["hidden"], arch["hidden"] // arch["heads"] * arch["kv_heads"]
    attention = h * h * 2 + h * kv * 2 + (h + 2 * kv if arch["family"] == "qwen2" else 0)
    layer = attention + 3 * h * arch["intermediate"] + 2 * h
    embeddings = arch["vocab"] * h * (1 if arch["tied"] else 2)
    return arch["layers"] * layer + embeddings + h


# ---- traces -----------------------------------------------------------------------------------------------


def trace_key(
    arch: Mapping[str, Any], rows: int, prompt: int, completion: int, precision: str, kl: bool
) -> str:
    dims = ",".join(f"{k}={arch[k]}" for k in sorted(arch) if k != "layers")
    geometry = f"rows={rows}|prompt={prompt}|completion={completion}"
    return f"v{CACHE_VERSION}|{dims}|{geometry}|{precision}|kl={int(kl)}"


def read_cache(path: Path = CACHE_PATH) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def layer_traces(
    arch: Mapping[str, Any],
    rows: int,
    prompt: int,
    completion: int,
    precision: str,
    kl: bool,
    *,
    cache: dict[str, Any],
    trace: bool = True,
) -> dict[str, dict[str, int]] | None:
    """The 1- and 2-layer traces of a geometry: from ``cache``, else traced (and cached) when ``trace``."""
    key = trace_key(arch, rows, prompt, completion, precision, kl)
    if key in cache:
        return cache[key]
    if not trace:
        return None
    from d3s.memory_trace import trace_step

    geometry = dict(rows=rows, prompt_tokens=prompt, completion_tokens=completion, precision=precision, kl=kl)
    cache[key] = {str(n): trace_step(dict(arch), layers=n, **geometry) for n in (1, 2)}
    return cache[key]


def scale_to_layers(traces: Mapping[str, Mapping[str, int]], layers: int) -> dict[str, float]:
    """Every category at ``layers`` layers, linear from the 1- and 2-layer traces."""
    one, two = traces["1"], traces["2"]
    return {name: one[name] + (layers - 1) * (two[name] - one[name]) for name in one}


def write_cache(cache: Mapping[str, Any], path: Path = CACHE_PATH) -> None:
    path.write_text(json.dumps(dict(sorted(cache.items())), indent=1) + "\n")


# ---- plans ------------------------------------------------------------------------------------------------


def kept_rows(method: str, trainer: Mapping[str, Any], deepspeed: bool = False) -> int:
    """Rows of the largest micro-batch of the update: a selection method's kept rows (at its largest N), of
    TRL's micro-batch, or of a packed one (d3s/packing.py: the kept rows of an optimizer step's
    gradient_accumulation_steps micro-batches in ceil(rows / per_device_train_batch_size) near-equal ones)."""
    micro = int(trainer.get("per_device_train_batch_size", 8))
    generations = int(trainer.get("num_generations", 8))
    # the registry's N is G for a method that keeps every rollout (sample_rule none)
    keep = trainer.get("keep_per_prompt") or max(get_method(method).keep_per_prompt(generations))
    rows = max(1, int(keep) * micro // generations)
    accumulation = int(trainer.get("gradient_accumulation_steps", 1))
    steps_per_generation = trainer.get("steps_per_generation")
    packs = (
        trainer.get("pack_micro_batches") is not False
        and trainer.get("token_scope", get_method(method).token_scope) != "micro_batch"
        and not deepspeed  # packing is off under DeepSpeed (docs/fidelity/trainer.md)
        and (steps_per_generation is None or int(steps_per_generation) % accumulation == 0)
    )
    if not packs or accumulation == 1:
        return rows
    window = rows * accumulation
    return math.ceil(window / math.ceil(window / micro))


def plan_training(
    config: Mapping[str, Any],
    method: str,
    arch: Mapping[str, Any],
    settings: Mapping[str, Any],
    launch: TrainLaunch,
    *,
    cache: dict[str, Any],
    trace: bool,
) -> JobPlan | None:
    """The per-GPU peak of one training step of ``method`` on the training GPUs of ``launch`` (None: not in
    the cache and ``trace`` is off)."""
    trainer = method_trainer(config["train"], method)
    stage, offload = launch.zero_stage()
    processes = launch.processes  # the vLLM server's GPUs (server mode) train nothing
    rows = kept_rows(method, trainer, deepspeed=stage > 0)
    completion = int(trainer.get("max_completion_length", 512))
    prompt = int(settings["prompt_tokens"])
    kl = float(trainer.get("beta", 0.0)) != 0.0
    precision = "bf16" if stage else "amp"
    traces = layer_traces(arch, rows, prompt, completion, precision, kl, cache=cache, trace=trace)
    if traces is None:
        return None
    traced = scale_to_layers(traces, arch["layers"])
    psi = parameter_count(arch)
    activations = sum(traced[k] for k in ("Activation", "Temp", "Buffer", "Other")) / GIB
    if stage == 0:
        weights, grads, optimizer = (traced[name] / GIB for name in ("Parameter", "Gradient", "Optstate"))
        reference = 4 * psi / GIB if kl else 0.0  # TRL loads the reference with model_init_kwargs: fp32 here
        buffers = 4 * psi / GIB if processes > 1 else 0.0  # DDP's gradient buckets (not bucket views)
    else:
        # DeepSpeed's bf16 engine: bf16 weights; ZeRO-2 shards gradients and optimizer state, ZeRO-3 all
        weights = 2 * psi / (processes if stage == 3 else 1) / GIB
        grads = 2 * psi / processes / GIB
        # fp32 master weights + Adam's two moments; offloaded, they live in host memory
        optimizer = 0.0 if offload else 12 * psi / processes / GIB
        reference = (2 * psi / (processes if stage == 3 else 1) / GIB) if kl else 0.0  # bf16, ZeRO-3 sharded
        embedding = arch["vocab"] * arch["hidden"]
        layer = (psi - embedding * (1 if arch["tied"] else 2)) / arch["layers"]
        # ZeRO-3 gathers a module's full bf16 weights for its use, prefetching the next (the head is largest)
        buffers = (2 * (embedding + 2 * layer) / GIB) if stage == 3 else 2 * 2 * arch["hidden"] ** 2 / GIB
    components = {
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations,
        "reference": reference,
        "engine buffers": buffers,
    }
    vllm_note = ""
    if trainer.get("use_vllm") and trainer.get("vllm_mode", "colocate") == "colocate":
        share = float(trainer.get("vllm_gpu_memory_utilization", 0.3)) * float(settings["gpu_memory_gib"])
        asleep = bool(trainer.get("vllm_enable_sleep_mode"))
        update_vllm = VLLM_ASLEEP_GIB if asleep else share
        # Generation: vLLM's share beside the weights, optimizer state and reference (gradients freed)
        generation_peak = weights + optimizer + reference + buffers + share
        update_peak = sum(components.values()) + update_vllm
        components["vLLM"] = update_vllm
        vllm_note = f"vLLM {share:.1f} GiB while generating (peak then {generation_peak:.1f})"
        if generation_peak > update_peak:
            components |= {"gradients": 0.0, "activations": 0.0, "vLLM": share}
            vllm_note = f"generation phase (update phase {update_peak:.1f} GiB)"
    engine = f"ZeRO-{stage}" if stage else "fp32 + bf16 autocast"
    engine += ", optimizer on CPU" if offload else ""
    label = f"train {method}: {rows} rows x ({prompt} + {completion}) tokens, {processes} x {engine}"
    return JobPlan(label, launch.job_gpus, components, vllm_note)


def plan_evaluation(
    config: Mapping[str, Any], arch: Mapping[str, Any], settings: Mapping[str, Any]
) -> JobPlan:
    """vLLM reserves gpu_memory_utilization of each GPU: weights (bf16) plus the KV cache it fills."""
    ev = config["eval"]
    gpus = max(1, job_gpus(ev.get("resources")))
    tp = int(ev.get("tensor_parallel_size") or gpus)
    share = float(ev.get("gpu_memory_utilization", 0.9)) * float(settings["gpu_memory_gib"])
    weights = 2 * parameter_count(arch) / tp / GIB
    head_dim = arch["hidden"] // arch["heads"]
    kv_per_token = 2 * arch["layers"] * arch["kv_heads"] * head_dim * 2 / tp  # K and V, bf16
    max_len = int(ev.get("max_model_len") or arch["max_positions"])
    kv_one = kv_per_token * max_len / GIB
    if weights + kv_one > share:
        raise PlanError(
            f"eval: the bf16 weights ({weights:.1f} GiB) and one {max_len}-token sequence's KV cache "
            f"({kv_one:.1f} GiB) exceed eval.gpu_memory_utilization x GPU = {share:.1f} GiB: raise "
            "eval.gpu_memory_utilization or eval.resources.gpu"
        )
    sequences = (share - weights) / kv_one
    return JobPlan(
        f"eval: vLLM, tensor parallel {tp}",
        gpus,
        {"weights": weights, "KV cache and vLLM": share - weights},
        f"KV cache for about {sequences:.0f} sequences of {max_len} tokens",
    )


def plan_config(
    config: Mapping[str, Any],
    launch: TrainLaunch,
    *,
    trace: bool = True,
    cache: dict[str, Any] | None = None,
) -> ConfigPlan | None:
    """Every training job's and the evaluation job's plan, the training jobs on the GPUs, processes and
    accelerate config of ``launch`` (run_config.train_launch of ``config``: the plan recomputes none of them);
    None for a CPU config (no GPUs asked for), or when ``trace`` is off and a geometry is not cached."""
    settings = plan_settings(config)
    if launch.job_gpus == 0:
        return None
    arch = architecture_of(config["base_model"])
    cache = read_cache() if cache is None else cache
    jobs: dict[str, JobPlan] = {}
    for method in config["methods"]:
        job = plan_training(config, method, arch, settings, launch, cache=cache, trace=trace)
        if job is None:
            return None
        geometry = job.job.split(":", 1)[1]
        if geometry in jobs:  # methods whose largest micro-batch is the same (GRPO, and D3S at N = G)
            jobs[geometry].job = jobs[geometry].job.replace(":", f", {method}:", 1)
        else:
            jobs[geometry] = job
    jobs = list(jobs.values())
    if job_gpus(config["eval"].get("resources")) > 0:
        jobs.append(plan_evaluation(config, arch, settings))
    return ConfigPlan(
        str(config["experiment"]), float(settings["gpu_memory_gib"]), float(settings["margin"]), jobs
    )


def setting_to_change(job: JobPlan) -> str:
    """The one setting that moves the largest component of a job that does not fit."""
    largest = max(job.components, key=job.components.get)
    if job.job.startswith("eval"):
        return "eval.gpu_memory_utilization"
    return {
        "activations": "trainer.max_completion_length or trainer.per_device_train_batch_size",
        "vLLM": "trainer.vllm_gpu_memory_utilization",
        "reference": "trainer.beta (0 drops the reference model) or train.launch.accelerate_config: zero3",
    }.get(largest, "train.launch.accelerate_config (zero3, or offload_optimizer_device: cpu)")


def check_fit(config: Mapping[str, Any], launch: TrainLaunch) -> str | None:
    """One line naming the setting to change when the cached plan of ``config``, trained as ``launch`` says,
    does not fit; None when it fits, when the config asks for no GPUs, when the check is off, when the model's
    architecture is not one the planner knows, or when no cached trace covers it (no tracing here)."""
    # a base model built in code (gpu-smoke) is small, and not an architecture the planner knows
    if not plan_settings(config)["check"] or config["base_model"].get("kind") != "path":
        return None
    try:
        plan = plan_config(config, launch, trace=False)
    except PlanError:
        return None  # an architecture the planner does not know: `d3s plan` says so; the run is not refused
    over = plan.too_big() if plan is not None else []
    if not over:
        return None
    job = max(over, key=lambda j: j.peak)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in job.components.items() if v >= 0.05)
    return (
        f"train.memory_plan: {job.job} needs {job.peak:.1f} GiB per GPU ({parts}), over the "
        f"{plan.limit:.1f} GiB of a {plan.gpu_memory_gib:g} GiB GPU with a {plan.margin:.0%} margin: lower "
        f"{setting_to_change(job)} (d3s plan --config shows the plan; "
        "train.memory_plan.check: false runs anyway)"
    )


def format_plan(plan: ConfigPlan) -> str:
    """The plan as a Markdown table."""
    fixed = ["weights", "gradients", "optimizer", "activations", "reference", "engine buffers", "vLLM"]
    names = list(dict.fromkeys(fixed + [n for job in plan.jobs for n in job.components]))
    columns = ["job", "GPUs", *names, "peak", "margin", "fits", "note"]
    lines = [
        f"{plan.experiment}: per-GPU peak (GiB), GPU {plan.gpu_memory_gib:g} GiB, "
        f"limit {plan.limit:.1f} GiB ({plan.margin:.0%} margin)",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for job in plan.jobs:
        cells = [f"{job.components[n]:.1f}" if n in job.components else "" for n in names]
        margin = 1 - job.peak / plan.gpu_memory_gib
        fits = "yes" if job.peak <= plan.limit + 1e-9 else "**no**"
        row = [job.job, str(job.gpus), *cells, f"{job.peak:.1f}", f"{margin:.0%}", fits, job.notes]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
