"""The copied-answer flag: whether a completion's answer is an unevaluated expression copied from the prompt
(``\\boxed{12+7-3}`` for "What is 12+7-3?"), which math-verify credits because it compares values. Training
can give such answers no reward (``reward_copied_answers``) and logs their share; the evaluation counts them
(docs/evaluation/readers.md, "Answers copied from the question")."""

from __future__ import annotations

import math
import re

from d3s.grading.policies import brace_matches

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
    while form.startswith("{") and form.endswith("}") and brace_matches(form).get(0) == len(form) - 1:
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
