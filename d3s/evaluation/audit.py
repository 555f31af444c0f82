r"""Grader audit: do the gold answers and reference solutions parse and verify, and how often do the answer
policies disagree on real completions (docs/evaluation/audit.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from operator import attrgetter
from pathlib import Path

import pandas as pd

from d3s.data.benchmarks import (
    BENCHMARKS,
    Problem,
    get_benchmark,
    load_benchmark,
    local_copy,
    solution_final_answer,
)
from d3s.evaluation.metrics import policy_disagreement
from d3s.grading.policies import BOXED_POLICIES, count_boxes, last_boxed_answer
from d3s.grading.pool import Grader
from d3s.markdown import markdown_table
from d3s.provenance.manifest import atomic_write_text


@dataclass
class AuditRow:
    benchmark: str
    problems: int
    gold_parsed: int = 0
    gold_unparsable: int = 0
    gold_as_text: int = 0  # parsed only as a string: such golds are matched by exact string comparison
    with_reference: int = 0  # problems with a reference solution
    reference_answer_found: int = 0  # ... whose final answer could be located (boxed / ####)
    reference_verified: int = 0  # ... that verifies against the gold
    reference_verified_pct: str = ""  # of those found
    timeouts: int = 0
    unparsable_examples: list[str] = field(default_factory=list)
    text_gold_examples: list[str] = field(default_factory=list)
    mismatch_examples: list[str] = field(default_factory=list)  # "id: reference != gold"

    def details(self) -> list[str]:
        """The examples behind the counts: unparsable gold answers and reference mismatches."""
        lines = [f"  unparsable gold  {e}" for e in self.unparsable_examples]
        lines += [f"  gold as text     {e}" for e in self.text_gold_examples]
        lines += [f"  reference failed {e}" for e in self.mismatch_examples]
        return [f"{self.benchmark}:", *lines] if lines else []


def audit_benchmark(name: str, problems: Sequence[Problem], grader: Grader, examples: int = 5) -> AuditRow:
    """Audit one benchmark (all its ``problems``)."""
    spec = get_benchmark(name)
    # A completion that is nothing but the gold, boxed: whether the gold parses at all.
    golds = grader.grade_many([f"\\boxed{{{p.gold[0]}}}" for p in problems], [p.gold for p in problems])
    pairs = list(zip(problems, golds, strict=True))
    with_reference = [(p, r) for p, r in pairs if p.reference_solution is not None]
    answers = [(p, r, solution_final_answer(spec, p.reference_solution)) for p, r in with_reference]
    jobs = [(p, answer) for p, r, answer in answers if answer is not None and r.gold_parsed]
    checked = grader.grade_many([f"\\boxed{{{answer}}}" for _, answer in jobs], [p.gold for p, _ in jobs])
    verified = sum(r.correct for r in checked)
    mismatches = [
        f"{p.problem_id}: {a!r} vs gold {p.gold!r}"
        for (p, a), r in zip(jobs, checked, strict=True)
        if not r.correct
    ]
    return AuditRow(
        name,
        len(problems),
        gold_parsed=sum(r.gold_parsed for r in golds),
        gold_unparsable=sum(not r.gold_parsed for r in golds),
        gold_as_text=sum(bool(r.gold_parsed and r.gold_as_text) for r in golds),
        with_reference=len(with_reference),
        reference_answer_found=len(jobs),
        reference_verified=verified,
        reference_verified_pct=f"{100.0 * verified / len(jobs):.1f}" if jobs else "",
        timeouts=sum(r.timed_out for r in [*golds, *checked]),
        unparsable_examples=[f"{p.problem_id}: {p.gold!r}" for p, r in pairs if not r.gold_parsed][:examples],
        text_gold_examples=[
            f"{p.problem_id}: {p.gold!r}" for p, r in pairs if r.gold_parsed and r.gold_as_text
        ][:examples],
        mismatch_examples=mismatches[:examples],
    )


@dataclass
class DisagreementRow:
    source: str  # "reference solutions" or the samples file's evaluation
    benchmark: str
    completions: int  # with a parsable gold
    with_box: int
    with_2plus_boxes: int
    disagree: int
    disagree_pct: str
    math_verify_only_correct: int
    last_boxed_only_correct: int
    timeouts: int
    examples: list[str] = field(default_factory=list)  # "id: verdicts, last box, gold"

    def details(self) -> list[str]:
        """The samples on which the policies disagree."""
        lines = [f"  {e}" for e in self.examples]
        return [f"{self.benchmark} ({self.source}):", *lines] if lines else []


def policy_disagreement_row(
    source: str,
    benchmark: str,
    items: Sequence[tuple[str, str, Sequence[str]]],
    grader: Grader,
    examples: int = 5,
) -> DisagreementRow:
    """Grade ``(item id, completion, gold)`` items under both policies and count where they disagree.
    Items whose gold does not parse are left out (neither policy scores them). Items without a box are
    graded too: math_verify reads them as math-verify does, last_boxed by its own fallback."""
    grades = grader.grade_many_by_policy([c for _, c, _ in items], [g for _, _, g in items], BOXED_POLICIES)
    first, second = BOXED_POLICIES
    scored = [i for i, r in enumerate(grades[first]) if r.gold_parsed]
    counted = policy_disagreement(
        [(grades[first][i].correct, grades[second][i].correct) for i in scored], names=(first, second)
    )
    completions = len(scored)
    row = DisagreementRow(
        source=source,
        benchmark=benchmark,
        completions=completions,
        with_box=sum(count_boxes(items[i][1]) >= 1 for i in scored),
        with_2plus_boxes=sum(count_boxes(items[i][1]) >= 2 for i in scored),
        disagree=counted["disagree"],
        disagree_pct=f"{100.0 * counted['disagree'] / completions:.2f}" if completions else "",
        math_verify_only_correct=counted[f"{first}_only_correct"],
        last_boxed_only_correct=counted[f"{second}_only_correct"],
        # answers whose grading overran the time limit twice (wrong); an answer read bounded (math-verify's
        # reading past its work budget) is graded, not an overrun
        timeouts=sum(r.timed_out for policy in BOXED_POLICIES for r in grades[policy]),
    )
    for (item_id, completion, gold), a, b in zip(items, grades[first], grades[second], strict=True):
        if a.correct != b.correct and len(row.examples) < examples:
            row.examples.append(
                f"{item_id}: {first}={a.correct} ({a.extracted!r}), {second}={b.correct} "
                f"(last box {last_boxed_answer(completion)!r}), gold {list(gold)!r}"
            )
    return row


def samples_files(path: Path) -> list[Path]:
    """The ``samples.jsonl`` files of an ``--audit-samples`` path: the file itself or an evaluation's."""
    if path.is_file():
        return [path]
    files = sorted(path.glob("*/samples.jsonl")) or sorted(path.glob("samples.jsonl"))
    if not files:
        raise ValueError(
            f"--audit-samples {path}: no samples.jsonl there or in its benchmark folders "
            "(give the file, or an evaluation directory)"
        )
    return files


def samples_disagreement(paths: Iterable[str | os.PathLike[str]], grader: Grader) -> list[DisagreementRow]:
    """Both policies on the completions of evaluation outputs: each path is a ``samples.jsonl`` (its folder
    names the benchmark) or an evaluation directory holding ``<benchmark>/samples.jsonl``."""
    rows = []
    for path in paths:
        for file in samples_files(Path(path)):
            items = []
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    sample = f"{record['problem_id']}#{record.get('sample_index', number)}"
                    items.append((sample, str(record["completion"]), record["gold"]))
                except (ValueError, KeyError) as exc:
                    raise ValueError(f"{file}:{number}: not a samples.jsonl record ({exc})") from None
            rows.append(policy_disagreement_row(str(file.parent.parent), file.parent.name, items, grader))
    return rows


def _columns(row_type: type) -> list[str]:
    """A table's columns: the fields of its rows, but the examples (listed under the table)."""
    return [f.name for f in fields(row_type) if not f.name.endswith("examples")]


def audit_report(
    data_dir: str | os.PathLike[str] | None,
    benchmarks: Sequence[str] | None,
    samples: Iterable[str | os.PathLike[str]],
    grader: Grader,
    out_dir: Path | None = None,
) -> str:
    """Both audit tables and their examples as text; with ``out_dir``, also written there as
    ``grader_audit.{csv,md}``, ``policy_disagreement.{csv,md}`` and their ``*_examples.txt``.

    ``benchmarks`` None: every benchmark with a local copy, synthetic included."""
    names = benchmarks or [n for n in BENCHMARKS if n == "synthetic" or local_copy(n, data_dir)]
    rows, policy_rows = [], []
    for name in names:
        problems = load_benchmark(name, data_dir, allow_hub=False)
        rows.append(audit_benchmark(name, problems, grader))
        # both policies on the reference solutions (human-written, some with several boxes)
        items = [(p.problem_id, p.reference_solution, p.gold) for p in problems if p.reference_solution]
        if items:
            policy_rows.append(policy_disagreement_row("reference solutions", name, items, grader))
    policy_rows += samples_disagreement(samples, grader)
    policies = "answer policies (math_verify: math-verify's reading; last_boxed: the last box only):"
    tables = [
        ("grader_audit", _columns(AuditRow), rows, ""),
        ("policy_disagreement", _columns(DisagreementRow), policy_rows, policies),
    ]
    parts, written = [], []
    for stem, columns, table_rows, title in tables:
        markdown = markdown_table(table_rows, {c: attrgetter(c) for c in columns})
        details = "\n".join(line for row in table_rows for line in row.details())
        parts += [part for part in (title, markdown, details) if part]
        if out_dir is not None:
            table = pd.DataFrame(map(asdict, table_rows), columns=columns)
            texts = {
                ".csv": table.to_csv(index=False, lineterminator="\n"),
                ".md": markdown + "\n",
                "_examples.txt": details + "\n",
            }
            for suffix, text in texts.items():
                written.append(out_dir / f"{stem}{suffix}")
                atomic_write_text(written[-1], text)
    return "\n\n".join(parts) + "".join(f"\nwrote {path}" for path in written)
