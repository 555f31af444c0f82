"""Nothing in the selection path loops in Python over groups or tokens.

We count the Python-level events of d3s code (calls of its functions, C functions called from its frames,
executed lines of its frames) that a selection function makes on a small and on a large input of the same
shape family. A vectorised implementation makes the same events whatever the number of groups or tokens; a
Python loop over groups or tokens makes more on the larger input. Only code under d3s/ counts, so garbage
collection, torch's Python internals and pytest plugins cannot change the count. The last tests show the
counter catches deliberately loopy implementations and ignores work outside the watched code.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch

import d3s
from d3s.selection import (
    max_variance_subset,
    renormalize_advantages,
    select_samples,
    token_keep_mask,
    token_scores,
)

G, KEEP = 8, 3  # rollouts per group, kept per group
D3S_DIR = Path(d3s.__file__).resolve().parent
THIS_FILE = Path(__file__).resolve()


def python_events(
    fn: Callable[..., Any], *args: Any, watch: Iterable[Path] = (D3S_DIR,), **kwargs: Any
) -> Counter[str]:
    """Events of code under ``watch`` (folders or files) during one call of ``fn``, after a warm-up call
    (first calls can take one-off paths: lazy imports, caches). Keys name the event and where it happened:
    ``call f``, ``line f:12``, ``c_call f -> Tensor.sort``; values are how often."""
    roots = tuple(Path(root).resolve() for root in watch)
    watched_by_filename: dict[str, bool] = {}

    def watched(code: CodeType) -> bool:
        filename = code.co_filename
        if filename not in watched_by_filename:
            path = Path(filename).resolve()
            watched_by_filename[filename] = any(path == root or root in path.parents for root in roots)
        return watched_by_filename[filename]

    fn(*args, **kwargs)
    events: Counter[str] = Counter()

    def line_tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            events[f"line {frame.f_code.co_qualname}:{frame.f_lineno}"] += 1
        return line_tracer

    def call_tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event != "call" or not watched(frame.f_code):
            return None  # no line events from frames outside the watched code
        events[f"call {frame.f_code.co_qualname}"] += 1
        return line_tracer

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and watched(frame.f_code):  # frame: the watched caller of the C function
            events[
                f"c_call {frame.f_code.co_qualname} -> {getattr(arg, '__qualname__', type(arg).__name__)}"
            ] += 1

    old_profile, old_trace = sys.getprofile(), sys.gettrace()  # coverage tools install a tracer
    sys.setprofile(profiler)
    sys.settrace(call_tracer)
    try:
        fn(*args, **kwargs)
    finally:
        sys.settrace(old_trace)
        sys.setprofile(old_profile)
    return events


def grouped(num_groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (rewards, advantages) of ``num_groups`` groups of G: binary rewards, mixed and uniform groups."""
    generator = torch.Generator().manual_seed(seed)
    success = torch.rand(num_groups, 1, generator=generator)
    rewards = (torch.rand(num_groups, G, generator=generator) < success).float()
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return rewards.flatten(), advantages.flatten()


def tokens(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages (rows,), entropies (rows, cols), valid mask with right padding) for rows x cols tokens."""
    generator = torch.Generator().manual_seed(seed)
    entropies = torch.rand(rows, cols, generator=generator)
    lengths = torch.randint(1, cols + 1, (rows,), generator=generator)
    valid = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return torch.randn(rows, generator=generator), entropies, valid


def assert_constant(small: Counter[str], large: Counter[str]) -> None:
    assert any(key.startswith("call ") for key in small), "the counter saw no watched call: it is broken"
    grown = {key: (small[key], large[key]) for key in small.keys() | large.keys() if small[key] != large[key]}
    shown = dict(sorted(grown.items())[:10])
    assert not grown, (
        f"Python work depends on the input size ({len(grown)} events differ, small -> large): {shown}"
    )


# ------------------------------------------------------------------------------------------- sample level


@pytest.mark.parametrize("rule", ["max_variance", "random", "max_reward"])
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_select_samples_does_not_loop_over_groups(rule: str, scope: str) -> None:
    def run(num_groups: int) -> Counter[str]:
        rewards, advantages = grouped(num_groups)
        return python_events(
            select_samples,
            advantages,
            rewards,
            num_generations=G,
            keep_per_prompt=KEEP,
            rule=rule,
            scope=scope,
            generator=torch.Generator().manual_seed(0),
        )

    assert_constant(run(4), run(400))


def test_max_variance_subset_does_not_loop_over_rows() -> None:
    small = python_events(max_variance_subset, torch.randn(4, G), KEEP)
    assert_constant(small, python_events(max_variance_subset, torch.randn(400, G), KEEP))
    # ... nor over the elements of a row (the cross-group rule scans every split of the pooled batch)
    pooled = python_events(max_variance_subset, torch.randn(4 * G), 4 * KEEP)
    assert_constant(pooled, python_events(max_variance_subset, torch.randn(400 * G), 400 * KEEP))


def test_renormalize_advantages_does_not_loop_over_groups() -> None:
    def run(num_groups: int) -> Counter[str]:
        rewards, advantages = grouped(num_groups)
        kept = select_samples(advantages, rewards, G, KEEP, rule="max_variance", scope="batch")
        return python_events(renormalize_advantages, rewards, kept, G)

    assert_constant(run(4), run(400))


# -------------------------------------------------------------------------------------------- token level


@pytest.mark.parametrize("scope", ["batch", "sequence"])
@pytest.mark.parametrize("rule", ["adv_entropy", "entropy", "none"])
def test_token_selection_does_not_loop_over_tokens(scope: str, rule: str) -> None:
    def run(rows: int, cols: int) -> Counter[str]:
        advantages, entropies, valid = tokens(rows, cols)

        def select() -> torch.Tensor:
            return token_keep_mask(token_scores(advantages, entropies, rule), valid, 0.2, scope)

        return python_events(select)

    assert_constant(run(2, 5), run(100, 100))  # 10 vs 10,000 token positions


# ------------------------------------------------------------------------------- the counter can fail


def loopy_select_samples(advantages: torch.Tensor, num_generations: int, keep: int) -> torch.Tensor:
    """A per-group loop (what the test must reject): the same picks as the vectorised group scope."""
    groups = advantages.view(-1, num_generations)
    picks = [max_variance_subset(row, keep) + i * num_generations for i, row in enumerate(groups)]
    return torch.cat(picks)


def loopy_token_mask(scores: torch.Tensor, valid: torch.Tensor, token_keep_ratio: float) -> torch.Tensor:
    """A per-token loop (what the test must reject): keep tokens whose score reaches the K-quantile."""
    threshold = torch.quantile(scores[valid], 1 - token_keep_ratio)
    keep = torch.zeros_like(valid)
    for row in range(scores.shape[0]):
        for col in range(scores.shape[1]):
            keep[row, col] = bool(valid[row, col]) and bool(scores[row, col] >= threshold)
    return keep


def test_the_counter_catches_a_loop_over_groups() -> None:
    """The loop lives in this file but calls d3s once per group: the default counter (d3s only) sees it."""
    _, small = grouped(4)
    _, large = grouped(400)
    assert torch.equal(
        loopy_select_samples(large, G, KEEP), select_samples(large, large, G, KEEP, scope="group")
    )
    small_events = python_events(loopy_select_samples, small, G, KEEP)
    large_events = python_events(loopy_select_samples, large, G, KEEP)
    assert (small_events["call max_variance_subset"], large_events["call max_variance_subset"]) == (4, 400)
    with pytest.raises(AssertionError, match="depends on the input size"):
        assert_constant(small_events, large_events)


def test_the_counter_catches_a_loop_over_tokens() -> None:
    """A loop that calls only torch: its own lines and C calls grow. Watching this file puts the helper where
    d3s code would be (d3s itself is not changed to prove the point)."""

    def run(rows: int, cols: int) -> Counter[str]:
        _, entropies, valid = tokens(rows, cols)
        return python_events(loopy_token_mask, entropies, valid, 0.2, watch=(D3S_DIR, THIS_FILE))

    with pytest.raises(AssertionError, match="depends on the input size"):
        assert_constant(run(2, 5), run(100, 100))


class Finalized:
    """Garbage whose collection runs Python code (a finalizer) in the middle of a counted call."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        sum(range(100))


def test_the_counter_ignores_work_outside_the_watched_code() -> None:
    """A Python loop and a garbage collection with finalizers during the call, outside d3s: not counted."""
    rewards, advantages = grouped(4)

    def select() -> torch.Tensor:
        return select_samples(advantages, rewards, G, KEEP)

    def select_amid_noise() -> torch.Tensor:
        for _ in range(1000):
            Finalized()
        gc.collect()
        return select()

    assert python_events(loopy_token_mask, *tokens(2, 5)[1:], 0.2) == Counter()
    assert python_events(select_amid_noise) == python_events(select)
