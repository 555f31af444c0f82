"""Plain integer answers read without the parser (d3s/integer_answers.py): the same verdict and extracted
answer as math-verify's own reading, on every completion of the shape read there, and on the tiny model's
sampled completions."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from d3s.data.synthetic import arithmetic_problems, make_problem
from d3s.grading.pool import Grader
from d3s.grading.reading import _MathVerifyGrader
from d3s.integer_answers import COMPLETION, POLICIES, integer_grade

MATH_VERIFY = _MathVerifyGrader("boxed_first")  # the parser's reading, which the grader used for every answer
FIELDS = ("correct", "extracted", "gold_parsed", "error", "gold_as_text")

integers = st.integers(-999_999, 999_999).map(str)
golds = st.one_of(integers, st.sampled_from(["0", "7", "-3", "12"]))


def _parsed(completion: str, gold: str, policy: str) -> dict:
    return {
        key: value for key, value in MATH_VERIFY.grade(completion, (gold,), policy).items() if key in FIELDS
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=st.from_regex(COMPLETION, fullmatch=True), gold=golds, policy=st.sampled_from(POLICIES))
def test_every_completion_read_here_gets_math_verifys_grade(completion, gold, policy):
    read = integer_grade(completion, (gold,), policy)
    assert read is not None
    assert {key: read[key] for key in FIELDS} == _parsed(completion, gold, policy)


@settings(max_examples=100, deadline=None)
@given(
    prefix=st.from_regex(r"[0-9+\-=,. ]{0,30}", fullmatch=True),
    answer=integers,
    policy=st.sampled_from(POLICIES),
)
def test_the_right_answer_and_a_wrong_one(prefix, answer, policy):
    completion = f"{prefix}\\boxed{{{answer}}}"
    for gold in (answer, str(int(answer) + (1 if int(answer) < 999_999 else -1))):
        read = integer_grade(completion, (gold,), policy)
        assert read is not None and read["correct"] == (gold == answer)
        assert {key: read[key] for key in FIELDS} == _parsed(completion, gold, policy)


@pytest.mark.parametrize(
    "completion, gold, policy",
    [
        (" 3+4=7. \\boxed{07}", "7", "math_verify"),  # a leading zero: math-verify decides
        (" 3+4=7. \\boxed{-0}", "0", "math_verify"),
        (" 3+4=7. \\boxed{5} ", "5", "math_verify"),  # anything after the box
        (" 3+4=7. \\boxed{5}\\boxed{6}", "5", "math_verify"),  # two boxes
        ("the answer is \\boxed{5}", "5", "math_verify"),  # words before the box
        (" 3+4=7. \\boxed{5}", "5.0", "math_verify"),  # a gold that is not a plain integer
        (" 3+4=7. \\boxed{1234567}", "1234567", "math_verify"),  # more than 6 digits
        (" 3+4=7. \\boxed{5", "5", "math_verify"),  # a cut-off box
    ],
)
def test_every_other_answer_goes_to_math_verify(completion, gold, policy):
    assert integer_grade(completion, (gold,), policy) is None
    assert integer_grade(" 1+1=2. \\boxed{2}", ("2", "3"), "math_verify") is None  # two golds


def test_the_grader_gives_the_same_results_either_way():
    """Through the grader (time-limited workers): a batch mixing both kinds, every field as math-verify's."""
    problems = arithmetic_problems(40, seed=3, min_ops=3, max_ops=7, max_operand=9, bounded=True)
    completions = [p.completion for p in problems]
    completions += [c.replace("\\boxed{", "\\boxed{1") for c in completions[:10]]  # wrong answers
    completions += ["Q: 3+4=\\boxed{7} and more", " 2+2=4. The answer is \\boxed{4}."]
    gold_answers = [p.answer for p in problems] + [p.answer for p in problems[:10]] + ["7", "4"]
    with Grader(num_workers=1, time_limit=5.0) as grader:
        results = grader.grade_many_by_policy(completions, gold_answers, POLICIES)
    for policy in POLICIES:
        for completion, gold, result in zip(completions, gold_answers, results[policy], strict=True):
            expected = _parsed(completion, gold, policy)
            assert {key: getattr(result, key) for key in FIELDS} == expected, (policy, completion)
            assert not result.timed_out and not result.bounded
    assert sum(r.correct for r in results["math_verify"]) >= 40  # the task's own completions are right


@pytest.mark.slow
def test_sampled_completions_of_the_tiny_model_get_math_verifys_grade(tiny_sft_model):
    """What the tiny model writes at temperature 1 (well-formed or not): every grade as math-verify's."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_sft_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_sft_model)
    rng = random.Random(0)
    problems = [make_problem(rng, rng.randint(1, 3), 9, bounded=True) for _ in range(32)]
    prompts = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **prompts, do_sample=True, temperature=1.0, max_new_tokens=32, num_return_sequences=4
        )
    texts = tokenizer.batch_decode(out[:, prompts["input_ids"].size(1) :], skip_special_tokens=True)
    answers = [p.answer for p in problems for _ in range(4)]
    read_here = 0
    for text, gold in zip(texts, answers, strict=True):
        for policy in POLICIES:
            read = integer_grade(text, (gold,), policy)
            if read is not None:
                read_here += 1
                assert {key: read[key] for key in FIELDS} == _parsed(text, gold, policy), text
    assert read_here > 0


def test_a_read_grade_is_a_full_grade_result():
    with Grader(time_limit=None) as grader:
        result = grader.grade(" 3+4=7, 7-2=5. \\boxed{5}", "5")
    assert dataclasses.asdict(result) | {"seconds": 0.0} == {
        "correct": True,
        "extracted": "5",
        "gold_parsed": True,
        "timed_out": False,
        "seconds": 0.0,
        "error": None,
        "gold_as_text": False,
        "bounded": False,
        "copied_from_prompt": False,
    }
