"""The synthetic task of the tiny default: chained integer arithmetic with a short chain of thought.

Prompt ``Q: 23+45-17=\\nA:``; target completion `` 23+45=68, 68-17=51. \\boxed{51}`` (15-40 tokens with
the character-level tokenizer of :mod:`d3s.tiny_model`), so many tokens carry entropy and token-level selection
matters. Problems are a pure function of (seed, index): the held-out split never overlaps training.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ArithmeticProblem:
    prompt: str
    completion: str
    answer: str


def make_problem(rng: random.Random, num_ops: int, max_operand: int = 99) -> ArithmeticProblem:
    operands = [rng.randint(0, max_operand) for _ in range(num_ops + 1)]
    ops = [rng.choice("+-") for _ in range(num_ops)]
    expression = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True))
    steps, value = [], operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        new = value + x if op == "+" else value - x
        steps.append(f"{value}{op}{x}={new}")
        value = new
    completion = " " + ", ".join(steps) + f". \\boxed{{{value}}}"
    return ArithmeticProblem(prompt=f"Q: {expression}=\nA:", completion=completion, answer=str(value))


def is_held_out(prompt: str, test_fraction: float = 0.1) -> bool:
    """Stable hash split: a prompt is in the test split iff its CRC32 falls in the first ``test_fraction``."""
    return zlib.crc32(prompt.encode()) % 10_000 < test_fraction * 10_000


def arithmetic_problems(
    count: int,
    seed: int = 0,
    min_ops: int = 1,
    max_ops: int = 3,
    split: str = "train",
    max_operand: int = 99,
) -> list[ArithmeticProblem]:
    """``count`` problems of ``min_ops``..``max_ops`` operations on integers 0..``max_operand``.

    ``split`` picks a side of a fixed hash split of the prompts (10 % test), so the held-out problems
    never appear in training, whatever the seed or count. Problems may repeat within a split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"d3s-arithmetic-{split}-{seed}")
    want_test = split == "test"
    out: list[ArithmeticProblem] = []
    for _ in range(1000 * count + 10_000):
        if len(out) == count:
            return out
        problem = make_problem(rng, rng.randint(min_ops, max_ops), max_operand)
        if is_held_out(problem.prompt) == want_test:
            out.append(problem)
    raise ValueError(f"could not draw {count} {split} problems; widen max_operand or max_ops")
