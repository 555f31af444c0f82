"""math-verify's reading of a completion, bounded by work, not by time: the parser and verifier that run
in a grading worker (:class:`_MathVerifyGrader`), the gold parsed and cached, math-verify's own extraction of
a whole completion replayed candidate by candidate under a budget of :data:`MAX_READING_CANDIDATES` distinct
candidates (past it, the bounded reading of d3s/grading/policies.py grades the completion), and the shortcut
that skips math-verify's boxed-environment pattern where it cannot match. Nothing here looks at a clock: the
same completion gets the same verdict on every machine (docs/evaluation/grading.md)."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterator
from typing import Any

from d3s.grading.policies import (
    AnswerExtraction,
    AnswerPolicy,
    extract_answer,
    gold_candidates,
    normalize_answer,
)

# Runs in the worker subprocess (or in-process without a time limit); math_verify is imported lazily, so the
# worker starts without importing torch.

_GOLD_CACHE_SIZE = 4096  # parsed gold answers kept per grader

# math-verify's reading of a whole completion (the math_verify policy) under a work budget that is a count,
# not a clock, so that a verdict is the same on every machine: at most this many distinct candidates parsed
# (the same match read again is remembered, not parsed again); past it, the bounded reading grades the
# completion. The real completions of ../shared/data/completions need at most 3 (docs/evaluation/grading.md,
# "Answer policy").
MAX_READING_CANDIDATES = 16


_BOX_OPENING = "\\boxed{"


def _find_delimiter(text: str, delimiter: str, start: int, escapable: bool) -> int:
    """Index of the first ``delimiter`` in ``text`` at or after ``start``, -1 if none; with ``escapable``,
    one right after a backslash is skipped (math-verify's patterns put ``(?<!\\\\)`` before it)."""
    index = text.find(delimiter, start)
    while escapable and index > 0 and text[index - 1] == "\\":
        index = text.find(delimiter, index + 1)
    return index


def boxed_environment_possible(text: str) -> bool:
    """False only where math-verify's pattern for a box inside a math environment cannot match ``text``.
    Each of its five environments needs an opening delimiter, a ``\\boxed{`` after it and a closing
    delimiter after that: ``$$``/``\\[`` anywhere, ``$``, ``\\(`` and ``[`` on one line (their content
    excludes newlines); a ``$``, ``$$``, ``\\[``, ``\\]``, ``\\(`` or ``\\)`` right after a backslash
    delimits nothing (``\\$`` is a dollar sign). Taking the first opening and the first box after it
    finds every such triple."""
    for opening, closing in (("$$", "$$"), ("\\[", "\\]")):
        start = _find_delimiter(text, opening, 0, escapable=True)
        box = text.find(_BOX_OPENING, start + len(opening)) if start >= 0 else -1
        if box >= 0 and _find_delimiter(text, closing, box + len(_BOX_OPENING), escapable=True) >= 0:
            return True
    for line in text.split("\n"):
        if _BOX_OPENING not in line:
            continue
        for opening, closing in (("$", "$"), ("\\(", "\\)"), ("[", "]")):
            escapable = opening != "["  # math-verify's " [...] " environment takes any "[" after a space
            start = _find_delimiter(line, opening, 0, escapable)
            box = line.find(_BOX_OPENING, start + len(opening)) if start >= 0 else -1
            if box >= 0 and _find_delimiter(line, closing, box + len(_BOX_OPENING), escapable) >= 0:
                return True
    return False


class _BoxedEnvironmentPattern:
    """math-verify's pattern for a box inside a math environment, searched only where it can match: on a
    line that loops over boxes after an unclosed ``$`` it backtracks for seconds and then finds nothing."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        return self.pattern.finditer(text) if boxed_environment_possible(text) else iter(())


def _with_boxed_environment_shortcut(regexes: list[tuple[list[Any], Any]]) -> list[tuple[list[Any], Any]]:
    """A copy of math-verify's extraction patterns (``get_extraction_regexes``) with the boxed-environment
    pattern wrapped in :class:`_BoxedEnvironmentPattern` (the library's own cached patterns untouched)."""
    wrapped, shortcut = [], 0
    for patterns, target in regexes:
        copied = []
        for pattern, priority in patterns:
            if "first_latexDisplayDollar" in pattern.pattern and "\\\\boxed{" in pattern.pattern:
                pattern, shortcut = _BoxedEnvironmentPattern(pattern), shortcut + 1
            copied.append((pattern, priority))
        wrapped.append((copied, target))
    if shortcut != 1:  # another math-verify version: its patterns must be checked again
        raise RuntimeError(f"expected one boxed-environment pattern in math-verify's, found {shortcut}")
    return wrapped


class _OverBudget(Exception):
    """math-verify's reading of a completion needs more than its work budget (MAX_READING_CANDIDATES)."""


class _MathVerifyGrader:
    """Parses and verifies with math-verify; caches parsed gold. Not time-limited by itself."""

    def __init__(self, answer_extraction: AnswerExtraction) -> None:
        import logging

        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from math_verify.parser import extract_match, get_extraction_regexes

        # Our own wall-clock limit replaces math-verify's signal-based one; silence its warning.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        self._parse, self._verify = parse, verify
        self._gold_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        self._pred_config = (
            self._gold_config
            if answer_extraction == "boxed_first"
            else [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
        )
        self._fallback = answer_extraction == "boxed_first"
        self._extract_match = extract_match
        # TRL 1.16's trl.rewards.accuracy_reward, bit for bit: LaTeX only, an anchor required, units
        # normalised, the first match; the gold parsed by parse(sol) with math-verify's defaults
        from latex2sympy2_extended import NormalizationConfig

        self._trl_pred_config = [
            LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
        ]
        self._pred_regexes = _with_boxed_environment_shortcut(get_extraction_regexes(self._pred_config))
        self.parse_gold = functools.lru_cache(maxsize=_GOLD_CACHE_SIZE)(self._parse_gold)

    def _parse_gold(self, golds: tuple[str, ...]) -> list[list[Any]]:
        """One parsed list per gold string that parses; [] when none does."""
        parsed_golds = []
        for gold in golds:
            # The gold normalised as the bounded reading normalises answers (18. -> 18, -3./2 -> -3/2), and
            # the gold as written, as math-verify's own call reads it: a box math-verify keeps as the text
            # "-1./3" matches only the latter.
            normalized = gold if "\\boxed" in gold else normalize_answer(gold)
            readings = [gold_candidates(normalized) if normalized else [], gold_candidates(gold)]
            for forms in readings:
                for form in forms:
                    parsed = self._parse(form, self._gold_config, parsing_timeout=None)
                    if parsed:
                        if parsed not in parsed_golds:
                            parsed_golds.append(parsed)
                        break
        return parsed_golds

    def _parse_whole(self, completion: str) -> list[Any] | None:
        """``parse(completion, pred_config)`` as math-verify 0.9.0 runs it (its defaults: "any_match",
        fallback "first_match", [] on any error), with the boxed-environment pattern searched only where
        it can match (:func:`boxed_environment_possible`), each distinct candidate read once, and a work
        budget: None where the reading needs more than :data:`MAX_READING_CANDIDATES` distinct candidates
        (then the bounded reading grades it). Within the budget, the same result as ``parse``."""
        try:
            return self._extract_within_budget(completion)
        except _OverBudget:
            return None
        except Exception:
            return []

    def _extract_within_budget(self, pred: str) -> list[Any]:
        """math-verify 0.9.0's ``extract_target_from_pred(pred, regexes, fallback_mode="first_match",
        extraction_mode="any_match")``, line for line, but that a candidate whose match groups were read
        before (a loop repeats the same text) is not parsed again (``extract_match`` is a function of the
        groups that matched, so the result is the same), and that past the budget it raises _OverBudget.
        Its order: priority groups from the lowest; in a group, matches by end position (rightmost first),
        then start (leftmost first); the first that parses wins; the first non-empty string read is
        appended as the fallback."""
        all_patterns = [
            (pattern, target_type, priority)
            for target_patterns, target_type in self._pred_regexes
            for pattern, priority in target_patterns
        ]
        extracted: list[Any] = []
        fallbacks: list[str] = []
        read: dict[tuple[int, tuple[tuple[str, str], ...]], tuple[Any, str]] = {}
        for _, group in itertools.groupby(sorted(all_patterns, key=lambda x: x[2]), key=lambda x: x[2]):
            matches = sorted(
                (
                    (match, match.start(), match.end(), target_type)
                    for pattern, target_type, _ in group
                    for match in pattern.finditer(pred)
                ),
                key=lambda x: (x[2], -x[1]),
                reverse=True,
            )
            for match, _, _, target_type in matches:
                key = (id(target_type), tuple((k, v) for k, v in match.groupdict().items() if v))
                if key not in read:
                    if len(read) >= MAX_READING_CANDIDATES:
                        raise _OverBudget
                    read[key] = self._extract_match(match, target_type)
                extracted_match, str_fallback = read[key]
                if str_fallback:
                    fallbacks.append(str_fallback)
                if extracted_match is not None:
                    extracted.append(extracted_match)
                    break
            if extracted:
                break
        return extracted + fallbacks[:1]

    def grade(self, completion: str, golds: tuple[str, ...], policy: AnswerPolicy) -> dict[str, Any]:
        """The fields of a GradeResult but ``timed_out`` and ``seconds``: a plain dict, so it pickles
        across modules. ``math_verify`` is math-verify's own reading of the whole completion, or where that
        is over its work budget (``bounded``) the bounded reading (:func:`extract_answer`). Nothing here
        depends on time: the same completion gets the same result on every machine."""
        out = {
            "correct": False,
            "extracted": None,
            "gold_parsed": True,
            "error": None,
            "gold_as_text": False,
            "bounded": False,
        }
        try:
            if policy == "trl":
                return self._grade_trl(completion, golds, out)
            parsed_golds = self.parse_gold(golds)
            if not parsed_golds:
                return out | {"gold_parsed": False}
            out["gold_as_text"] = all(isinstance(item, str) for parsed in parsed_golds for item in parsed)
            # verify(gold, parse(completion)): the field's call
            pred = self._parse_whole(completion) if policy == "math_verify" else None
            if pred is None:
                out["bounded"] = policy == "math_verify"
                answer_text = extract_answer(completion, policy, self._fallback)
                if answer_text is None:  # an empty or cut-off last box (or answer tag): no answer
                    return out
                pred = self._parse(answer_text, self._pred_config, parsing_timeout=None)
            if pred:
                # parse() returns [sympy_object, matched_string]; the string is what the model wrote.
                extracted = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
                correct = any(self._verify(gold, pred, timeout_seconds=None) for gold in parsed_golds)
                out |= {"extracted": extracted, "correct": correct}
            return out
        except Exception as exc:  # a parser bug (RecursionError included) must not kill training
            return out | {"error": f"{type(exc).__name__}: {exc}"[:500]}

    def _grade_trl(self, completion: str, golds: tuple[str, ...], out: dict[str, Any]) -> dict[str, Any]:
        """The ``trl`` policy: TRL 1.16's ``accuracy_reward`` call (its time limits replaced by ours), each
        gold string as its ``solution``; correct when any gold is, unscored when none parses."""
        parsed_golds = [parsed for parsed in (self._parse(g, parsing_timeout=None) for g in golds) if parsed]
        if not parsed_golds:
            return out | {"gold_parsed": False}
        out["gold_as_text"] = all(isinstance(item, str) for parsed in parsed_golds for item in parsed)
        pred = self._parse(
            completion, self._trl_pred_config, extraction_mode="first_match", parsing_timeout=None
        )
        if pred:
            out["extracted"] = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
        out["correct"] = any(self._verify(gold, pred, timeout_seconds=None) for gold in parsed_golds)
        return out
