"""The rounding rule of every keep count N, torch-free: the method registry (d3s.methods) and the workflow's
parse-time checks use it without importing torch (3 s of every `snakemake` start on the 2-core CPU), and the
selection math (d3s.selection) rounds with the same function."""

from __future__ import annotations

import math


def round_half_up(value: float) -> int:
    """The nearest integer, halves rounded up (2.5 -> 3): the rule for every keep count N.

    The papers say "round" without a rule; the 1e-9 absorbs binary error (0.58 x 25 = 14.499999999999998).
    """
    return math.floor(value + 0.5 + 1e-9)
