"""The reward functions TRL calls (:func:`accuracy_reward`, PODS's :func:`pods_format_reward`, the sets a
run config picks by name: :data:`REWARD_SETS`) and the one-answer grading API (:func:`grade`,
:func:`grade_detailed`), on the grading of d3s/grading/: the same grader as the evaluation, so a model is
rewarded as it is scored. The rules (gold, extraction, answer policies, time limit):
docs/evaluation/grading.md."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from d3s.grading.copied import copied_from_prompt
from d3s.grading.policies import DEFAULT_ANSWER_POLICY, AnswerPolicy, Gold, check_answer_policy
from d3s.grading.pool import Grader, GradeResult, default_grader


def grade_detailed(
    completion: str,
    gold: Gold,
    policy: AnswerPolicy = DEFAULT_ANSWER_POLICY,
    *,
    prompt: str | None = None,
    grader: Grader | None = None,
) -> GradeResult:
    """Grade one completion; the full :class:`GradeResult` (extracted answer, timeout, gold status, and
    with ``prompt`` whether the answer was copied from it: :func:`copied_from_prompt`)."""
    result = (grader or default_grader()).grade(completion, gold, policy)
    return with_copied_flag(result, prompt)


def with_copied_flag(result: GradeResult, prompt: str | None) -> GradeResult:
    """``result`` with ``copied_from_prompt`` set for ``prompt`` (:func:`copied_from_prompt`)."""
    return dataclasses.replace(result, copied_from_prompt=copied_from_prompt(result.extracted, prompt))


def grade(
    completion: str, gold: Gold, policy: AnswerPolicy = DEFAULT_ANSWER_POLICY, *, grader: Grader | None = None
) -> bool:
    """True when the completion's final answer equals the gold answer under the answer ``policy``."""
    return grade_detailed(completion, gold, policy, grader=grader).correct


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of a TRL completion: a string, or a list of chat messages (the last one's content)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1].get("content", "") if completion else ""
    if isinstance(content, list):  # multimodal-style content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def prompt_text(prompt: str | Sequence[dict[str, Any]]) -> str:
    """The text of a TRL prompt: a string, or every message's content of a conversation, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(completion_text([message]) for message in prompt)


def make_accuracy_reward(
    grader: Grader | None = None,
    *,
    policy: AnswerPolicy = DEFAULT_ANSWER_POLICY,
    reward_copied_answers: bool = True,
) -> Callable[..., list[float | None]]:
    """:func:`accuracy_reward` bound to ``grader`` (None: the default grader, looked up per call so it
    survives a fork) and ``policy``; it keeps its name, so TRL logs it under the same key.
    ``reward_copied_answers=False``: an answer copied from the prompt (:func:`copied_from_prompt`) gets 0."""
    check_answer_policy(policy)

    def accuracy_reward(
        completions: Sequence[str | Sequence[dict[str, Any]]], answer: Sequence[Gold], **kwargs: Any
    ) -> list[float | None]:
        """TRL reward function: 1.0 correct, 0.0 wrong or timed out, None (TRL ignores the sample) when the
        gold is unparsable; graded under ``math_verify`` (:func:`make_accuracy_reward` binds another).
        With TRL's ``prompts`` and ``log_metric``, it logs ``reward/copied_fraction``: the share of
        completions whose answer is copied from the prompt."""
        texts = [completion_text(c) for c in completions]
        results = (grader or default_grader()).grade_many(texts, list(answer), policy)
        prompts = kwargs.get("prompts")
        copied = [False] * len(results)
        if prompts is not None:
            pairs = zip(results, prompts, strict=True)
            copied = [copied_from_prompt(r.extracted, prompt_text(p)) for r, p in pairs]
            if kwargs.get("log_metric") is not None and results:
                kwargs["log_metric"]("reward/copied_fraction", sum(copied) / len(results))
        return [
            (0.0 if c and not reward_copied_answers else float(r.correct)) if r.gold_parsed else None
            for r, c in zip(results, copied, strict=True)
        ]

    accuracy_reward.answer_policy = policy  # type: ignore[attr-defined]
    accuracy_reward.reward_copied_answers = reward_copied_answers  # type: ignore[attr-defined]
    accuracy_reward.__qualname__ = "accuracy_reward"  # the module-level one pickles by name
    return accuracy_reward


accuracy_reward = make_accuracy_reward()


def bind_answer_policy(reward_funcs: Any, policy: AnswerPolicy, *, reward_copied_answers: bool = True) -> Any:
    """``reward_funcs`` (one function or a list, as TRL takes them) with every :func:`accuracy_reward`
    replaced by one graded under ``policy`` (and ``reward_copied_answers``); other reward functions are
    left as they are."""
    check_answer_policy(policy)
    if policy == DEFAULT_ANSWER_POLICY and reward_copied_answers:
        return reward_funcs

    def bind(func: Any) -> Any:
        if func is not accuracy_reward:
            return func
        return make_accuracy_reward(policy=policy, reward_copied_answers=reward_copied_answers)

    if isinstance(reward_funcs, (list, tuple)):
        return type(reward_funcs)(bind(f) for f in reward_funcs)
    return bind(reward_funcs)


# PODS's reward: correctness 1.0 plus a format term (max 0.2) for its <think>...</answer> format.

PODS_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
PODS_FORMAT_WEIGHT = 0.1  # times max(0, 1 - 0.01 * characters outside the format)
PODS_CHARS_PENALTY = 0.01
PODS_TAG_WEIGHT = 0.025  # per tag that appears exactly once
_PODS_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


def pods_format_score(completion: str) -> float:
    """PODS's format term of one completion: 0.1 * max(0, 1 - 0.01 * characters outside
    ``<think>...</think><answer>...</answer>``) + 0.025 per tag appearing exactly once (0 to 0.2).
    Without the structure every character is outside; whitespace around the completion is not counted."""
    text = completion.strip()
    matched = _PODS_FORMAT.search(text)
    outside = len(text) - (matched.end() - matched.start()) if matched else len(text)
    structure = PODS_FORMAT_WEIGHT * max(0.0, 1.0 - PODS_CHARS_PENALTY * outside)
    return structure + PODS_TAG_WEIGHT * sum(text.count(tag) == 1 for tag in PODS_TAGS)


def pods_format_reward(completions: Sequence[str | Sequence[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """TRL reward function: PODS's format term (:func:`pods_format_score`) of each completion. With
    :func:`accuracy_reward` (graded under the ``answer_tag`` policy) it makes PODS's reward (max 1.2):
    ``REWARD_SETS["pods"]``."""
    return [pods_format_score(completion_text(c)) for c in completions]


# The reward functions a run config picks by name (``reward:`` in a `d3s train` YAML); TRL sums them.
REWARD_SETS: dict[str, tuple[Callable[..., list[float | None]], ...]] = {
    "accuracy": (accuracy_reward,),
    "pods": (accuracy_reward, pods_format_reward),
}
DEFAULT_REWARD_SET = "accuracy"


def reward_functions(name: str = DEFAULT_REWARD_SET) -> list[Callable[..., list[float | None]]]:
    """The reward functions of the set ``name`` (:data:`REWARD_SETS`); the trainer grades their
    :func:`accuracy_reward` under its ``answer_policy``."""
    if name not in REWARD_SETS:
        raise ValueError(f"reward must be one of {', '.join(REWARD_SETS)}; got {name!r}")
    return list(REWARD_SETS[name])
