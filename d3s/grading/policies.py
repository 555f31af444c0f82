"""The answer policies: which answer of a completion is graded (``math_verify``, ``last_boxed``,
``answer_tag``, ``trl``), the gold answers as they are compared, and the bounded reading of a completion's
boxes, ``<answer>`` tags and "answer is" anchors (:func:`extract_answer`): one linear pass, each distinct
answer parsed once, answers longer than any benchmark's wrong without being parsed. Plain text, no
math-verify: what is read here is parsed by the grader (d3s/grading/reading.py). Rules and examples:
docs/evaluation/grading.md, "Answer policy"."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, get_args

AnswerExtraction = Literal["boxed_first", "boxed_only"]
AnswerPolicy = Literal["math_verify", "last_boxed", "answer_tag", "trl"]
ANSWER_POLICIES: tuple[AnswerPolicy, ...] = get_args(AnswerPolicy)
# The two policies that read boxes (compared with each other in evaluation and the audit).
BOXED_POLICIES: tuple[AnswerPolicy, AnswerPolicy] = ("math_verify", "last_boxed")
DEFAULT_ANSWER_POLICY: AnswerPolicy = "math_verify"
Gold = str | int | float | Sequence[str | int | float]


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
# budget, d3s/grading/reading.py) are bounded by what a completion holds: each distinct answer is parsed once,
# and answers no benchmark has (longer than this, or more distinct boxes than this) are wrong without being
# parsed.
MAX_ANSWER_CHARS = 1000
MAX_DISTINCT_BOXES = 32
# math-verify's normaliser (latex2sympy2_extended's extract_boxed_content, "last" mode) reads the boxes
# back from the last one while the text between two boxes is under 10 characters, or under 70 with
# "and", "or", "," or ";" in it and a different content: the bounded reading of math_verify does the same.
CHAIN_GAP_CHARS = 10
CHAIN_SEPARATED_GAP_CHARS = 70
_CHAIN_SEPARATOR = re.compile(r"\b(?:and|or)\b|,|;")
FALLBACK_TAIL_CHARS = 1000  # without a box or an anchor, the last expression is looked for here

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


def brace_matches(text: str) -> dict[int, int]:
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
    matches = brace_matches(text) if commands and "{" in text else {}
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


def last_boxed_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``completion``, or None when it has
    no box, or its last box is empty or never closes (use :func:`count_boxes` to tell these apart)."""
    contents = _box_contents(completion)
    return ((contents[-1] or "").strip() or None) if contents else None


def count_boxes(completion: str) -> int:
    """How many ``\\boxed`` / ``\\fbox`` commands ``completion`` holds (the policies can only disagree
    when there is at least one)."""
    return len(_BOX_COMMAND.findall(completion))
