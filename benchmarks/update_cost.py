"""Benchmark 2: one policy update, GRPO (G = 32, every rollout kept) against D3S (8 of 32 kept, 5 % of tokens).

    .venv/bin/python benchmarks/update_cost.py            # full run (~5 min on 2 cores)
    .venv/bin/python benchmarks/update_cost.py --quick    # smoke run

Both updates start from the same generated batch: the tiny model samples 32 completions for each of 8 prompts,
math-verify grades them and TRL computes the advantages; D3S keeps 8 rollouts per prompt by cross-group
max-variance selection and trains on the top 5 % of their tokens by |A| x H. One update is the loss
(``D3STrainer._compute_loss``), its backward pass and one AdamW step, timed alternately for the methods so drift
hits all of them alike. ``d3s (masked head)`` is D3S with ``kept_token_logprobs=False``: the LM head runs, with
gradient, at every position and the loss masks the unselected tokens (the straightforward computation).

Models: the tiny model, and the same model with Qwen2.5's vocabulary (151,936 rows), where the LM head dominates
as it does in a real 1.5B model. On a CUDA GPU a randomly initialised model with Qwen2.5-Math-1.5B's architecture
is added (bf16), on a batch of random tokens with the same rollout geometry, with peak GPU memory.
Peak memory on the CPU is the growth of the process's resident set during one update (after a warm-up update,
optimizer state included), measured in a fresh process per variant.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    base_parser,
    build_tiny_trainer,
    fmt_seconds,
    markdown_table,
    prepare_tiny_model,
    set_threads,
    write_results,
)

G, KEEP, TOKEN_RATIO = 32, 8, 0.05
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
VARIANTS = {  # name -> (method, trainer overrides, rows)
    "grpo": ("grpo", {}, "all"),
    "d3s": ("d3s", {}, "kept"),
    "d3s (masked head)": ("d3s", {"kept_token_logprobs": False}, "kept"),
}
D3S_OVERRIDES = {"keep_per_prompt": KEEP, "token_keep_ratio": TOKEN_RATIO, "schedule": "constant"}


def make_trainer(variant: str, model_dir: Path, out: Path, rows: int, gpu: bool) -> Any:
    method, overrides, _ = VARIANTS[variant]
    settings = {"num_generations": G, "per_device_train_batch_size": rows, "max_completion_length": 64}
    if method == "d3s":
        settings |= D3S_OVERRIDES
    if gpu:
        settings |= {"bf16": True, "use_cpu": False}
    trainer = build_tiny_trainer(
        method, model_dir, out / variant.replace(" ", "_"), 1, **settings, **overrides
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.create_optimizer()
    return trainer


def update(trainer: Any, batch: dict) -> None:
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    trainer.optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generated_batch(model_dir: Path, out: Path, prompts: int) -> tuple[dict, dict]:
    """Generate, grade and score prompts x G rollouts once; return GRPO's batch and D3S's selection of it."""
    from d3s.selection import select_samples

    trainer = build_tiny_trainer(
        "grpo", model_dir, out / "generate", 1, num_generations=G, per_device_train_batch_size=prompts * G
    )
    trainer.model.train()
    rows = [trainer.train_dataset[i] for i in range(prompts) for _ in range(G)]
    full = trainer._generate_and_score_completions(rows)
    full = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    return full, _d3s_rows(full, select_samples)


def _d3s_rows(full: dict, select_samples: Any) -> dict:
    advantages = full["advantages"]
    kept = select_samples(advantages, advantages, G, KEEP, "max_variance", "batch")
    kept_batch = {
        k: (v[kept] if v.dim() and v.shape[0] == advantages.shape[0] else v) for k, v in full.items()
    }
    kept_batch["num_items_in_batch"] = kept_batch["completion_mask"].sum()
    return kept_batch


def random_batch(
    prompts: int, prompt_len: int, completion_len: int, device: str, seed: int = 0
) -> tuple[dict, dict]:
    """Rollout geometry of a real run with random tokens (a random model's generations carry no reward)."""
    from d3s.selection import select_samples

    gen = torch.Generator().manual_seed(seed)
    rows = prompts * G
    lengths = torch.randint(completion_len // 4, completion_len + 1, (rows,), generator=gen)
    rewards = (torch.rand(rows, generator=gen) < 0.4).float().view(-1, G)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    full = {
        "prompt_ids": torch.randint(10, QWEN_VOCAB, (rows, prompt_len), generator=gen),
        "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(10, QWEN_VOCAB, (rows, completion_len), generator=gen),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    full = {k: v.to(device) for k, v in full.items()}
    return full, _d3s_rows(full, select_samples)


def vocab_model(model_dir: Path, target: Path, vocab: int) -> Path:
    """The tiny model with a larger vocabulary (new rows random): the LM head of a real model's size."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return target


def qwen_1_5b_model(tokenizer_dir: Path, target: Path) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        **QWEN_1_5B, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def time_updates(trainers: dict, batches: dict, repeats: int) -> dict[str, list[float]]:
    """Alternate the variants, one update each per round, after one warm-up update each."""
    for name, trainer in trainers.items():
        update(trainer, batches[name])
    samples: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(repeats):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            update(trainer, batches[name])
            samples[name].append(time.perf_counter() - start)
    return samples


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(spec: dict) -> None:
    """In a fresh process: warm-up update, reset the peak RSS, one update, print the growth (MiB)."""
    set_threads(spec["threads"])
    batches = torch.load(spec["batches"])
    trainer = make_trainer(
        spec["variant"], Path(spec["model_dir"]), Path(spec["out"]), spec["rows"], gpu=False
    )
    batch = batches[VARIANTS[spec["variant"]][2]]
    update(trainer, batch)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    before = _rss_kib("VmRSS")
    update(trainer, batch)
    print(json.dumps({"peak_growth_mib": (_rss_kib("VmHWM") - before) / 1024}))


def cpu_memory(
    variant: str, model_dir: Path, out: Path, batches_file: Path, rows: int, threads: int
) -> float:
    spec = dict(variant=variant, model_dir=str(model_dir), out=str(out), batches=str(batches_file), rows=rows)
    spec["threads"] = threads
    result = subprocess.run(
        [sys.executable, __file__, "--memory-worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        check=False,
    )
    if result.returncode:
        raise RuntimeError(f"memory worker for {variant} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_growth_mib"]


def gpu_memory(trainer: Any, batch: dict) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    update(trainer, batch)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def run_flavour(flavour: str, model_dir: Path, out: Path, batches: dict, args: Any, gpu: bool) -> list[dict]:
    rows = {name: batches[VARIANTS[name][2]]["advantages"].shape[0] for name in VARIANTS}
    trainers = {name: make_trainer(name, model_dir, out / flavour, rows["grpo"], gpu) for name in VARIANTS}
    per_variant = {name: batches[VARIANTS[name][2]] for name in VARIANTS}
    samples = time_updates(trainers, per_variant, args.repeats)
    trained = {  # tokens whose log-prob reached the gradient in the last update
        name: int(per_variant[name]["completion_mask"].sum())
        if trainers[name]._last_token_mask is None
        else int(trainers[name]._last_token_mask.sum())
        for name in VARIANTS
    }
    if gpu:
        memory = {name: gpu_memory(trainers[name], per_variant[name]) for name in VARIANTS}
    else:
        batches_file = out / f"{flavour}_batches.pt"
        torch.save(batches, batches_file)
        del trainers
        memory = {
            name: cpu_memory(name, model_dir, out / flavour, batches_file, rows["grpo"], args.threads)
            for name in VARIANTS
        }
    grpo_time = statistics.median(samples["grpo"])
    result = []
    for name in VARIANTS:
        batch = per_variant[name]
        median = statistics.median(samples[name])
        result.append(
            {
                "model": flavour,
                "variant": name,
                "rollouts": int(batch["advantages"].shape[0]),
                "completion_tokens": int(batch["completion_mask"].sum()),
                "trained_tokens": trained[name],
                "median_s": median,
                "samples_s": samples[name],
                "time_ratio_vs_grpo": median / grpo_time,
                "peak_memory_mib": memory[name],
                "memory_ratio_vs_grpo": memory[name] / memory["grpo"] if memory["grpo"] > 0 else None,
            }
        )
    return result


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed updates per variant (default 7; quick 2)"
    )
    parser.add_argument("--prompts", type=int, default=None, help="prompts per batch (default 8; quick 2)")
    parser.add_argument("--memory-worker", help=argparse_hidden(), default=None)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(json.loads(args.memory_worker))
        return
    args.repeats = args.repeats or (2 if args.quick else 7)
    prompts = args.prompts or (2 if args.quick else 8)
    set_threads(args.threads)
    gpu = torch.cuda.is_available()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = prepare_tiny_model(work / "tiny", sft_steps=20 if args.quick else 150)
        full, kept = generated_batch(tiny, work, prompts)
        batches = {"all": full, "kept": kept}
        flavours = {"tiny (vocab 110)": tiny}
        if not args.quick:
            flavours[f"tiny body, vocab {QWEN_VOCAB:,}"] = vocab_model(tiny, work / "vocab", QWEN_VOCAB)
        for flavour, model_dir in flavours.items():
            rows += run_flavour(flavour, model_dir, work, batches, args, gpu=False)
            print(f"{flavour}: done", flush=True)
        if gpu:
            big = qwen_1_5b_model(tiny, work / "qwen1.5b")
            completion_len = 256 if args.quick else 1024
            full_gpu, kept_gpu = random_batch(prompts, 128, completion_len, "cuda")
            rows += run_flavour(
                "Qwen2.5-Math-1.5B architecture (random, bf16)",
                big,
                work,
                {"all": full_gpu, "kept": kept_gpu},
                args,
                gpu=True,
            )

    headers = ["model", "update", "rollouts", "tokens (trained)", "median time", "time / GRPO", "peak memory",
               "memory / GRPO"]  # fmt: skip
    table = [
        [
            r["model"],
            r["variant"],
            r["rollouts"],
            f"{r['completion_tokens']} ({r['trained_tokens']})",
            fmt_seconds(r["median_s"]),
            f"{r['time_ratio_vs_grpo']:.3f}",
            f"{r['peak_memory_mib']:.1f} MiB",
            "n/a" if r["memory_ratio_vs_grpo"] is None else f"{r['memory_ratio_vs_grpo']:.3f}",
        ]
        for r in rows
    ]
    goal = KEEP / G + 0.1
    d3s_ratios = [r["time_ratio_vs_grpo"] for r in rows if r["variant"] == "d3s"]
    notes = [
        f"Goal: D3S update time / GRPO <= kept/all + 0.1 = {goal:.2f}; measured "
        + ", ".join(f"{ratio:.3f}" for ratio in d3s_ratios)
        + (" (met)." if all(ratio <= goal for ratio in d3s_ratios) else " (NOT met)."),
        "One update = _compute_loss + backward + AdamW step on the whole batch; median of alternating rounds.",
        "CPU peak memory: growth of the resident set during one update after a warm-up update (fresh process "
        "per variant); GPU: torch.cuda.max_memory_allocated above the allocation before the update.",
    ]
    if not gpu:
        notes.append("No GPU on this machine: the Qwen2.5-Math-1.5B (bf16) row was not measured.")
    markdown = markdown_table(headers, table)
    print(markdown)
    settings = {
        "num_generations": G,
        "keep_per_prompt": KEEP,
        "token_keep_ratio": TOKEN_RATIO,
        "prompts": prompts,
        "repeats": args.repeats,
        "threads": args.threads,
        "quick": args.quick,
    }
    write_results(
        "update_cost", settings, rows, markdown, notes, out_dir=args.out, title="Update cost: GRPO vs D3S"
    )


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
