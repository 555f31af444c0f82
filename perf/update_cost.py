"""One policy update as training runs it: GRPO (G = 32, every rollout) against D3S (N of 32, K of tokens).

    .venv/bin/python perf/update_cost.py --device cuda   # Qwen2.5-Math-1.5B architecture, paper geometry
    .venv/bin/python perf/update_cost.py                 # CPU: tiny model + a small Qwen2 (~25 min, 2 cores)
    .venv/bin/python perf/update_cost.py --quick         # CPU smoke run (the test suite runs it)
    bash scripts/device_update_cost.sh                   # one lent GPU: micro-batches 32 and 8, --profile

Variants (GRPO; D3S in TRL's micro-batches; D3S packed, d3s/packing.py), models, peak memory, --profile and
the truncation table (``update_cost_truncation.*``): perf/README.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _common import (
    base_parser,
    build_tiny_trainer,
    fmt_seconds,
    markdown_table,
    parse_args,
    prepare_tiny_model,
    set_threads,
    write_results,
)
from transformers import AutoTokenizer

G, KEEP, TOKEN_RATIO = 32, 8, 0.05
PROMPT_TOKENS = 256
QWEN_VOCAB = 151_936
# Qwen2.5-Math-1.5B (config.json of the released model); random weights, nothing downloaded.
QWEN_1_5B = dict(
    vocab_size=QWEN_VOCAB,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# The CPU stand-in: Qwen2.5's vocabulary (the LM head of the real model) on a small body.
QWEN_SMALL = QWEN_1_5B | dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4
)
D3S_OVERRIDES = {"keep_per_prompt": KEEP, "token_keep_ratio": TOKEN_RATIO, "schedule": "constant"}
KEPT_HEAD, MASKED_HEAD = {"kept_token_logprobs": True}, {"kept_token_logprobs": False}
VARIANTS = {  # name -> (method, trainer overrides, rows it trains on)
    "grpo": ("grpo", {}, "all"),
    # TRL's micro-batches: D3S's kept rows in as many micro-batches as GRPO's rows, N/G as large
    "d3s": ("d3s", D3S_OVERRIDES | KEPT_HEAD | {"pack_micro_batches": False}, "kept"),
    # d3s/packing.py: an optimizer step's kept rows in ceil(rows / per_device_train_batch_size) micro-batches
    "d3s (packed)": ("d3s", D3S_OVERRIDES | KEPT_HEAD | {"pack_micro_batches": True}, "kept"),
    "d3s (masked head)": ("d3s", D3S_OVERRIDES | MASKED_HEAD | {"pack_micro_batches": False}, "kept"),
}
# device -> (random model, label, prompt tokens, geometries: prompts x G rollouts, completion tokens). CUDA:
# the H100 figures' geometries (../shared/docs/gpu-device-notes.md); CPU: short prompts, as the LM head
# (152k rows) costs seconds on a CPU.
CUDA_GEOMETRIES = [(1, 1024), (4, 1024), (8, 1024), (4, 3072)]
RANDOM_MODELS = {
    "cuda": (QWEN_1_5B, "Qwen2.5-Math-1.5B architecture", PROMPT_TOKENS, CUDA_GEOMETRIES),
    "cpu": (QWEN_SMALL, "small Qwen2, Qwen vocabulary", 32, [(1, 64), (2, 64)]),
}


def make_trainer(
    variant: str,
    model: Path | Any,
    out: Path,
    micro_batch: int,
    rows: int,
    device: str = "cpu",
    weights: str = "fp32",
    checkpointing: bool = True,
    max_completion_length: int = 64,
) -> Any:
    """A D3STrainer for ``variant`` set up as ``Trainer.train`` does (checkpointing, optimizer), accumulating
    ``rows`` (GRPO's rollouts per optimizer step) in micro-batches of ``micro_batch`` rows."""
    if rows % micro_batch:
        raise ValueError(f"rollouts per step ({rows}) must be a multiple of the micro-batch ({micro_batch})")
    method, overrides, _ = VARIANTS[variant]
    settings: dict[str, Any] = {
        "num_generations": G,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": rows // micro_batch,
        "gradient_checkpointing": checkpointing,
        "max_completion_length": max_completion_length,
    }
    if device == "cuda":
        settings |= {"bf16": True, "use_cpu": False}
    trainer = build_tiny_trainer(method, model, out / variant.replace(" ", "_"), 1, **settings, **overrides)
    if weights == "bf16":
        trainer.model.to(torch.bfloat16)
    if checkpointing:  # as Trainer._inner_training_loop turns it on (no every_n_layers or offload here)
        kwargs = trainer.args.gradient_checkpointing_kwargs
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs or {}) or None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    trainer.create_optimizer()
    return trainer


def micro_batches(trainer: Any, batch: dict, split: bool = True) -> list[dict]:
    """The micro-batches the update runs, with a forward and a backward each: TRL's split of the step's batch
    into ``steps_per_generation`` parts (``split``; as ``_prepare_inputs`` splits it, without its shuffle,
    which timing does not depend on), packed as the trainer packs them (``trainer.packs_micro_batches``, its
    empty slots left out: no forward, no backward), or the whole batch in one pass."""
    from trl.trainer.utils import split_tensor_dict

    from d3s.packing import is_empty, pack_generation_batch

    if not split:
        return [batch]
    parts = split_tensor_dict(batch, trainer.args.steps_per_generation)
    if trainer.packs_micro_batches:
        args = trainer.args
        parts = pack_generation_batch(
            parts,
            args.gradient_accumulation_steps,
            args.per_device_train_batch_size,
            trainer._unpacked_row_scale,
        )
    return [part for part in parts if not is_empty(part)]


def accumulate_gradient(trainer: Any, batch: dict, split: bool = True) -> None:
    """Backward of the step's loss, micro-batch by micro-batch (``micro_batches``); then the step's metrics
    closed, as the training loop closes them after an optimizer step's last micro-batch."""
    from d3s.packing import rows_of

    trainer.model.train()
    if "token_mask" not in batch and trainer.args.token_rule != "none":
        # chosen once per generation batch, before the update: the warm-up call adds it, timed calls reuse it
        batch["token_mask"] = token_mask(trainer, batch)
    tokens_before = trainer.update_tokens_total
    parts = micro_batches(trainer, batch, split)
    for part in parts:
        with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(trainer.model, part)
        trainer.accelerator.backward(loss)
    trainer._close_step_metrics()  # update_tokens_total grows here, once per optimizer step
    # log-probs that reached the gradient, and the rows of each forward pass
    trainer.trained_tokens = trainer.update_tokens_total - tokens_before
    trainer.micro_batch_rows = [rows_of(part) for part in parts]


def token_mask(trainer: Any, batch: dict) -> torch.Tensor:
    """The batch's token mask as the trainer chooses it: d3s.selection on a no-gradient pass's entropies."""
    from d3s.selection import token_keep_mask, token_scores

    scores = token_scores(batch["advantages"], token_entropies(trainer, batch), trainer.args.token_rule)
    ratio = trainer.selection_schedule.token_keep_ratio(0.0)
    return token_keep_mask(scores, batch["completion_mask"].bool(), ratio, trainer.args.token_scope)


def update(trainer: Any, batch: dict) -> None:
    """One optimizer step: the micro-batches' backward passes, clipping, AdamW."""
    trainer.optimizer.zero_grad(set_to_none=True)
    accumulate_gradient(trainer, batch)
    if trainer.args.max_grad_norm:
        trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generated_batch(model_dir: Path, out: Path, prompts: int) -> tuple[dict, Any]:
    """Generate, grade and score prompts x G rollouts (<= 64 tokens) with the tiny model; also return it."""
    geometry = dict(num_generations=G, per_device_train_batch_size=prompts * G, max_completion_length=64)
    trainer = build_tiny_trainer("grpo", model_dir, out / "generate", 1, **geometry)
    trainer.model.train()
    rows = [trainer.train_dataset[i] for i in range(prompts) for _ in range(G)]
    full = trainer._generate_and_score_completions(rows)
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}, trainer


def kept_rows(full: dict, keep: int = KEEP) -> dict:
    """D3S's cross-group max-variance selection of ``keep`` rollouts per prompt (d3s.selection)."""
    from d3s.selection import select_samples

    advantages, rows = full["advantages"], full["advantages"].shape[0]
    kept = select_samples(advantages.cpu(), advantages.cpu(), G, keep, "max_variance", "batch")
    kept = kept.to(advantages.device)
    kept_batch = {k: (v[kept] if v.dim() and v.shape[0] == rows else v) for k, v in full.items()}
    kept_batch["num_items_in_batch"] = kept_batch["completion_mask"].sum()
    return kept_batch


def random_batch(
    prompts: int, completion_len: int, vocab: int, device: str, prompt_len: int = PROMPT_TOKENS, seed: int = 0
) -> dict:
    """The rollout geometry of a real step with random tokens: every completion ``completion_len`` long, and
    binary rewards (40 % correct) give the advantages (a random model's generations carry no reward)."""
    gen = torch.Generator().manual_seed(seed)
    rows = prompts * G
    rewards = (torch.rand(rows, generator=gen) < 0.4).float().view(-1, G)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    full = {
        "prompt_ids": torch.randint(10, vocab, (rows, prompt_len), generator=gen),
        "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(10, vocab, (rows, completion_len), generator=gen),
        "completion_mask": torch.ones(rows, completion_len, dtype=torch.long),
        "advantages": advantages,
    }
    full["num_items_in_batch"] = full["completion_mask"].sum()
    return {k: v.to(device) for k, v in full.items()}


def qwen_model(dims: dict, tokenizer: Any, device: str) -> Any:
    """A randomly initialised Qwen2 model with ``dims`` (built on ``device``: no 6 GB CPU initialisation)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**dims, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def measure(builders: dict, batches: dict, repeats: int, cuda: bool) -> dict[str, dict]:
    """Update times per variant after one warm-up update, interleaved on the CPU (drift hits them alike), one
    after the other on CUDA (one 1.5B model at a time); CUDA peak memory of the last timed update."""
    results: dict[str, dict] = {name: {"samples_s": []} for name in builders}
    for names in [[name] for name in builders] if cuda else [list(builders)]:
        trainers = {name: builders[name]() for name in names}
        for name, trainer in trainers.items():
            update(trainer, batches[name])
        before = torch.cuda.memory_allocated() if cuda else 0
        for _ in range(repeats):
            for name, trainer in trainers.items():
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                update(trainer, batches[name])
                results[name]["samples_s"].append(time.perf_counter() - start)
        for name, trainer in trainers.items():
            results[name]["trained_tokens"] = trainer.trained_tokens
            results[name]["micro_batch_rows"] = trainer.micro_batch_rows
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                results[name]["peak_above_state_mib"] = (peak - before) / 2**20
                results[name]["peak_total_mib"] = peak / 2**20
        del trainers, trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return results


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.MULTILINE)[1])


def memory_worker(
    variant: str, model_dir: Path, out: Path, batch: dict, micro_batch: int, rows: int
) -> float:
    """In a fresh process: warm-up update, reset the peak RSS, one update; returns the growth (MiB)."""
    width = int(batch["completion_mask"].shape[1])
    trainer = make_trainer(variant, model_dir, out, micro_batch, rows, max_completion_length=width)
    update(trainer, batch)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    before = _status_kib("VmRSS")
    update(trainer, batch)
    return (_status_kib("VmHWM") - before) / 1024


def cpu_memory(
    variant: str, model_dir: Path, out: Path, batch: dict, micro_batch: int, rows: int, threads: int
) -> float:
    """Peak RSS growth of one update of ``variant`` in a fresh process (NaN where /proc is missing)."""
    if not Path("/proc/self/clear_refs").exists():
        return float("nan")
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=set_threads, initargs=(threads,)) as pool:
        return pool.submit(memory_worker, variant, model_dir, out, batch, micro_batch, rows).result()


def run_geometry(
    label: str, model: Path | Any, work: Path, full: dict, args: Any, device: str, micro_batch: int
) -> list[dict]:
    """Time (and measure the memory of) every variant on one step's batch in micro-batches of
    ``micro_batch`` rows; one row per variant."""
    cuda = device == "cuda"
    rows, width = int(full["advantages"].shape[0]), int(full["completion_mask"].shape[1])
    batches = {"all": full, "kept": kept_rows(full)}
    per_variant = {name: batches[VARIANTS[name][2]] for name in VARIANTS}
    setup = (model, work / f"{label}-mb{micro_batch}", micro_batch, rows, device, args.weights, True, width)
    builders = {name: functools.partial(make_trainer, name, *setup) for name in VARIANTS}
    results = measure(builders, per_variant, args.repeats, cuda)
    if not cuda and not args.skip_cpu_memory:
        for name in VARIANTS:
            results[name]["peak_rss_growth_mib"] = cpu_memory(
                name, model, work, per_variant[name], micro_batch, rows, args.threads
            )
    grpo_time = statistics.median(results["grpo"]["samples_s"])
    memory_key = "peak_above_state_mib" if cuda else "peak_rss_growth_mib"
    grpo_memory = results["grpo"].get(memory_key)
    out = []
    for name in VARIANTS:
        batch, measured = per_variant[name], results[name]
        median = statistics.median(measured["samples_s"])
        memory = measured.get(memory_key)
        forward_rows = measured["micro_batch_rows"]  # what the update ran: one forward + backward each
        has_ratio = memory is not None and grpo_memory and not math.isnan(grpo_memory)
        out.append(
            {
                "model": label,
                "variant": name,
                "device": device,
                "micro_batch": micro_batch,
                "rollouts": int(batch["advantages"].shape[0]),
                "micro_batches": len(forward_rows),
                "micro_batch_rows": max(forward_rows),
                "forward_rows": forward_rows,
                "completion_width": int(batch["completion_mask"].shape[1]),
                "completion_tokens": int(batch["completion_mask"].sum()),
                "trained_tokens": measured["trained_tokens"],
                "gradient_checkpointing": True,
                "median_s": median,
                "samples_s": measured["samples_s"],
                "time_ratio_vs_grpo": median / grpo_time,
                "memory_measure": memory_key if memory is not None else None,
                "peak_memory_mib": memory,
                "peak_total_mib": measured.get("peak_total_mib"),
                "memory_ratio_vs_grpo": memory / grpo_memory if has_ratio else None,
            }
        )
    return out


# ---- where a micro-batch's time goes: torch.profiler over one micro-batch's forward + backward -----------

PROFILED = ("d3s", "d3s (packed)")  # D3S in TRL's micro-batches (N/G of the rows each), and packed
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
TOP_OPS = 15


def _self_device_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def profile_micro_batch(trainer: Any, batch: dict, trace: Path, cuda: bool) -> tuple[dict, list[dict]]:
    """One micro-batch's forward + backward (the update's last one, which packing fills) under torch.profiler,
    after a warm-up update; its Chrome trace written to ``trace``. Returns a summary (wall, CPU time in
    operators, CUDA kernel time, kernel launches) and the top operators by self CUDA time (CPU: self CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from d3s.packing import rows_of

    update(trainer, batch)  # warm-up: the token mask, the allocator's pool, the kernels' first calls
    part = micro_batches(trainer, batch)[-1]
    trainer.optimizer.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(trainer.model, part)
        trainer.accelerator.backward(loss)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    trainer._close_step_metrics()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    launches = [e for e in averages if e.key in LAUNCH_CALLS]
    cpu_us = sum(e.self_cpu_time_total for e in averages)
    kernel_us = sum(e.duration for e in kernels) if kernels else 0.0
    summary = {
        "rows": rows_of(part),
        "tokens": int(part["prompt_mask"].shape[1] + part["completion_mask"].shape[1]),
        "wall_s": wall,
        "cpu_op_s": cpu_us / 1e6,
        "cuda_kernel_s": kernel_us / 1e6,
        "gpu_busy_fraction": kernel_us / 1e6 / wall if cuda else None,
        "kernels": len(kernels),
        "kernel_launches": sum(e.count for e in launches),
        "launch_cpu_s": sum(e.self_cpu_time_total for e in launches) / 1e6,
        "mean_kernel_us": kernel_us / len(kernels) if kernels else None,
        "trace": trace.name,
    }
    by = _self_device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    top = [
        {
            "op": e.key,
            "calls": e.count,
            "self_cuda_s": _self_device_us(e) / 1e6,
            "self_cpu_s": e.self_cpu_time_total / 1e6,
            "cpu_total_s": e.cpu_time_total / 1e6,
        }
        for e in sorted(averages, key=by, reverse=True)[:TOP_OPS]
    ]
    return summary, top


def profile_geometry(
    label: str, model: Path | Any, work: Path, full: dict, args: Any, device: str, micro_batch: int
) -> list[dict]:
    """``profile_micro_batch`` for each variant of ``PROFILED`` (a fresh trainer each, freed before the next);
    the traces go to ``args.out``. One summary row per variant, then its top operators."""
    cuda = device == "cuda"
    rows, width = int(full["advantages"].shape[0]), int(full["completion_mask"].shape[1])
    kept = kept_rows(full)
    out: list[dict] = []
    for name in PROFILED:
        trainer = make_trainer(
            name,
            model,
            work / f"profile-mb{micro_batch}",
            micro_batch,
            rows,
            device,
            args.weights,
            True,
            width,
        )
        trace = args.out / f"update_cost_profile_{re.sub(r'[^a-z0-9]+', '_', name).strip('_')}.json.gz"
        summary, top = profile_micro_batch(trainer, kept, trace, cuda)
        common = {"model": label, "variant": name, "device": device, "micro_batch": micro_batch}
        out.append(common | {"kind": "summary"} | summary)
        out += [common | {"kind": "op", "rank": i + 1} | op for i, op in enumerate(top)]
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


PROFILE_COLUMNS = {
    "update": "{variant}",
    "micro-batch (rows x tokens)": "{rows} x {tokens}",
    "wall": lambda r: fmt_seconds(r["wall_s"]),
    "CPU time in ops": lambda r: fmt_seconds(r["cpu_op_s"]),
    "CUDA kernel time": lambda r: fmt_seconds(r["cuda_kernel_s"]) if r["kernels"] else "n/a",
    "GPU busy": lambda r: "n/a" if r["gpu_busy_fraction"] is None else f"{r['gpu_busy_fraction']:.0%}",
    "kernels (launches)": "{kernels} ({kernel_launches})",
    "launch CPU time": lambda r: fmt_seconds(r["launch_cpu_s"]),
    "trace": "{trace}",
}
PROFILE_OP_COLUMNS = {
    "update": "{variant}",
    "#": "{rank}",
    "operator": lambda r: r["op"][:70].replace("|", "/"),
    "calls": "{calls}",
    "self CUDA": lambda r: fmt_seconds(r["self_cuda_s"]),
    "self CPU": lambda r: fmt_seconds(r["self_cpu_s"]),
    "CPU total": lambda r: fmt_seconds(r["cpu_total_s"]),
}


# Forward FLOPs of one token at position t in Qwen2.5-Math-1.5B: 2 x (non-embedding parameters + the LM head)
# + 4 x layers x hidden x t (attention scores and weighted sum). The backward pass and checkpointing's
# recompute scale both terms alike, so the ratio of FLOPs saved is the same for forward + backward.
_FLOPS_PER_TOKEN = 2 * 1_543_714_304  # Qwen2.5-Math-1.5B parameters: the body and the (tied) LM head
_FLOPS_PER_POSITION = 4 * 28 * 1536

# A labelled MODEL of token entropies (nats) at 3,000 tokens, not a measurement. Most reasoning tokens are
# near certain and about one in five is a high-entropy "forking" token (the 80/20 observation of Wang et al.,
# 2025, arXiv 2506.01939). Each scenario moves where in the completion the forking tokens fall.
ENTROPY_MODELS = {
    "stationary": "20 % forking tokens (H ~ LogNormal(0, 0.5)), the rest H ~ Exp(mean 0.05), anywhere",
    "falling": "forking share 30 % at the first token, falling linearly to 10 % at the last",
    "rising": "forking share 10 % at the first token, rising linearly to 30 % at the last",
    "answer tail": "stationary, and a finished completion's last 60 tokens (the stated answer) "
    "H ~ Exp(mean 0.02)",
}


def modelled_rollouts(scenario: str, prompts: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Entropies, completion mask, advantages and prompt lengths of prompts x G rollouts under a scenario of
    ``ENTROPY_MODELS``, with the lengths and rewards perf/README.md describes (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    rows = prompts * G
    finished = torch.rand(rows, generator=gen) >= 0.3
    lengths = torch.where(
        finished,
        torch.randint(max_tokens // 5, max_tokens + 1, (rows,), generator=gen),
        torch.tensor(max_tokens),
    )
    position = torch.arange(max_tokens).float() / max(1, max_tokens - 1)
    share = {"falling": 0.3 - 0.2 * position, "rising": 0.1 + 0.2 * position}.get(
        scenario, torch.full_like(position, 0.2)
    )
    forking = torch.rand(rows, max_tokens, generator=gen) < share
    high = torch.exp(0.5 * torch.randn(rows, max_tokens, generator=gen))
    low = -0.05 * torch.log(torch.rand(rows, max_tokens, generator=gen).clamp(min=1e-12))
    answer = -0.02 * torch.log(torch.rand(rows, max_tokens, generator=gen).clamp(min=1e-12))
    entropies = torch.where(forking, high, low)
    index = torch.arange(max_tokens)
    if scenario == "answer tail":  # every scenario draws the same numbers: they differ only in where
        tail = finished[:, None] & (index >= lengths[:, None] - 60)
        entropies = torch.where(tail, answer, entropies)
    mask = (index < lengths[:, None]).long()
    p = 0.1 + 0.8 * torch.rand(prompts, 1, generator=gen)
    rewards = (torch.rand(prompts, G, generator=gen) < p).float()
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    full = {"entropies": entropies * mask, "completion_mask": mask, "advantages": advantages}
    return full | {"prompt_lengths": torch.full((rows,), PROMPT_TOKENS)}


def tail_after_last_selected(
    entropies: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    prompt_lengths: torch.Tensor,
    token_keep_ratio: float,
    micro_batch_rows: int,
) -> dict[str, float]:
    """What stopping every rollout at its last selected token would save under D3S's token selection, per
    micro-batch of ``micro_batch_rows`` rows: the fractions of tokens, of FLOPs and of padded columns."""
    from d3s.selection import token_keep_mask, token_scores

    saved = total = saved_flops = total_flops = saved_padded = total_padded = 0.0
    for start in range(0, entropies.shape[0], micro_batch_rows):
        part = slice(start, start + micro_batch_rows)
        mask, prompt = completion_mask[part], prompt_lengths[part]
        scores = token_scores(advantages[part], entropies[part], "adv_entropy")
        keep = token_keep_mask(scores, mask, token_keep_ratio, "batch")
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=1)  # -1: nothing kept
        lengths = mask.sum(dim=1)
        saved += float((lengths - (last + 1)).sum())
        total += float((lengths + prompt).sum())
        # FLOPs of positions prompt + last + 1 .. prompt + length - 1, against those of all positions
        n_all, n_kept = (prompt + lengths).double(), (prompt + last + 1).double()
        tail = n_all - n_kept
        total_flops += float((_FLOPS_PER_TOKEN * n_all + _FLOPS_PER_POSITION * n_all * (n_all - 1) / 2).sum())
        saved_flops += float((_FLOPS_PER_TOKEN + _FLOPS_PER_POSITION * (n_kept + n_all - 1) / 2) @ tail)
        total_padded += mask.shape[0] * (int(prompt.max()) + mask.shape[1])
        saved_padded += mask.shape[0] * (mask.shape[1] - (int(last.max()) + 1))
    return {
        "token_fraction_after_last_selected": saved / total,
        "flop_fraction_after_last_selected": saved_flops / total_flops,
        "padded_micro_batch_fraction": saved_padded / total_padded,
    }


# The linear schedule's pairs (p = 0, 1/3, 1): N rollouts kept per prompt with K of their tokens.
SCHEDULE_POINTS = [(8, 0.05), (16, 0.10), (32, 0.20)]


def truncation_rows(source: str, full: dict, micro_batch: int, rows_per_step: int) -> list[dict]:
    """tail_after_last_selected at each schedule point, after D3S's sample selection and TRL's split."""
    out = []
    for keep, ratio in SCHEDULE_POINTS:
        batch = kept_rows(full, keep)
        micro_rows = batch["advantages"].shape[0] // (rows_per_step // micro_batch)
        parts = (batch[key] for key in ("entropies", "completion_mask", "advantages", "prompt_lengths"))
        out.append(
            {
                "source": source,
                "keep_per_prompt": keep,
                "token_keep_ratio": ratio,
                "micro_batch_rows": micro_rows,
                "mean_completion_tokens": float(batch["completion_mask"].sum(1).float().mean()),
                **tail_after_last_selected(*parts, ratio, micro_rows),
            }
        )
    return out


def token_entropies(trainer: Any, full: dict) -> torch.Tensor:
    """Token entropies (nats) of the trainer's model on ``full``: TRL's scoring pass, without gradient."""
    from trl.models.utils import disable_gradient_checkpointing

    input_ids = torch.cat([full["prompt_ids"], full["completion_ids"]], dim=1)
    attention = torch.cat([full["prompt_mask"], full["completion_mask"]], dim=1)
    no_checkpointing = disable_gradient_checkpointing(
        trainer.model, trainer.args.gradient_checkpointing_kwargs
    )
    width, batch_size = full["completion_ids"].shape[1], trainer.args.per_device_train_batch_size
    with torch.no_grad(), no_checkpointing:
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention, width, batch_size=batch_size, compute_entropy=True
        )
    return entropies.float() * full["completion_mask"]


def _geometries(text: str) -> list[tuple[int, int]]:
    """``PROMPTSxTOKENS,...`` (e.g. 1x1024,4x3072) as (prompts, tokens) pairs; ``none``: no random run."""
    if text == "none":
        return []
    return [(int(p), int(t)) for p, t in (item.split("x") for item in text.split(","))]


UPDATE_COLUMNS = {
    "model": "{model}",
    "update": "{variant}",
    "micro-batch": "{micro_batch}",
    "rollouts (micro-batches x rows)": "{rollouts} ({micro_batches} x {micro_batch_rows})",
    "tokens (trained)": "{completion_tokens} ({trained_tokens})",
    "median time": lambda r: fmt_seconds(r["median_s"]),
    "time / GRPO": "{time_ratio_vs_grpo:.3f}",
    "peak memory": lambda r: "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.1f} MiB",
    "memory / GRPO": lambda r: (
        "n/a" if r["memory_ratio_vs_grpo"] is None else f"{r['memory_ratio_vs_grpo']:.3f}"
    ),
}
TRUNCATION_COLUMNS = {
    "token scores from": "{source}",
    "N": "{keep_per_prompt}",
    "K": "{token_keep_ratio:.0%}",
    "micro-batch rows": "{micro_batch_rows}",
    "mean completion tokens": "{mean_completion_tokens:.0f}",
    "tokens after last selected": "{token_fraction_after_last_selected:.2%}",
    "FLOPs after last selected (1.5B)": "{flop_fraction_after_last_selected:.2%}",
    "padded micro-batch columns": "{padded_micro_batch_fraction:.2%}",
}


def _ints(text: str) -> list[int]:
    """``8`` or ``32,8``: micro-batches (rows)."""
    return [int(item) for item in text.split(",")]


def command_line() -> argparse.ArgumentParser:
    """The options (scripts/device_update_cost.sh passes them; tests/test_perf_scripts.py parses them)."""
    parser = base_parser(__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the 1.5B model")
    parser.add_argument("--repeats", type=int, default=None, help="timed updates per variant (3; quick 2)")
    parser.add_argument("--prompts", type=int, help="tiny model: prompts per step (8; quick 2)")
    parser.add_argument("--geometries", type=_geometries, help="PROMPTSxTOKENS,... of the random-token runs")
    parser.add_argument(
        "--micro-batch",
        type=_ints,
        help="per_device_train_batch_size(s) of the random-token runs (cuda 32, cpu 8)",
    )
    parser.add_argument(
        "--tiny-micro-batch",
        type=_ints,
        help="per_device_train_batch_size(s) of the tiny model (4,8; quick 4)",
    )
    parser.add_argument(
        "--no-tiny", action="store_true", help="skip the tiny model (its rows and truncation rows)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler trace and summary of one D3S micro-batch, unpacked and packed, at the first "
        "random geometry (the tiny model without one) and its smallest micro-batch (update_cost_profile.*)",
    )
    parser.add_argument("--note", action="append", default=[], help="a note for the table (repeatable)")
    parser.add_argument("--name", default="update_cost", help="the result files' name (<name>.json, .md)")
    parser.add_argument("--weights", choices=["fp32", "bf16"], default="fp32", help="cuda: master weights")
    parser.add_argument("--skip-cpu-memory", action="store_true", help="no fresh-process RSS measurement")
    return parser


def main() -> None:
    args = parse_args(command_line(), sft_steps=20)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible; run on a GPU node or drop --device cuda")
    # options left unset take the defaults of the mode (quick, CPU or CUDA)
    args.repeats = args.repeats or (2 if args.quick else 3)
    prompts = args.prompts = args.prompts or (2 if args.quick else 8)
    args.micro_batch = args.micro_batch or [32 if cuda else 8]
    args.tiny_micro_batch = args.tiny_micro_batch or ([4] if args.quick else [4, 8])
    dims, dims_label, prompt_len, default_geometries = RANDOM_MODELS[args.device]
    geometries = default_geometries if args.geometries is None and not args.quick else args.geometries or []
    rows: list[dict] = []
    truncation: list[dict] = []
    profiled: list[dict] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.no_tiny:
            from d3s.tiny_model import build_tokenizer

            tokenizer = build_tokenizer()
        else:
            tiny = prepare_tiny_model(work / "tiny", sft_steps=args.sft_steps)
            full, generator = generated_batch(tiny, work, prompts)
            entropies = token_entropies(generator, full)
            scored = full | {"entropies": entropies, "prompt_lengths": full["prompt_mask"].sum(1)}
            source = f"tiny model's own rollouts ({prompts} x 32, completions <= 64 tokens, real entropies)"
            rows_per_step = full["advantages"].shape[0]
            truncation = truncation_rows(source, scored, max(args.tiny_micro_batch), rows_per_step)
            del generator, scored, entropies
            for micro_batch in args.tiny_micro_batch:
                rows += run_geometry("tiny (generated batch)", tiny, work, full, args, "cpu", micro_batch)
                print(f"tiny, micro-batch {micro_batch}: done", flush=True)
            if args.profile and not geometries:
                tiny_batch = min(args.tiny_micro_batch)
                profiled = profile_geometry(
                    "tiny (generated batch)", tiny, work, full, args, "cpu", tiny_batch
                )
            tokenizer = AutoTokenizer.from_pretrained(tiny)
        for index, (n_prompts, tokens) in enumerate(geometries):
            model: Path | Any = qwen_model(dims, tokenizer, args.device)
            if not cuda:  # the CPU memory worker loads it from disk (make_trainer casts bf16 weights)
                model.save_pretrained(work / "qwen_small")
                tokenizer.save_pretrained(work / "qwen_small")
                model = work / "qwen_small"
            batch = random_batch(n_prompts, tokens, dims["vocab_size"], args.device, prompt_len)
            label = f"{dims_label}, {n_prompts} x 32, {tokens} tokens"
            for micro_batch in args.micro_batch:
                try:
                    found = run_geometry(label, model, work, batch, args, args.device, micro_batch)
                except torch.cuda.OutOfMemoryError:  # the longest geometries may not fit: say so, go on
                    failed.append(f"{n_prompts}x{tokens} at micro-batch {micro_batch}: CUDA out of memory")
                    print(failed[-1], flush=True)
                    found = []
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                rows += [r | {"prompts": n_prompts, "tokens": tokens} for r in found]
                print(f"{n_prompts} x 32, {tokens} tokens, micro-batch {micro_batch}: done", flush=True)
            if args.profile and index == 0:
                micro_batch = min(args.micro_batch)
                profiled = profile_geometry(label, model, work, batch, args, args.device, micro_batch)
            del model, batch
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    modelled_prompts, modelled_tokens = (2, 600) if args.quick else (8, 3000)
    for scenario in ENTROPY_MODELS:
        modelled = modelled_rollouts(scenario, modelled_prompts, modelled_tokens)
        source = f"MODEL '{scenario}' ({modelled_prompts} x 32, {modelled_tokens} tokens)"
        truncation += truncation_rows(source, modelled, 32, modelled_prompts * G)

    device_text = "CUDA" if cuda else "CPU"
    device_name = f": {torch.cuda.get_device_name()}." if cuda else " (no GPU): CPU figures, not GPU figures."
    ratios = "; ".join(
        f"{label}, micro-batch {micro_batch}: "
        + ", ".join(
            f"{r['variant']} {r['time_ratio_vs_grpo']:.3f}"
            for r in rows
            if (r["model"], r["micro_batch"]) == (label, micro_batch) and r["variant"] != "grpo"
        )
        for label, micro_batch in dict.fromkeys((r["model"], r["micro_batch"]) for r in rows)
    )
    notes = [
        f"Measured on the {device_text}{device_name}",
        f"Run: perf/update_cost.py {' '.join(sys.argv[1:])}".rstrip(),
        "One update = the step's batch in micro-batches with gradient checkpointing, compute_loss + backward "
        "per micro-batch, gradient clipping, one AdamW step; median of the timed updates after a warm-up "
        "update. Column 'micro-batch': per_device_train_batch_size, the micro-batch of that row's figure. "
        "GRPO: the step's rows in micro-batches of that many rows. d3s and d3s (masked head): TRL's "
        "micro-batches (pack_micro_batches false), as many as GRPO's with N/G of the rows each. "
        "d3s (packed): pack_micro_batches true, the step's kept rows in ceil(rows / micro-batch) "
        "micro-batches (d3s/packing.py). Column 'rollouts': the micro-batches and rows the update ran.",
        "Peak memory: "
        + (
            "torch.cuda.max_memory_allocated during one update, above the allocation before it (weights, "
            "optimizer state)."
            if cuda
            else "growth of the resident set's high-water mark (VmHWM, /proc) during one update after a "
            "warm-up update, in a fresh process per variant; allocator reuse makes small values coarse."
        ),
        f"D3S / GRPO update time (kept rollouts {KEEP}/{G} = {KEEP / G:.2f}), per model and micro-batch: "
        f"{ratios}.",
    ]
    notes += failed + args.note
    settings = dict(
        num_generations=G,
        keep_per_prompt=KEEP,
        token_keep_ratio=TOKEN_RATIO,
        geometries=[f"{p}x{t}" for p, t in geometries],
        weights=args.weights,  # as run_geometry ran every model, the CPU ones too
        gradient_checkpointing=True,
    )
    title = f"Update cost: GRPO vs D3S ({device_text})"
    write_results(args.name, args, rows, markdown_table(rows, UPDATE_COLUMNS), notes, title=title, **settings)
    if profiled:
        summaries = [r for r in profiled if r["kind"] == "summary"]
        markdown = (
            markdown_table(summaries, PROFILE_COLUMNS)
            + "\n\nTop operators by self "
            + ("CUDA" if cuda else "CPU")
            + " time:\n\n"
            + markdown_table([r for r in profiled if r["kind"] == "op"], PROFILE_OP_COLUMNS)
        )
        first = summaries[0]
        notes = [
            f"Measured on the {device_text}{device_name}",
            "One micro-batch's compute_loss + backward (gradient checkpointing, autocast) of "
            f"{first['model']} at micro-batch {first['micro_batch']}, the update's last micro-batch, after a "
            "warm-up update, "
            "under torch.profiler (" + ("CPU and CUDA activities" if cuda else "CPU activity only") + "); "
            "the profiler's own overhead is in the wall time. 'CPU time in ops': self CPU time summed over "
            "operators (the host's work, the launch calls included); 'CUDA kernel time': the kernels' "
            "durations summed; 'GPU busy': that over the wall time (low: the micro-batch is bound by the "
            "host, a fixed cost a larger micro-batch shares). Traces: Chrome trace format (chrome://tracing, "
            "Perfetto).",
        ]
        title = f"Update cost: where one D3S micro-batch's time goes ({device_text})"
        write_results(f"{args.name}_profile", args, profiled, markdown, notes, title=title, **settings)
    modelled = [r for r in truncation if r["source"].startswith("MODEL")]
    bound = max(
        max(r["flop_fraction_after_last_selected"], r["padded_micro_batch_fraction"]) for r in modelled
    )
    decision = (
        "implement truncation: the saving is 10 % or more of the update"
        if bound >= 0.10
        else "do not implement truncation: the bound is under 10 % of the update"
    )
    notes = [
        "Saving bound = FLOPs of the forward/backward positions after each kept rollout's last selected "
        "token, over all forward/backward FLOPs (Qwen2.5-Math-1.5B per-token cost incl. causal attention), "
        "with packed rows. 'Padded micro-batch columns': the columns a padded micro-batch drops when cut at "
        "its latest last-selected token (this includes padding that trimming each micro-batch to its longest "
        "row would already drop). The optimizer step and fixed costs do not shrink, so the update-time "
        "saving is at most the larger of the two.",
        "Precondition: the selection must be known before the gradient pass (entropies from an earlier pass, "
        "e.g. vLLM's old-policy pass); computing them with an extra no-gradient forward costs about a "
        "quarter of a checkpointed forward + backward, more than any saving here.",
        "Entropy MODEL scenarios (not measurements): "
        + "; ".join(f"{k}: {v}" for k, v in ENTROPY_MODELS.items()),
        f"Largest modelled saving at the paper geometry: {bound:.2%}. Decision: {decision}.",
    ]
    title = "Token level: what stopping each kept rollout at its last selected token saves"
    markdown = markdown_table(truncation, TRUNCATION_COLUMNS)
    settings = {"schedule_points": SCHEDULE_POINTS} | settings
    write_results(f"{args.name}_truncation", args, truncation, markdown, notes, title=title, **settings)


if __name__ == "__main__":
    main()
