"""Pass@k: the unbiased estimator against brute force, edge cases, stability, bootstrap CI."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s.evaluation import pass_at_k
from d3s.evaluation.metrics import average_over_benchmarks, bootstrap_ci, pass_at_k_table


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


@st.composite
def n_c_k(draw: st.DrawFn, max_n: int = 10) -> tuple[int, int, int]:
    n = draw(st.integers(1, max_n))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(n_c_k())
@settings(max_examples=200, deadline=None)
def test_matches_exhaustive_enumeration(args: tuple[int, int, int]) -> None:
    n, c, k = args
    assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), abs=1e-12)


@given(n_c_k(max_n=64))
@settings(max_examples=200, deadline=None)
def test_is_a_probability_and_monotone(args: tuple[int, int, int]) -> None:
    n, c, k = args
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-15  # more correct samples never hurt
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-15  # nor do more attempts


@pytest.mark.parametrize("n", [1, 2, 7, 32, 1024])
def test_edge_cases(n: int) -> None:
    for k in {1, min(8, n), n}:
        assert pass_at_k(n, 0, k) == 0.0  # nothing correct
        assert pass_at_k(n, n, k) == 1.0  # everything correct
    assert pass_at_k(n, 1, n) == 1.0  # k = n draws every sample
    for c in range(0, n + 1, max(1, n // 8)):
        assert pass_at_k(n, c, 1) == c / n  # Pass@1 is the mean accuracy, exactly


def test_stable_at_n_1024() -> None:
    n = 1024
    for c in (1, 2, 3, 10, 100, 500, 1000, 1016, 1017):
        for k in (1, 2, 8, 16, 64, 256):
            exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
            assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    # Tiny probabilities must not be lost to cancellation: 1 correct of 1024, k = 1 and 2.
    assert pass_at_k(n, 1, 2) == pytest.approx(2 / 1024, rel=1e-12)


def test_paper_setting_32_samples() -> None:
    # 32 samples, 4 correct: Pass@1 = 1/8; Pass@8 = 1 - C(28,8)/C(32,8).
    assert pass_at_k(32, 4, 1) == 0.125
    assert pass_at_k(32, 4, 8) == pytest.approx(1 - math.comb(28, 8) / math.comb(32, 8), rel=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)], ids=lambda v: str(v)
)
def test_invalid_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_non_integer_arguments() -> None:
    with pytest.raises(TypeError):
        pass_at_k(4.0, 1, 1)  # type: ignore[arg-type]


def test_benchmark_mean_and_average() -> None:
    counts = [(4, 0), (4, 2), (4, 4)]
    table = pass_at_k_table(counts, [1, 2, 4], resamples=200, seed=1)
    assert set(table) == {"1", "2", "4"}
    assert table["1"]["value"] == pytest.approx(0.5)
    assert table["4"]["value"] == pytest.approx(2 / 3)
    low, high = table["1"]["ci"]
    assert 0.0 <= low <= 0.5 <= high <= 1.0
    assert average_over_benchmarks({"a": {"1": 0.2, "8": 0.5}, "b": {"1": 0.4, "8": 0.7}}) == pytest.approx(
        {"1": 0.3, "8": 0.6}
    )


def test_bootstrap_is_seeded_and_sensible() -> None:
    values = [float(i % 3 == 0) for i in range(90)]
    first = bootstrap_ci(values, resamples=500, seed=7)
    assert first == bootstrap_ci(values, resamples=500, seed=7)
    assert first != bootstrap_ci(values, resamples=500, seed=8)
    mean = sum(values) / len(values)
    assert first[0] < mean < first[1]
    assert first[1] - first[0] < 0.3
    assert bootstrap_ci([0.25] * 10, resamples=50) == (0.25, 0.25)  # no spread, no width
    wide = bootstrap_ci(values, resamples=500, confidence=0.99, seed=7)
    assert wide[0] <= first[0] and wide[1] >= first[1]
    with pytest.raises(ValueError):
        bootstrap_ci([], resamples=10)
    with pytest.raises(ValueError):
        bootstrap_ci(values, confidence=1.5)
