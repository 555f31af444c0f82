"""Registry (:data:`BENCHMARKS`) and loaders of the math benchmarks and the MATH level 3-5 training set; golds
are normalised to a tuple of strings at load, so no caller needs a benchmark's quirks."""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from d3s.grading.policies import last_boxed_answer, normalize_gold

DATA_DIR_ENV = "D3S_DATA_DIR"


class BenchmarkError(ValueError):
    """An unknown benchmark, a missing or malformed copy: the message says which and what to do."""


class MalformedRowsWarning(UserWarning):
    """Malformed rows were skipped (``on_malformed="skip"``); the message names their lines."""


@dataclass(frozen=True)
class Problem:
    """One benchmark problem, ready to prompt and grade."""

    benchmark: str
    problem_id: str  # the dataset's own id where it has one, else the 0-based row index
    question: str
    gold: tuple[str, ...]  # one or more acceptable answers (OlympiadBench final_answer is a list)
    reference_solution: str | None = None  # worked solution, used by the grader audit only
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HubSource:
    """Where a benchmark lives on the Hugging Face Hub. ``renames`` maps a local field name to the hub
    columns to try when the hub copy names it differently (first present wins)."""

    path: str
    split: str
    name: str | None = None
    data_files: str | None = None
    renames: Mapping[str, Sequence[str]] = field(default_factory=dict)


def gsm8k_final_answer(rationale: str) -> str | None:
    """The number after ``####`` in a GSM8K rationale, thousands separators removed ("1,600" -> "1600")."""
    if "####" not in rationale:
        return None
    value = rationale.rsplit("####", 1)[1].strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", value) or None


def _as_text(value: Any) -> str | None:
    if isinstance(value, (list, tuple)):  # OlympiadBench stores solutions as a list of strings
        value = "\n\n".join(str(v) for v in value if v is not None) or None
    return None if value is None else str(value)


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to read one benchmark."""

    name: str
    hub: HubSource | None = None
    local_file: str = "test.jsonl"  # in <data root>/<local_dir or name>/
    local_dir: str | None = None
    question_field: str = "problem"
    # The gold: the first of these fields present and non-empty; a value read from solution_field is
    # replaced by the final answer written in it (GSM8K's rationale, Minerva's solution).
    gold_fields: tuple[str, ...] = ("answer",)
    id_field: str | None = "id"
    solution_field: str | None = None  # a worked solution (reference for the grader audit)
    # Where a solution states its final answer: "boxed" (its last \boxed{}) or "gsm8k" (after ####).
    solution_answer: str = "boxed"
    role: str = "eval"  # "eval" benchmark or "train" set
    default_template: str | None = None  # None: chosen from the model (chat template or plain)
    metadata_fields: tuple[str, ...] = ()

    @property
    def local_path(self) -> str:
        """The local copy's path relative to the data root."""
        return f"{self.local_dir or self.name}/{self.local_file}"


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in [
        BenchmarkSpec(
            "aime24",
            HubSource("HuggingFaceH4/aime_2024", split="train"),
            solution_field="solution",
            metadata_fields=("url",),
        ),
        BenchmarkSpec("aime25", HubSource("math-ai/aime25", split="test", renames={"problem": ["question"]})),
        BenchmarkSpec(
            "amc23",
            HubSource("math-ai/amc23", split="test", renames={"problem": ["question"]}),
            metadata_fields=("url",),
        ),
        BenchmarkSpec(
            "math500",
            HubSource("HuggingFaceH4/MATH-500", split="test"),
            id_field="unique_id",
            solution_field="solution",
            metadata_fields=("subject", "level"),
        ),
        BenchmarkSpec(
            "gsm8k",
            HubSource("openai/gsm8k", name="main", split="test"),
            question_field="question",
            id_field=None,
            solution_field="answer",
            solution_answer="gsm8k",
        ),
        BenchmarkSpec(
            "minerva_math",
            HubSource("math-ai/minervamath", split="test", renames={"problem": ["question"], "idx": ["id"]}),
            gold_fields=("answer", "solution"),  # hub copies carry a separate answer column
            id_field="idx",
            solution_field="solution",
            metadata_fields=("type",),
        ),
        BenchmarkSpec(
            "olympiadbench",
            HubSource("Hothan/OlympiadBench", name="OE_TO_maths_en_COMP", split="train"),
            question_field="question",
            gold_fields=("final_answer",),
            solution_field="solution",
            metadata_fields=("subfield", "answer_type", "unit", "is_multiple_answer"),
        ),
        BenchmarkSpec(
            "math_level3to5",
            HubSource(
                "hkust-nlp/SimpleRL-Zoo-Data",
                split="train",
                data_files="simplelr_qwen_level3to5/train.parquet",
                renames={"prompt": ["problem", "question"], "answer": ["gt_answer"]},
            ),
            local_file="math.8k.json",
            question_field="prompt",
            role="train",
        ),
        BenchmarkSpec(
            "gsm8k_train",
            HubSource("openai/gsm8k", name="main", split="train"),
            local_dir="gsm8k",
            local_file="train.jsonl",
            question_field="question",
            id_field=None,
            solution_field="answer",
            solution_answer="gsm8k",
            role="train",
        ),
        BenchmarkSpec(
            "synthetic",
            question_field="prompt",
            id_field=None,
            solution_field="solution",
            default_template="raw",  # the prompt already is the model's input format ("Q: ...\nA:")
        ),
    ]
}

EVAL_BENCHMARKS = tuple(
    name for name, spec in BENCHMARKS.items() if spec.role == "eval" and name != "synthetic"
)


def get_benchmark(name: str) -> BenchmarkSpec:
    """The spec of ``name``; unknown names fail with the list of valid ones."""
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def parse_benchmark_list(text: str | Sequence[str]) -> list[str]:
    """Split 'aime24,math500' (or a list), validate every name, keep order, drop duplicates."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if not names:
        raise BenchmarkError("no benchmark given; valid names: " + ", ".join(BENCHMARKS))
    for name in names:
        get_benchmark(name)
    return list(dict.fromkeys(names))


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The data root: the argument, else ``$D3S_DATA_DIR``, else None (hub only)."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else None


def local_copy(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The file of benchmark ``name`` under the data root, or None when there is none (or no root)."""
    root = resolve_data_dir(data_dir)
    path = root / get_benchmark(name).local_path if root is not None and name != "synthetic" else None
    return path if path is not None and path.is_file() else None


def benchmark_source(name: str, data_dir: str | os.PathLike[str] | None = None) -> str:
    """Where :func:`load_benchmark` reads ``name`` from: its local file, the Hub, or generated (synthetic)."""
    if name == "synthetic":
        return "generated (d3s.data.synthetic)"
    return str(local_copy(name, data_dir) or "Hugging Face Hub")


def _malformed_message(where: object, problems: list[str], shown: int = 20) -> str:
    more = f"\n  ... and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"{where}: {len(problems)} malformed row(s):\n  " + "\n  ".join(problems[:shown]) + more


def _read_local_rows(path: Path) -> list[tuple[int, Any]]:
    """(line number, row) pairs; a JSON array file numbers rows 1.. by position. Invalid JSON raises."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BenchmarkError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, list):
            raise BenchmarkError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
        return list(enumerate(data, start=1))
    rows, bad = [], []
    for number, line in enumerate(text.split("\n"), start=1):  # JSON Lines: only \n ends a line
        try:
            if line.strip():
                rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            bad.append(f"line {number}: invalid JSON ({exc.msg})")
    if bad:
        raise BenchmarkError(_malformed_message(path, bad))
    return rows


def _hub_rows(spec: BenchmarkSpec, looked_local: str) -> list[tuple[int, Any]]:
    """Rows of the benchmark's Hub copy (``datasets``), each renamed column added under its local name."""
    hub = spec.hub
    assert hub is not None
    where = hub.path + (f" ({hub.name})" if hub.name else "") + f" split {hub.split}"
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        reason = "offline mode is set (HF_HUB_OFFLINE)"
    else:
        import datasets  # heavy; only needed when a local copy is missing

        extra = {"data_files": hub.data_files} if hub.data_files else {}
        try:
            dataset = datasets.load_dataset(hub.path, hub.name, split=hub.split, **extra)
        except Exception as exc:  # no network, missing repo, auth: all mean "not available here"
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        else:
            rows = []
            for index, row in enumerate(dataset, start=1):
                row = dict(row)
                for local, columns in hub.renames.items():
                    present = [column for column in columns if column in row]
                    if local not in row and present:
                        row[local] = row[present[0]]
                rows.append((index, row))
            return rows
    raise BenchmarkError(
        f"benchmark {spec.name!r} not found: looked for {looked_local}; the Hugging Face Hub copy {where} "
        f"cannot be fetched ({reason}). Put a copy at <data-dir>/{spec.local_path} or set ${DATA_DIR_ENV}."
    )


SYNTHETIC_MINIMUMS = {"count": 1, "seed": 0, "min_ops": 1, "max_ops": 1, "max_operand": 1, "bounded": 0}


def check_synthetic_options(options: Mapping[str, Any], what: str = "synthetic") -> dict[str, int]:
    """The synthetic task's options (count, seed, min_ops, max_ops, max_operand, bounded 0/1) as checked
    integers; ``what`` names them in the messages (the CLI's ``--synthetic``)."""
    for key, value in options.items():
        if key not in SYNTHETIC_MINIMUMS:
            raise BenchmarkError(f"unknown {what} option {key!r}; valid: {', '.join(SYNTHETIC_MINIMUMS)}")
        if int(value) < SYNTHETIC_MINIMUMS[key]:
            raise BenchmarkError(f"{what} {key} must be >= {SYNTHETIC_MINIMUMS[key]}, got {value}")
    if int(options.get("bounded", 0)) > 1:
        raise BenchmarkError(f"{what} bounded must be 0 or 1, got {options['bounded']}")
    if int(options.get("min_ops", 1)) > int(options.get("max_ops", 3)):
        raise BenchmarkError(f"{what} min_ops must be <= max_ops")
    return {key: int(value) for key, value in options.items()}


def _synthetic_rows(options: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    from d3s.data.synthetic import arithmetic_problems

    # Only options given are passed on, so the task's own defaults apply to the rest.
    problems = arithmetic_problems(**{"count": 200} | check_synthetic_options(options), split="test")
    # The SFT target completion doubles as a reference solution (it ends in \boxed{answer}).
    return [
        (i, {"prompt": p.prompt, "answer": p.answer, "solution": p.completion})
        for i, p in enumerate(problems, start=1)
    ]


def load_benchmark(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    limit: int | None = None,
    allow_hub: bool = True,
    synthetic: Mapping[str, Any] | None = None,
    on_malformed: str | None = None,
) -> list[Problem]:
    """The first ``limit`` problems of benchmark ``name``: its local copy, else (``allow_hub``) the Hub;
    ``synthetic`` holds the synthetic task's options. Malformed rows: docs/evaluation/benchmarks.md."""
    spec = get_benchmark(name)
    on_malformed = on_malformed or ("skip" if spec.role == "train" else "error")
    if on_malformed not in ("error", "skip"):
        raise BenchmarkError(f"on_malformed must be 'error' or 'skip', got {on_malformed!r}")
    if limit is not None and limit < 1:
        raise BenchmarkError(f"limit must be a positive number of problems, got {limit}")
    local, root = local_copy(name, data_dir), resolve_data_dir(data_dir)
    if name == "synthetic":
        rows, source = _synthetic_rows(synthetic or {}), "d3s.data.synthetic (test split)"
    elif local is not None:
        rows, source = _read_local_rows(local), str(local)
    else:
        looked = (
            f"local copy {root / spec.local_path} (not found)"
            if root is not None
            else f"no local copy (no --data-dir given and ${DATA_DIR_ENV} unset)"
        )
        if spec.hub is None or not allow_hub:
            reason = "no hub source is registered" if spec.hub is None else "hub loading is disabled"
            raise BenchmarkError(f"benchmark {name!r} not found: looked for {looked}; {reason}")
        rows, source = _hub_rows(spec, looked), f"hf://{spec.hub.path}"
    problems, bad, seen_ids = [], [], {}
    for position, (line, row) in enumerate(rows):
        if limit is not None and len(problems) >= limit:
            break
        problem = _problem(spec, position, line, row, seen_ids)
        if isinstance(problem, str):
            bad.append(f"line {line}: {problem}")
        else:
            problems.append(problem)
    if bad and on_malformed == "error":
        message = _malformed_message(source, bad)
        raise BenchmarkError(message + "\n(fix these rows, or skip them with on_malformed='skip')")
    if bad:
        warnings.warn(_malformed_message(source, bad) + "\n(skipped)", MalformedRowsWarning, stacklevel=2)
    if not problems:
        raise BenchmarkError(f"{source}: no problems found")
    return problems


def _problem(
    spec: BenchmarkSpec, position: int, line: int, row: Any, seen_ids: dict[str, int]
) -> Problem | str:
    """The problem of one row, or what is wrong with the row."""
    if not isinstance(row, dict):
        return "not a JSON object"
    question = row.get(spec.question_field)
    if not isinstance(question, str) or not question.strip():
        return f"missing or empty question field {spec.question_field!r}"
    gold: tuple[str, ...] = ()
    for name in spec.gold_fields:
        value = row.get(name)
        if name == spec.solution_field and value is not None:
            value = solution_final_answer(spec, _as_text(value))
        if value not in (None, ""):
            try:
                gold = normalize_gold(value)
            except TypeError as exc:
                return str(exc)
            break
    if not gold:
        return f"missing or empty answer (field {' or '.join(spec.gold_fields)})"
    raw_id = row.get(spec.id_field) if spec.id_field else None
    problem_id = str(raw_id) if raw_id is not None else str(position)
    if problem_id in seen_ids:
        return f"duplicate problem id {problem_id!r} (also on line {seen_ids[problem_id]})"
    seen_ids[problem_id] = line
    reference = _as_text(row.get(spec.solution_field)) if spec.solution_field else None
    metadata = {"line": line, **{k: row[k] for k in spec.metadata_fields if k in row}}
    return Problem(spec.name, problem_id, question, gold, reference, metadata)


def solution_final_answer(spec: BenchmarkSpec, solution: str | None) -> str | None:
    """The final answer written in a reference solution of ``spec`` (its last box, or GSM8K's ####)."""
    if solution is None:
        return None
    return gsm8k_final_answer(solution) if spec.solution_answer == "gsm8k" else last_boxed_answer(solution)
