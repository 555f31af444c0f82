r"""Grader audit: does the grader understand each benchmark's gold answers and reference solutions?

For every benchmark: how many gold answers parse, and, where a reference solution exists, how often the
solution's own final answer (the last ``\boxed{}``, or the number after ``####`` for GSM8K) verifies
against the gold with :func:`d3s.rewards.grade`. A reference answer that fails is either a grader gap
or a disagreement inside the dataset; the rows list a few examples of each to look at.

Second table: how often the two answer policies (``math_verify``: every box as one set answer;
``last_boxed``: the last box only) disagree, per benchmark, on real completions: the reference
solutions themselves, and the completions of any ``samples.jsonl`` given (a model's evaluation).
Every boxed completion is graded again under both policies against its gold; completions without any box
are counted but not graded, because both policies then read the same text the same way (they cannot
differ).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from d3s.data.benchmarks import (
    BENCHMARKS,
    BenchmarkNotFoundError,
    get_benchmark,
    load_benchmark,
    reference_final_answer,
)
from d3s.evaluation.metrics import policy_disagreement
from d3s.rewards import ANSWER_POLICIES, Grader, count_boxes, last_boxed_answer

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


# ------------------------------------------------------------------------- answer-policy disagreement

DISAGREEMENT_COLUMNS = (
    "source",
    "benchmark",
    "completions",
    "with_box",
    "with_2plus_boxes",
    "disagree",
    "disagree_pct",
    "math_verify_only_correct",
    "last_boxed_only_correct",
    "timeouts",
)


@dataclass
class DisagreementRow:
    source: str  # "reference solutions" or the samples file's evaluation
    benchmark: str
    completions: int  # with a parsable gold
    with_box: int
    with_2plus_boxes: int
    disagree: int
    math_verify_only_correct: int
    last_boxed_only_correct: int
    timeouts: int
    examples: list[str] = field(default_factory=list)  # "id: verdicts, last box, gold"

    @property
    def disagree_pct(self) -> float | None:
        return 100.0 * self.disagree / self.completions if self.completions else None

    def cells(self) -> dict[str, object]:
        out = {k: v for k, v in asdict(self).items() if k in DISAGREEMENT_COLUMNS}
        pct = self.disagree_pct
        out["disagree_pct"] = "" if pct is None else f"{pct:.2f}"
        return {k: out[k] for k in DISAGREEMENT_COLUMNS}


def policy_disagreement_row(
    source: str,
    benchmark: str,
    items: Sequence[tuple[str, str, Sequence[str]]],
    grader: Grader,
    examples: int = 5,
) -> DisagreementRow:
    """Grade ``(item id, completion, gold)`` items under both policies and count where they disagree.
    Boxed items whose gold does not parse are left out (neither policy scores them); items without a box
    are counted as agreeing without grading (both policies read them identically)."""
    boxed = [item for item in items if count_boxes(item[1])]
    grades = grader.grade_many_by_policy([c for _, c, _ in boxed], [g for _, _, g in boxed])
    first, second = ANSWER_POLICIES
    scored = [i for i, r in enumerate(grades[first]) if r.gold_parsed]
    counted = policy_disagreement(
        [(grades[first][i].correct, grades[second][i].correct) for i in scored], names=(first, second)
    )
    row = DisagreementRow(
        source=source,
        benchmark=benchmark,
        completions=len(items) - (len(boxed) - len(scored)),
        with_box=len(scored),
        with_2plus_boxes=sum(count_boxes(boxed[i][1]) >= 2 for i in scored),
        disagree=counted["disagree"],
        math_verify_only_correct=counted[f"{first}_only_correct"],
        last_boxed_only_correct=counted[f"{second}_only_correct"],
        timeouts=sum(r.timed_out for policy in ANSWER_POLICIES for r in grades[policy]),
    )
    for (item_id, completion, gold), a, b in zip(boxed, grades[first], grades[second], strict=True):
        if a.correct != b.correct and len(row.examples) < examples:
            row.examples.append(
                f"{item_id}: {first}={a.correct} ({a.extracted!r}), {second}={b.correct} "
                f"(last box {last_boxed_answer(completion)!r}), gold {list(gold)!r}"
            )
    return row


def reference_disagreement(
    data_dir: str | os.PathLike[str] | None, benchmarks: Sequence[str], grader: Grader
) -> list[DisagreementRow]:
    """Both policies on each benchmark's full reference solutions (human-written, sometimes with several
    boxes), for the benchmarks that have them."""
    rows = []
    for name in benchmarks:
        try:
            problems = load_benchmark(name, data_dir, allow_hub=False)
        except BenchmarkNotFoundError:
            continue
        items = [(p.problem_id, p.reference_solution, p.gold) for p in problems if p.reference_solution]
        if items:
            rows.append(policy_disagreement_row("reference solutions", name, items, grader))
    return rows


def _samples_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*/samples.jsonl")) or sorted(path.glob("samples.jsonl"))
    if not files:
        raise FileNotFoundError(f"{path}: no samples.jsonl there or in its benchmark folders")
    return files


def samples_disagreement(paths: Iterable[str | os.PathLike[str]], grader: Grader) -> list[DisagreementRow]:
    """Both policies on the completions of evaluation outputs: each path is a ``samples.jsonl`` (its folder
    names the benchmark) or an evaluation directory holding ``<benchmark>/samples.jsonl``."""
    rows = []
    for path in paths:
        for file in _samples_files(Path(path)):
            items = []
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    items.append(
                        (
                            f"{record['problem_id']}#{record.get('sample_index', number)}",
                            str(record["completion"]),
                            record["gold"],
                        )
                    )
                except (ValueError, KeyError) as exc:
                    raise ValueError(f"{file}:{number}: not a samples.jsonl record ({exc})") from None
            rows.append(policy_disagreement_row(str(file.parent.parent), file.parent.name, items, grader))
    return rows


def disagreement_markdown(rows: Sequence[DisagreementRow]) -> str:
    lines = ["| " + " | ".join(DISAGREEMENT_COLUMNS) + " |", "|" + "---|" * len(DISAGREEMENT_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(v) for v in row.cells().values()) + " |")
    return "\n".join(lines)


def disagreement_csv(rows: Sequence[DisagreementRow]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=DISAGREEMENT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row.cells())
    return buffer.getvalue()


def disagreement_details(rows: Sequence[DisagreementRow]) -> str:
    parts = []
    for row in rows:
        if row.examples:
            parts.append(f"{row.benchmark} ({row.source}):")
            parts += [f"  {e}" for e in row.examples]
    return "\n".join(parts)


def write_disagreement(rows: Sequence[DisagreementRow], out_dir: Path) -> list[Path]:
    from d3s.evaluation.runner import _atomic_write_lines

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        out_dir / "policy_disagreement.csv",
        out_dir / "policy_disagreement.md",
        out_dir / "policy_disagreement_examples.txt",
    ]
    texts = [disagreement_csv(rows), disagreement_markdown(rows) + "\n", disagreement_details(rows) + "\n"]
    for path, text in zip(paths, texts, strict=True):
        _atomic_write_lines(path, [text])
    return paths
