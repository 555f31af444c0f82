"""Shared fixtures: the benchmark copies in ../shared/data and a warm-started tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import SHARED_DATA

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """``<repo root>/../shared/data``; tests that use it are skipped when the benchmark copies are absent."""
    if not (SHARED_DATA / "aime24" / "test.jsonl").is_file():
        pytest.skip(
            f"benchmark copies not found at {SHARED_DATA} (expected ../shared/data beside the checkout)"
        )
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_sft_model(tmp_path_factory) -> Path:
    """The tiny model after a short SFT on one-step sums of digits: ~20-40 % sampled accuracy, so GRPO
    groups have mixed rewards. Built once per session (~15 s) and saved; tests load it from disk."""
    from d3s.data.synthetic import arithmetic_problems
    from d3s.tiny_model import build_model, build_tokenizer, sft_warm_start

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=0)
        problems = arithmetic_problems(2000, max_ops=1, max_operand=9)
        sft_warm_start(model, tokenizer, [(p.prompt, p.completion) for p in problems], steps=150, seed=0)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("tiny_sft")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
