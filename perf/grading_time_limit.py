"""Grading under the per-answer time limit: what a hanging answer costs.

    .venv/bin/python perf/grading_time_limit.py            # ~10 s on a 2-core machine
    .venv/bin/python perf/grading_time_limit.py --quick    # a smaller limit, a smoke run

Two grader workers grade adversarial answers under ``--limit`` seconds each (perf/README.md).
"""

from __future__ import annotations

from typing import Any

from _common import base_parser, fmt_seconds, markdown_table, parse_args, timed_once, write_results

from d3s.grading.pool import Grader

NAME = "grading_time_limit"
WORKERS = 2
ADVERSARIAL = {
    "power tower 9^9^9^9": r"\boxed{9^{9^{9^{9}}}}",
    "power tower 10^10^10^10": r"\boxed{10^{10^{10^{10}}}}",
    "python power tower": "9**9**9**9",
    "3000 nested braces": "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
    "100k characters, answer at the end": "x" * 100_000 + r" so \boxed{5}",
    "100k characters of 1+1+...": "1+" * 50_000 + "1",
    "5000 bare nested braces": "{" * 5000 + "5" + "}" * 5000,
}


def main() -> None:
    parser = base_parser(__doc__, tiny_model=False)
    parser.add_argument("--limit", type=float, default=1.5, help="seconds per answer (the tests' limit)")
    args = parse_args(parser, limit=0.5)
    labels, completions = list(ADVERSARIAL), list(ADVERSARIAL.values())
    with Grader(num_workers=WORKERS, time_limit=args.limit) as grader:
        grader.grade_many([r"\boxed{1}"] * WORKERS, ["1"] * WORKERS)  # start the workers
        batch = timed_once(lambda: grader.grade_many(completions, ["5"] * len(completions)))
        results, batch_seconds = batch["result"], batch["median_s"]
        restarts, overruns = grader.restarts, grader.timeouts

    rows: list[dict[str, Any]] = [
        {
            "kind": "answer",
            "answer": label,
            "timed_out": result.timed_out,
            "correct": result.correct,
            "seconds": result.seconds,
            "past_limit_s": result.seconds - args.limit if result.timed_out else None,
        }
        for label, result in zip(labels, results, strict=True)
    ]
    bound = args.limit * len(completions) / WORKERS
    rows.append(
        {
            "kind": "batch",
            "answers": len(completions),
            "workers": WORKERS,
            "timeouts": sum(result.timed_out for result in results),
            # an answer that overruns is graded once more in a fresh worker and is timed out when that
            # overruns too; every overrun restarts its worker
            "overruns": overruns,
            "restarts": restarts,
            "seconds": batch_seconds,
            "limit_times_answers_per_worker_s": bound,
            "seconds_over_that": batch_seconds / bound,
        }
    )
    answer_table = markdown_table(
        rows[:-1],
        {
            "answer": "{answer}",
            "timed out": "{timed_out}",
            "correct": "{correct}",
            "seconds": lambda r: fmt_seconds(r["seconds"]),
            "past the limit": lambda r: fmt_seconds(r["past_limit_s"]),
        },
    )
    batch_table = markdown_table(
        rows[-1:],
        {
            "answers": "{answers}",
            "workers": "{workers}",
            "timeouts": "{timeouts}",
            "overruns": "{overruns}",
            "restarts": "{restarts}",
            "batch wall": lambda r: fmt_seconds(r["seconds"]),
            "limit x answers / workers": lambda r: fmt_seconds(r["limit_times_answers_per_worker_s"]),
            "ratio": "{seconds_over_that:.2f}",
        },
    )
    title = "Grading under the per-answer time limit"
    write_results(NAME, args, rows, f"{answer_table}\n\n{batch_table}", title=title, workers=WORKERS)


if __name__ == "__main__":
    main()
