"""Build the shared base model of the tiny default: tiny Qwen2 model + SFT warm start, saved to a folder
(called by base_model.py, the script of rule base_model).

The SFT runs on ``device``: the CPU (the tiny default), or CUDA for models built larger through ``model``
(config/gpu-smoke.yaml's ~100M parameters). The weights stay fp32 on either and are saved as such.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def build_base(
    out: Path,
    sft_steps: int,
    sft_problems: int,
    min_ops: int,
    max_ops: int,
    max_operand: int,
    seed: int,
    threads: int,
    model_kwargs: dict,
    learning_rate: float = 3e-3,
    device: str = "cpu",
    bounded: bool = False,
    sft_box_error: tuple[float, float] = (0.0, 0.0),
) -> dict:
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
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    model.to(device)  # initialised on the CPU, so the initial weights are the same on every device
    problems = arithmetic_problems(
        sft_problems,
        seed=1000 + seed,
        min_ops=min_ops,
        max_ops=max_ops,
        max_operand=max_operand,
        bounded=bounded,
    )
    losses = sft_warm_start(
        model,
        tokenizer,
        demonstrations(problems, sft_box_error, seed=seed),
        steps=sft_steps,
        seed=seed,
        learning_rate=learning_rate,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {
        "sft_steps": sft_steps,
        "sft_problems": sft_problems,
        "min_ops": min_ops,
        "max_ops": max_ops,
        "max_operand": max_operand,
        "bounded": bounded,
        "sft_box_error": list(sft_box_error),
        "seed": seed,
        "threads": threads,
        "device": device,
        "learning_rate": learning_rate,
        "model": model_kwargs,
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
