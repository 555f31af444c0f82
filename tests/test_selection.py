"""The selection core against brute force, on hand-made batches, and at scale."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s.methods import Method, get_method
from d3s.selection import (
    Schedule,
    max_variance_subset,
    renormalize_advantages,
    round_half_up,
    select_samples,
    token_keep_mask,
    token_scores,
    variance_tie_tolerance,
)


def brute_force_best_variance(values: list[float], k: int) -> float:
    return max(
        torch.tensor([values[i] for i in subset], dtype=torch.float64).var(unbiased=False).item()
        for subset in itertools.combinations(range(len(values)), k)
    )


def subset_variance(values: torch.Tensor, idx: torch.Tensor) -> float:
    return values.to(torch.float64)[idx].var(unbiased=False).item()


value_lists = st.lists(
    st.one_of(
        st.floats(-100, 100, allow_nan=False, width=32),
        st.sampled_from([0.0, 1.0, -1.0, 0.5]),  # many ties
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=300, deadline=None)
@given(values=value_lists, data=st.data())
def test_max_variance_subset_matches_brute_force(values, data):
    k = data.draw(st.integers(1, len(values)))
    idx = max_variance_subset(torch.tensor(values, dtype=torch.float64), k)
    assert idx.dtype == torch.long and idx.shape == (k,)
    assert len(set(idx.tolist())) == k, "indices must be distinct"
    assert idx.tolist() == sorted(idx.tolist())
    best = brute_force_best_variance(values, k)
    assert subset_variance(torch.tensor(values), idx) == pytest.approx(best, rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 8),
    binary=st.booleans(),
    data=st.data(),
)
def test_max_variance_subset_batched_rows_are_independent(rows, n, binary, data):
    k = data.draw(st.integers(1, n))
    seed = data.draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    values = (
        torch.randint(0, 2, (rows, 2, n), generator=g).float()
        if binary
        else torch.randn(rows, 2, n, generator=g)
    )
    idx = max_variance_subset(values, k)
    assert idx.shape == (rows, 2, k)
    for r, c in itertools.product(range(rows), range(2)):
        assert torch.equal(idx[r, c], max_variance_subset(values[r, c], k))
        row = values[r, c].tolist()
        assert idx[r, c].tolist() == documented_pick(row, k, FLOAT32_ROUNDOFF)
        # optimal up to the tie tolerance (float32 rows: splits closer than float32 rounding are ties)
        tolerance = variance_tie_tolerance(max(row) - min(row), max(map(abs, row)), k, torch.float32)
        assert (
            subset_variance(values[r, c], idx[r, c]) >= brute_force_best_variance(row, k) - tolerance - 1e-12
        )


def test_tie_breaking_is_deterministic():
    values = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    idx = max_variance_subset(values, 2)
    assert idx.tolist() == [0, 5]  # the earliest of the top values, the latest of the bottom values
    assert torch.equal(idx, max_variance_subset(values.clone(), 2))
    assert max_variance_subset(torch.zeros(5), 3).tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_dtype_and_device_preserved(dtype):
    values = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], dtype=dtype)
    idx = max_variance_subset(values, 4)
    assert idx.dtype == torch.long and idx.device == values.device
    # the best split is the 2 largest (9, 6) plus the 2 smallest (both 1s): a unique optimum, no tie to break
    assert idx[0].tolist() == [1, 3, 5, 7]


@pytest.mark.parametrize("k", [0, -1, 9])
def test_invalid_k_raises(k):
    with pytest.raises(ValueError, match="k must satisfy 1 <= k <= n = 8"):
        max_variance_subset(torch.randn(8), k)


def test_nan_values_rejected_with_clear_error():
    with pytest.raises(ValueError, match="NaN"):
        max_variance_subset(torch.tensor([0.0, float("nan"), 1.0]), 2)
    adv = torch.tensor([1.0, -1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="NaN"):
        select_samples(adv, torch.zeros(4), num_generations=2, keep_per_prompt=1)


@settings(max_examples=200, deadline=None)
@given(rewards=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=16))
def test_lemma_standardised_group_has_subset_with_variance_at_least_one(rewards):
    # D3S Lemma 1: a set standardised to variance 1 contains a subset with variance >= 1 (the two extremes:
    # (range / 2)^2 >= 1 since range >= 2 sigma). The best pair is what max_variance_subset(., 2) finds.
    r = torch.tensor(rewards, dtype=torch.float64)
    if r.std(unbiased=False) < 1e-6:
        return  # a constant group cannot be standardised
    standardised = (r - r.mean()) / r.std(unbiased=False)
    idx = max_variance_subset(standardised, 2)
    assert subset_variance(standardised, idx) >= 1.0 - 1e-9
    # the minimum is kept, or a value tied with it at float64 precision (the tie rule may prefer that one)
    assert standardised[idx].min().item() == pytest.approx(standardised.min().item(), rel=1e-12, abs=1e-12)


def test_a_million_values_grouped_and_pooled():
    # Speed at this size is measured by perf/selection_overhead.py; that no Python loop runs over
    # groups is checked by tests/test_selection_vectorised.py. Here: the picks at scale.
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2**20, generator=g)
    grouped = max_variance_subset(values.view(-1, 32), 8)
    pooled = max_variance_subset(values, 2**18)
    assert grouped.shape == (2**15, 8) and pooled.shape == (2**18,)
    # The pooled optimum is the top i plus the bottom k - i of the sorted values.
    kept = values[pooled].sort().values
    ordered = values.sort().values
    n_bottom = int((kept < 0).sum())
    assert torch.equal(kept[:n_bottom], ordered[:n_bottom])


# ---- the tie rule, in exact arithmetic ---------------------------------------------------------------------

FLOAT32_ROUNDOFF = Fraction(1, 2**24)
FLOAT64_ROUNDOFF = Fraction(1, 2**53)
NUM_GROUPS = 900  # the size of the measurement in issue 12


def exact_score(values: list[Fraction]) -> Fraction:
    """k^2 x the population variance of ``values`` (k = len), exactly."""
    return len(values) * sum(x * x for x in values) - sum(values) ** 2


def best_subset_score(values: list[Fraction], k: int) -> Fraction:
    """The largest exact_score over every size-k subset, enumerated as counts of each distinct value (so
    repeated values cost nothing: binary rewards have at most k + 1 distinct subsets)."""
    distinct = sorted(set(values))
    available = [values.count(v) for v in distinct]

    def counts(position: int, left: int):
        if position == len(distinct):
            if left == 0:
                yield ()
            return
        for c in range(min(available[position], left) + 1):
            for rest in counts(position + 1, left - c):
                yield (c, *rest)

    return max(
        k * sum(c * v * v for c, v in zip(taken, distinct, strict=True))
        - sum(c * v for c, v in zip(taken, distinct, strict=True)) ** 2
        for taken in counts(0, k)
    )


def documented_pick(values: list[float], k: int, unit_roundoff: Fraction | None) -> list[int]:
    """The module docstring's tie rule, in exact arithmetic on the values as given.

    ``unit_roundoff`` None applies it with no tolerance: exact ties only (the rule on exact rewards).
    """
    exact = [Fraction(v) for v in values]
    n = len(exact)
    order = sorted(range(n), key=lambda j: (-exact[j], j))  # the stable descending sort
    splits = [order[:i] + order[n - k + i :] for i in range(k + 1)]
    scores = [exact_score([exact[j] for j in split]) for split in splits]
    best = max(scores)
    assert best == best_subset_score(exact, k), "PODS Lemma 3.1: some top i + bottom k - i split is optimal"
    tolerance = Fraction(0)
    if unit_roundoff is not None:
        spread, magnitude = max(exact) - min(exact), max(abs(max(exact)), abs(min(exact)))
        tolerance = k * k * 16 * (unit_roundoff + k * FLOAT64_ROUNDOFF) * spread * magnitude
    largest_optimal = max(i for i, score in enumerate(scores) if score >= best - tolerance)
    return sorted(splits[largest_optimal])


def roundoff_of(dtype: torch.dtype) -> Fraction:
    return FLOAT64_ROUNDOFF if dtype == torch.float64 else FLOAT32_ROUNDOFF


def trl_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """TRL's group-scaled advantages (r - mean) / (std + 1e-4), in the rewards' dtype."""
    grouped = rewards.view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()


def discrete_rewards(num_groups: int, group: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """(num_groups, group) rewards: even groups binary, odd groups in {0, 1, 2}, each with its own mix."""
    generator = torch.Generator().manual_seed(seed)
    probabilities = torch.rand(num_groups, 3, generator=generator)
    probabilities[::2, 2] = 0.0
    return torch.multinomial(probabilities, group, replacement=True, generator=generator).to(dtype)


reward_kinds = st.sampled_from(["binary", "ternary", "continuous"])


def draw_rewards(data: st.DataObject, kind: str, size: int) -> list[float]:
    if kind == "binary":
        element = st.sampled_from([0.0, 1.0])
    elif kind == "ternary":
        element = st.sampled_from([0.0, 1.0, 2.0])
    else:
        element = st.floats(-10, 10, allow_nan=False, width=32)
    return data.draw(st.lists(element, min_size=size, max_size=size))


@settings(max_examples=300, deadline=None)
@given(
    kind=reward_kinds,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    n=st.integers(1, 9),
    data=st.data(),
)
def test_max_variance_subset_follows_the_tie_rule_exactly(kind, dtype, n, data):
    values = draw_rewards(data, kind, n)
    k = data.draw(st.integers(1, n))
    picked = max_variance_subset(torch.tensor(values, dtype=dtype), k).tolist()
    assert picked == documented_pick(values, k, roundoff_of(dtype))


@settings(max_examples=150, deadline=None)
@given(
    kind=reward_kinds,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    num_prompts=st.integers(1, 3),
    group=st.integers(2, 5),
    data=st.data(),
)
def test_select_samples_follows_the_tie_rule_in_both_scopes(kind, dtype, num_prompts, group, data):
    if num_prompts * group > 10:  # keeps the brute force over all subsets cheap
        num_prompts = 10 // group
    rewards = torch.tensor(draw_rewards(data, kind, num_prompts * group), dtype=dtype)
    advantages = trl_advantages(rewards, group)
    keep = data.draw(st.integers(1, group - 1))
    grouped = select_samples(advantages, rewards, group, keep, "max_variance", "group")
    expected = [
        p * group + j
        for p in range(num_prompts)
        for j in documented_pick(advantages[p * group : (p + 1) * group].tolist(), keep, roundoff_of(dtype))
    ]
    assert grouped.tolist() == expected
    pooled = select_samples(advantages, rewards, group, keep, "max_variance", "batch")
    assert pooled.tolist() == documented_pick(advantages.tolist(), keep * num_prompts, roundoff_of(dtype))


@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    group=st.sampled_from([4, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    data=st.data(),
)
def test_discrete_rewards_keep_what_the_rule_gives_on_the_exact_rewards(seed, group, dtype, data):
    # Issue 12's measurement: 900 groups of binary or {0, 1, 2} rewards, selected on their float advantages.
    # Every pick must be the rule's pick in exact arithmetic on the rewards, with no tolerance: ties between
    # splits are exact ties of the rewards, and float rounding of the advantages must not break them.
    keep = data.draw(st.integers(1, group - 1))
    rewards = discrete_rewards(NUM_GROUPS, group, seed, dtype)
    kept = select_samples(trl_advantages(rewards.flatten(), group), rewards.flatten(), group, keep)
    local = (kept.view(NUM_GROUPS, keep) % group).tolist()
    deviations = [g for g, row in enumerate(rewards.tolist()) if local[g] != documented_pick(row, keep, None)]
    assert deviations == []


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(["binary", "ternary"]), group=st.integers(2, 16), data=st.data())
def test_float32_and_float64_pick_the_same_rows_for_discrete_rewards(kind, group, data):
    num_prompts = data.draw(st.integers(1, 4))
    rewards = draw_rewards(data, kind, num_prompts * group)
    keep = data.draw(st.integers(1, group - 1))
    picks = []
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor(rewards, dtype=dtype)
        advantages = trl_advantages(r, group)
        picks.append(
            [
                select_samples(advantages, r, group, keep, "max_variance", "group").tolist(),
                select_samples(r, r, group, keep, "max_variance", "batch").tolist(),  # the rewards themselves
                max_variance_subset(advantages.view(num_prompts, group), keep).tolist(),
            ]
        )
    assert picks[0] == picks[1]


@settings(max_examples=200, deadline=None)
@given(kind=reward_kinds, dtype=st.sampled_from([torch.float32, torch.float64]), data=st.data())
def test_permuting_the_input_permutes_the_pick_as_the_stable_sort_says(kind, dtype, data):
    n = data.draw(st.integers(1, 9))
    values = draw_rewards(data, kind, n)
    k = data.draw(st.integers(1, n))
    permutation = data.draw(st.permutations(range(n)))
    permuted = [values[j] for j in permutation]
    picked = max_variance_subset(torch.tensor(values, dtype=dtype), k).tolist()
    picked_permuted = max_variance_subset(torch.tensor(permuted, dtype=dtype), k).tolist()
    # The same values whatever the order (the split depends on the sorted values only) ...
    assert sorted(permuted[j] for j in picked_permuted) == sorted(values[j] for j in picked)
    # ... and among equal values, the indices the stable sort gives (top: earliest, bottom: latest).
    assert picked_permuted == documented_pick(permuted, k, roundoff_of(dtype))
    if len(set(values)) == n:  # distinct values: the pick follows the rows
        assert sorted(permutation[j] for j in picked_permuted) == picked


def test_equal_values_keep_the_earliest_on_top_and_the_latest_at_the_bottom():
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    # 4 of 8 kept: 2 ones + 2 zeros is the only optimum; the earliest ones and the latest zeros
    assert max_variance_subset(rewards, 4).tolist() == [1, 3, 5, 7]
    # 3 of 8: 2 ones + 1 zero ties with 1 one + 2 zeros; the largest i (more from the top) wins
    assert max_variance_subset(rewards, 3).tolist() == [1, 3, 7]
    assert max_variance_subset(1 - rewards, 3).tolist() == [0, 2, 6]


@pytest.mark.parametrize(
    ("rewards", "keep", "dtype", "expected"),
    [
        # splits i = 0, 1, 2 all keep {1, 1, 0}: the largest i takes the two earliest ones (the old
        # prefix-difference scan scored them a few ulps apart and took i = 1: [0, 1, 3])
        ([0.0, 1.0, 1.0, 1.0], 3, torch.float32, [0, 1, 2]),
        # splits i = 1, 2 both keep {2, 0}: i = 2 takes the earliest zero from the top (the old scan: [2, 3])
        ([0.0, 0.0, 0.0, 2.0], 2, torch.float64, [0, 3]),
        ([0.0, 0.0, 0.0, 2.0], 3, torch.float64, [0, 1, 3]),
    ],
)
def test_ties_that_float_rounding_used_to_break(rewards, keep, dtype, expected):
    r = torch.tensor(rewards, dtype=dtype)
    assert documented_pick(rewards, keep, None) == expected
    assert max_variance_subset(trl_advantages(r, len(rewards)), keep).tolist() == expected
    assert max_variance_subset(r, keep).tolist() == expected


@pytest.mark.parametrize(
    ("spread", "magnitude", "k", "dtype", "expected"),
    [
        (2.0, 1.0, 4, torch.float32, 16 * (2**-24 + 4 * 2**-53) * 2.0),
        (2.0, 1.0, 4, torch.bfloat16, 16 * (2**-24 + 4 * 2**-53) * 2.0),
        (3.0, 2.0, 8, torch.float64, 16 * 9 * 2**-53 * 6.0),
        (3.0, 2.0, 8, torch.int64, 16 * 9 * 2**-53 * 6.0),
    ],
)
def test_variance_tie_tolerance_formula(spread, magnitude, k, dtype, expected):
    assert variance_tie_tolerance(spread, magnitude, k, dtype) == expected


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CPU and CUDA picks are compared)"
)
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_cuda_picks_the_same_rows_as_the_cpu(scope):
    # Issue 12 saw 15 of 480 cases differ (max_variance, group scope, G = 16, N = 5) before the tie rule.
    device = torch.device("cuda")
    differing = []
    for case in range(480):
        group, keep = 16, 5
        generator = torch.Generator().manual_seed(case)
        if case % 3 == 2:
            rewards = torch.randn(8 * group, generator=generator)
        else:
            rewards = discrete_rewards(8, group, case, torch.float32).flatten()
        for dtype in (torch.float32, torch.float64):
            r = rewards.to(dtype)
            advantages = trl_advantages(r, group)
            on_cpu = select_samples(advantages, r, group, keep, "max_variance", scope)
            on_cuda = select_samples(advantages.to(device), r.to(device), group, keep, "max_variance", scope)
            if not torch.equal(on_cpu, on_cuda.cpu()):
                differing.append((case, dtype))
    assert differing == []
    big = torch.randn(2**16, generator=torch.Generator().manual_seed(0))  # the pooled scan at scale
    assert torch.equal(max_variance_subset(big, 2**14), max_variance_subset(big.to(device), 2**14).cpu())


# ---- sample rules and scopes on hand-made batches ----------------------------------------------------------


def grpo_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    grouped = rewards.view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()


def test_group_scope_keeps_exactly_n_per_prompt_with_balanced_binary_mix():
    rewards = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float32)
    adv = grpo_advantages(rewards, 8)
    kept = select_samples(
        adv, rewards, num_generations=8, keep_per_prompt=4, rule="max_variance", scope="group"
    )
    assert kept[:4].tolist() == [0, 1, 6, 7]  # 2 correct + 2 wrong
    assert 8 in kept.tolist() and rewards[kept[4:]].tolist().count(1.0) == 1  # the single correct + 3 wrong
    per_group = torch.bincount(kept // 8, minlength=2)
    assert per_group.tolist() == [4, 4]


def test_all_equal_rewards_keep_the_first_n_and_zero_advantages():
    rewards = torch.ones(8)
    adv = grpo_advantages(rewards, 4)
    for scope in ("group", "batch"):
        kept = select_samples(adv, rewards, 4, 2, "max_variance", scope)
        assert kept.numel() == 4
        assert torch.all(adv[kept] == 0)
    assert select_samples(adv, rewards, 4, 2, "max_variance", "group").tolist() == [0, 1, 4, 5]


def test_single_correct_rollout_is_always_kept():
    rewards = torch.zeros(8)
    rewards[5] = 1.0
    adv = grpo_advantages(rewards, 8)
    for rule in ("max_variance", "max_reward"):
        kept = select_samples(adv, rewards, 8, 2, rule, "group")
        assert 5 in kept.tolist()


def test_batch_scope_pools_groups_and_skips_groups_without_signal():
    # group 0 has no signal (all equal); group 1 has signal: cross-group selection spends the budget there
    rewards = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0], dtype=torch.float32)
    adv = grpo_advantages(rewards, 4)
    kept = select_samples(adv, rewards, 4, 2, "max_variance", "batch")
    assert kept.tolist() == [4, 5, 6, 7]
    group_kept = select_samples(adv, rewards, 4, 2, "max_variance", "group")
    assert torch.bincount(group_kept // 4).tolist() == [2, 2]


def test_max_reward_and_random_rules():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.8, 0.2, 0.7, 0.0])
    adv = grpo_advantages(rewards, 4)
    assert select_samples(adv, rewards, 4, 2, "max_reward", "group").tolist() == [1, 2, 4, 6]
    assert select_samples(adv, rewards, 4, 2, "max_reward", "batch").tolist() == [1, 2, 4, 6]
    a = select_samples(adv, rewards, 4, 2, "random", "group", torch.Generator().manual_seed(3))
    b = select_samples(adv, rewards, 4, 2, "random", "group", torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.bincount(a // 4).tolist() == [2, 2]
    c = select_samples(adv, rewards, 4, 2, "random", "batch", torch.Generator().manual_seed(3))
    assert c.numel() == 4 and len(set(c.tolist())) == 4
    counts = torch.zeros(8)
    for seed in range(400):  # every rollout is reachable, roughly uniformly
        counts[
            select_samples(adv, rewards, 4, 2, "random", "group", torch.Generator().manual_seed(seed))
        ] += 1
    assert counts.min() > 150 and counts.max() < 250


def test_none_rule_keeps_everything():
    rewards = torch.rand(8)
    assert select_samples(grpo_advantages(rewards, 4), rewards, 4, 2, "none").tolist() == list(range(8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_per_prompt": 5}, "keep_per_prompt must be between 1 and num_generations = 4"),
        ({"keep_per_prompt": 0}, "keep_per_prompt must be between 1"),
        ({"rule": "best"}, "sample_rule must be one of"),
        ({"scope": "global"}, "sample_scope must be one of"),
        ({"num_generations": 3}, "not a whole number of groups"),
    ],
)
def test_select_samples_bad_arguments(kwargs, message):
    args = {"num_generations": 4, "keep_per_prompt": 2, "rule": "max_variance", "scope": "group"} | kwargs
    with pytest.raises(ValueError, match=message):
        select_samples(torch.zeros(8), torch.zeros(8), **args)


def test_renormalize_matches_pods_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.4])
    kept = torch.tensor([0, 1, 3, 5, 6])
    adv = renormalize_advantages(rewards, kept, num_generations=4)
    g0 = torch.tensor([1.0, 0.0, 1.0])
    expected0 = (g0 - g0.mean()) / (g0.std() + 1e-4)
    g1 = torch.tensor([0.2, 0.9])
    expected1 = (g1 - g1.mean()) / (g1.std() + 1e-4)
    assert torch.allclose(adv, torch.cat([expected0, expected1]), atol=1e-6)
    # a group with one kept member or unscorable rewards gets A = 0, never NaN
    single = renormalize_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), torch.tensor([0, 1]), 4)
    assert single.tolist() == [0.0, 0.0]
    assert renormalize_advantages(rewards, kept, 4, scale=False)[:3].tolist() == pytest.approx(
        [1 / 3, -2 / 3, 1 / 3]
    )


# ---- token level -------------------------------------------------------------------------------------------


def test_token_scores_rules():
    entropies = torch.tensor([[0.5, 1.0], [2.0, 0.1]])
    advantages = torch.tensor([-2.0, 0.5])
    assert torch.allclose(
        token_scores(advantages, entropies, "adv_entropy"), torch.tensor([[1.0, 2.0], [1.0, 0.05]])
    )
    assert torch.equal(token_scores(advantages, entropies, "entropy"), entropies)
    per_token = torch.tensor([[1.0, -3.0], [0.0, 2.0]])
    assert torch.allclose(
        token_scores(per_token, entropies, "adv_entropy"), torch.tensor([[0.5, 3.0], [0.0, 0.2]])
    )


def brute_force_token_mask(scores, valid, token_keep_ratio, scope):
    keep = torch.zeros_like(valid, dtype=torch.bool)
    groups = [[r] for r in range(scores.shape[0])] if scope == "sequence" else [list(range(scores.shape[0]))]
    for rows in groups:
        cells = [(r, t) for r in rows for t in range(scores.shape[1]) if valid[r, t]]
        cells.sort(key=lambda rt: (-scores[rt].item(), rt))  # stable: earlier position first on ties
        for rt in cells[: math.ceil(token_keep_ratio * len(cells) - 1e-9)]:
            keep[rt] = True
    return keep


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 7),
    token_keep_ratio=st.sampled_from([0.05, 0.2, 0.25, 0.5, 0.9, 1.0]),
    scope=st.sampled_from(["batch", "micro_batch", "sequence"]),
    ties=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_token_keep_mask_matches_brute_force(rows, cols, token_keep_ratio, scope, ties, seed):
    g = torch.Generator().manual_seed(seed)
    scores = (
        torch.randint(0, 3, (rows, cols), generator=g).float()
        if ties
        else torch.rand(rows, cols, generator=g)
    )
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    valid = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)  # right padding
    keep = token_keep_mask(scores, valid, token_keep_ratio, scope)
    assert torch.equal(keep, brute_force_token_mask(scores, valid, token_keep_ratio, scope))
    assert not (keep & ~valid).any(), "padding must never be selected"
    if scope == "sequence":
        assert torch.equal(keep.any(1), valid.any(1)), "ceil(K x n) keeps at least one token of a sequence"
    else:  # no forced token: exactly ceil(K x valid) of the batch, the paper's top-K%
        assert keep.sum().item() == math.ceil(token_keep_ratio * valid.sum().item() - 1e-9)


def test_token_keep_mask_exact_fraction_despite_ties():
    scores = torch.zeros(4, 10)  # all tied, e.g. zero-advantage rollouts
    valid = torch.ones(4, 10, dtype=torch.bool)
    keep = token_keep_mask(scores, valid, 0.2, "batch")
    # 8 by rank (0.2 x 40, not 9 from 0.2 * 40 = 8.000000000000002), no token forced into rows 1-3
    assert keep.sum().item() == 8 and keep[0, :8].all() and not keep[1:].any()
    assert token_keep_mask(scores, valid, 0.2, "sequence").sum(1).tolist() == [2, 2, 2, 2]


def test_token_keep_mask_bad_ratio():
    for ratio in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"token_keep_ratio must be in \(0, 1\]"):
            token_keep_mask(torch.rand(2, 3), torch.ones(2, 3), ratio)


# ---- schedule ----------------------------------------------------------------------------------------------


def test_linear_schedule_endpoints_and_rounding():
    s = Schedule(
        "linear",
        keep_per_prompt_init=8,
        keep_per_prompt_final=32,
        token_keep_ratio_init=0.05,
        token_keep_ratio_final=0.20,
    )
    assert s.keep_per_prompt(0.0) == 8 and s.keep_per_prompt(1.0) == 32
    assert s.keep_per_prompt(0.5) == 20
    assert s.keep_per_prompt(1 / 48) == 9  # 8.5 rounds up
    assert s.token_keep_ratio(0.0) == pytest.approx(0.05) and s.token_keep_ratio(1.0) == pytest.approx(0.20)
    assert s.token_keep_ratio(0.5) == pytest.approx(0.125)
    values = [s.keep_per_prompt(step / 100) for step in range(101)]
    assert values == sorted(values) and set(values) == set(range(8, 33))
    assert set(values) <= set(s.reachable_keep_values())
    assert s.keep_per_prompt(-1) == 8 and s.keep_per_prompt(2) == 32  # progress is clamped


def test_constant_schedule():
    s = Schedule(
        "constant",
        keep_per_prompt_init=4,
        keep_per_prompt_final=16,
        token_keep_ratio_init=0.3,
        token_keep_ratio_final=1.0,
    )
    assert {s.keep_per_prompt(p / 10) for p in range(11)} == {4}
    assert {s.token_keep_ratio(p / 10) for p in range(11)} == {0.3}
    assert list(s.reachable_keep_values()) == [4]
    with pytest.raises(ValueError, match="schedule must be one of"):
        Schedule("exponential", 1, 1, 1.0, 1.0)


# ---- one rounding rule for keep counts ---------------------------------------------------------------------


def test_keep_counts_round_halves_up_in_the_registry_and_the_schedule():
    # G = 10 at 25 % is 2.5: 3 in both (Python's round, halves to even, gave 2 in the registry)
    assert get_method("pods").keep_per_prompt(10) == (3, 3)
    assert Method(
        "x", keep_per_prompt_fraction_init=0.25, keep_per_prompt_fraction_final=1.0
    ).keep_per_prompt(10) == (3, 10)
    assert Schedule("linear", 0, 10, 1.0, 1.0).keep_per_prompt(0.25) == 3
    assert Schedule("linear", 2, 3, 1.0, 1.0).keep_per_prompt(0.5) == 3
    assert [round_half_up(x) for x in (0.5, 1.5, 2.5, 2.4999, -0.5)] == [1, 2, 3, 2, 0]
    # halves in exact arithmetic whose floats land a hair below: 14.499999999999998, 4.499999999999999
    assert Method("x", keep_per_prompt_fraction_init=0.58).keep_per_prompt(25) == (15, 25)
    assert Schedule("linear", 1, 6, 1.0, 1.0).keep_per_prompt(0.7) == 5


@settings(max_examples=300, deadline=None)
@given(percent=st.integers(1, 100), group=st.integers(1, 256))
def test_registry_and_schedule_round_a_keep_fraction_alike(percent, group):
    fraction = percent / 100
    expected = max(1, math.floor(Fraction(percent, 100) * group + Fraction(1, 2)))
    method = Method("x", keep_per_prompt_fraction_init=fraction, keep_per_prompt_fraction_final=fraction)
    assert method.keep_per_prompt(group) == (expected, expected)
    # a schedule from 0 to G is at fraction x G at progress = fraction
    assert max(1, Schedule("linear", 0, group, 1.0, 1.0).keep_per_prompt(fraction)) == expected


def test_schedule_rounds_the_exact_interpolation_half_up():
    # every step of short schedules between the paper's range of N: the float interpolation of an exact half
    # often lands below it (1 -> 6 at step 7 of 10 gives 4.499999999999999)
    mismatches = []
    for keep_per_prompt_init, keep_per_prompt_final, max_steps in itertools.product(
        range(1, 9), range(1, 33), (7, 10, 48, 100)
    ):
        schedule = Schedule("linear", keep_per_prompt_init, keep_per_prompt_final, 1.0, 1.0)
        for step in range(max_steps + 1):
            exact = keep_per_prompt_init + (keep_per_prompt_final - keep_per_prompt_init) * Fraction(
                step, max_steps
            )
            if schedule.keep_per_prompt(step / max_steps) != math.floor(exact + Fraction(1, 2)):
                mismatches.append((keep_per_prompt_init, keep_per_prompt_final, step, max_steps))
    assert mismatches == []
