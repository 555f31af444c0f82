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
import gc
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import base_parser, parse_args, prepare_tiny_model
from transformers import AutoTokenizer
from update_cost_geometry import RANDOM_MODELS, generated_batch, qwen_model, random_batch, run_geometry
from update_cost_profile import profile_geometry
from update_cost_report import write_reports
from update_cost_truncation import ENTROPY_MODELS, modelled_rollouts, truncation_rows
from update_cost_variants import G, token_entropies


def _geometries(text: str) -> list[tuple[int, int]]:
    """``PROMPTSxTOKENS,...`` (e.g. 1x1024,4x3072) as (prompts, tokens) pairs; ``none``: no random run."""
    if text == "none":
        return []
    return [(int(p), int(t)) for p, t in (item.split("x") for item in text.split(","))]


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
    write_reports(args, rows, profiled, truncation, failed, geometries)


if __name__ == "__main__":
    main()
