r"""Grader audit: does the grader understand each benchmark's gold answers and reference solutions?

For every benchmark: how many gold answers parse, and, where a reference solution exists, how often the
solution's own final answer (the last ``\boxed{}``, or the number after ``####`` for GSM8K) verifies
against the gold with :func:`d3s.rewards.grade`. A reference answer that fails is either a grader gap
or a disagreement inside the dataset; the rows list a few examples of each to look at.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from d3s.data.benchmarks import (
    BENCHMARKS,
    BenchmarkNotFoundError,
    get_benchmark,
    load_benchmark,
    reference_final_answer,
)
from d3s.rewards import Grader

AUDIT_COLUMNS = (
    "benchmark",
    "problems",
    "gold_parsed",
    "gold_unparsable",
    "gold_as_text",
    "with_reference",
    "reference_answer_found",
    "reference_verified",
    "reference_verified_pct",
    "timeouts",
)


@dataclass
class AuditRow:
    benchmark: str
    problems: int
    gold_parsed: int
    gold_unparsable: int
    gold_as_text: int  # parsed only as a string: such golds are matched by exact string comparison
    with_reference: int  # problems with a reference solution
    reference_answer_found: int  # ... whose final answer could be located (boxed / ####)
    reference_verified: int  # ... that verifies against the gold
    timeouts: int
    unparsable_examples: list[str] = field(default_factory=list)
    text_gold_examples: list[str] = field(default_factory=list)
    mismatch_examples: list[str] = field(default_factory=list)  # "id: reference != gold"

    @property
    def reference_verified_pct(self) -> float | None:
        if not self.reference_answer_found:
            return None
        return 100.0 * self.reference_verified / self.reference_answer_found

    def cells(self) -> dict[str, object]:
        out = {k: v for k, v in asdict(self).items() if k in AUDIT_COLUMNS}
        pct = self.reference_verified_pct
        out["reference_verified_pct"] = "" if pct is None else f"{pct:.1f}"
        return {k: out[k] for k in AUDIT_COLUMNS}


def audit_benchmark(
    name: str, data_dir: str | os.PathLike[str] | None, grader: Grader, examples: int = 5
) -> AuditRow:
    """Audit one benchmark (all its problems)."""
    spec = get_benchmark(name)
    problems = load_benchmark(name, data_dir, allow_hub=False)
    # A completion that is nothing but the gold, boxed: whether the gold parses at all.
    gold_results = grader.grade_many(
        [f"\\boxed{{{p.gold[0]}}}" for p in problems], [p.gold for p in problems]
    )
    row = AuditRow(name, len(problems), 0, 0, 0, 0, 0, 0, 0)
    reference_jobs: list[tuple[int, str]] = []
    for index, (problem, result) in enumerate(zip(problems, gold_results, strict=True)):
        row.timeouts += result.timed_out
        if result.gold_parsed:
            row.gold_parsed += 1
            row.gold_as_text += result.gold_as_text
            if result.gold_as_text and len(row.text_gold_examples) < examples:
                row.text_gold_examples.append(f"{problem.problem_id}: {problem.gold!r}")
        else:
            row.gold_unparsable += 1
            if len(row.unparsable_examples) < examples:
                row.unparsable_examples.append(f"{problem.problem_id}: {problem.gold!r}")
        if problem.reference_solution is not None:
            row.with_reference += 1
            answer = reference_final_answer(spec, problem)
            if answer is not None and result.gold_parsed:
                reference_jobs.append((index, answer))
    row.reference_answer_found = len(reference_jobs)
    reference_results = grader.grade_many(
        [f"\\boxed{{{answer}}}" for _, answer in reference_jobs],
        [problems[i].gold for i, _ in reference_jobs],
    )
    for (index, answer), result in zip(reference_jobs, reference_results, strict=True):
        row.timeouts += result.timed_out
        if result.correct:
            row.reference_verified += 1
        elif len(row.mismatch_examples) < examples:
            row.mismatch_examples.append(
                f"{problems[index].problem_id}: {answer!r} vs gold {problems[index].gold!r}"
            )
    return row


def run_audit(
    data_dir: str | os.PathLike[str] | None,
    benchmarks: Sequence[str] | None = None,
    grader: Grader | None = None,
) -> list[AuditRow]:
    """Audit ``benchmarks`` (default: all with a local copy, synthetic included)."""
    names = list(benchmarks) if benchmarks else list(BENCHMARKS)
    owns_grader = grader is None
    grader = grader or Grader(num_workers=max(1, min(4, os.cpu_count() or 1)))
    rows = []
    try:
        for name in names:
            try:
                rows.append(audit_benchmark(name, data_dir, grader))
            except BenchmarkNotFoundError:
                if benchmarks:  # explicitly asked for: an error; otherwise skip what is not there
                    raise
    finally:
        if owns_grader:
            grader.close()
    return rows


def audit_markdown(rows: Sequence[AuditRow]) -> str:
    lines = ["| " + " | ".join(AUDIT_COLUMNS) + " |", "|" + "---|" * len(AUDIT_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(v) for v in row.cells().values()) + " |")
    return "\n".join(lines)


def audit_csv(rows: Sequence[AuditRow]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=AUDIT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row.cells())
    return buffer.getvalue()


def audit_details(rows: Sequence[AuditRow]) -> str:
    """The examples behind the counts: unparsable gold answers and reference mismatches."""
    parts = []
    for row in rows:
        if row.unparsable_examples or row.mismatch_examples or row.text_gold_examples:
            parts.append(f"{row.benchmark}:")
            parts += [f"  unparsable gold  {e}" for e in row.unparsable_examples]
            parts += [f"  gold as text     {e}" for e in row.text_gold_examples]
            parts += [f"  reference failed {e}" for e in row.mismatch_examples]
    return "\n".join(parts)


def write_audit(rows: Sequence[AuditRow], out_dir: Path) -> list[Path]:
    from d3s.evaluation.runner import _atomic_write_lines

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "grader_audit.csv", out_dir / "grader_audit.md", out_dir / "grader_audit_examples.txt"]
    for path, text in zip(
        paths, [audit_csv(rows), audit_markdown(rows) + "\n", audit_details(rows) + "\n"], strict=True
    ):
        _atomic_write_lines(path, [text])
    return paths
