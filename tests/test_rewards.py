"""Grading: real answer formats of every benchmark, LaTeX variants, adversarial inputs under the time
limit, threads and worker processes, and the TRL reward function."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s import rewards
from d3s.data.benchmarks import load_benchmark
from d3s.grading.copied import copied_from_prompt
from d3s.grading.policies import (
    ANSWER_POLICIES,
    BOXED_POLICIES,
    MAX_DISTINCT_BOXES,
    _box_chain,
    count_boxes,
    extract_answer,
    gold_candidates,
    last_boxed_answer,
    normalize_answer,
    normalize_gold,
)
from d3s.grading.pool import Grader, GradeResult, default_grader
from d3s.grading.reading import boxed_environment_possible
from d3s.rewards import accuracy_reward, grade, grade_detailed

LIMIT_S = 1.5  # per-answer limit used by the adversarial tests


@pytest.fixture(scope="module")
def grader() -> Iterator[Grader]:
    with Grader(num_workers=2, time_limit=LIMIT_S) as shared:
        yield shared


# ---------------------------------------------------------------------------------------------- gold


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        ("025", ("025",)),
        (70, ("70",)),
        (27.0, ("27",)),  # AMC floats
        (2.5, ("2.5",)),
        (["$69$,$84$"], ("$69$,$84$",)),
        (["", "  3 "], ("3",)),
        ("", ()),
    ],
)
def test_normalize_gold(gold: object, expected: tuple[str, ...]) -> None:
    assert normalize_gold(gold) == expected  # type: ignore[arg-type]


def test_gold_candidates_wrap_bare_latex() -> None:
    assert gold_candidates(r"\dfrac{9}{7}")[0] == r"\boxed{\dfrac{9}{7}}"
    assert gold_candidates(r"$\frac{1}{2}$")[0] == r"\boxed{\frac{1}{2}}"  # $ stripped first
    assert gold_candidates(r"\$18")[0] == r"\boxed{\$18}"  # escaped dollar kept
    assert gold_candidates(r"\boxed{3}") == [r"\boxed{3}"]


# ---------------------------------------------------------------------------------- real benchmarks

REAL_FORMAT_CASES = {
    # benchmark: (correct completion for the first problem, a wrong one)
    "aime24": (r"so the answer is $\boxed{204}$.", r"\boxed{205}"),
    "aime25": (r"Therefore \boxed{70}", r"\boxed{71}"),
    "amc23": (r"They meet \boxed{27} miles from A.", r"\boxed{27.5}"),
    "math500": (r"\boxed{\left(3, \frac{\pi}{2}\right)}", r"\boxed{(3, \pi)}"),
    "gsm8k": (r"She makes 9 * 2 = 18 dollars. \boxed{18}", r"\boxed{16}"),
    "minerva_math": (r"s = 1.6 cm, \boxed{1.6}", r"\boxed{16}"),
    "olympiadbench": (r"Sergey needs \boxed{2} moves.", r"\boxed{3}"),
    "math_level3to5": (r"\boxed{118}", r"\boxed{119}"),
}


@pytest.mark.parametrize("benchmark_name", sorted(REAL_FORMAT_CASES))
def test_real_benchmark_gold_formats(benchmark_name: str, grader: Grader, shared_data_dir: Path) -> None:
    problem = load_benchmark(benchmark_name, shared_data_dir, limit=1)[0]
    right, wrong = REAL_FORMAT_CASES[benchmark_name]
    assert grader.grade(right, problem.gold).correct, (benchmark_name, problem.gold)
    result = grader.grade(wrong, problem.gold)
    assert result.gold_parsed and not result.correct and not result.timed_out


@pytest.mark.parametrize("benchmark_name", sorted(REAL_FORMAT_CASES))
def test_every_gold_verifies_against_itself_boxed(
    benchmark_name: str, grader: Grader, shared_data_dir: Path
) -> None:
    """The first 25 golds of each benchmark, written back boxed by a model, must be graded correct."""
    problems = load_benchmark(benchmark_name, shared_data_dir, limit=25)
    results = grader.grade_many(
        [rf"The answer is \boxed{{{p.gold[0]}}}." for p in problems], [p.gold for p in problems]
    )
    failures = [(p.problem_id, p.gold) for p, r in zip(problems, results, strict=True) if not r.correct]
    assert not failures


def test_aime_zero_padding_and_amc_floats(grader: Grader) -> None:
    assert grader.grade(r"\boxed{25}", "025").correct
    assert grader.grade(r"\boxed{025}", "025").correct
    assert not grader.grade(r"\boxed{250}", "025").correct
    assert grader.grade(r"\boxed{27}", 27.0).correct
    assert grader.grade(r"\boxed{-1}", -1.0).correct


# ---------------------------------------------------------------------------------- LaTeX variants

LATEX_CASES = [
    # (completion, gold, correct)
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", True),
    (r"\boxed{\frac{9}{7}}", r"\dfrac{9}{7}", True),  # bare-LaTeX gold (math-verify #70)
    (r"\boxed{0.5}", r"\frac{1}{2}", True),  # decimal vs fraction
    (r"\boxed{1.60}", "1.6", True),
    (r"\boxed{1.7}", "1.6", False),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (r"\boxed{\frac{\pi}{2}}", r"\dfrac{\pi}{2}", True),
    (r"\boxed{(3, \infty)}", r"(3,\infty)", True),  # intervals
    (r"\boxed{[3, \infty)}", r"(3,\infty)", False),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", True),  # sets are unordered
    (r"\boxed{1, 2}", r"\{2, 1\}", True),
    (r"\boxed{(1,2)}", r"(2,1)", False),  # tuples are ordered
    (r"\boxed{5\text{ cm}}", "5", True),  # units
    (r"\boxed{5 \mathrm{~cm}}", "5", True),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{\text{Monday}}", r"\text{Monday}", True),  # text answers
    (r"\boxed{\text{Tuesday}}", r"\text{Monday}", False),
    (r"\boxed{\text{(C)}}", r"\text{(C)}", True),
    (r"\boxed{x=5}", "5", True),
    ("The answer is 68", "68", True),  # no boxed answer: falls back to the last expression
    (r"First 5, then finally \boxed{7}", "7", True),  # boxed preferred over earlier numbers
    (r"First 5, then finally \boxed{7}", "5", False),
    # Boxes close together, or joined by "or" / "and", are read together as one set answer by math-verify.
    (r"\boxed{3} or maybe \boxed{4}", "4", False),
    (r"\boxed{3} and \boxed{4}", "3, 4", True),
    ("I don't know", "5", False),
    ("", "5", False),
]


@pytest.mark.parametrize(("completion", "gold", "correct"), LATEX_CASES)
def test_latex_variants(completion: str, gold: str, correct: bool, grader: Grader) -> None:
    result = grader.grade(completion, gold)
    assert result.correct is correct
    assert result.gold_parsed and not result.timed_out and result.error is None


def test_multiple_golds_any_matches(grader: Grader) -> None:
    assert grader.grade(r"\boxed{4}", ["3", "4"]).correct
    assert not grader.grade(r"\boxed{5}", ["3", "4"]).correct


def test_boxed_only_extraction() -> None:
    with Grader(time_limit=LIMIT_S, answer_extraction="boxed_only") as strict:
        assert not strict.grade("The answer is 68", "68").correct
        assert strict.grade(r"\boxed{68}", "68").correct


def test_unparsable_gold_is_reported_not_scored(grader: Grader) -> None:
    for gold in ["", "$ $", []]:
        result = grader.grade(r"\boxed{1}", gold)  # type: ignore[arg-type]
        assert result.gold_parsed is False and result.correct is False and not result.timed_out


def test_extracted_answer_reported(grader: Grader) -> None:
    result = grader.grade(r"so $x = \boxed{\frac{3}{4}}$", "0.75")
    assert result.correct and result.extracted == r"\frac{3}{4}"
    assert grader.grade("no answer here", "3").extracted is None
    assert dataclasses.asdict(result)["correct"] is True


# ------------------------------------------------------------------------------ adversarial inputs

HANGING = [
    r"\boxed{9^{9^{9^{9}}}}",  # sympy tries to evaluate a tower of powers
    r"\boxed{10^{10^{10^{10}}}}",
    "9**9**9**9",
]


def test_adversarial_inputs_return_within_the_limit(grader: Grader) -> None:
    nested = "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}"
    long_correct = "x" * 100_000 + r" so \boxed{5}"
    long_wrong = ("1+" * 50_000) + "1"
    brace_soup = "{" * 5000 + "5" + "}" * 5000
    completions = [*HANGING, nested, long_correct, long_wrong, brace_soup]
    # How long these take (time charged per answer, the batch against the limit) is measured by
    # perf/grading_time_limit.py; here, what comes back.
    results = grader.grade_many(completions, ["5"] * len(completions))
    assert len(results) == len(completions)
    for result in results:
        if result.timed_out:  # cut off only once the limit has passed, and wrong
            assert result.seconds >= LIMIT_S and result.correct is False
    for result in results[: len(HANGING)]:  # the power towers must hit the limit and count as wrong
        assert result.timed_out and not result.correct
    assert results[4].correct and not results[4].timed_out  # 100k characters, answer at the end
    assert not results[5].correct
    assert grader.timeouts >= len(HANGING)
    # The grader is healthy after killing workers.
    assert grader.grade(r"\boxed{5}", "5").correct


# Answers that go to the workers: words before the box (a bare integer box is read without them,
# d3s/integer_answers.py)
def test_worker_killed_while_idle_is_replaced() -> None:
    with Grader(time_limit=LIMIT_S) as fresh:
        assert fresh.grade(r"so \boxed{1}", "1").correct
        fresh._workers[0].process.kill()
        fresh._workers[0].process.wait()
        assert fresh.grade(r"so \boxed{2}", "2").correct
        assert fresh.restarts == 1


def test_worker_dying_mid_answer_is_replaced_and_results_keep_their_order() -> None:
    # A worker killed while it grades (out of memory, a crash): that answer is wrong with an error, the
    # answers around it, which the other worker finishes first, come back in their places.
    completions = [rf"so \boxed{{{i}}}" for i in range(8)]
    completions[3] = HANGING[0]
    golds = [str(i) for i in range(8)]
    with Grader(num_workers=2, time_limit=LIMIT_S) as fresh:
        fresh.grade_many([r"so \boxed{1}"] * 2, ["1"] * 2)  # start both workers
        graded: list[list[GradeResult]] = []
        thread = threading.Thread(
            target=lambda: graded.append(fresh.grade_many(completions, golds, "last_boxed"))
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not (busy := [w for w in fresh._workers if w.job and w.job[0] == 3]):  # grading the tower
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy[0].process.kill()
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert fresh.restarts == 1 and fresh.timeouts == 0  # killed before its limit
    results = graded[0]
    assert results[3].error == "grading worker died" and not results[3].correct and not results[3].timed_out
    for i, result in enumerate(results):
        if i != 3:
            assert result.correct and result.extracted == str(i) and result.error is None, (i, result)


def test_inline_grader_without_limit() -> None:
    inline = Grader(time_limit=None)
    assert inline.grade(r"\boxed{\frac{1}{2}}", "0.5").correct
    assert inline.grade("", "").gold_parsed is False


def test_invalid_grader_settings() -> None:
    with pytest.raises(ValueError):
        Grader(num_workers=0)
    with pytest.raises(ValueError):
        Grader(time_limit=0)
    with pytest.raises(ValueError):
        Grader(answer_extraction="last_number")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Grader(time_limit=1).grade_many(["a"], [])


# ------------------------------------------------------------------------ threads and processes


def test_time_limit_from_non_main_threads() -> None:
    results: dict[str, object] = {}

    def work() -> None:  # math-verify's signal.alarm would raise ValueError here
        with Grader(time_limit=LIMIT_S) as in_thread:
            results["right"] = in_thread.grade(r"\boxed{\frac{1}{2}}", "0.5")
            results["hang"] = in_thread.grade(HANGING[0], "1")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results["right"].correct  # type: ignore[attr-defined]
    assert results["hang"].timed_out and not results["hang"].correct  # type: ignore[attr-defined]
    # the answer and its second try each overran: each cost the limit, not more
    assert 2 * LIMIT_S <= results["hang"].seconds < 2 * LIMIT_S + 1.0  # type: ignore[attr-defined]


def test_default_grader_shared_by_thread_pool() -> None:
    cases = [(rf"\boxed{{{i}}}", str(i if i % 3 else i + 1)) for i in range(24)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        verdicts = list(pool.map(lambda case: grade(*case), cases))
    assert verdicts == [i % 3 != 0 for i in range(24)]


def _grade_in_child(payload: tuple[str, str]) -> tuple[bool, bool, float]:
    # A pool worker is daemonic: it may not start multiprocessing children (so no process pool such as
    # concurrent.futures or pebble can grade here: docs/evaluation/grading-performance.md); the grader's plain
    # subprocess it may.
    assert multiprocessing.current_process().daemon
    completion, gold = payload
    with Grader(time_limit=LIMIT_S) as child_grader:
        result = child_grader.grade(completion, gold)
    return result.correct, result.timed_out, result.seconds


def _default_grade_in_child(payload: tuple[str, str]) -> bool:
    return grade(*payload)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_time_limit_inside_worker_processes(start_method: str) -> None:
    context = multiprocessing.get_context(start_method)
    with context.Pool(2) as pool:
        right, hang = pool.map(_grade_in_child, [(r"\boxed{3}", "3"), (HANGING[0], "1")])
    assert right[0] and not right[1]
    assert hang[:2] == (False, True)
    assert hang[2] >= LIMIT_S  # cut off only once the limit has passed


def test_default_grader_after_fork() -> None:
    assert grade(r"\boxed{1}", "1")  # the parent's default grader exists before the fork
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.map(_default_grade_in_child, [(r"\boxed{2}", "2"), (r"\boxed{2}", "3")]) == [True, False]


# ---------------------------------------------------------------------------------- TRL reward


def test_accuracy_reward_trl_signature() -> None:
    assert accuracy_reward.__name__ == "accuracy_reward"
    completions = [
        r"\boxed{68}",
        "The answer is 67",
        [{"role": "assistant", "content": r"$\boxed{\frac{1}{2}}$"}],
        "x",
    ]
    rewards_out = accuracy_reward(
        prompts=["Q: 23+45=\nA:"] * 4,
        completions=completions,
        completion_ids=[[1, 2]] * 4,
        answer=["68", "68", "0.5", ""],
        trainer_state=None,
        log_extra=None,
        other_column=[1, 2, 3, 4],
    )
    assert rewards_out == [1.0, 0.0, 1.0, None]


def test_make_accuracy_reward_uses_its_grader() -> None:
    with Grader(num_workers=2, time_limit=LIMIT_S) as pool:
        reward = rewards.make_accuracy_reward(pool)
        assert reward.__name__ == "accuracy_reward"
        assert reward(completions=[r"\boxed{1}", HANGING[0]], answer=["1", "1"], prompts=None) == [1.0, 0.0]
        assert pool.timeouts == 2  # the answer, then its second try in a fresh worker


def test_accuracy_reward_on_a_batch_of_the_tiny_task() -> None:
    # Answers per second of this path (the default grader's worker) are measured by
    # perf/eval_throughput.py ("synthetic", subprocess x1).
    from d3s.data.synthetic import arithmetic_problems

    problems = arithmetic_problems(200, seed=3, split="test")
    completions = [
        p.completion.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}")
        if i % 2
        else p.completion
        for i, p in enumerate(problems)
    ]
    assert sum(c != p.completion for c, p in zip(completions, problems, strict=True)) == len(problems) // 2
    scores = accuracy_reward(completions, [p.answer for p in problems])
    assert scores == [0.0 if i % 2 else 1.0 for i in range(len(problems))]


def test_grade_detailed_default_grader() -> None:
    result = grade_detailed(r"\boxed{12}", "12")
    assert result.correct and result.gold_parsed and not result.timed_out


# ------------------------------------------------------------------------------- answer policies

ISSUE_EXAMPLE = r"\boxed{18} ... wait, actually \boxed{20}"  # the issue's example

POLICY_CASES = [
    # (completion, gold, math_verify correct, last_boxed correct); math_verify: math-verify 0.9.0's verdict
    (ISSUE_EXAMPLE, "20", False, True),  # boxes 16 characters apart: math-verify reads {18, 20}
    # each box in its own math environment: math-verify reads the last environment, 20
    (r"So $x = \boxed{18}$... wait, actually $x = \boxed{20}$.", "20", True, True),
    (r"\boxed{20} ... hmm, no: \boxed{18}", "20", False, False),  # first right, last wrong: both wrong
    (r"\boxed{18} and \boxed{20}", "18, 20", True, False),  # a set answer spread over boxes
    (r"\boxed{3} then \boxed{\frac{1}{2}}", "0.5", False, True),  # nested braces in the last box
    (r"first \boxed{\{1, 2\}} then \boxed{\left\{ 3 \right.}", "3", True, True),  # escaped braces skipped
    (r"\boxed 5", "5", True, True),  # no braces: the token after the command
    (r"\boxed{7} or \boxed 5", "5", False, True),
    (r"\boxed{7}, then \boxed 5.", "5", False, True),  # the sentence's period is not part of the answer
    (r"\fbox{7}", "7", False, True),  # math-verify's extraction finds only \boxed
    (r"\boxed{18} wait \boxed{20}", r"\boxed{20}", False, True),  # a box inside the gold
    ("I don't know", "5", False, False),  # no box, no answer: both wrong
    ("The answer is 68", "68", True, True),  # no box: both fall back the same way (boxed_first)
    # the last box never closes: no answer for last_boxed; math-verify reads the last closed one
    (r"\boxed{3} wait, it is \boxed{12", "3", True, False),
    (
        r"\boxed{7} and finally \boxed{}",
        "7",
        False,
        False,
    ),  # an empty last box: no answer (and "7," for math-verify)
]


@pytest.mark.parametrize(("completion", "gold", "by_math_verify", "by_last_boxed"), POLICY_CASES)
def test_answer_policies(
    completion: str, gold: str, by_math_verify: bool, by_last_boxed: bool, grader: Grader
) -> None:
    results = grader.grade_many_by_policy([completion], [gold])
    assert results["math_verify"][0].correct is by_math_verify
    assert results["last_boxed"][0].correct is by_last_boxed
    for policy in ANSWER_POLICIES:
        assert results[policy][0].gold_parsed and not results[policy][0].timed_out
        assert grader.grade(completion, gold, policy).correct is results[policy][0].correct


MATH_VERIFY_READINGS = [
    # (completion, gold, correct): math-verify 0.9.0 reads a box alone when it is in its own math
    # environment, boxes in one environment together, and boxes outside any close together
    (r"$\boxed{18}$ ... wait, actually $\boxed{20}$", "20", True),
    (r"$\boxed{11}$ and then $\boxed{7}$", "7", True),
    (r"$\boxed{11}$ and then $\boxed{7}$", "11", False),
    (r"$\boxed{3} or \boxed{4}$", "4", False),
    (r"$\boxed{3} or \boxed{4}$", "3, 4", True),
    (r"\boxed{11}. We check this again carefully step by step. \boxed{7}", "7", True),
]


@pytest.mark.parametrize(("completion", "gold", "correct"), MATH_VERIFY_READINGS)
def test_math_verify_policy_reads_as_math_verify(
    completion: str, gold: str, correct: bool, grader: Grader
) -> None:
    result = grader.grade(completion, gold, "math_verify")
    assert result.correct is correct and not result.bounded and not result.timed_out


def test_bounded_reading_follows_math_verify_box_chain() -> None:
    chain = _box_chain
    assert chain(ISSUE_EXAMPLE) == ["18", "20"]  # under 10 characters apart
    assert chain(r"\boxed{3} or perhaps, on reflection, \boxed{4}") == ["3", "4"]  # a separator, under 70
    assert chain(r"\boxed{11}. We check this again carefully step by step. \boxed{7}") == ["7"]
    assert chain(r"\boxed{5} \boxed{5} \boxed{6}") == ["5", "6"]  # consecutive repeats once
    assert chain(r"\boxed{5} \boxed{6} \boxed{5}") == ["5", "6", "5"]
    assert chain("no box") == []
    assert extract_answer(ISSUE_EXAMPLE, "math_verify") == r"\boxed{18} \boxed{20}"


# A loop after an unclosed "$": math-verify's pattern for a box in a math environment backtracks for
# seconds on it before finding nothing; the policy searches it only where it can match (the same result).
UNCLOSED_LOOP = "So $x = 12$ and the answer is $ " + " ".join([r"\boxed{\frac{24}{2}}"] * 300)
# The same loop followed by an escaped "\$", a dollar sign that closes no environment: the pattern cannot
# match either (24 s of backtracking in math-verify before issue 57, past any time limit).
ESCAPED_LOOP = "So the answer is $ " + " ".join([r"\boxed{\frac{24}{2}}"] * 300) + r" \$"


def test_loop_after_unclosed_dollar_is_read_by_math_verify_fast(grader: Grader) -> None:
    assert not boxed_environment_possible(UNCLOSED_LOOP)
    result = grader.grade(UNCLOSED_LOOP, "12", "math_verify")
    assert result.correct and not result.bounded and not result.timed_out and result.seconds < LIMIT_S


def test_loop_before_an_escaped_dollar_is_read_by_math_verify_fast(grader: Grader) -> None:
    assert not boxed_environment_possible(ESCAPED_LOOP)
    assert boxed_environment_possible(ESCAPED_LOOP + " $")  # an unescaped "$" closes it
    before = grader.timeouts
    result = grader.grade(ESCAPED_LOOP, "12", "math_verify")
    assert result.correct and not result.bounded and not result.timed_out and result.seconds < LIMIT_S
    assert grader.timeouts == before


def test_overrun_is_graded_again_then_wrong(grader: Grader) -> None:
    # Under any policy: a second try in a fresh worker, the same reading; both overran, so it is wrong.
    before = grader.timeouts
    results = grader.grade_many_by_policy([HANGING[0]], ["1"], ("math_verify", "last_boxed"))
    for policy, (result,) in results.items():
        assert result.timed_out and not result.correct and not result.bounded, policy
        assert result.seconds >= 2 * LIMIT_S, policy
    assert grader.timeouts == before + 2 * len(results)


def test_last_boxed_answer_extraction() -> None:
    assert last_boxed_answer(ISSUE_EXAMPLE) == "20"
    assert last_boxed_answer(r"\boxed{\frac{a}{b^{2}}} text") == r"\frac{a}{b^{2}}"
    assert last_boxed_answer(r"\boxed  42 is it") == "42"
    assert last_boxed_answer(r"\boxedx{3}") is None  # another command, not a box
    assert last_boxed_answer("no box") is None
    assert count_boxes(r"\boxed{1} \fbox{2} \boxed 3 \boxedfoo") == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{ {a}^{b} }", "{a}^{b}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5$", "5"),
        ("no box", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_last_boxed_answer_of_reference_solutions(text: str, expected: str | None) -> None:
    """Minerva's gold and the audit's reference answers are the last box of a solution."""
    assert last_boxed_answer(text) == expected


def test_module_grade_takes_a_policy() -> None:
    assert not grade(ISSUE_EXAMPLE, "20")  # the default policy is math_verify
    assert grade(ISSUE_EXAMPLE, "20", "last_boxed")
    assert grade(ISSUE_EXAMPLE, "20", policy="last_boxed")
    assert grade_detailed(ISSUE_EXAMPLE, "20", "last_boxed").extracted == "20"
    results = default_grader().grade_many([ISSUE_EXAMPLE] * 2, ["20", "18"], "last_boxed")
    assert [r.correct for r in results] == [True, False]
    with pytest.raises(ValueError, match="math_verify, last_boxed"):
        grade(ISSUE_EXAMPLE, "20", "first_boxed")  # type: ignore[arg-type]


def test_both_policies_under_the_time_limit_and_inline(grader: Grader) -> None:
    completions = [HANGING[0], r"\boxed{9} no \boxed{5}"]  # a power tower hangs under both policies
    results = grader.grade_many_by_policy(completions, ["5"] * 2, BOXED_POLICIES)
    assert [r.timed_out for r in results["math_verify"]] == [True, False]
    assert [r.timed_out for r in results["last_boxed"]] == [True, False]
    assert [r.correct for r in results["last_boxed"]] == [False, True]
    assert grader.grade(r"\boxed{5}", "5", "last_boxed").correct  # healthy after the kills
    inline = Grader(time_limit=None)  # no worker: the same policies in-process
    verdicts = {
        p: [r.correct for r in v] for p, v in inline.grade_many_by_policy([ISSUE_EXAMPLE], ["20"]).items()
    }
    assert verdicts == {"math_verify": [False], "last_boxed": [True], "answer_tag": [True], "trl": [False]}


def test_accuracy_reward_under_each_policy() -> None:
    completions = [ISSUE_EXAMPLE, [{"role": "assistant", "content": r"\boxed{20} no \boxed{18}"}]]
    assert accuracy_reward(completions, ["20", "20"]) == [0.0, 0.0]
    last = rewards.make_accuracy_reward(policy="last_boxed")
    assert last.__name__ == "accuracy_reward" and last.answer_policy == "last_boxed"  # type: ignore[attr-defined]
    assert last(completions=completions, answer=["20", "20"], prompts=None) == [1.0, 0.0]
    with pytest.raises(ValueError, match="answer policy"):
        rewards.make_accuracy_reward(policy="first_boxed")  # type: ignore[arg-type]


def test_bind_answer_policy_replaces_only_accuracy_reward() -> None:
    def other(completions: list[str], **kwargs: object) -> list[float]:
        return [0.5] * len(completions)

    funcs = [accuracy_reward, other]
    assert rewards.bind_answer_policy(funcs, "math_verify") is funcs  # the default: untouched
    bound = rewards.bind_answer_policy(funcs, "last_boxed")
    assert bound[1] is other and bound[0] is not accuracy_reward
    assert bound[0]([ISSUE_EXAMPLE], ["20"]) == [1.0]
    assert rewards.bind_answer_policy(accuracy_reward, "last_boxed")([ISSUE_EXAMPLE], ["20"]) == [1.0]


def test_trainer_grades_with_its_answer_policy(tmp_path: Path) -> None:
    """D3SConfig.answer_policy reaches the accuracy reward the trainer calls."""
    from datasets import Dataset
    from helpers import save_tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s.trainer import D3SConfig, D3STrainer

    model_path = save_tiny(tmp_path / "tiny")
    settings = dict(per_device_train_batch_size=4, num_generations=4, max_steps=1, bf16=False, use_cpu=True)
    settings |= dict(logging_steps=1)  # the step's record is read below
    with pytest.raises(ValueError, match="answer_policy must be one of math_verify, last_boxed"):
        D3SConfig(output_dir=str(tmp_path / "bad"), answer_policy="first_box", **settings)
    assert D3SConfig(output_dir=str(tmp_path / "default"), **settings).answer_policy == "math_verify"
    trainer = D3STrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=D3SConfig(
            output_dir=str(tmp_path / "run"), answer_policy="last_boxed", metrics_log=None, **settings
        ),
        reward_funcs=[accuracy_reward],
        train_dataset=Dataset.from_list([{"prompt": "Q: 1+1=\nA:", "answer": "2"}] * 4),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    reward = trainer.reward_funcs[0]
    assert reward.__name__ == "accuracy_reward" and trainer.reward_func_names == ["accuracy_reward"]
    assert reward(completions=[ISSUE_EXAMPLE], answer=["20"]) == [1.0]
    assert reward.reward_copied_answers  # the default: math-verify's verdict, copies included
    with pytest.raises(ValueError, match="reward_copied_answers must be true or false"):
        D3SConfig(output_dir=str(tmp_path / "bad"), reward_copied_answers="no", **settings)
    guarded_trainer = D3STrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=D3SConfig(
            output_dir=str(tmp_path / "guarded"),
            reward_copied_answers=False,
            max_completion_length=8,
            metrics_log=None,
            report_to=[],
            **settings,
        ),
        reward_funcs=[accuracy_reward],
        train_dataset=Dataset.from_list([{"prompt": "Q: 12+7-3=\nA:", "answer": "16"}] * 4),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    guarded = guarded_trainer.reward_funcs[0]
    prompts = ["Q: 12+7-3=\nA:"] * 2
    assert guarded([r"\boxed{12+7-3}", r"\boxed{16}"], ["16", "16"], prompts=prompts) == [0.0, 1.0]
    guarded_trainer.train()  # one step: TRL passes the prompts and log_metric, the share is logged
    (step,) = [entry for entry in guarded_trainer.state.log_history if "loss" in entry]
    assert 0.0 <= step["reward/copied_fraction"] <= 1.0


# ------------------------------------------------- issue 20: what counts as the answer, and how fast

FAST_S = 0.5  # no completion of these kinds may take longer to grade (the issue's bound)
REASONING = "We add the two cases and simplify the fraction before checking the constraint again. " * 40


def looping_completions(gold: str) -> dict[str, str]:
    """Completions that loop: 1,000+ boxes, mostly the same, as lines or run together (math-verify reads
    run-together boxes as one growing set answer: seconds per completion before deduplication)."""
    same = r"\frac{" + str(2 * int(gold)) + "}{2}"
    variants = [same if i % 40 else rf"\frac{{{i}}}{{7}}" for i in range(1200)]
    return {
        "lines": REASONING + "".join(f"The final answer is $\\boxed{{{same}}}$.\n" for _ in range(1100)),
        "run together": REASONING + " ".join(f"\\boxed{{{same}}}" for _ in range(1300)),
        "with variants": REASONING + " ".join(f"\\boxed{{{v}}}" for v in variants),
        "cut off": REASONING + " ".join(f"\\boxed{{{same}}}" for _ in range(1000)) + r" \boxed{\frac{1",
    }


def test_looping_completions_graded_fast_without_timeouts() -> None:
    completions = looping_completions("12")
    with Grader(num_workers=1) as fast:  # the default 5 s limit: only a last guard
        fast.grade(r"\boxed{1}", "1")  # start the worker before timing
        results = fast.grade_many_by_policy(list(completions.values()), ["12"] * len(completions))
        assert fast.timeouts == 0
    for policy, graded in results.items():
        for kind, result in zip(completions, graded, strict=True):
            assert not result.timed_out and not result.bounded and result.error is None, (policy, kind)
            # math_verify is math-verify on the whole completion: the issue's bound of 1 s
            assert result.seconds < (1.0 if policy == "math_verify" else FAST_S), (
                policy,
                kind,
                result.seconds,
            )
    last_boxed = [r.correct for r in results["last_boxed"]]
    assert last_boxed == [True, True, True, False]  # the cut-off last box is no answer
    # math-verify: repeats of one box are one answer; boxes with variants between them a set answer
    # (wrong); after a cut-off box, the closed boxes before it
    assert [r.correct for r in results["math_verify"]] == [True, True, False, True]


def test_many_distinct_boxes_are_wrong_without_parsing() -> None:
    distinct = " ".join(f"\\boxed{{{i}}}" for i in range(MAX_DISTINCT_BOXES + 1))
    assert extract_answer(distinct, "math_verify") is None
    assert extract_answer(distinct, "last_boxed") == rf"\boxed{{{MAX_DISTINCT_BOXES}}}"
    assert extract_answer(r"\boxed{" + "1+" * 1000 + "1}", "last_boxed") is None  # too long


RESTATED_QUESTION = (
    "Find the value of $m$ such that $m + 3 = 10$. Let me restate: we need $m$ where $m + 3 = 10$. "
    "So the answer is \\boxed{}"
)
CUT_OFF = r"We get $x = p - q$, and the remainder is $\frac{1}{8}$. Hence \boxed{p - q - \frac{1}{8"


BOUNDED_POLICIES = ("last_boxed", "answer_tag")  # the rules of extract_answer; math_verify is math-verify


@pytest.mark.parametrize("policy", BOUNDED_POLICIES)
def test_empty_or_cut_off_last_box_is_wrong_never_free_text(policy: str, grader: Grader) -> None:
    for completion, gold in [
        (RESTATED_QUESTION, "m"),  # free text holds $m$: it must not be read
        (RESTATED_QUESTION, "7"),
        (CUT_OFF, r"p - q - \frac{1}{8}"),
        (CUT_OFF, r"\frac{1}{8}"),
        (r"The answer is 5, so \boxed{5} ... \boxed{ }", "5"),  # a blank last box
    ]:
        result = grader.grade(completion, gold, policy)  # type: ignore[arg-type]
        assert not result.correct and result.extracted is None and not result.timed_out, (completion, gold)
    # a box that parses as nothing gives no answer either, not the free text around it
    assert not grader.grade(r"The answer is 42. \boxed{\,}", "42", policy).correct  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", BOUNDED_POLICIES)
@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"so she has \boxed{18.}", "18"),
        (r"\boxed{5.}", "5"),
        (r"$\boxed{2.5;}$", "2.5"),
        (r"\boxed{5!}", "120"),
    ],
)
def test_trailing_punctuation_inside_the_box(completion: str, gold: str, policy: str, grader: Grader) -> None:
    assert grader.grade(completion, gold, policy).correct  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("completion", "gold", "correct"),
    [
        (r"\boxed{-1.5}", "-3./2", True),  # the gold parsed only as text before normalisation
        (r"\boxed{-\frac{3}{2}}", "-3./2", True),
        (r"\boxed{1.5}", "-3./2", False),
        (r"\boxed{18}", "18.", True),
        (r"\boxed{540}", r"540 \text{ meters}", True),  # units dropped from gold as from predictions
        (r"\boxed{10 cups}", "10", True),
    ],
)
def test_gold_normalised_like_predictions(completion: str, gold: str, correct: bool, grader: Grader) -> None:
    result = grader.grade(completion, gold, "last_boxed")
    assert result.correct is correct and result.gold_parsed and not result.gold_as_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18.", "18"),
        ("-3./2", "-3/2"),
        ("2.5", "2.5"),
        ("$\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("\\[540 \\text{ meters}\\]", "540"),
        ("\\frac{1}{2} \\text{ inches}", "\\frac{1}{2}"),
        ("10 cups (to feed all 20 chickens)", "10"),
        ("1,200 dollars", "1200"),
        ("\\text{Monday}", "\\text{Monday}"),
        ("(3, \\frac{\\pi}{2})", "(3, \\frac{\\pi}{2})"),
        ("5!", "5!"),
        ("Evelyn.", "Evelyn"),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


SENTENCE = "Each chicken eats half a cup. The answer is 10 cups (enough for all 20 chickens)."


@pytest.mark.parametrize("policy", BOUNDED_POLICIES)
def test_sentence_answers_not_credited_for_a_quoted_number(policy: str, grader: Grader) -> None:
    for completion in [
        SENTENCE,
        r"\boxed{10 cups (enough for all 20 chickens)}",
        "<answer>10 cups (all 20 chickens)</answer>",
    ]:
        assert not grader.grade(completion, "20", policy).correct, completion  # type: ignore[arg-type]
        assert grader.grade(completion, "10", policy).correct, completion  # type: ignore[arg-type]


FALLBACK_CASES = [
    # (completion without a box, gold, correct)
    (
        r"In polar form the point is therefore... The answer is (3, \frac{\pi}{2}).",
        r"\left( 3, \frac{\pi}{2} \right)",
        True,
    ),
    ("Alice runs 5 miles per hour and Evelyn 7 miles per hour. The answer is Evelyn.", "Evelyn", True),
    ("Alice runs 5 miles per hour and Evelyn 7 miles per hour. The answer is Evelyn.", "7", False),
    ("Let City $A$ be the start and City $B$ the end.\n<answer>27</answer>", "27", True),
    (r"So the total distance is: \[540 \text{ meters}\]", "540", True),
    (r"The final answer is: \[540 \text{ meters}\]", "540", True),
    ("She has 3 apples, then buys 15. The answer is 18.", "18", True),
    ("She has 3 apples, then buys 15. The answer is 18.", "3", False),
]


@pytest.mark.parametrize(("completion", "gold", "correct"), FALLBACK_CASES)
@pytest.mark.parametrize("policy", BOUNDED_POLICIES)
def test_fallback_reads_answers_outside_a_box(
    completion: str, gold: str, correct: bool, policy: str, grader: Grader
) -> None:
    result = grader.grade(completion, gold, policy)  # type: ignore[arg-type]
    assert result.correct is correct and not result.timed_out


# ---------------------------------------------------------------------- PODS's <answer> tags and reward

PODS_RIGHT = "<think>\nShe buys 3 packs of 6 eggs: 3 * 6 = 18.\n</think>\n<answer>\n18\n</answer>"
PODS_BOXED = "<think>\n3 * 6 = 18\n</think>\n<answer>\\boxed{18}</answer>"
PODS_DRAFT_BOX = "<think>\nFirst guess \\boxed{16}, but 3 * 6 = 18.\n</think>\n<answer>18</answer>"
PODS_CUT_OFF = "<think>\n3 * 6 = 18\n</think>\n<answer>\n1"
PODS_EMPTY = "<think>\n3 * 6 = 18\n</think>\n<answer> </answer>"


@pytest.mark.parametrize(
    ("completion", "by_answer_tag", "by_last_boxed"),
    [
        (PODS_RIGHT, True, True),  # no box: the fallback reads the answer tag too
        (PODS_BOXED, True, True),
        (PODS_DRAFT_BOX, True, False),  # a box in the reasoning: last_boxed reads it, answer_tag the tag
        (PODS_CUT_OFF, False, False),  # an answer tag that never closes is no answer
        (PODS_EMPTY, False, False),
        (r"No tags, but \boxed{18}", True, True),  # no answer tag: read as last_boxed reads it
        ("<answer>17</answer> then <answer>18</answer>", True, True),  # the last tag counts
        ("<answer>18</answer> then <answer>17</answer>", False, False),
    ],
)
def test_answer_tag_policy(completion: str, by_answer_tag: bool, by_last_boxed: bool, grader: Grader) -> None:
    results = grader.grade_many_by_policy([completion], ["18"], ("answer_tag", "last_boxed"))
    assert results["answer_tag"][0].correct is by_answer_tag
    assert results["last_boxed"][0].correct is by_last_boxed


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>5</answer>", 0.2),  # all inside, every tag once
        (" <think>a</think>\n<answer>5</answer>\n", 0.2),  # whitespace around and between is not counted
        ("<think>a</think><answer>5</answer>" + "x" * 30, 0.1 * 0.7 + 0.1),  # 30 characters outside
        ("<think>a</think><answer>5</answer>" + "x" * 200, 0.1),  # the structure term floors at 0
        ("<think>a</think><answer>5</answer><answer>6</answer>", 0.1 * (1 - 0.18) + 0.05),  # tags twice
        ("The answer is 5", 0.1 * (1 - 0.15)),  # no structure: every character is outside
        ("", 0.1),
    ],
)
def test_pods_format_score(completion: str, expected: float) -> None:
    assert rewards.pods_format_score(completion) == pytest.approx(expected)


def test_pods_reward_sums_correctness_and_format() -> None:
    funcs = rewards.bind_answer_policy(rewards.reward_functions("pods"), "answer_tag")
    assert [f.__name__ for f in funcs] == ["accuracy_reward", "pods_format_reward"]
    assert funcs[0].answer_policy == "answer_tag"
    completions = [[{"role": "assistant", "content": c}] for c in (PODS_RIGHT, PODS_DRAFT_BOX, PODS_CUT_OFF)]
    per_func = [f(completions=completions, answer=["18"] * 3, prompts=["q"] * 3) for f in funcs]
    totals = [sum(values) for values in zip(*per_func, strict=True)]
    assert totals[0] == pytest.approx(1.2) and totals[1] == pytest.approx(1.2)
    # wrong; no structure, so every character is outside; </answer> is missing
    assert totals[2] == pytest.approx(0.1 * (1 - 0.01 * len(PODS_CUT_OFF)) + 0.075)
    assert rewards.reward_functions() == [rewards.accuracy_reward]
    with pytest.raises(ValueError, match="accuracy, pods"):
        rewards.reward_functions("format")


def test_run_config_selects_pods_reward_template_and_policy() -> None:
    from d3s.data.templates import build_prompt
    from d3s.runs.config import ConfigError, coerce_run_config

    config = coerce_run_config(
        {"reward": "pods", "template": "pods", "trainer": {"answer_policy": "answer_tag"}}
    )
    assert config["reward"] == "pods" and config["trainer"]["answer_policy"] == "answer_tag"
    with pytest.raises(ConfigError, match="accuracy, pods"):
        coerce_run_config({"reward": "format"})
    prompt = build_prompt("What is 3 * 6?", "pods")  # no chat template: the plain form
    assert "<think>" in prompt and "<answer>" in prompt and prompt.endswith("What is 3 * 6?\n")


# ------------------------------------------------------- issue 47: the trl policy, copied answers

TRL_CASES = [
    # (completion, gold, math_verify, trl): TRL's reward reads LaTeX only and needs an anchor or a box
    (r"so \boxed{16}", "16", True, True),
    ("12 + 4 = 16", "16", True, False),  # a plain expression: math_verify's ExprExtractionConfig only
    ("The final answer is $16$", "16", True, True),
    (r"$\boxed{3}$ then $\boxed{4}$", "4", True, True),  # both read the last box in its own $...$
    (r"The distance is \boxed{5\text{ km}}", "5", True, True),  # units normalised by TRL
]


@pytest.mark.parametrize(("completion", "gold", "by_math_verify", "by_trl"), TRL_CASES)
def test_trl_policy_is_trls_accuracy_reward(
    completion: str, gold: str, by_math_verify: bool, by_trl: bool, grader: Grader
) -> None:
    from trl.rewards import accuracy_reward as trl_accuracy_reward

    results = grader.grade_many_by_policy([completion], [gold], ("math_verify", "trl"))
    assert results["math_verify"][0].correct is by_math_verify
    assert results["trl"][0].correct is by_trl
    assert trl_accuracy_reward([[{"content": completion}]], [gold]) == [float(by_trl)]


def test_trl_policy_skips_an_unparsable_gold_as_trl_does(grader: Grader) -> None:
    from trl.rewards import accuracy_reward as trl_accuracy_reward

    gold = r"\frac{"  # parse(sol) finds nothing
    assert trl_accuracy_reward([[{"content": r"\boxed{1}"}]], [gold]) == [None]
    assert not grader.grade(r"\boxed{1}", gold, "trl").gold_parsed
    assert rewards.make_accuracy_reward(grader, policy="trl")([r"\boxed{1}"], [gold]) == [None]


COPIED = [
    # (answer as extracted, prompt, copied)
    ("12+7-3", "What is 12+7-3?", True),  # the issue's example
    ("12 + 7 - 3", "Evaluate $12+7-3$.", True),  # up to whitespace and $
    ("(1+2i)6-3i", "Evaluate $(1+2i)6-3i$.", True),  # the issue's real completion
    (r"(\frac{1}{2})^{100} \cdot 2^{100}", r"What is $\left(\frac{1}{2}\right)^{100} \cdot 2^{100}$?", True),
    (r"\dfrac{24}{2}", r"Simplify $\frac{24}{2}$.", True),  # a fraction not in lowest terms is an operation
    ("7-3", "What is 12+7-3?", True),  # a copied piece is a copy too
    ("x+y", "Positive reals satisfy ... What is $x+y$?", True),
    ("16", "A farmer has 16 cows and buys 12+7-3 more.", False),  # a short answer that is in the prompt
    ("-3", "What is 12-3?", False),  # a leading sign is not an operation
    (r"\frac{1}{2}", r"Is $\frac{1}{2}$ of 1 equal to 0.5?", False),  # a fraction in lowest terms: a value
    ("6+9i", "Is 6+9i a root of the polynomial?", False),  # a complex number written out: a value
    ("3.5", "Add 3.5 and 0", False),
    ("1,000", "Of 1,000 apples ...", False),
    ("12+7-3", "What is 12+7-4?", False),  # not in the prompt
    ("12+7-3", "", False),
    (None, "What is 12+7-3?", False),
    (r"\sqrt{2}", r"Is $\sqrt{2}$ rational?", False),  # no operation written: a value
]


@pytest.mark.parametrize(("answer", "prompt", "copied"), COPIED)
def test_copied_from_prompt(answer: str | None, prompt: str, copied: bool) -> None:
    assert copied_from_prompt(answer, prompt) is copied


def test_copied_flag_on_graded_completions() -> None:
    """The flag reads the answer as the policy extracted it; a correct computed answer is never flagged."""
    prompt = "Evaluate 12+7-3."
    for policy in ("math_verify", "last_boxed"):
        copied = grade_detailed(r"So \boxed{12+7-3}", "16", policy, prompt=prompt)
        assert copied.correct and copied_from_prompt  # credited by math-verify, flagged
        computed = grade_detailed(r"12+7-3 = 16, so \boxed{16}", "16", policy, prompt=prompt)
        assert computed.correct and not computed.copied_from_prompt
        bare = grade_detailed(" 12+7-3", "16", policy, prompt=prompt)  # no box: math-verify's fallback
        assert bare.correct and bare.copied_from_prompt
    assert not grade_detailed(r"So \boxed{12+7-3}", "16").copied_from_prompt  # no prompt: no flag


@given(
    numbers=st.lists(st.integers(0, 999), min_size=2, max_size=4),
    operators=st.lists(st.sampled_from(["+", "-", "*"]), min_size=3, max_size=3),
    spaced=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_copied_expression_flagged_and_its_value_never(
    numbers: list[int], operators: list[str], spaced: bool
) -> None:
    """For any arithmetic question: its expression copied is flagged, written with other spacing or in
    $...$ too; its value, even where that number also appears in the prompt, is not."""
    joiner = " {} " if spaced else "{}"
    pairs = zip(operators, numbers[1:], strict=False)
    expression = str(numbers[0]) + "".join(joiner.format(o) + str(n) for o, n in pairs)
    value = eval(expression)  # noqa: S307 (integers and + - * only)
    prompt = f"Compute ${expression}$. (Hint: the answer is not {value + 1}; {value} apples are red.)"
    assert copied_from_prompt(expression.replace(" ", ""), prompt)
    assert copied_from_prompt(f"{{{expression}}}", prompt)
    assert not copied_from_prompt(str(value), prompt)


def test_accuracy_reward_logs_copied_fraction_and_guard_zeroes_copies() -> None:
    logged: list[tuple[str, float]] = []
    prompts = [[{"role": "user", "content": "Evaluate 12+7-3."}]] * 4
    completions = [r"\boxed{12+7-3}", r"\boxed{16}", r"\boxed{15}", r"\boxed{12+7-3}"]
    kwargs = dict(prompts=prompts, log_metric=lambda name, value: logged.append((name, value)))
    assert accuracy_reward(completions, ["16"] * 4, **kwargs) == [1.0, 1.0, 0.0, 1.0]  # the default
    assert logged == [("reward/copied_fraction", 0.5)]
    guarded = rewards.make_accuracy_reward(reward_copied_answers=False)
    assert guarded(completions, ["16"] * 4, **kwargs) == [0.0, 1.0, 0.0, 0.0]
    assert guarded(completions, ["16"] * 4) == [1.0, 1.0, 0.0, 1.0]  # without prompts nothing is known
    bound = rewards.bind_answer_policy([accuracy_reward], "math_verify", reward_copied_answers=False)
    assert bound[0](completions, ["16"] * 4, prompts=prompts) == [0.0, 1.0, 0.0, 0.0]
