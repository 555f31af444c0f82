"""Answer grading with math-verify, shared by the training reward and the evaluation.

One grading function (:func:`grade`) decides whether a completion's final answer equals the gold
answer, so a model is rewarded during training exactly as it is scored afterwards.

How an answer is graded:

* **Gold** is normalised first (``$`` delimiters removed, then wrapped as ``\\boxed{...}``) because
  math-verify returns ``[]`` for bare LaTeX such as ``\\dfrac{9}{7}``; if the boxed form does not parse,
  ``$...$`` and the raw string are tried. A list of golds (OlympiadBench's ``final_answer``) counts as
  correct when any of them matches. Gold that parses in none of these forms is *unparsable*: it is
  reported (``gold_parsed=False``, reward ``None``), never scored as wrong.
* **Completions** are parsed with ``\\boxed{}`` answers first (``boxed_match_priority=0``); without a
  boxed answer math-verify falls back to "answer is ..." anchors and the last LaTeX or plain expression
  (``answer_extraction="boxed_first"``, the Qwen2.5-Math evaluation convention), or finds nothing
  (``"boxed_only"``).
* **Which boxed answer counts** (the *answer policy*). ``math_verify`` (the default) gives the whole
  completion to math-verify, which reads *every* ``\\boxed{}`` it finds together as one set answer:
  ``\\boxed{18} ... wait, actually \\boxed{20}`` is the answer {18, 20} and does not match the gold 20.
  ``last_boxed`` takes only the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces; ``\\boxed 5``
  without braces is the token after it), as the Qwen2.5-Math evaluation toolkit does, and verifies that
  single answer with the same math-verify settings, so only the choice of box differs. A last box
  whose braces never close (a cut-off completion) or that is empty is no answer (wrong). Without any
  box both policies read the completion the same way (``answer_extraction`` decides the fallback), so
  they can only disagree on completions that contain a box.
* ``verify(gold, pred)`` is called gold first: the comparison is not symmetric.
* **Time limit.** math-verify's own timeouts use ``signal.alarm``, which fails off the main thread and
  cannot stop everything, so they are switched off (``parsing_timeout=None``, ``timeout_seconds=None``)
  and every answer is graded in a persistent worker *subprocess* that is killed and replaced when it
  overruns its wall-clock limit. A subprocess (not ``multiprocessing``) is used so that grading also
  works inside daemonic pool workers, which may not have children of their own. Timed-out answers
  count as wrong and are reported as ``timed_out``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

AnswerExtraction = Literal["boxed_first", "boxed_only"]
AnswerPolicy = Literal["math_verify", "last_boxed"]
ANSWER_POLICIES: tuple[AnswerPolicy, ...] = ("math_verify", "last_boxed")
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
    timed_out: bool  # True: grading overran the time limit (counted as wrong)
    seconds: float  # wall-clock time spent grading this answer
    error: str | None = None  # unexpected exception inside the grader (counted as wrong)
    gold_as_text: bool = False  # gold parsed only as a string (no math): compared by exact string match

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Pure grading logic. It runs inside the worker subprocess (or in-process when time_limit is None) and
# only imports math_verify lazily, so the worker starts without importing d3s or torch.
# --------------------------------------------------------------------------------------------------


def normalize_gold(gold: Gold) -> tuple[str, ...]:
    """Gold answer(s) as a tuple of non-empty strings (numbers formatted without a trailing ``.0``)."""
    items = list(gold) if isinstance(gold, (list, tuple)) else [gold]
    out: list[str] = []
    for item in items:
        if isinstance(item, bool):
            raise TypeError(f"gold answer must be a string or number, got {item!r}")
        # AMC stores 27.0: "27" keeps the comparison exact instead of a float comparison.
        text = str(int(item)) if isinstance(item, float) and item.is_integer() else str(item).strip()
        if text:
            out.append(text)
    return tuple(out)


def _strip_math_delimiters(text: str) -> str:
    """Remove unescaped ``$`` delimiters, keeping ``\\$`` (a literal dollar sign)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out.append(text[i : i + 2])
            i += 2
            continue
        if text[i] != "$":
            out.append(text[i])
        i += 1
    return "".join(out).strip()


def gold_candidates(gold: str) -> list[str]:
    """The forms tried, in order, to parse one gold string (first non-empty parse wins)."""
    if "\\boxed" in gold:
        return [gold]
    bare = _strip_math_delimiters(gold)
    forms = [f"\\boxed{{{bare}}}", f"${bare}$", gold]
    return list(dict.fromkeys(f for f in forms if f.strip("$ ")))


def check_answer_policy(policy: str) -> AnswerPolicy:
    """``policy`` itself when it is a known answer policy; otherwise a ValueError naming the choices."""
    if policy not in ANSWER_POLICIES:
        raise ValueError(f"answer policy must be one of {', '.join(ANSWER_POLICIES)}; got {policy!r}")
    return policy  # type: ignore[return-value]


_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_NO_BOX = object()  # sentinel: the completion has no box at all


def _box_content(text: str, start: int) -> str | None:
    """The argument of a box command ending at ``start``: ``{...}`` with balanced braces (escaped
    ``\\{`` ``\\}`` skipped), or without braces the token up to the next space or ``$`` (without
    trailing punctuation); None when the braces never close."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i == len(text) or text[i] != "{":
        return re.split(r"[\s$]", text[i:], maxsplit=1)[0].rstrip(".,;:")  # a sentence's punctuation
    depth, begin = 0, i + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped brace (or any command's first letter) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def last_boxed_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``completion``, or None when it has
    no box, or its last box is empty or never closes (use :func:`count_boxes` to tell these apart)."""
    found = _last_box(completion)
    return None if found is _NO_BOX else found  # type: ignore[return-value]


def _last_box(completion: str) -> str | None | object:
    last = None
    for match in _BOX_COMMAND.finditer(completion):
        last = match
    if last is None:
        return _NO_BOX
    content = _box_content(completion, last.end())
    return content if content and content.strip() else None


def count_boxes(completion: str) -> int:
    """How many ``\\boxed`` / ``\\fbox`` commands ``completion`` holds (the policies can only disagree
    when there is at least one)."""
    return sum(1 for _ in _BOX_COMMAND.finditer(completion))


class _MathVerifyGrader:
    """Parses and verifies with math-verify; caches parsed gold. Not time-limited by itself."""

    def __init__(self, answer_extraction: AnswerExtraction) -> None:
        import logging

        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        # Our own wall-clock limit replaces math-verify's signal-based one; silence its warning.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        self._parse, self._verify = parse, verify
        self._gold_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        if answer_extraction == "boxed_first":
            self._pred_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        elif answer_extraction == "boxed_only":
            self._pred_config = [
                LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
            ]
        else:
            raise ValueError(
                f"answer_extraction must be 'boxed_first' or 'boxed_only', got {answer_extraction!r}"
            )
        self._gold_cache: OrderedDict[tuple[str, ...], list[list[Any]]] = OrderedDict()

    def parse_gold(self, golds: tuple[str, ...]) -> list[list[Any]]:
        """One parsed list per gold string that parses; [] when none does."""
        cached = self._gold_cache.get(golds)
        if cached is not None:
            self._gold_cache.move_to_end(golds)
            return cached
        parsed_golds = []
        for gold in golds:
            for form in gold_candidates(gold):
                parsed = self._parse(form, self._gold_config, parsing_timeout=None)
                if parsed:
                    parsed_golds.append(parsed)
                    break
        self._gold_cache[golds] = parsed_golds
        if len(self._gold_cache) > _GOLD_CACHE_SIZE:
            self._gold_cache.popitem(last=False)
        return parsed_golds

    def grade(
        self, completion: str, golds: tuple[str, ...], policy: AnswerPolicy = DEFAULT_ANSWER_POLICY
    ) -> tuple[bool, str | None, bool, str | None, bool]:
        """(correct, extracted, gold parsed, error, gold as text): a plain tuple, so it pickles across modules."""
        gold_as_text = False
        try:
            parsed_golds = self.parse_gold(golds)
            if not parsed_golds:
                return False, None, False, None, False
            gold_as_text = all(isinstance(item, str) for parsed in parsed_golds for item in parsed)
            answer_text = completion
            if policy == "last_boxed":
                last = _last_box(completion)
                if last is None:  # the last box is empty or cut off: no answer
                    return False, None, True, None, gold_as_text
                if last is not _NO_BOX:  # without any box, the completion is read as math_verify reads it
                    answer_text = f"\\boxed{{{last}}}"
            elif policy != "math_verify":
                raise ValueError(f"unknown answer policy {policy!r}")
            pred = self._parse(answer_text, self._pred_config, parsing_timeout=None)
            extracted = None
            if pred:
                # parse() returns [sympy_object, matched_string]; the string is what the model wrote.
                extracted = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
            correct = bool(pred) and any(
                self._verify(gold, pred, timeout_seconds=None) for gold in parsed_golds
            )
            return correct, extracted, True, None, gold_as_text
        except (Exception, RecursionError) as exc:  # a parser bug must not kill training
            return False, None, True, f"{type(exc).__name__}: {exc}"[:500], gold_as_text


# --------------------------------------------------------------------------------------------------
# Worker subprocess: length-prefixed pickles over two pipes.
# --------------------------------------------------------------------------------------------------

_HEADER = struct.Struct("<Q")


def _write_message(fd: int, obj: Any) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            raise EOFError("grading pipe closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _read_message(fd: int) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


def _worker_main(read_fd: int, write_fd: int, answer_extraction: AnswerExtraction) -> None:
    """Loop of the grading subprocess: read (completion, golds, policy), write the grade tuple."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))  # deeply nested LaTeX
    grader = _MathVerifyGrader(answer_extraction)
    _write_message(write_fd, "ready")
    while True:
        try:
            completion, golds, policy = _read_message(read_fd)
        except EOFError:  # the parent closed the pipe or exited
            return
        _write_message(write_fd, grader.grade(completion, golds, policy))


# Loads this file by path, so the worker imports neither d3s/__init__ nor anything heavy.
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_d3s_grading_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])\n"
)


class _WorkerProcess:
    """One grading subprocess; killed (never reused) when an answer overruns its limit."""

    def __init__(self, answer_extraction: AnswerExtraction) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOTSTRAP,
                __file__,
                str(to_child_r),
                str(from_child_w),
                answer_extraction,
            ],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.started_at = time.perf_counter()
        self.ready = False

    def fileno(self) -> int:
        return self._from_child

    def finish_start(self) -> None:
        """Read the worker's "ready" message (call when its pipe is readable)."""
        try:
            message = _read_message(self._from_child)
        except EOFError:
            code = self.process.wait()
            raise RuntimeError(f"grading worker exited during start-up (exit code {code})") from None
        if message != "ready":
            raise RuntimeError(f"grading worker sent {message!r} instead of 'ready'")
        self.ready = True

    def send(self, completion: str, golds: tuple[str, ...], policy: AnswerPolicy) -> None:
        _write_message(self._to_child, (completion, golds, policy))

    def receive(self) -> tuple[bool, str | None, bool, str | None, bool]:
        return _read_message(self._from_child)

    def kill(self) -> None:
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Grader:
    """Grades answers in ``num_workers`` persistent subprocesses, each answer under ``time_limit`` s.

    ``time_limit=None`` grades in the calling process with no limit at all (debugging only: one
    pathological answer can then hang the caller). Thread-safe; create one per process (after a fork,
    :func:`default_grader` makes a fresh one).
    """

    def __init__(
        self,
        num_workers: int = 1,
        time_limit: float | None = DEFAULT_TIME_LIMIT_S,
        answer_extraction: AnswerExtraction = "boxed_first",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if time_limit is not None and time_limit <= 0:
            raise ValueError(f"time_limit must be positive seconds or None, got {time_limit}")
        if answer_extraction not in ("boxed_first", "boxed_only"):
            raise ValueError(
                f"answer_extraction must be 'boxed_first' or 'boxed_only', got {answer_extraction!r}"
            )
        self.num_workers = num_workers
        self.time_limit = time_limit
        self.answer_extraction: AnswerExtraction = answer_extraction
        self._workers: list[_WorkerProcess] = []
        self._inline: _MathVerifyGrader | None = None
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self.timeouts = 0  # answers that overran the limit since construction
        self.restarts = 0  # workers killed and replaced

    # -- public API -------------------------------------------------------------------------------

    def grade(self, completion: str, gold: Gold, policy: AnswerPolicy = DEFAULT_ANSWER_POLICY) -> GradeResult:
        return self.grade_many([completion], [gold], policy)[0]

    def grade_many(
        self,
        completions: Sequence[str],
        golds: Sequence[Gold],
        policy: AnswerPolicy = DEFAULT_ANSWER_POLICY,
    ) -> list[GradeResult]:
        """Grade ``completions[i]`` against ``golds[i]`` under ``policy``, spreading answers over the workers."""
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
        with self._lock:
            if os.getpid() != self._owner_pid:
                raise RuntimeError("Grader used in a forked child: create a new Grader in this process")
            results = self._grade_inline(jobs) if self.time_limit is None else self._grade_in_workers(jobs)
        n = len(pairs)
        return {policy: results[i * n : (i + 1) * n] for i, policy in enumerate(policies)}

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers = []

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; workers also exit when their pipe closes
        try:
            if os.getpid() == self._owner_pid:
                for worker in self._workers:
                    worker.kill()
        except Exception:
            pass

    # -- internals --------------------------------------------------------------------------------

    def _grade_inline(self, jobs: list[tuple[str, tuple[str, ...], AnswerPolicy]]) -> list[GradeResult]:
        if self._inline is None:
            self._inline = _MathVerifyGrader(self.answer_extraction)
        results = []
        for completion, golds, policy in jobs:
            start = time.perf_counter()
            if not golds:
                results.append(GradeResult(False, None, False, False, 0.0))
                continue
            correct, extracted, gold_parsed, error, as_text = self._inline.grade(completion, golds, policy)
            seconds = time.perf_counter() - start
            results.append(GradeResult(correct, extracted, gold_parsed, False, seconds, error, as_text))
        return results

    def _grade_in_workers(self, jobs: list[tuple[str, tuple[str, ...], AnswerPolicy]]) -> list[GradeResult]:
        assert self.time_limit is not None
        results: list[GradeResult | None] = [None] * len(jobs)
        for index, (_, golds, _) in enumerate(jobs):  # empty gold is unparsable by definition
            if not golds:
                results[index] = GradeResult(False, None, False, False, 0.0)
        pending = [i for i in range(len(jobs)) if results[i] is None][::-1]  # popped from the end
        while len(self._workers) < self.num_workers:
            self._workers.append(_WorkerProcess(self.answer_extraction))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (job index, start time)
        while pending or busy:
            for slot, worker in enumerate(self._workers):
                if worker.ready and slot not in busy and pending:
                    index = pending.pop()
                    try:
                        worker.send(*jobs[index])
                    except OSError:  # the worker died while idle (killed, out of memory): replace, retry
                        pending.append(index)
                        self._replace(slot)
                        continue
                    busy[slot] = (index, time.perf_counter())
            # Wait for an answer, a deadline, or a (re)starting worker; start-up is charged to no answer.
            starting = [w for w in self._workers if not w.ready]
            now = time.perf_counter()
            deadlines = [start + self.time_limit for _, start in busy.values()]
            deadlines += [w.started_at + WORKER_START_TIMEOUT_S for w in starting]
            wait = max(0.0, min(deadlines) - now)
            watched = [self._workers[s] for s in busy] + starting
            readable = {id(w) for w in select.select(watched, [], [], wait)[0]}
            now = time.perf_counter()
            for worker in starting:
                if id(worker) in readable:
                    worker.finish_start()
                elif now - worker.started_at >= WORKER_START_TIMEOUT_S:
                    worker.kill()
                    raise RuntimeError(f"grading worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
            for slot in list(busy):
                index, start = busy[slot]
                if id(self._workers[slot]) in readable:
                    try:
                        correct, extracted, gold_parsed, error, as_text = self._workers[slot].receive()
                    except EOFError:  # the worker died (e.g. out of memory): wrong, and replace it
                        correct, extracted, gold_parsed, error, as_text = (
                            False,
                            None,
                            True,
                            "grading worker died",
                            False,
                        )
                        self._replace(slot)
                    results[index] = GradeResult(
                        correct, extracted, gold_parsed, False, now - start, error, as_text
                    )
                    del busy[slot]
                elif now - start >= self.time_limit:
                    self.timeouts += 1
                    self._replace(slot)
                    results[index] = GradeResult(False, None, True, True, now - start)
                    del busy[slot]
        return [r for r in results if r is not None]

    def _replace(self, slot: int) -> None:
        # The replacement starts importing now, while the other workers keep grading.
        self._workers[slot].kill()
        self._workers[slot] = _WorkerProcess(self.answer_extraction)
        self.restarts += 1


# --------------------------------------------------------------------------------------------------
# Module-level convenience API (one default grader per process).
# --------------------------------------------------------------------------------------------------

_default_grader: Grader | None = None
_default_lock = threading.Lock()


def default_grader() -> Grader:
    """The process-wide grader (one worker, default time limit), recreated in forked children."""
    global _default_grader
    with _default_lock:
        if _default_grader is None or _default_grader._owner_pid != os.getpid():
            _default_grader = Grader()
        return _default_grader


@atexit.register
def _close_default_grader() -> None:
    if _default_grader is not None and _default_grader._owner_pid == os.getpid():
        _default_grader.close()


def grade_detailed(
    completion: str,
    gold: Gold,
    policy: AnswerPolicy = DEFAULT_ANSWER_POLICY,
    *,
    grader: Grader | None = None,
) -> GradeResult:
    """Grade one completion; the full :class:`GradeResult` (extracted answer, timeout, gold status)."""
    return (grader or default_grader()).grade(completion, gold, check_answer_policy(policy))


def grade(
    completion: str,
    gold: Gold,
    policy: AnswerPolicy = DEFAULT_ANSWER_POLICY,
    *,
    grader: Grader | None = None,
) -> bool:
    """True when the completion's final answer equals the gold answer (math-verify, gold first).

    ``policy``: ``"math_verify"`` reads all boxed answers together as one set answer (math-verify's
    behaviour); ``"last_boxed"`` grades only the last box (the Qwen2.5-Math toolkit's convention).
    """
    return grade_detailed(completion, gold, policy, grader=grader).correct


def grade_many(
    completions: Sequence[str],
    golds: Sequence[Gold],
    policy: AnswerPolicy = DEFAULT_ANSWER_POLICY,
    *,
    grader: Grader | None = None,
) -> list[GradeResult]:
    """Grade many answers at once (uses all of the grader's workers)."""
    return (grader or default_grader()).grade_many(completions, golds, check_answer_policy(policy))


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of a TRL completion: a string, or a list of chat messages (the last one's content)."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    content = completion[-1].get("content", "")
    if isinstance(content, list):  # multimodal-style content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def accuracy_reward(
    completions: Sequence[str | Sequence[dict[str, Any]]], answer: Sequence[Gold], **kwargs: Any
) -> list[float | None]:
    """TRL reward function: 1.0 correct, 0.0 wrong or timed out, None when the gold is unparsable.

    TRL passes ``prompts``, ``completion_ids``, ``trainer_state`` and every dataset column as keyword
    arguments; only ``completions`` and the ``answer`` column are used. ``None`` makes TRL ignore the
    sample for this reward instead of punishing the model for a bad gold answer. Graded under the
    ``math_verify`` answer policy; :func:`make_accuracy_reward` binds another one.
    """
    return _rewards_from(default_grader(), completions, answer, DEFAULT_ANSWER_POLICY)


def _rewards_from(
    grader: Grader,
    completions: Sequence[str | Sequence[dict[str, Any]]],
    answer: Sequence[Gold],
    policy: AnswerPolicy,
) -> list[float | None]:
    results = grader.grade_many([completion_text(c) for c in completions], list(answer), policy)
    return [None if not r.gold_parsed else (1.0 if r.correct else 0.0) for r in results]


def make_accuracy_reward(
    grader: Grader | None = None, *, policy: AnswerPolicy = DEFAULT_ANSWER_POLICY
) -> Callable[..., list[float | None]]:
    """:func:`accuracy_reward` bound to ``grader`` (e.g. more workers or another time limit; None: the
    process's default grader, looked up at each call so it survives a fork) and to an answer ``policy``.

    The returned function keeps the name ``accuracy_reward``, so TRL logs it under the same key.
    """
    check_answer_policy(policy)

    def accuracy_reward(
        completions: Sequence[str | Sequence[dict[str, Any]]], answer: Sequence[Gold], **kwargs: Any
    ) -> list[float | None]:
        return _rewards_from(grader or default_grader(), completions, answer, policy)

    accuracy_reward.__doc__ = globals()["accuracy_reward"].__doc__
    accuracy_reward.answer_policy = policy  # type: ignore[attr-defined]
    return accuracy_reward


def bind_answer_policy(reward_funcs: Any, policy: AnswerPolicy) -> Any:
    """``reward_funcs`` (one function or a list, as TRL takes them) with every :func:`accuracy_reward`
    replaced by one graded under ``policy``; other reward functions are left as they are."""
    check_answer_policy(policy)
    if policy == DEFAULT_ANSWER_POLICY:
        return reward_funcs

    def bind(func: Any) -> Any:
        return make_accuracy_reward(policy=policy) if func is accuracy_reward else func

    if isinstance(reward_funcs, (list, tuple)):
        return type(reward_funcs)(bind(f) for f in reward_funcs)
    return bind(reward_funcs)
