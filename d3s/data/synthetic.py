"""The synthetic task of the tiny default: chained integer arithmetic with a short chain of thought
(docs/workflow/testbed.md); problems are a pure function of (seed, index)."""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ArithmeticProblem:
    prompt: str
    completion: str
    answer: str
    num_ops: int = 0


def make_problem(
    rng: random.Random, num_ops: int, max_operand: int = 99, bounded: bool = False
) -> ArithmeticProblem:
    if bounded:  # each next operand keeps the running value in 0..max_operand
        operands, ops = [rng.randint(0, max_operand)], []
        value = operands[0]
        for _ in range(num_ops):
            ops.append(rng.choice("+-"))
            operands.append(rng.randint(0, max_operand - value) if ops[-1] == "+" else rng.randint(0, value))
            value += operands[-1] if ops[-1] == "+" else -operands[-1]
    else:
        operands = [rng.randint(0, max_operand) for _ in range(num_ops + 1)]
        ops = [rng.choice("+-") for _ in range(num_ops)]
    expression = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True))
    steps, value = [], operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        new = value + x if op == "+" else value - x
        steps.append(f"{value}{op}{x}={new}")
        value = new
    completion = " " + ", ".join(steps) + f". \\boxed{{{value}}}"
    return ArithmeticProblem(f"Q: {expression}=\nA:", completion, str(value), num_ops)


def arithmetic_problems(
    count: int,
    seed: int = 0,
    min_ops: int = 1,
    max_ops: int = 3,
    split: str = "train",
    max_operand: int = 99,
    bounded: bool = False,
) -> list[ArithmeticProblem]:
    """``count`` problems of ``min_ops``..``max_ops`` operations on integers 0..``max_operand``, from the
    ``split`` side of a fixed hash split (so held-out problems never appear in training); they may repeat."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"d3s-arithmetic-{split}-{seed}" + ("-bounded" if bounded else ""))
    want_test = split == "test"
    out: list[ArithmeticProblem] = []
    for _ in range(1000 * count + 10_000):
        if len(out) == count:
            return out
        problem = make_problem(rng, rng.randint(min_ops, max_ops), max_operand, bool(bounded))
        held_out = zlib.crc32(problem.prompt.encode()) % 10_000 < 1_000  # a stable 10 % test split
        if held_out == want_test:
            out.append(problem)
    raise ValueError(f"could not draw {count} {split} problems; widen max_operand or max_ops")


def demonstrations(
    problems: Sequence[ArithmeticProblem], box_error: Sequence[float] = (0.0, 0.0), seed: int = 0
) -> list[tuple[str, str]]:
    """SFT (prompt, completion) pairs; a fraction, from ``box_error[0]`` on the shortest chains rising
    linearly to ``box_error[1]`` on the longest, box the first intermediate result
    (docs/workflow/testbed.md)."""
    rng = random.Random(f"d3s-demonstrations-{seed}")
    low, high = (min(p.num_ops for p in problems), max(p.num_ops for p in problems)) if problems else (0, 0)
    pairs = []
    for p in problems:
        rate = box_error[0] + (box_error[1] - box_error[0]) * (p.num_ops - low) / max(1, high - low)
        first = re.search(r"=(-?\d+),", p.completion)  # chains of two or more operations
        completion = p.completion
        if first and rng.random() < rate:
            completion = completion[: completion.rindex("\\boxed{")] + f"\\boxed{{{first.group(1)}}}"
        pairs.append((p.prompt, completion))
    return pairs
