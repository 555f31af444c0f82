"""Pass@k (the unbiased estimator of Chen et al., 2021) and bootstrap confidence intervals."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` of ``n`` samples (``c`` correct), drawn without replacement, is
    correct: ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, no huge binomials (docs/evaluation/outputs.md,
    "Pass@k")."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"n, c, k must be integers, got {n!r}, {c!r}, {k!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and n={n} (the samples per problem), got k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    if k == 1:
        return c / n  # exact; the product form agrees up to rounding
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def bootstrap_ci(
    values: Sequence[float], *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Seeded percentile bootstrap interval of the mean of per-problem ``values`` (problems resampled)."""
    if not values:
        raise ValueError("no values to bootstrap")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if len(set(values)) == 1:  # no spread (or one problem, which scipy refuses): no width
        return float(values[0]), float(values[0])
    from scipy import stats  # here, not at import: scipy.stats costs ~1-2 s, and `d3s train` needs none

    result = stats.bootstrap(
        (np.asarray(values, dtype=float),),
        np.mean,
        n_resamples=resamples,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def pass_at_k_table(
    counts: Sequence[tuple[int, int]],
    ks: Sequence[int],
    *,
    resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, float | list[float]]]:
    """``{"1": {"value": .., "ci": [lo, hi]}, "8": ...}`` for the (n_i, c_i) counts; {} without any."""
    table: dict[str, dict[str, float | list[float]]] = {}
    if not counts:  # no problem scored: no Pass@k (and nothing to bootstrap)
        return table
    for k in ks:
        per_problem = [pass_at_k(n, c, k) for n, c in counts]
        low, high = bootstrap_ci(per_problem, resamples=resamples, confidence=confidence, seed=seed)
        table[str(k)] = {"value": sum(per_problem) / len(per_problem), "ci": [low, high]}
    return table


def average_over_benchmarks(per_benchmark: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Unweighted mean of each Pass@k over benchmarks (the "Avg." column of the paper's tables)."""
    keys = set.intersection(*(set(v) for v in per_benchmark.values())) if per_benchmark else set()
    return {k: sum(v[k] for v in per_benchmark.values()) / len(per_benchmark) for k in sorted(keys, key=int)}


def policy_disagreement(
    verdicts: Sequence[tuple[bool, bool]], names: tuple[str, str] = ("math_verify", "last_boxed")
) -> dict[str, Any]:
    """How often two grading policies disagree on the same samples: ``verdicts`` holds one (first
    policy correct, second policy correct) pair per sample. ``rate`` is None without samples."""
    first_only = sum(1 for a, b in verdicts if a and not b)
    second_only = sum(1 for a, b in verdicts if b and not a)
    disagree = first_only + second_only
    return {
        "samples": len(verdicts),
        "disagree": disagree,
        "rate": disagree / len(verdicts) if verdicts else None,
        f"{names[0]}_only_correct": first_only,
        f"{names[1]}_only_correct": second_only,
    }
