"""The ``math_verify`` policy against math-verify itself as the oracle: ``verify(gold, parse(completion))`` on
real completions (../shared/data/completions) and on generated ones. Every difference fails; where the oracle
overruns the time limit, the completion is counted instead. Both sides get the same parsed gold: what is under
test is the reading of the completion."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import SHARED_DATA
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from d3s.evaluation import reader_comparison
from d3s.grading.policies import normalize_gold
from d3s.grading.pool import Grader
from d3s.grading.reading import _MathVerifyGrader, boxed_environment_possible

COMPLETIONS = SHARED_DATA / "completions"
ORACLE_LIMIT_S = 5.0  # math-verify's own default parsing and verification limits (here CPU seconds)
# Every STRIDE-th real completion, and every one with a box, is checked (1: all of them).
STRIDE = int(os.environ.get("D3S_DIFFERENTIAL_STRIDE", "16"))


class _Overrun(BaseException):
    """Not an Exception: math-verify's parse and verify catch those and return [] / False."""


def _alarm(signum: int, frame: Any) -> None:
    raise _Overrun


def _limited(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or _Overrun past ORACLE_LIMIT_S of CPU time (a signal: the caller is a process's main
    thread; CPU time, so that a loaded machine does not turn a slow answer into an overrun)."""
    previous = signal.signal(signal.SIGPROF, _alarm)
    signal.setitimer(signal.ITIMER_PROF, ORACLE_LIMIT_S)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


class Oracle:
    """math-verify as the field calls it: the whole completion to ``parse`` (boxed answers first, then
    math-verify's own fallbacks: the grader's ``boxed_first`` configuration), ``verify`` gold first."""

    def __init__(self) -> None:
        import logging

        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)
        self.parse, self.verify = parse, verify
        self.config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        self.grader = Grader(time_limit=None)  # in process: the policy's own code, no worker
        self.inline = _MathVerifyGrader("boxed_first")  # the grader's gold parsing, shared by both sides

    def verdict(self, completion: str, golds: tuple[str, ...]) -> bool:
        pred = self.parse(completion, self.config, parsing_timeout=None)
        parsed_golds = self.inline.parse_gold(golds)
        return any(self.verify(gold, pred, timeout_seconds=None) for gold in parsed_golds)

    def compare(self, item: tuple[str, str, str]) -> tuple[str, str, bool | None, bool | None]:
        """``(key, gold, oracle, policy)``; oracle None: it overran the limit (policy not graded)."""
        key, completion, gold = item
        golds = normalize_gold(gold)
        try:
            _limited(self.inline.parse_gold, golds)
        except _Overrun:
            return key, gold, None, None
        if not self.inline.parse_gold(golds):  # unparsable gold: neither side scores it
            return key, gold, False, False
        try:
            oracle = _limited(self.verdict, completion, golds)
        except _Overrun:
            return key, gold, None, None
        try:
            policy = _limited(lambda: self.grader.grade(completion, gold, "math_verify").correct)
        except _Overrun:
            policy = None  # the policy overran where the oracle did not: a difference
        return key, gold, oracle, policy


_oracle: Oracle | None = None


def _compare_in_worker(item: tuple[str, str, str]) -> tuple[str, str, bool | None, bool | None]:
    global _oracle
    _oracle = _oracle or Oracle()
    return _oracle.compare(item)


def pods_completions() -> list[tuple[str, str, str]]:
    """(key, completion, gold) of PODS's released evaluation outputs (read as the comparison script reads
    them: d3s.evaluation.reader_comparison)."""
    return [(c.key, c.completion, c.gold) for c in reader_comparison.pods_completions(COMPLETIONS)]


def gsm8k_solutions() -> list[tuple[str, str, str]]:
    """(key, solution, gold) of OpenAI's GSM8K example solutions, four models per question; the gold is the
    number after the reference solution's last "A:" (these files) or "####" (the dataset's)."""
    return [(c.key, c.completion, c.gold) for c in reader_comparison.gsm8k_solutions(COMPLETIONS)]


def checked_share(items: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Every STRIDE-th item, and every item with a box (where a reading of boxes could differ)."""
    return [item for index, item in enumerate(items) if index % STRIDE == 0 or "box" in item[1]]


@pytest.fixture(scope="module")
def real_comparisons() -> dict[str, list[tuple[str, str, bool | None, bool | None]]]:
    if not (COMPLETIONS / "pods").is_dir():
        pytest.skip(
            f"real completions not found at {COMPLETIONS} (expected ../shared/data beside the checkout)"
        )
    sources = {"pods": checked_share(pods_completions()), "gsm8k": checked_share(gsm8k_solutions())}
    with multiprocessing.get_context("fork").Pool(2) as pool:  # both sides in each of 2 processes
        return {name: pool.map(_compare_in_worker, items, chunksize=32) for name, items in sources.items()}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["pods", "gsm8k"])
def test_math_verify_policy_is_math_verify_on_real_completions(
    source: str, real_comparisons: dict[str, list[tuple[str, str, bool | None, bool | None]]]
) -> None:
    compared = real_comparisons[source]
    overruns = [key for key, _, oracle, _ in compared if oracle is None]
    differences = [(key, gold, o, p) for key, gold, o, p in compared if o is not None and o != p]
    print(f"{source}: {len(compared)} completions compared, {len(overruns)} math-verify overruns {overruns}")
    assert len(compared) > (1000 if source == "pods" else 300)
    assert not differences, differences[:20]
    assert len(overruns) <= len(compared) // 100  # a timeout is an exception, not the rule


# ------------------------------------------------------------------------------ generated completions

ATOMS = st.sampled_from(
    [
        "7",
        "12",
        "-3",
        "0.5",
        r"\frac{1}{2}",
        r"\frac{24}{2}",
        r"\sqrt{2}",
        r"2\sqrt{3}",
        "x + 1",
        r"\pi",
        "18.",
    ]
)
GAPS = st.sampled_from([" ", ", ", " or ", " and ", "\n", ". Wait, actually ", " ... hmm, no: ", "; "])
FILLER = st.sampled_from(
    ["", "We add the two cases. ", "So $x = 4$ and $y = 2$. ", "Checking: $3 \\times 4 = 12$.\n", "Thus "]
)


@st.composite
def box(draw: st.DrawFn) -> str:
    """One boxed answer, well formed or not: nested, unbalanced, empty, cut off."""
    atom = draw(ATOMS)
    return draw(
        st.sampled_from(
            [
                f"\\boxed{{{atom}}}",
                f"\\boxed{{{{{atom}}}}}",  # nested braces
                f"\\boxed{{{atom}}}}}",  # one closing brace too many
                f"\\boxed{{{{{atom}}}",  # one opening brace too many
                "\\boxed{}",
                "\\boxed{ }",
                f"\\boxed {atom}",
                f"\\fbox{{{atom}}}",
                f"\\boxed{{\\text{{{atom}}}}}",
            ]
        )
    )


@st.composite
def answer_unit(draw: st.DrawFn) -> str:
    """Boxes alone, together in one math environment, or each in its own."""
    boxes = draw(st.lists(box(), min_size=1, max_size=3))
    gap = draw(GAPS)
    layout = draw(st.sampled_from(["bare", "one $", "each $", "display", "each \\[", "answer tag"]))
    if layout == "one $":
        return "$" + gap.join(boxes) + "$"
    if layout == "each $":
        return gap.join(f"${b}$" for b in boxes)
    if layout == "display":
        return "$$" + gap.join(boxes) + "$$"
    if layout == "each \\[":
        return gap.join(f"\\[{b}\\]" for b in boxes)
    if layout == "answer tag":
        return f"<answer>{gap.join(boxes)}</answer>"
    return gap.join(boxes)


@st.composite
def completion(draw: st.DrawFn) -> str:
    """A reasoning text with answers in it: repeated, as a list of sub-problems, in tags, cut off."""
    parts = [draw(FILLER)]
    shape = draw(st.sampled_from(["answers", "repeated", "sub-problems", "think/answer", "plain"]))
    if shape == "answers":
        for _ in range(draw(st.integers(1, 3))):
            parts += [draw(answer_unit()), draw(GAPS), draw(FILLER)]
    elif shape == "repeated":
        unit = draw(answer_unit())
        parts += [draw(GAPS).join([unit] * draw(st.integers(2, 12)))]
    elif shape == "sub-problems":
        for label in "abc"[: draw(st.integers(2, 3))]:
            parts += [f"({label}) {draw(FILLER)}{draw(answer_unit())}\n"]
    elif shape == "think/answer":
        parts += [f"<think>{draw(FILLER)}{draw(answer_unit())}</think>\n<answer>{draw(ATOMS)}"]
        parts += [draw(st.sampled_from(["</answer>", "", " </answer> <answer></answer>"]))]
    else:
        parts += [f"The answer is {draw(ATOMS)}{draw(st.sampled_from(['.', '', ' dollars.']))}"]
    text = "".join(parts)
    if draw(st.booleans()) and len(text) > 4:  # cut off mid-answer
        text = text[: draw(st.integers(len(text) // 2, len(text) - 1))]
    return text


@pytest.fixture(scope="module")
def oracle() -> Iterator[Oracle]:
    yield Oracle()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=completion(), gold=st.sampled_from(["7", "12", "-3", "0.5", r"\sqrt{2}", "7, 12", "x + 1", "18"]))
def test_math_verify_policy_is_math_verify_on_generated_completions(
    text: str, gold: str, oracle: Oracle
) -> None:
    key, _, expected, got = oracle.compare(("generated", text, gold))
    if expected is not None:  # an overrun of the oracle is the one allowed exception
        assert got == expected, (text, gold)


@pytest.fixture(scope="module")
def boxed_environment_pattern() -> Any:
    from math_verify import LatexExtractionConfig
    from math_verify.parser import lazy_latex_regex

    patterns = [p for p, _ in lazy_latex_regex(LatexExtractionConfig(boxed_match_priority=0))]
    (pattern,) = [p for p in patterns if "first_latexDisplayDollar" in p.pattern and r"\\boxed{" in p.pattern]
    return pattern


DELIMITERS = st.sampled_from(["$", "$$", "\\[", "\\]", "\\(", "\\)", "[", "]", "\n", " ", "\\$", "x"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(DELIMITERS, box(), ATOMS), max_size=12))
def test_boxed_environment_shortcut_skips_only_where_nothing_matches(
    pieces: list[str], boxed_environment_pattern: Any
) -> None:
    """Where the shortcut skips math-verify's boxed-environment pattern, the pattern matches nothing."""
    text = "".join(pieces)
    if not boxed_environment_possible(text):
        assert next(boxed_environment_pattern.finditer(text), None) is None, text


# ------------------------------------------------------ the trl policy against TRL's accuracy_reward itself

TRL_PARSE_TIMEOUT_S = 10  # trl.rewards.accuracy_reward's own parsing limit in a main thread


class TrlOracle:
    """TRL 1.16's ``trl.rewards.accuracy_reward`` itself beside the grader's ``trl`` policy, in process."""

    def __init__(self) -> None:
        import logging

        from trl.rewards import accuracy_reward as trl_accuracy_reward

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)
        self.trl_accuracy_reward = trl_accuracy_reward
        self.inline = _MathVerifyGrader("boxed_first")

    def compare(self, item: tuple[str, str, str]) -> tuple[str, float | None, float | None, float]:
        """``(key, TRL's reward, the policy's reward, seconds TRL took)``; None: the gold is unparsable."""
        key, completion, gold = item
        start = time.perf_counter()
        (expected,) = self.trl_accuracy_reward([[{"role": "assistant", "content": completion}]], [gold])
        seconds = time.perf_counter() - start
        result = self.inline.grade(completion, normalize_gold(gold), "trl")
        got = float(result["correct"]) if result["gold_parsed"] else None
        return key, expected, got, seconds


_trl_oracle: TrlOracle | None = None


def _compare_trl_in_worker(item: tuple[str, str, str]) -> tuple[str, float | None, float | None, float]:
    global _trl_oracle
    _trl_oracle = _trl_oracle or TrlOracle()
    return _trl_oracle.compare(item)


@pytest.mark.slow
def test_trl_policy_is_trls_accuracy_reward_on_every_real_completion() -> None:
    """Every shared completion (PODS and GSM8K, no stride): the ``trl`` policy's reward equals
    ``trl.rewards.accuracy_reward``'s, None for an unparsable gold included; a difference is allowed only
    where TRL's own parse ran into its time limit (it then reads nothing)."""
    if not (COMPLETIONS / "pods").is_dir():
        pytest.skip(f"real completions not found at {COMPLETIONS}")
    items = pods_completions() + gsm8k_solutions()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        compared = pool.map(_compare_trl_in_worker, items, chunksize=64)
    differences = [c for c in compared if c[1] != c[2] and c[3] < TRL_PARSE_TIMEOUT_S]
    overruns = [c[0] for c in compared if c[3] >= TRL_PARSE_TIMEOUT_S]
    credited = sum(c[1] == 1.0 for c in compared)
    print(f"{len(compared)} completions, {credited} credited by TRL, {len(overruns)} TRL overruns {overruns}")
    assert len(compared) == len(items) > 28_000
    assert credited > 100  # the comparison holds credited answers, not only zeros
    assert not differences, differences[:20]
