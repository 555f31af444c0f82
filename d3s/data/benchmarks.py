"""Registry and loaders of the math benchmarks (and the MATH level 3-5 training set).

Every benchmark is one :class:`BenchmarkSpec` row in :data:`BENCHMARKS`: where its local copy lives
(``<root>/<benchmark>/test.jsonl``), which field holds the question, how the gold answer is obtained,
which field holds a reference solution (for the grader audit), and a Hugging Face Hub fallback.
Loading returns a list of :class:`Problem` with the gold already normalised to a tuple of strings, so
the evaluation and the training reward never need to know a benchmark's quirks.
"""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "D3S_DATA_DIR"


class BenchmarkError(ValueError):
    """Base class of the errors raised here (a ValueError so CLIs can report it as bad input)."""


class UnknownBenchmarkError(BenchmarkError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class BenchmarkNotFoundError(BenchmarkError, FileNotFoundError):
    pass


class MalformedDataError(BenchmarkError):
    pass


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
    """Where a benchmark lives on the Hugging Face Hub, and how its columns map to the local fields.

    ``fields`` maps each local field name to the hub columns to try, first present wins (hub copies of
    the same benchmark name their columns differently).
    """

    path: str
    split: str
    name: str | None = None
    data_files: str | None = None
    fields: Mapping[str, Sequence[str]] = field(default_factory=dict)


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, braces balanced; None if absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            if text[i] == "\\" and i + 1 < len(text):  # skip escaped characters such as \{ and \}
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    match = re.search(r"\\boxed ([^\s$]+)", text)  # "\boxed 5" without braces
    return match.group(1) if match else None


def gsm8k_final_answer(rationale: str) -> str | None:
    """The number after ``####`` in a GSM8K rationale, thousands separators removed ("1,600" -> "1600")."""
    if "####" not in rationale:
        return None
    value = rationale.rsplit("####", 1)[1].strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", value) or None


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):  # OlympiadBench stores solutions as a list of strings
        parts = [str(v) for v in value if v is not None]
        return "\n\n".join(parts) if parts else None
    return str(value)


def _answer_field(row: Mapping[str, Any]) -> list[Any]:
    value = row.get("answer")
    return [] if value is None else [value]


def _gold_gsm8k(row: Mapping[str, Any]) -> list[Any]:
    answer = gsm8k_final_answer(str(row.get("answer") or ""))
    return [] if answer is None else [answer]


def _gold_minerva(row: Mapping[str, Any]) -> list[Any]:
    if row.get("answer") not in (None, ""):  # hub copies carry a separate answer column
        return [row["answer"]]
    boxed = last_boxed(str(row.get("solution") or ""))
    return [] if boxed is None else [boxed]


def _gold_olympiad(row: Mapping[str, Any]) -> list[Any]:
    value = row.get("final_answer")
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _reference_boxed(row: Mapping[str, Any]) -> str | None:
    return _as_text(row.get("solution"))


def _reference_gsm8k(row: Mapping[str, Any]) -> str | None:
    return _as_text(row.get("answer"))


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to read one benchmark. ``gold`` returns the raw gold value(s) of a row ([] = missing)."""

    name: str
    description: str
    local_path: str  # relative to the data root
    question_field: str
    gold: Callable[[Mapping[str, Any]], list[Any]]
    gold_fields: tuple[str, ...]  # the fields ``gold`` reads, named in error messages
    id_field: str | None = None
    reference_solution: Callable[[Mapping[str, Any]], str | None] | None = None
    reference_kind: str | None = None  # "boxed" (last \boxed{} of a solution) or "gsm8k" (#### value)
    hub: HubSource | None = None
    role: str = "eval"  # "eval" benchmark or "train" set
    default_template: str | None = None  # None: chosen from the model (chat template or plain)
    metadata_fields: tuple[str, ...] = ()


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in [
        BenchmarkSpec(
            name="aime24",
            description="AIME 2024 I+II (30); answers are zero-padded strings such as '025'",
            local_path="aime24/test.jsonl",
            question_field="problem",
            gold=_answer_field,
            gold_fields=("answer",),
            id_field="id",
            reference_solution=_reference_boxed,
            reference_kind="boxed",
            hub=HubSource(
                "HuggingFaceH4/aime_2024",
                split="train",
                fields={"problem": ["problem"], "answer": ["answer"], "solution": ["solution"], "id": ["id"]},
            ),
            metadata_fields=("url",),
        ),
        BenchmarkSpec(
            name="aime25",
            description="AIME 2025 I+II (30); answers are JSON integers",
            local_path="aime25/test.jsonl",
            question_field="problem",
            gold=_answer_field,
            gold_fields=("answer",),
            id_field="id",
            hub=HubSource(
                "math-ai/aime25",
                split="test",
                fields={"problem": ["problem", "question"], "answer": ["answer"], "id": ["id"]},
            ),
        ),
        BenchmarkSpec(
            name="amc23",
            description="AMC 2023, 40-problem version; answers are JSON floats such as 27.0",
            local_path="amc23/test.jsonl",
            question_field="problem",
            gold=_answer_field,
            gold_fields=("answer",),
            id_field="id",
            hub=HubSource(
                "math-ai/amc23",
                split="test",
                fields={"problem": ["problem", "question"], "answer": ["answer"], "id": ["id"]},
            ),
            metadata_fields=("url",),
        ),
        BenchmarkSpec(
            name="math500",
            description="MATH500 (PRM800K test split, 500)",
            local_path="math500/test.jsonl",
            question_field="problem",
            gold=_answer_field,
            gold_fields=("answer",),
            id_field="unique_id",
            reference_solution=_reference_boxed,
            reference_kind="boxed",
            hub=HubSource(
                "HuggingFaceH4/MATH-500",
                split="test",
                fields={
                    "problem": ["problem"],
                    "answer": ["answer"],
                    "solution": ["solution"],
                    "unique_id": ["unique_id"],
                    "subject": ["subject"],
                    "level": ["level"],
                },
            ),
            metadata_fields=("subject", "level"),
        ),
        BenchmarkSpec(
            name="gsm8k",
            description="GSM8K test (1,319); gold is the number after '####' in the rationale",
            local_path="gsm8k/test.jsonl",
            question_field="question",
            gold=_gold_gsm8k,
            gold_fields=("answer",),
            reference_solution=_reference_gsm8k,
            reference_kind="gsm8k",
            hub=HubSource(
                "openai/gsm8k",
                name="main",
                split="test",
                fields={"question": ["question"], "answer": ["answer"]},
            ),
        ),
        BenchmarkSpec(
            name="minerva_math",
            description="Minerva Math / OCW (272); gold is the last \\boxed{} of the solution",
            local_path="minerva_math/test.jsonl",
            question_field="problem",
            gold=_gold_minerva,
            gold_fields=("solution",),
            id_field="idx",
            reference_solution=_reference_boxed,
            reference_kind="boxed",
            hub=HubSource(
                "math-ai/minervamath",
                split="test",
                fields={
                    "problem": ["problem", "question"],
                    "solution": ["solution"],
                    "answer": ["answer"],
                    "idx": ["idx", "id"],
                },
            ),
            metadata_fields=("type",),
        ),
        BenchmarkSpec(
            name="olympiadbench",
            description="OlympiadBench OE_TO_maths_en_COMP (675); gold is the final_answer list",
            local_path="olympiadbench/test.jsonl",
            question_field="question",
            gold=_gold_olympiad,
            gold_fields=("final_answer",),
            id_field="id",
            reference_solution=_reference_boxed,
            reference_kind="boxed",
            hub=HubSource(
                "Hothan/OlympiadBench",
                name="OE_TO_maths_en_COMP",
                split="train",
                fields={
                    "question": ["question"],
                    "final_answer": ["final_answer"],
                    "solution": ["solution"],
                    "id": ["id"],
                    "subfield": ["subfield"],
                    "answer_type": ["answer_type"],
                    "unit": ["unit"],
                },
            ),
            metadata_fields=("subfield", "answer_type", "unit", "is_multiple_answer"),
        ),
        BenchmarkSpec(
            name="math_level3to5",
            description="MATH level 3-5 training set (SimpleRL/LIMR 'math.8k', 8,523); JSON array",
            local_path="math_level3to5/math.8k.json",
            question_field="prompt",
            gold=_answer_field,
            gold_fields=("answer",),
            id_field="id",
            hub=HubSource(
                "hkust-nlp/SimpleRL-Zoo-Data",
                split="train",
                data_files="simplelr_qwen_level3to5/train.parquet",
                fields={"prompt": ["prompt", "problem", "question"], "answer": ["answer", "gt_answer"]},
            ),
            role="train",
        ),
        BenchmarkSpec(
            name="synthetic",
            description="chained integer arithmetic of the tiny default (d3s.data.synthetic, test split)",
            local_path="",
            question_field="prompt",
            gold=_answer_field,
            gold_fields=("answer",),
            reference_solution=_reference_boxed,
            reference_kind="boxed",
            default_template="raw",  # the prompt already is the model's input format ("Q: ...\nA:")
        ),
    ]
}

EVAL_BENCHMARKS = tuple(
    name for name, spec in BENCHMARKS.items() if spec.role == "eval" and name != "synthetic"
)


def get_benchmark(name: str) -> BenchmarkSpec:
    """The spec of ``name``; unknown names fail with the list of valid ones."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise UnknownBenchmarkError(
            f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}"
        ) from None


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


def _read_local_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs; a JSON array file numbers rows 1.. by position."""
    rows: list[tuple[int, dict[str, Any]]] = []
    bad: list[str] = []
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise MalformedDataError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, list):
            raise MalformedDataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
        for index, row in enumerate(data, start=1):
            if isinstance(row, dict):
                rows.append((index, row))
            else:
                bad.append(f"row {index}: not a JSON object")
    else:
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    bad.append(f"line {line_number}: invalid JSON ({exc.msg})")
                    continue
                if not isinstance(row, dict):
                    bad.append(f"line {line_number}: not a JSON object")
                    continue
                rows.append((line_number, row))
    if bad:
        raise MalformedDataError(_malformed_message(path, bad))
    return rows


def _malformed_message(where: object, problems: list[str], shown: int = 20) -> str:
    more = f"\n  ... and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"{where}: {len(problems)} malformed row(s):\n  " + "\n  ".join(problems[:shown]) + more


def _load_hub_rows(spec: BenchmarkSpec) -> list[tuple[int, dict[str, Any]]]:
    """Rows from the Hub, with columns renamed to the local field names."""
    assert spec.hub is not None
    import datasets  # heavy; only needed when a local copy is missing

    hub = spec.hub
    kwargs: dict[str, Any] = {"split": hub.split}
    if hub.data_files is not None:
        kwargs["data_files"] = hub.data_files
    dataset = datasets.load_dataset(hub.path, hub.name, **kwargs)
    rows = []
    for index, hub_row in enumerate(dataset, start=1):
        row: dict[str, Any] = {}
        for local_field, candidates in hub.fields.items():
            for column in candidates:
                if column in hub_row:
                    row[local_field] = hub_row[column]
                    break
        rows.append((index, row))
    return rows


def _load_synthetic(options: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    from d3s.data.synthetic import arithmetic_problems

    valid = ("count", "seed", "min_ops", "max_ops", "max_operand")
    unknown = set(options) - set(valid)
    if unknown:
        raise BenchmarkError(f"unknown synthetic option(s) {sorted(unknown)}; valid: {', '.join(valid)}")
    # Only options given are passed on, so the task's own defaults apply to the rest.
    extra = {key: int(options[key]) for key in ("max_operand",) if key in options}
    problems = arithmetic_problems(
        int(options.get("count", 200)),
        seed=int(options.get("seed", 0)),
        min_ops=int(options.get("min_ops", 1)),
        max_ops=int(options.get("max_ops", 3)),
        split="test",
        **extra,
    )
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
    """Load a benchmark's problems (the first ``limit`` of them, if given).

    Looks for ``<data_dir or $D3S_DATA_DIR>/<local_path>`` and, when that is absent and ``allow_hub``,
    the Hugging Face Hub. ``synthetic`` passes count/seed/min_ops/max_ops/max_operand to the
    synthetic task.
    Malformed rows (missing question, missing or empty gold, duplicate id) raise
    :class:`MalformedDataError` listing their line numbers (``on_malformed="error"``, the default for
    evaluation benchmarks), or are skipped with a :class:`MalformedRowsWarning` naming them
    (``"skip"``, the default for training sets: math.8k has two rows with an empty answer). Invalid
    JSON is always an error. A problem is never dropped silently.
    """
    spec = get_benchmark(name)
    if on_malformed is None:
        on_malformed = "skip" if spec.role == "train" else "error"
    if on_malformed not in ("error", "skip"):
        raise BenchmarkError(f"on_malformed must be 'error' or 'skip', got {on_malformed!r}")
    if limit is not None and limit < 1:
        raise BenchmarkError(f"limit must be a positive number of problems, got {limit}")
    if name == "synthetic":
        rows, source = _load_synthetic(synthetic or {}), "d3s.data.synthetic (test split)"
    else:
        root = resolve_data_dir(data_dir)
        local = root / spec.local_path if root is not None else None
        if local is not None and local.is_file():
            rows, source = _read_local_rows(local), str(local)
        else:
            rows, source = _rows_from_hub(spec, local, allow_hub)
    return _rows_to_problems(spec, rows, source, limit, on_malformed)


def hub_unavailable_reason(timeout_s: float = 3.0) -> str | None:
    """Why the Hub cannot be reached right now (offline mode, no network), or None if it can.

    A quick check avoids ``datasets``' minute of retries on an offline machine.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or os.environ.get(
        "HF_DATASETS_OFFLINE", ""
    ).strip().lower() in ("1", "true", "yes", "on"):
        return "offline mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = (
        endpoint.hostname or "huggingface.co",
        endpoint.port or (80 if endpoint.scheme == "http" else 443),
    )
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc}"


def _rows_from_hub(
    spec: BenchmarkSpec, local: Path | None, allow_hub: bool
) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    looked_local = (
        f"local copy {local} (not found)"
        if local is not None
        else f"no local copy (no --data-dir given and ${DATA_DIR_ENV} unset)"
    )
    if spec.hub is None or not allow_hub:
        reason = "no hub source is registered" if spec.hub is None else "hub loading is disabled"
        raise BenchmarkNotFoundError(
            f"benchmark {spec.name!r} not found: looked for {looked_local}; {reason}"
        )
    hub_name = spec.hub.path + (f" ({spec.hub.name})" if spec.hub.name else "") + f" split {spec.hub.split}"
    offline_reason = hub_unavailable_reason()
    if offline_reason is not None:
        raise BenchmarkNotFoundError(
            f"benchmark {spec.name!r} not found: looked for {looked_local}; the Hugging Face Hub copy "
            f"{hub_name} cannot be fetched ({offline_reason}). Put a copy at <data-dir>/{spec.local_path} "
            f"or set ${DATA_DIR_ENV}."
        )
    try:
        rows = _load_hub_rows(spec)
    except Exception as exc:  # offline, missing repo, auth: all mean "not available here"
        raise BenchmarkNotFoundError(
            f"benchmark {spec.name!r} not found: looked for {looked_local} and on the Hugging Face Hub "
            f"at {hub_name} ({type(exc).__name__}: {exc}). Put a copy at <data-dir>/{spec.local_path} "
            f"or set ${DATA_DIR_ENV}."
        ) from exc
    return rows, f"hf://{hub_name}"


def _rows_to_problems(
    spec: BenchmarkSpec,
    rows: list[tuple[int, dict[str, Any]]],
    source: str,
    limit: int | None,
    on_malformed: str = "error",
) -> list[Problem]:
    from d3s.rewards import normalize_gold  # stdlib-only import; shares gold normalisation with grading

    problems: list[Problem] = []
    bad: list[str] = []
    seen_ids: dict[str, int] = {}
    for position, (line_number, row) in enumerate(rows):
        if limit is not None and len(problems) >= limit:
            break
        question = row.get(spec.question_field)
        if not isinstance(question, str) or not question.strip():
            bad.append(f"line {line_number}: missing or empty question field {spec.question_field!r}")
            continue
        try:
            gold = normalize_gold(spec.gold(row))
        except TypeError as exc:
            bad.append(f"line {line_number}: {exc}")
            continue
        if not gold:
            bad.append(f"line {line_number}: missing or empty answer (field {', '.join(spec.gold_fields)})")
            continue
        raw_id = row.get(spec.id_field) if spec.id_field else None
        problem_id = str(raw_id) if raw_id is not None else str(position)
        if problem_id in seen_ids:
            bad.append(
                f"line {line_number}: duplicate problem id {problem_id!r} (also on line {seen_ids[problem_id]})"
            )
            continue
        seen_ids[problem_id] = line_number
        reference = spec.reference_solution(row) if spec.reference_solution else None
        metadata = {"line": line_number, **{k: row[k] for k in spec.metadata_fields if k in row}}
        problems.append(Problem(spec.name, problem_id, question, gold, reference, metadata))
    if bad and on_malformed == "error":
        raise MalformedDataError(
            _malformed_message(source, bad) + "\n(fix these rows, or skip them with on_malformed='skip')"
        )
    if bad:
        message = _malformed_message(source, bad) + "\n(skipped)"
        warnings.warn(message, MalformedRowsWarning, stacklevel=3)
    if not problems:
        raise MalformedDataError(f"{source}: no problems found")
    return problems


def reference_final_answer(spec: BenchmarkSpec, problem: Problem) -> str | None:
    """The final answer written in the problem's reference solution (for the audit), if any."""
    if problem.reference_solution is None:
        return None
    if spec.reference_kind == "gsm8k":
        return gsm8k_final_answer(problem.reference_solution)
    return last_boxed(problem.reference_solution)
