"""perf/update_cost.py's geometries and their measurement: the models (the tiny model's own generated batch,
random Qwen2 models with Qwen2.5-Math-1.5B's architecture on CUDA or a small body on the CPU), the batches of
a step's geometry (prompts x G rollouts, completion tokens: :func:`random_batch`), and :func:`run_geometry`,
which times every variant's update on one geometry and micro-batch (peak CUDA memory, or the peak RSS growth
of one update in a fresh process on the CPU): one result row per variant."""

from __future__ import annotations

import functools
import gc
import math
import multiprocessing
import re
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _common import build_tiny_trainer, set_threads
from update_cost_variants import VARIANTS, G, kept_rows, make_trainer, update

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
# device -> (random model, label, prompt tokens, geometries: prompts x G rollouts, completion tokens). CUDA:
# the H100 figures' geometries (../shared/docs/gpu-device-notes.md); CPU: short prompts, as the LM head
# (152k rows) costs seconds on a CPU.
CUDA_GEOMETRIES = [(1, 1024), (4, 1024), (8, 1024), (4, 3072)]
RANDOM_MODELS = {
    "cuda": (QWEN_1_5B, "Qwen2.5-Math-1.5B architecture", PROMPT_TOKENS, CUDA_GEOMETRIES),
    "cpu": (QWEN_SMALL, "small Qwen2, Qwen vocabulary", 32, [(1, 64), (2, 64)]),
}


def generated_batch(model_dir: Path, out: Path, prompts: int) -> tuple[dict, Any]:
    """Generate, grade and score prompts x G rollouts (<= 64 tokens) with the tiny model; also return it."""
    geometry = dict(num_generations=G, per_device_train_batch_size=prompts * G, max_completion_length=64)
    trainer = build_tiny_trainer("grpo", model_dir, out / "generate", 1, **geometry)
    trainer.model.train()
    rows = [trainer.train_dataset[i] for i in range(prompts) for _ in range(G)]
    full = trainer._generate_and_score_completions(rows)
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}, trainer


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
