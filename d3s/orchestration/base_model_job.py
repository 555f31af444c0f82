"""The shared base model of the tiny default: a tiny Qwen2 model built in code and SFT-warm-started, on the
CPU or (models built larger, as the GPU smoke config does) on CUDA; fp32 weights either way; and the
workflow's job that builds it (rules base_model and base_model_variant)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from d3s.orchestration.gpu_slots import gpu_job, granted_gpus, job_gpus
from d3s.variants import TASK_KEYS


def build_base(
    out: Path, cfg: Mapping[str, Any], task: Mapping[str, Any], threads: int, device: str = "cpu"
) -> dict:
    """Build, warm-start and save the model of ``cfg`` (the base_model section, with the schema's defaults) on
    the synthetic ``task`` (its keys replaced by ``cfg["sft_task"]``'s where it has any); returns
    the summary written to ``out``/base_summary.json."""
    from d3s.data.synthetic import arithmetic_problems, demonstrations
    from d3s.tiny_model import build_model, build_tokenizer, sft_warm_start

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"base model: device {device} asked for (base_model.resources.gpu), but torch sees no CUDA GPU "
            f"(torch {torch.__version__}): install the CUDA build of torch (D3S_GPU=1 scripts/setup.sh) or "
            "remove base_model.resources.gpu"
        )
    torch.set_num_threads(threads)
    start = time.perf_counter()
    seed, box_error = int(cfg["seed"]), tuple(float(v) for v in cfg["sft_box_error"])
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, **cfg["model"])
    model.to(device)  # initialised on the CPU, so the initial weights are the same on every device
    # the SFT's task: the RL task's, with base_model.sft_task's keys on top (a base model may know problems
    # that training holds out: the generalization study)
    sft_task = dict(task) | dict(cfg.get("sft_task") or {})
    options = {key: sft_task[key] for key in TASK_KEYS}
    problems = arithmetic_problems(cfg["sft_problems"], seed=1000 + seed, **options)
    losses = sft_warm_start(
        model,
        tokenizer,
        demonstrations(problems, box_error, seed=seed),
        steps=cfg["sft_steps"],
        seed=seed,
        learning_rate=cfg["learning_rate"],
    )
    model.save_pretrained(out)  # makes the folder
    tokenizer.save_pretrained(out)
    settings = ("sft_steps", "sft_problems", "seed", "learning_rate", "model")
    summary = {key: cfg[key] for key in settings} | options | {"sft_box_error": list(box_error)}
    summary |= {
        "threads": threads,
        "device": device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "seconds": time.perf_counter() - start,
        "completion_tokens_mean": sum(
            len(tokenizer(p.completion, add_special_tokens=False)["input_ids"]) + 1 for p in problems
        )
        / len(problems),
    }
    (out / "sft_losses.json").write_text(json.dumps(losses))
    (out / "base_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_base_model_job(
    out: str | os.PathLike[str],
    cfg: Mapping[str, Any],
    task: Mapping[str, Any],
    *,
    threads: int,
    resources: Any,
    log_path: str | os.PathLike[str],
    label: str = "base_model",
) -> None:
    """The workflow's base-model job: build_base into ``out`` on the CPU, or on a GPU of its own when
    ``cfg`` (base_model) declares one and Snakemake granted it (``resources``); output to ``log_path``."""
    declared = job_gpus(cfg.get("resources"))
    if declared > 1:
        raise SystemExit(
            f"base_model.resources.gpu = {declared}: the SFT warm start uses one GPU; set it to 1"
        )
    granted = granted_gpus(resources, declared, "base_model")
    with gpu_job(log_path, granted, label) as gpu_ids:
        if granted:  # before torch touches CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
            print(f"GPU(s) {gpu_ids}", flush=True)
        print(build_base(Path(out), cfg, task, threads, "cuda" if granted else "cpu"))
