"""Plain integer answers graded without math-verify's parser, with math-verify's verdict.

The synthetic task's answers are integers and its completions read ``" 3+4=7, 7-2=5. \\boxed{5}"``: most
rewards of a tiny run, and most of an evaluation's grading, are a box around an integer after a chain of
sums. Sending each through math-verify (a worker process, a pipe, LaTeX parsing, sympy) costs about a
millisecond; reading it here costs microseconds. Only completions of that narrow shape are read here: digits,
``+ - = , .`` and spaces, then one ``\\boxed{n}`` at the very end, n a plain integer (no leading zero, no
sign but a minus, at most 6 digits), against one plain integer gold. Every other completion, and every
other policy, goes to math-verify as before. tests/test_integer_answers.py proves the verdict and the
extracted answer equal to math-verify's on every shape this reads (Hypothesis) and on sampled completions
of the tiny model.
"""

from __future__ import annotations

import re
from typing import Any

# The answer policies whose reading of such a completion is the box's content (each tested).
POLICIES = ("math_verify", "last_boxed", "answer_tag", "trl")
_INTEGER = r"-?(?:0|[1-9][0-9]{0,5})"
PLAIN_INTEGER = re.compile(rf"(?!-0$){_INTEGER}")
COMPLETION = re.compile(rf"[0-9+\-=,. ]*\\boxed\{{((?!-0\}}){_INTEGER})\}}")


def integer_grade(completion: str, golds: tuple[str, ...], policy: str) -> dict[str, Any] | None:
    """The GradeResult fields (but ``seconds``) math-verify gives ``completion`` against ``golds`` under
    ``policy``, where the completion has the task's shape (module docstring); None: grade it with
    math-verify."""
    if policy not in POLICIES or len(golds) != 1 or not PLAIN_INTEGER.fullmatch(golds[0]):
        return None
    matched = COMPLETION.fullmatch(completion)
    if matched is None:
        return None
    answer = matched.group(1)
    return {
        "correct": answer == golds[0],
        "extracted": answer,
        "gold_parsed": True,
        "error": None,
        "gold_as_text": False,
        "timed_out": False,
    }
