"""Nothing in the selection path loops in Python over groups or tokens.

We count the Python-level events (function calls, C calls, executed lines) that a selection function
makes on a small and on a large input of the same shape family. A vectorised implementation makes the
same calls whatever the number of groups or tokens; a Python loop over groups or tokens makes more calls
on the larger input. The last tests show the counter catches a deliberately loopy implementation.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from d3s.selection import (
    max_variance_subset,
    renormalize_advantages,
    select_samples,
    token_keep_mask,
    token_scores,
)

G, KEEP = 8, 3  # rollouts per group, kept per group


def python_events(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter[str]:
    """Profile events (call, c_call, ...) and traced line events of one call of ``fn``, after a warm-up
    call (first calls can take one-off paths: lazy imports, caches)."""
    fn(*args, **kwargs)
    events: Counter[str] = Counter()

    def profiler(frame, event, arg):
        events[event] += 1

    def tracer(frame, event, arg):
        if event == "line":
            events["line"] += 1
        return tracer

    old_profile, old_trace = sys.getprofile(), sys.gettrace()  # coverage tools install a tracer
    # A garbage collection during the call would run finalizers of earlier tests' objects and count their
    # events: collect first, and keep the collector off while counting.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profiler)
    sys.settrace(tracer)
    try:
        fn(*args, **kwargs)
    finally:
        sys.settrace(old_trace)
        sys.setprofile(old_profile)
        if gc_was_enabled:
            gc.enable()
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
    assert small["call"] + small["c_call"] > 0, "the profiler saw nothing: the counter is broken"
    assert large == small, f"Python work grows with the input: {dict(small)} -> {dict(large)}"


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


def loopy_token_mask(scores: torch.Tensor, valid: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """A per-token loop (what the test must reject): keep tokens whose score reaches the K-quantile."""
    threshold = torch.quantile(scores[valid], 1 - keep_ratio)
    keep = torch.zeros_like(valid)
    for row in range(scores.shape[0]):
        for col in range(scores.shape[1]):
            keep[row, col] = bool(valid[row, col]) and bool(scores[row, col] >= threshold)
    return keep


def test_the_counter_catches_a_loop_over_groups() -> None:
    _, small = grouped(4)
    _, large = grouped(400)
    assert torch.equal(
        loopy_select_samples(large, G, KEEP), select_samples(large, large, G, KEEP, scope="group")
    )
    with pytest.raises(AssertionError, match="grows with the input"):
        assert_constant(
            python_events(loopy_select_samples, small, G, KEEP),
            python_events(loopy_select_samples, large, G, KEEP),
        )


def test_the_counter_catches_a_loop_over_tokens() -> None:
    def run(rows: int, cols: int) -> Counter[str]:
        _, entropies, valid = tokens(rows, cols)
        return python_events(loopy_token_mask, entropies, valid, 0.2)

    with pytest.raises(AssertionError, match="grows with the input"):
        assert_constant(run(2, 5), run(100, 100))
