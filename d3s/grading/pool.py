"""The grading pool: :class:`Grader` grades answers in persistent worker subprocesses, each answer under a
time limit, an overrun graded once more in a fresh worker and wrong when it overruns again; the result of
one grading (:class:`GradeResult`), and the process-wide grader (:func:`default_grader`). A box around a
plain integer is read in the calling process (d3s/integer_answers.py); every other answer goes to a worker's
math-verify (d3s/grading/reading.py). Why this pool and not pebble: docs/evaluation/grading-performance.md."""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from typing import get_args

from d3s.grading.policies import (
    ANSWER_POLICIES,
    DEFAULT_ANSWER_POLICY,
    AnswerExtraction,
    AnswerPolicy,
    Gold,
    check_answer_policy,
    normalize_gold,
)
from d3s.grading.reading import _MathVerifyGrader
from d3s.integer_answers import integer_grade

DEFAULT_TIME_LIMIT_S = 5.0  # per answer, parsing both sides plus verification
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take a while


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


# Runs this file by path: the worker imports the grading modules and math-verify, nothing heavy (no torch).
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


def _graded_here(completion: str, golds: tuple[str, ...], policy: AnswerPolicy) -> GradeResult | None:
    start = time.perf_counter()
    fields = integer_grade(completion, golds, policy)
    return None if fields is None else GradeResult(**fields, seconds=time.perf_counter() - start)
