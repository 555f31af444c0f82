"""Answer grading with math-verify, shared by the training reward and the evaluation, so a model is rewarded
as it is scored. The rules (gold, extraction, answer policies, time limit): docs/evaluation/grading.md."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any, Literal, get_args

from d3s.integer_answers import integer_grade

AnswerExtraction = Literal["boxed_first", "boxed_only"]
AnswerPolicy = Literal["math_verify", "last_boxed", "answer_tag", "trl"]
ANSWER_POLICIES: tuple[AnswerPolicy, ...] = get_args(AnswerPolicy)
# The two policies that read boxes (compared with each other in evaluation and the audit).
BOXED_POLICIES: tuple[AnswerPolicy, AnswerPolicy] = ("math_verify", "last_boxed")
DEFAULT_ANSWER_POLICY: AnswerPolicy = "math_verify"
Gold = str | int | float | Sequence[str | int | float]

DEFAULT_TIME_LIMIT_S = 5.0  # per answer, parsing both sides plus verification
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take a while
_GOLD_CACHE_SIZE = 4096


@dataclass(frozen=True)
class GradeResult:
    """The outcome of grading one completion against its gold answer."""

    correct: bool
    extracted: str | None  # the completion's answer as math-verify matched it, None if nothing found
    gold_parsed: bool  # False: the gold could not be parsed and the answer was not scored
    timed_out: bool  # True: grading overran the time limit, and again when graded once more (wrong)
    seconds: float  # wall-clock time spent grading this answer (both tries where it overran once)
    error: str | None = None  # unexpected exception inside the grader (counted as wrong)
    gold_as_text: bool = False  # gold parsed only as a string (no math): compared by exact string match
    # math_verify only: math-verify's reading of the whole completion needed more than its work budget
    # (MAX_READING_CANDIDATES), so the verdict is the bounded reading's
    # (docs/evaluation/grading.md, "Answer policy"); a count, never a clock, decides it
    bounded: bool = False
    # the answer is an unevaluated expression copied from the prompt (:func:`copied_from_prompt`); False
    # when no prompt was given
    copied_from_prompt: bool = False


# Grading logic: runs in the worker subprocess (or in-process without a time limit); math_verify is
# imported lazily, so the worker starts without importing d3s or torch.


def normalize_gold(gold: Gold) -> tuple[str, ...]:
    """Gold answer(s) as a tuple of non-empty strings (numbers formatted without a trailing ``.0``)."""
    items = gold if isinstance(gold, (list, tuple)) else [gold]
    for item in items:
        if isinstance(item, bool):
            raise TypeError(f"gold answer must be a string or number, got {item!r}")
    # AMC stores 27.0: "27" keeps the comparison exact instead of a float comparison.
    texts = (str(int(i)) if isinstance(i, float) and i.is_integer() else str(i).strip() for i in items)
    return tuple(text for text in texts if text)


def gold_candidates(gold: str) -> list[str]:
    """The forms tried, in order, to parse one gold string (first non-empty parse wins)."""
    if "\\boxed" in gold:
        return [gold]
    # unescaped $ delimiters removed, \$ (a literal dollar sign) kept
    bare = re.sub(r"(\\.)|\$", lambda match: match.group(1) or "", gold, flags=re.DOTALL).strip()
    forms = [f"\\boxed{{{bare}}}", f"${bare}$", gold]
    return list(dict.fromkeys(f for f in forms if f.strip("$ ")))


def check_answer_policy(policy: str) -> AnswerPolicy:
    """``policy`` itself when it is a known answer policy; otherwise a ValueError naming the choices."""
    if policy not in ANSWER_POLICIES:
        raise ValueError(f"answer policy must be one of {', '.join(ANSWER_POLICIES)}; got {policy!r}")
    return policy  # type: ignore[return-value]


_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*")

# The bounded readings (last_boxed, answer_tag, and math_verify where math-verify's reading is over its work
# budget, below) are bounded by what a completion holds: each distinct answer is parsed once, and answers
# no benchmark has (longer than this, or more distinct boxes than this) are wrong without being parsed.
MAX_ANSWER_CHARS = 1000
MAX_DISTINCT_BOXES = 32
# math-verify's normaliser (latex2sympy2_extended's extract_boxed_content, "last" mode) reads the boxes
# back from the last one while the text between two boxes is under 10 characters, or under 70 with
# "and", "or", "," or ";" in it and a different content: the bounded reading of math_verify does the same.
CHAIN_GAP_CHARS = 10
CHAIN_SEPARATED_GAP_CHARS = 70
_CHAIN_SEPARATOR = re.compile(r"\b(?:and|or)\b|,|;")
FALLBACK_TAIL_CHARS = 1000  # without a box or an anchor, the last expression is looked for here
# math-verify's reading of a whole completion (the math_verify policy) under a work budget that is a count,
# not a clock, so that a verdict is the same on every machine: at most this many distinct candidates parsed
# (the same match read again is remembered, not parsed again); past it, the bounded reading grades the
# completion. The real completions of ../shared/data/completions need at most 3 (docs/evaluation/grading.md,
# "Answer policy").
MAX_READING_CANDIDATES = 16

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANCHOR = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE)
_MATH_DELIMITERS = re.compile(r"^(?:\$\$|\$|\\\[|\\\()\s*([^$]*?)\s*(?:\$\$|\$|\\\]|\\\))$", re.DOTALL)
_TRAILING_PUNCTUATION = re.compile(r"(?<!\\)[\s.,;:]+$")  # not "!": 5! is an answer
_DOT_WITHOUT_DECIMALS = re.compile(r"(?<=\d)\.(?!\d)")  # "18." and "-3./2": the dot is punctuation
_UNIT_TEXT = re.compile(r"^(.*?[\d}])\s*\\(?:text|mbox|mathrm)\{\s*~?[A-Za-z][A-Za-z .]*\}$", re.DOTALL)
# A number (with sign, decimals, thousands separators or a fraction) followed by words: a sentence answer.
_LEADING_NUMBER = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)\s+(?:[A-Za-z]{2,}|\()")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# A brace, or a backslash and the character after it (an escaped brace never opens or closes a group).
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)


def _brace_matches(text: str) -> dict[int, int]:
    """Index of every ``{`` -> index of its ``}`` in one linear pass (escaped ``\\{`` ``\\}`` skipped);
    unclosed braces are absent."""
    matches: dict[int, int] = {}
    stack: list[int] = []
    for token in _BRACE_TOKEN.finditer(text):
        if token.group() == "{":
            stack.append(token.start())
        elif token.group() == "}" and stack:
            matches[stack.pop()] = token.start()
    return matches


def _boxes(text: str) -> list[tuple[int, str | None, int]]:
    """``(start, argument, end)`` of every box command in ``text``, in order: the argument is ``{...}``
    with balanced braces, or without braces the token up to the next space or ``$`` (without trailing
    punctuation), None when the braces never close; ``end`` is where the box ends. Linear in the length
    of ``text`` whatever the number of boxes."""
    commands = list(_BOX_COMMAND.finditer(text))
    matches = _brace_matches(text) if commands and "{" in text else {}
    boxes: list[tuple[int, str | None, int]] = []
    for command in commands:
        i = command.end()
        if i < len(text) and text[i] == "{":
            close = matches.get(i)
            content = None if close is None else text[i + 1 : close]
            boxes.append((command.start(), content, len(text) if close is None else close + 1))
        else:
            token = re.split(r"[\s$]", text[i : i + MAX_ANSWER_CHARS], maxsplit=1)[0]
            boxes.append((command.start(), token.rstrip(".,;:"), i + len(token)))
    return boxes


def _box_contents(text: str) -> list[str | None]:
    """The argument of every box command in ``text``, in order (:func:`_boxes`)."""
    return [content for _, content, _ in _boxes(text)]


def _box_chain(text: str) -> list[str | None]:
    """The boxes math-verify's normaliser reads together as one answer, in order: the last box and the
    boxes before it while they follow closely (:data:`CHAIN_GAP_CHARS`), consecutive repeats once."""
    boxes = _boxes(text)
    if not boxes:
        return []
    chain_start, last, _ = boxes[-1]
    chain = [last]
    for start, content, end in reversed(boxes[:-1]):
        gap = text[end:chain_start]  # as math-verify measures it: from the closing brace to the next box
        separated = len(gap) < CHAIN_SEPARATED_GAP_CHARS and _CHAIN_SEPARATOR.search(gap)
        if content is None or not (len(gap) < CHAIN_GAP_CHARS or (content != chain[-1] and separated)):
            break
        if content != chain[-1]:
            chain.append(content)
        chain_start = start
    return chain[::-1]


def normalize_answer(text: str) -> str:
    """An answer as it is compared, for predictions and gold alike: math delimiters, trailing punctuation
    (``18.``), a dot after an integer (``-3./2``), unit words after a number (``540 \\text{ meters}``)
    and the words of a sentence answer after its leading number (``10 cups (for all 20 chickens)``)
    removed."""
    text = _TRAILING_PUNCTUATION.sub("", text.strip())
    for _ in range(2):  # "$\[ ... \]$" nests at most twice
        delimited = _MATH_DELIMITERS.match(text)
        if delimited:
            text = _TRAILING_PUNCTUATION.sub("", delimited.group(1))
    text = _DOT_WITHOUT_DECIMALS.sub("", text)
    unit = _UNIT_TEXT.match(text)
    if unit:
        text = unit.group(1).strip()
    sentence = _LEADING_NUMBER.match(text)
    if sentence:
        number = sentence.group(1)
        text = number.replace(",", "") if _THOUSANDS.fullmatch(number) else number
    return text.strip()


def _last_answer_tag(completion: str) -> str | None:
    """The content of the last ``<answer>...</answer>``; "" when it is empty or an ``<answer>`` opened
    after it never closes (cut off); None when there is no ``<answer>`` at all."""
    opened = completion.rfind("<answer>")
    if opened < 0:
        return None
    tags = list(_ANSWER_TAG.finditer(completion))
    return tags[-1].group(1).strip() if tags and tags[-1].start() == opened else ""


def extract_answer(completion: str, policy: AnswerPolicy, fallback: bool = True) -> str | None:
    """What math-verify parses as the completion's answer under ``policy`` (None: no answer, wrong): the
    bounded reading, one linear pass, each distinct answer parsed once; the rules, one example each:
    docs/evaluation/grading.md. ``math_verify`` grades with it only where math-verify's reading of the whole
    completion is over its work budget (:data:`MAX_READING_CANDIDATES`); it then reads the boxes up to the
    completion's last closing brace, as math-verify's box pattern does. ``fallback=False``:
    ``answer_extraction="boxed_only"``."""
    if policy == "answer_tag":
        tag = _last_answer_tag(completion)
        if tag is not None:  # an empty or cut-off tag is no answer
            return _read_boxes_or_text(tag, "last_boxed", fallback=False) if tag else None
        policy = "last_boxed"  # no tag at all: read as last_boxed reads it
    if not fallback and not _BOX_COMMAND.search(completion):
        return None
    return _read_boxes_or_text(completion, policy, fallback=True)


def _read_boxes_or_text(text: str, policy: AnswerPolicy, fallback: bool) -> str | None:
    # math-verify's box pattern (\boxed{.+}) ends at the text's last closing brace: a box opened after it
    # (a loop cut off inside its last box) is not read, and the boxes before it are
    boxed_text = text[: text.rfind("}") + 1] if policy == "math_verify" else text
    contents = _box_contents(boxed_text)
    if contents:
        last = contents[-1]
        if last is None or not normalize_answer(last):
            return None
        if policy == "math_verify":
            # the boxes math-verify would read together; raw duplicates dropped first (a loop repeats the
            # same box), then normalised duplicates
            unique = (normalize_answer(c) for c in dict.fromkeys(_box_chain(boxed_text)) if c is not None)
            distinct = [answer for answer in dict.fromkeys(unique) if answer]
        else:
            distinct = [normalize_answer(last)]
        if len(distinct) > MAX_DISTINCT_BOXES or sum(map(len, distinct)) > MAX_ANSWER_CHARS:
            return None
        return " ".join(f"\\boxed{{{answer}}}" for answer in distinct)
    if fallback:
        tag = _last_answer_tag(text)  # a plain <answer>27</answer> wins over earlier LaTeX fragments
        if tag is not None:  # an empty or cut-off tag: the model's answer is missing
            return _read_boxes_or_text(tag, policy, fallback=False) if tag else None
    anchors = list(_ANCHOR.finditer(text))
    region = text[anchors[-1].end() :].split("\n", 1)[0] if anchors else text
    if anchors or not fallback:
        answer = normalize_answer(region)
        if answer and len(answer) <= MAX_ANSWER_CHARS:
            # plain text answers ("Evelyn", "(3, \frac{\pi}{2})") parse as LaTeX only when boxed
            return answer if "$" in answer else f"\\boxed{{{answer}}}"
        if not fallback:
            return None
    return text[-FALLBACK_TAIL_CHARS:] or None


# Credit for copying the question: math-verify compares values, so "\boxed{12+7-3}" is 16. An answer is
# "copied" when it still holds an operation and occurs, as written, in the prompt (docs/evaluation/readers.md,
# "Answers copied from the question").
_COPY_NOISE = re.compile(r"\s+|\$|\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[,;!: ]|\\displaystyle")
_COPY_OPERATION = re.compile(r"[+\-*/^]|\\(?:cdot|times|div|frac|dfrac|tfrac)(?![A-Za-z])")
_SIGNED_NUMBER = r"[+-]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_LITERAL_NUMBER = re.compile(rf"{_SIGNED_NUMBER}")
_LITERAL_FRACTION = re.compile(r"([+-]?)(?:\\[dt]?frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))")
_LITERAL_COMPLEX = re.compile(rf"{_SIGNED_NUMBER}[+-](?:\d[\d,]*(?:\.\d+)?)?i")


def _copy_form(text: str) -> str:
    """``text`` as :func:`copied_from_prompt` compares it: whitespace, ``$``, ``\\left``/``\\right`` and
    spacing commands removed, ``\\dfrac``/``\\tfrac`` read as ``\\frac``, outer braces dropped."""
    form = _COPY_NOISE.sub("", text)
    form = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", form)
    while form.startswith("{") and form.endswith("}") and _brace_matches(form).get(0) == len(form) - 1:
        form = form[1:-1]
    return form


def is_literal_value(answer: str) -> bool:
    """True when ``answer`` is a value written out, not an operation to carry out: a signed number
    (``16``, ``-3``, ``0.5``, ``1,000``), a fraction of integers in lowest terms (``\\frac{1}{2}``,
    ``-3/4``) or a complex number ``a+bi`` with literal parts."""
    form = _copy_form(answer)
    if _LITERAL_NUMBER.fullmatch(form) or _LITERAL_COMPLEX.fullmatch(form):
        return True
    fraction = _LITERAL_FRACTION.fullmatch(form)
    if fraction:
        numerator = int(fraction.group(2) or fraction.group(4))
        denominator = int(fraction.group(3) or fraction.group(5))
        return denominator > 1 and math.gcd(numerator, denominator) == 1
    return False


def copied_from_prompt(answer: str | None, prompt: str | None) -> bool:
    """True when ``answer`` (a completion's extracted answer) is an unevaluated expression copied from
    ``prompt``: it holds an operation (``+ - * / ^ \\cdot \\times \\div \\frac``; a leading sign
    does not count), it is not a literal value (:func:`is_literal_value`:
    ``16``, ``\\frac{1}{2}``, ``6+9i`` are values), and it occurs in the prompt as written, up to
    whitespace, ``$``, ``\\left``/``\\right`` and spacing commands. A correct short answer that happens to
    appear in the prompt ("16" in "... 16 apples ...") is therefore not flagged. The occurrence is a
    substring test without token boundaries ("2+3" occurs in "12+35"). False without an answer or a
    prompt."""
    if not answer or not prompt:
        return False
    form = _copy_form(answer)
    if not form or not _COPY_OPERATION.search(form.lstrip("+-")) or is_literal_value(form):
        return False
    return form in _copy_form(prompt)


def last_boxed_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``completion``, or None when it has
    no box, or its last box is empty or never closes (use :func:`count_boxes` to tell these apart)."""
    contents = _box_contents(completion)
    return ((contents[-1] or "").strip() or None) if contents else None


def count_boxes(completion: str) -> int:
    """How many ``\\boxed`` / ``\\fbox`` commands ``completion`` holds (the policies can only disagree
    when there is at least one)."""
    return len(_BOX_COMMAND.findall(completion))


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


# The worker: a plain subprocess (multiprocessing pool workers may not start multiprocessing children),
# spoken to over a multiprocessing.connection.Connection (pickled messages). pebble.ProcessPool was measured
# against this pool and not adopted (docs/evaluation/grading-performance.md, "The grading pool").


def _worker_main(fd: int, answer_extraction: AnswerExtraction) -> None:
    """Loop of the grading subprocess: receive (completion, golds, policy), send the grade."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))  # deeply nested LaTeX
    grader = _MathVerifyGrader(answer_extraction)
    conn = Connection(fd)
    conn.send("ready")
    while True:
        try:
            conn.send(grader.grade(*conn.recv()))
        except (EOFError, OSError):  # the parent closed the connection or exited
            return


# Runs this file by path, so the worker imports neither d3s/__init__ nor anything heavy.
_BOOTSTRAP = "import runpy, sys; runpy.run_path(sys.argv[1])['_worker_main'](int(sys.argv[2]), sys.argv[3])"


class _WorkerProcess:
    """One grading subprocess; killed (never reused) when an answer overruns its limit."""

    def __init__(self, answer_extraction: AnswerExtraction) -> None:
        self.conn, child = Pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, __file__, str(child.fileno()), answer_extraction],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        child.close()
        self.started_at = time.perf_counter()
        self.ready = False
        self.job: tuple[int, float, float] | None = None  # (job index, start time, limit) being graded

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()  # a no-op once it has exited
        self.process.wait()


# One grading job: (completion, golds, policy).
_Job = tuple[str, tuple[str, ...], AnswerPolicy]


class Grader(contextlib.AbstractContextManager):
    """Grades answers in ``num_workers`` persistent subprocesses, each under ``time_limit`` s (None: in
    process, unlimited, for debugging). An answer that overruns it is graded once more, the same way, in a
    fresh worker under ``retry_time_limit`` s (None: ``time_limit``); overrunning that too, it is wrong
    (``timed_out``). The grading itself never looks at a clock, so a verdict does not depend on the limit
    it ran under unless both tries overran. Thread-safe; one per process (:func:`default_grader` after a
    fork)."""

    def __init__(
        self,
        num_workers: int = 1,
        time_limit: float | None = DEFAULT_TIME_LIMIT_S,
        answer_extraction: AnswerExtraction = "boxed_first",
        retry_time_limit: float | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        for name, limit in (("time_limit", time_limit), ("retry_time_limit", retry_time_limit)):
            if limit is not None and limit <= 0:
                raise ValueError(f"{name} must be positive seconds or None, got {limit}")
        if answer_extraction not in get_args(AnswerExtraction):
            raise ValueError(
                f"answer_extraction must be 'boxed_first' or 'boxed_only', got {answer_extraction!r}"
            )
        self.num_workers = num_workers
        self.time_limit = time_limit
        self.retry_time_limit = retry_time_limit or time_limit
        self.answer_extraction: AnswerExtraction = answer_extraction
        self._workers: list[_WorkerProcess] = []
        self._inline: _MathVerifyGrader | None = None
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self.timeouts = 0  # overruns of the limit since construction (an answer's retry counts again)
        self.restarts = 0  # workers killed and replaced

    def grade(self, completion: str, gold: Gold, policy: AnswerPolicy = DEFAULT_ANSWER_POLICY) -> GradeResult:
        return self.grade_many([completion], [gold], policy)[0]

    def grade_many(
        self, completions: Sequence[str], golds: Sequence[Gold], policy: AnswerPolicy = DEFAULT_ANSWER_POLICY
    ) -> list[GradeResult]:
        """Grade ``completions[i]`` against ``golds[i]`` under ``policy``, spread over the workers."""
        return self.grade_many_by_policy(completions, golds, (policy,))[policy]

    def grade_many_by_policy(
        self,
        completions: Sequence[str],
        golds: Sequence[Gold],
        policies: Sequence[AnswerPolicy] = ANSWER_POLICIES,
    ) -> dict[AnswerPolicy, list[GradeResult]]:
        """Grade every answer under each of ``policies`` in one pass over the workers (each grading is a
        job of its own, under its own time limit): ``{policy: [result per completion]}``."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        policies = tuple(dict.fromkeys(check_answer_policy(p) for p in policies))
        pairs = [(str(c), normalize_gold(g)) for c, g in zip(completions, golds, strict=True)]
        jobs = [(c, g, policy) for policy in policies for c, g in pairs]
        # a box around a plain integer after a chain of sums (the synthetic task) needs no parser: the same
        # verdict, read here (d3s/integer_answers.py); every other answer goes to math-verify
        read_here = [_graded_here(*job) for job in jobs]
        parsed_jobs = [job for job, result in zip(jobs, read_here, strict=True) if result is None]
        with self._lock:
            if os.getpid() != self._owner_pid:
                raise RuntimeError("Grader used in a forked child: create a new Grader in this process")
            grade_jobs = self._grade_inline if self.time_limit is None else self._grade_in_workers
            parsed = iter(grade_jobs(parsed_jobs) if parsed_jobs else [])
        results = [next(parsed) if result is None else result for result in read_here]
        n = len(pairs)
        return {policy: results[i * n : (i + 1) * n] for i, policy in enumerate(policies)}

    def close(self) -> None:
        """Stop the workers (not from a forked child: they are the parent's)."""
        with self._lock:
            if os.getpid() == self._owner_pid:
                for worker in self._workers:
                    worker.kill()
                self._workers = []

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; workers also exit when their pipe closes
        try:  # noqa: SIM105 (contextlib may be torn down already at interpreter exit)
            self.close()
        except Exception:
            pass

    def _grade_inline(self, jobs: list[_Job]) -> list[GradeResult]:
        self._inline = self._inline or _MathVerifyGrader(self.answer_extraction)
        results = []
        for job in jobs:
            start = time.perf_counter()
            outcome = self._inline.grade(*job)
            results.append(GradeResult(**outcome, timed_out=False, seconds=time.perf_counter() - start))
        return results

    def _grade_in_workers(self, jobs: list[_Job]) -> list[GradeResult]:
        assert self.time_limit is not None and self.retry_time_limit is not None
        results: list[GradeResult] = [None] * len(jobs)  # type: ignore[list-item]
        overrun_s: list[float | None] = [None] * len(jobs)  # seconds of the first try, where it overran
        pending = list(range(len(jobs)))[::-1]  # popped from the end
        while len(self._workers) < self.num_workers:
            self._workers.append(_WorkerProcess(self.answer_extraction))
        while pending or any(w.job for w in self._workers):
            for slot, worker in enumerate(self._workers):
                if worker.ready and worker.job is None and pending:
                    index = pending.pop()
                    try:
                        worker.conn.send(jobs[index])
                    except OSError:  # the worker died while idle (killed, out of memory): replace, retry
                        pending.append(index)
                        self._replace(slot)
                        continue
                    limit = self.time_limit if overrun_s[index] is None else self.retry_time_limit
                    worker.job = (index, time.perf_counter(), limit)
            # Wait for an answer, a deadline, or a (re)starting worker; start-up is charged to no answer.
            watched = [w for w in self._workers if w.job or not w.ready]
            deadlines = [
                w.job[1] + w.job[2] if w.job else w.started_at + WORKER_START_TIMEOUT_S for w in watched
            ]
            readable = wait([w.conn for w in watched], max(0.0, min(deadlines) - time.perf_counter()))
            now = time.perf_counter()
            for slot, worker in enumerate(self._workers):
                if not worker.ready and worker.conn in readable:
                    try:
                        worker.ready = worker.conn.recv() == "ready"  # its only possible first message
                    except (EOFError, OSError):
                        code = worker.process.wait()
                        raise RuntimeError(f"grading worker died starting (exit code {code})") from None
                elif not worker.ready and now - worker.started_at >= WORKER_START_TIMEOUT_S:
                    worker.kill()
                    raise RuntimeError(f"grading worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
                elif worker.job and worker.conn in readable:
                    (index, start, _), worker.job = worker.job, None
                    seconds = (overrun_s[index] or 0.0) + now - start
                    try:
                        results[index] = GradeResult(**worker.conn.recv(), timed_out=False, seconds=seconds)
                    except (EOFError, OSError):  # died (out of memory, killed): counted wrong, replaced
                        results[index] = GradeResult(False, None, True, False, seconds, "grading worker died")
                        self._replace(slot)
                elif worker.job and now - worker.job[1] >= worker.job[2]:
                    (index, start, _), worker.job = worker.job, None
                    self.timeouts += 1
                    if overrun_s[index] is None:  # graded once more, the same way, in a fresh worker
                        overrun_s[index] = now - start
                        pending.append(index)
                    else:
                        seconds = (overrun_s[index] or 0.0) + now - start
                        results[index] = GradeResult(False, None, True, True, seconds)
                    self._replace(slot)
        return results

    def _replace(self, slot: int) -> None:
        # The replacement starts importing now, while the other workers keep grading.
        self._workers[slot].kill()
        self._workers[slot] = _WorkerProcess(self.answer_extraction)
        self.restarts += 1


# Module-level API: one default grader per process.
_default_grader: Grader | None = None
_default_lock = threading.Lock()


def default_grader() -> Grader:
    """The process-wide grader (one worker, default time limit), recreated in forked children."""
    global _default_grader
    with _default_lock:
        if _default_grader is None or _default_grader._owner_pid != os.getpid():
            _default_grader = Grader()
        return _default_grader


atexit.register(lambda: _default_grader and _default_grader.close())


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


def _graded_here(completion: str, golds: tuple[str, ...], policy: AnswerPolicy) -> GradeResult | None:
    start = time.perf_counter()
    fields = integer_grade(completion, golds, policy)
    return None if fields is None else GradeResult(**fields, seconds=time.perf_counter() - start)


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
