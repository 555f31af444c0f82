"""The selection core against brute force, on hand-made batches, and at scale."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s.selection import (
    Schedule,
    max_variance_subset,
    renormalize_advantages,
    select_samples,
    token_keep_mask,
    token_scores,
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
        best = brute_force_best_variance(values[r, c].tolist(), k)
        assert subset_variance(values[r, c], idx[r, c]) == pytest.approx(best, abs=1e-9)


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
    assert sorted(values[0, idx[0]].tolist()) == [1, 1, 6, 9] or sorted(values[0, idx[0]].tolist()) == [
        1,
        1,
        9,
        6,
    ]


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
    assert set(idx.tolist()) >= {int(standardised.argmin())} or standardised[idx].min() == standardised.min()


def test_scales_to_a_million_values_without_python_loops():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2**20, generator=g)
    start = time.perf_counter()
    grouped = max_variance_subset(values.view(-1, 32), 8)
    pooled = max_variance_subset(values, 2**18)
    elapsed = time.perf_counter() - start
    assert grouped.shape == (2**15, 8) and pooled.shape == (2**18,)
    # A Python loop over the 32,768 groups alone takes seconds; the vectorised path well under one.
    assert elapsed < 5.0
    # The pooled optimum is the top i plus the bottom k - i of the sorted values.
    kept = values[pooled].sort().values
    ordered = values.sort().values
    n_bottom = int((kept < 0).sum())
    assert torch.equal(kept[:n_bottom], ordered[:n_bottom])


# ---- sample rules and scopes on hand-made batches ------------------------------------------------------------


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


# ---- token level ---------------------------------------------------------------------------------------------


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


def brute_force_token_mask(scores, valid, keep_ratio, scope):
    keep = torch.zeros_like(valid, dtype=torch.bool)
    groups = [list(range(scores.shape[0]))] if scope == "batch" else [[r] for r in range(scores.shape[0])]
    for rows in groups:
        cells = [(r, t) for r in rows for t in range(scores.shape[1]) if valid[r, t]]
        cells.sort(key=lambda rt: (-scores[rt].item(), rt))  # stable: earlier position first on ties
        for rt in cells[: math.ceil(keep_ratio * len(cells) - 1e-9)]:
            keep[rt] = True
    for r in range(scores.shape[0]):
        cells = [t for t in range(scores.shape[1]) if valid[r, t]]
        if cells:
            keep[r, max(cells, key=lambda t: (scores[r, t].item(), -t))] = True
    return keep


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 7),
    keep_ratio=st.sampled_from([0.05, 0.2, 0.25, 0.5, 0.9, 1.0]),
    scope=st.sampled_from(["batch", "sequence"]),
    ties=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_token_keep_mask_matches_brute_force(rows, cols, keep_ratio, scope, ties, seed):
    g = torch.Generator().manual_seed(seed)
    scores = (
        torch.randint(0, 3, (rows, cols), generator=g).float()
        if ties
        else torch.rand(rows, cols, generator=g)
    )
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    valid = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)  # right padding
    keep = token_keep_mask(scores, valid, keep_ratio, scope)
    assert torch.equal(keep, brute_force_token_mask(scores, valid, keep_ratio, scope))
    assert not (keep & ~valid).any(), "padding must never be selected"
    assert torch.equal(keep.any(1), valid.any(1)), "every sequence with tokens keeps at least one"


def test_token_keep_mask_exact_fraction_despite_ties():
    scores = torch.zeros(4, 10)  # all tied, e.g. zero-advantage rollouts
    valid = torch.ones(4, 10, dtype=torch.bool)
    keep = token_keep_mask(scores, valid, 0.2, "batch")
    # 8 by rank (0.2 x 40, not 9 from 0.2 * 40 = 8.000000000000002) plus one forced per row: rows 1-3
    assert keep.sum().item() == 8 + 3
    assert token_keep_mask(scores, valid, 0.2, "sequence").sum(1).tolist() == [2, 2, 2, 2]


def test_token_keep_mask_bad_ratio():
    for ratio in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"token_keep_ratio must be in \(0, 1\]"):
            token_keep_mask(torch.rand(2, 3), torch.ones(2, 3), ratio)


# ---- schedule ------------------------------------------------------------------------------------------------


def test_linear_schedule_endpoints_and_rounding():
    s = Schedule("linear", keep_init=8, keep_final=32, token_ratio_init=0.05, token_ratio_final=0.20)
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
    s = Schedule("constant", keep_init=4, keep_final=16, token_ratio_init=0.3, token_ratio_final=1.0)
    assert {s.keep_per_prompt(p / 10) for p in range(11)} == {4}
    assert {s.token_keep_ratio(p / 10) for p in range(11)} == {0.3}
    assert list(s.reachable_keep_values()) == [4]
    with pytest.raises(ValueError, match="schedule must be one of"):
        Schedule("cosine", 1, 1, 1.0, 1.0)
