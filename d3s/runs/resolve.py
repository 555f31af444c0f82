"""Resolve a ``d3s train`` config: the trainer's arguments (D3SConfig) with the CPU defaults, the hardware,
vLLM-on-CPU and input checks, the training rows and the run's model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from d3s.runs.config import TinyOptions, check_model_dir, coerce_run_config

# The tiny model's head dim for vLLM on the CPU (d3s.tiny_model.HEADS_BY_HEAD_DIM).
VLLM_CPU_HEAD_DIM = 32
# Trainer defaults of every `d3s train` run (D3SConfig keeps TRL's): a record of every step in
# metrics.jsonl, which the analysis, the resume's log cut and the NaN guard read.
RUN_DEFAULTS: dict[str, Any] = {"logging_steps": 1}
# Trainer defaults that differ from TRL's because they matter on CPU or for reproducibility.
CPU_DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    "save_strategy": "no",
    "bf16": False,
    "gradient_checkpointing": False,
    "beta": 0.0,
    # rows bucketed by length in the log-prob passes: on the tiny default a pass costs half (a third of its
    # positions were padding, and 128-row buckets suit one core's caches); equal up to float rounding
    "length_bucket_rows": 128,
}


def resolve_config(config: dict[str, Any], *, check_hardware: bool = True, check_inputs: bool = True):
    """Check the config and build the D3SConfig; raises ValueError naming the field to change.

    ``check_hardware=False`` lets GPU-only settings pass on a machine without GPUs (the workflow's checks);
    ``check_inputs=False`` skips the model path and training data (workflow/scripts/check_inputs.py has them).
    """
    from d3s.trainer import D3SConfig

    config = coerce_run_config(config)  # once: a parsed RunConfig is returned as is
    method = config.get("method", "grpo")
    use_cpu = not torch.cuda.is_available()
    settings = RUN_DEFAULTS | ({**CPU_DEFAULTS, "use_cpu": use_cpu} if use_cpu else {"report_to": "none"})
    output_dir = str(config.get("output_dir", f"runs/{method}"))
    settings |= {"seed": int(config.get("seed", 0)), "output_dir": output_dir} | (config.get("trainer") or {})
    if check_hardware:
        _check_hardware(settings)
    if check_inputs:
        _check_inputs(config)
    args = D3SConfig.for_method(method, **settings)
    if check_hardware and use_cpu:
        _check_vllm_on_cpu(args, config)
    return args


def _check_hardware(settings: dict[str, Any]) -> None:
    """GPU-only settings on a machine without a GPU fail here, not after the model has loaded."""
    if torch.cuda.is_available():
        return
    wants_gpu = {
        "bf16": "bf16 training needs a GPU here: set trainer.bf16: false",
        "fp16": "fp16 training needs a GPU: set trainer.fp16: false",
    }
    for key, fix in wants_gpu.items():
        if settings.get(key):
            raise ValueError(
                f"trainer.{key} is set but this machine has no CUDA GPU; {fix} (or run on a GPU node)"
            )
    if settings.get("use_cpu") is False:
        raise ValueError("trainer.use_cpu: false asks for a GPU, but this machine has none; remove it")


def _check_vllm_on_cpu(args, config: dict[str, Any]) -> None:
    """vLLM without CUDA: its CPU build in colocate mode (d3s.vllm_engine), and a tiny model whose head dim
    its attention runs."""
    from d3s.vllm_engine import check_vllm_without_cuda

    check_vllm_without_cuda(args)
    tiny = TinyOptions(**(config.get("tiny") or {}))
    if args.use_vllm and str(config.get("model", "tiny")) == "tiny" and tiny.head_dim != VLLM_CPU_HEAD_DIM:
        raise ValueError(
            f"tiny.head_dim is {tiny.head_dim}, which vLLM's CPU attention does not run: set tiny: "
            f"{{head_dim: {VLLM_CPU_HEAD_DIM}}} (or trainer.use_vllm: false)"
        )


def _check_inputs(config: dict[str, Any]) -> None:
    """Model path and training data must exist before any compute is spent."""
    model = str(config.get("model", "tiny"))
    if model != "tiny":
        check_model_dir(model, "model")
    name = (config.get("dataset") or {}).get("name", "synthetic")
    if name != "synthetic":
        from d3s.data.benchmarks import BenchmarkError, load_benchmark

        try:
            load_benchmark(name, config.get("data_dir"), limit=1)
        except BenchmarkError as err:
            raise ValueError(f"dataset.name: {err}") from None


def training_rows(config: dict[str, Any], tokenizer) -> list[dict[str, Any]]:
    dataset = dict(config.get("dataset") or {"name": "synthetic"})
    name = dataset.pop("name", "synthetic")
    if name == "synthetic":
        from d3s.data.synthetic import arithmetic_problems

        problems = arithmetic_problems(
            split="train", seed=int(config.get("seed", 0)), **{"count": 2000} | dataset
        )
        return [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    from d3s.data.benchmarks import load_benchmark
    from d3s.data.templates import build_prompt

    problems = load_benchmark(name, config.get("data_dir"), limit=dataset.get("limit"))
    template = config.get("template", "auto")
    return [
        {"prompt": build_prompt(p.question, template, tokenizer), "answer": list(p.gold)} for p in problems
    ]


def model_init_kwargs(args) -> dict[str, Any]:
    """The trainer's model_init_kwargs (TRL applies them only to a model it loads), dtype as torch's: e.g.
    ``{dtype: float32}`` keeps fp32 master weights, where bf16 weights lose updates as small as lr 1e-6."""
    kwargs = dict(args.model_init_kwargs or {})  # a mapping: the parser reads JSON or YAML text
    if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return kwargs


def load_run_model(config: dict[str, Any], output_dir: Path, model_kwargs: dict[str, Any] | None = None):
    """(model, tokenizer) of a run: loaded from its path, or ``tiny`` built and warm-started by SFT (its
    losses written to ``output_dir``/sft_losses.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s.attention import use_cpu_gqa

    model_name = config.get("model", "tiny")
    if model_name != "tiny":
        model = AutoModelForCausalLM.from_pretrained(model_name, **(model_kwargs or {}))
        return use_cpu_gqa(model), AutoTokenizer.from_pretrained(model_name)
    from d3s.data.synthetic import arithmetic_problems
    from d3s.tiny_model import HEADS_BY_HEAD_DIM, build_model, build_tokenizer, sft_warm_start

    tiny = TinyOptions(**(config.get("tiny") or {}))
    tokenizer = build_tokenizer()
    heads, kv_heads = HEADS_BY_HEAD_DIM[tiny.head_dim]
    model = build_model(tokenizer, num_heads=heads, num_kv_heads=kv_heads, seed=int(config.get("seed", 0)))
    problems = arithmetic_problems(
        tiny.sft_problems, seed=1000, max_ops=tiny.max_ops, max_operand=tiny.max_operand
    )
    losses = sft_warm_start(
        model, tokenizer, [(p.prompt, p.completion) for p in problems], steps=tiny.sft_steps
    )
    (output_dir / "sft_losses.json").write_text(json.dumps(losses))
    return use_cpu_gqa(model), tokenizer
