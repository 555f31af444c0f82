"""One grade on every machine (issue 57): a verdict does not depend on the time limit it ran under.

math-verify's reading of a whole completion (the ``math_verify`` policy) runs under a work budget that is a
count (``MAX_READING_CANDIDATES`` distinct candidates, each read once), not a clock; an answer that overruns
the time limit is graded once more, the same way, in a fresh worker. So an artificially short first limit,
which sends every answer to its second try, changes no verdict: on a looping Minerva-style completion (the
issue's shape: 224 closed boxes and a last one cut off, 3 s on the fast machine class before, an overrun
and a wrong verdict on the slow one) and on a stride of the shared real completions."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from helpers import SHARED_DATA

from d3s.evaluation import reader_comparison
from d3s.grading.policies import count_boxes, extract_answer, last_boxed_answer, normalize_gold
from d3s.grading.pool import DEFAULT_TIME_LIMIT_S, Grader, GradeResult
from d3s.grading.reading import _MathVerifyGrader

SHORT_LIMIT_S = 0.001  # every answer's first try overruns it (a worker answers in a millisecond at best)

# A Minerva solution (minerva_math test.jsonl, idx 27): its box sits in an equation environment, which
# math-verify does not read as math, so every display block before it is a candidate that fails to parse.
MINERVA_SOLUTION = (
    "\\[\nL \\equiv \\frac{\\Delta E}{\\Delta t}=\\frac{0.007 \\Delta M c^{2}}{\\Delta t}=\\frac{10^{5} "
    "L_{\\odot}}{M_{\\odot}^{6}} M^{6}.\n\\]\nConverting these to differentials, we get\n\\begin{equation}\n"
    "\\frac{0.007 dM c^{2}}{dt}=\\frac{10^{5} L_{\\odot}}{M_{\\odot}^{6}} M^{6}, or\n\\end{equation}\n"
    "\\begin{equation}\n\\boxed{\\frac{dM}{dt}=\\frac{10^{5} L_{\\odot}}{0.007 c^{2} M_{\\odot}^{6}} M^{6}}\n"
    "\\end{equation}"
)
MINERVA_GOLD = last_boxed_answer(MINERVA_SOLUTION) or ""
_CUT = MINERVA_SOLUTION[: MINERVA_SOLUTION.index("\\boxed{") + len("\\boxed{\\frac")]
# The solution 224 times, then once more cut off inside its box (a completion that ran out of tokens).
# math-verify tries all 224 identical display blocks (each parse failing), then reads the last closed box:
# right. It took 4.2 CPU s here before issue 57 (each failing block parsed again); 0.09 s now (once each).
MINERVA_LOOP = (MINERVA_SOLUTION + "\n") * 224 + _CUT
# The same loop with the exponent changing in every copy: 224 distinct failing candidates, past the budget,
# so the bounded reading grades it (the last closed box, as math-verify reads it here too).
MINERVA_VARIANTS = (
    "".join(MINERVA_SOLUTION.replace("10^{5} L", f"10^{{{i}}} L", 1) + "\n" for i in range(224)) + _CUT
)
MINERVA_CASES = {"looping": MINERVA_LOOP, "with variants": MINERVA_VARIANTS}


def _verdict(result: GradeResult) -> tuple[bool, str | None, bool, bool, str | None]:
    """What must not depend on the limit: the verdict, what was read, how, and whether it was scored."""
    return result.correct, result.extracted, result.bounded, result.gold_parsed, result.error


@pytest.fixture(scope="module")
def normal() -> Iterator[Grader]:
    with Grader(num_workers=2) as grader:  # the default limit, as training and evaluation grade
        yield grader


@pytest.fixture(scope="module")
def short() -> Iterator[Grader]:
    with Grader(num_workers=2, time_limit=SHORT_LIMIT_S, retry_time_limit=DEFAULT_TIME_LIMIT_S) as grader:
        yield grader


def test_minerva_loop_graded_the_same_under_any_limit(normal: Grader, short: Grader) -> None:
    completions, golds = list(MINERVA_CASES.values()), [MINERVA_GOLD] * len(MINERVA_CASES)
    assert count_boxes(MINERVA_LOOP) == 225 and last_boxed_answer(MINERVA_LOOP) is None
    start = time.perf_counter()
    unlimited = Grader(time_limit=None).grade_many(completions, golds)  # in process, no clock at all
    in_process_s = time.perf_counter() - start
    under_normal = normal.grade_many(completions, golds)
    before = short.timeouts
    under_short = short.grade_many(completions, golds)
    assert short.timeouts - before == len(completions)  # every first try overran: graded again
    for kind, a, b, c in zip(MINERVA_CASES, unlimited, under_normal, under_short, strict=True):
        assert _verdict(a) == _verdict(b) == _verdict(c), kind
        assert a.correct and not b.timed_out and not c.timed_out, kind
    looping, variants = unlimited
    assert not looping.bounded  # math-verify's own reading, in budget: each distinct block parsed once
    assert variants.bounded  # past the budget: the bounded reading, decided by a count
    # The work is small on any machine: both cases in well under a second each here, far from the limit.
    assert in_process_s < DEFAULT_TIME_LIMIT_S / 2 and max(r.seconds for r in under_normal) < 2.5


def test_bounded_reading_skips_a_box_opened_after_the_last_closing_brace() -> None:
    # math-verify's box pattern ends at the last "}": a box cut off after it is not read, the one before is
    assert extract_answer(r"\boxed{3} wait, it is \boxed{12", "math_verify") == r"\boxed{3}"
    assert extract_answer(r"\boxed{3} wait, it is \boxed{12", "last_boxed") is None  # its own rule
    # a box cut off after a closing brace inside it is inside the pattern: no answer, as before
    assert extract_answer(r"\boxed{3} wait, it is \boxed{\frac{1}{2", "math_verify") is None


def _real_sample() -> list[reader_comparison.LabelledCompletion]:
    """Every 97th PODS completion with a box, every 1,500th without, and every 400th GSM8K solution: 17
    completions of every source and kind (each first try here costs a worker restart, about a second)."""
    completions = SHARED_DATA / "completions"
    if not (completions / "pods").is_dir():
        pytest.skip(f"real completions not found at {completions}")
    pods = reader_comparison.pods_completions(completions)
    boxed = [c for c in pods if "\\boxed" in c.completion][::97]
    plain = [c for c in pods if "\\boxed" not in c.completion][::1500]
    return boxed + plain + reader_comparison.gsm8k_solutions(completions)[::400]


@pytest.mark.slow  # about 30 s: a worker restart per first try
def test_shared_completions_graded_the_same_under_a_short_limit(normal: Grader, short: Grader) -> None:
    sample = _real_sample()
    completions, golds = [c.completion for c in sample], [c.gold for c in sample]
    unlimited = Grader(time_limit=None).grade_many(completions, golds)
    under_normal = normal.grade_many(completions, golds)
    under_short = short.grade_many(completions, golds)
    assert sum(r.correct for r in unlimited) >= 3  # right and wrong answers both compared
    differences = [
        (c.key, _verdict(a), _verdict(b), _verdict(s))
        for c, a, b, s in zip(sample, unlimited, under_normal, under_short, strict=True)
        if not _verdict(a) == _verdict(b) == _verdict(s) or b.timed_out or s.timed_out
    ]
    assert not differences, differences


def test_work_budget_never_binds_on_real_completions() -> None:
    """math-verify's reading stays math-verify's on real text: no completion of a stride of the shared
    ones (every one with a box among them) needs the bounded reading."""
    completions = SHARED_DATA / "completions"
    if not (completions / "pods").is_dir():
        pytest.skip(f"real completions not found at {completions}")
    items = reader_comparison.pods_completions(completions) + reader_comparison.gsm8k_solutions(completions)
    sample = [c for i, c in enumerate(items) if i % 64 == 0 or ("\\boxed" in c.completion and i % 4 == 0)]
    inline = _MathVerifyGrader("boxed_first")
    bounded = [
        c.key for c in sample if inline.grade(c.completion, normalize_gold(c.gold), "math_verify")["bounded"]
    ]
    assert len(sample) > 500 and not bounded, bounded
