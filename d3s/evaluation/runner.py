"""Evaluate a model on benchmarks: generate, grade under every answer policy, write per-sample JSONL (one
whole problem per append, so a killed run resumes) and summaries (docs/evaluation/outputs.md)."""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from d3s.data.benchmarks import Problem, get_benchmark
from d3s.data.templates import build_prompt, resolve_template
from d3s.evaluation.backends import GenerationBackend, GenerationSettings, problem_seed
from d3s.evaluation.metrics import average_over_benchmarks, pass_at_k_table, policy_disagreement
from d3s.grading.copied import copied_from_prompt
from d3s.grading.policies import (
    ANSWER_POLICIES,
    BOXED_POLICIES,
    DEFAULT_ANSWER_POLICY,
    AnswerPolicy,
    check_answer_policy,
    count_boxes,
)
from d3s.grading.pool import Grader
from d3s.provenance import manifest as provenance
from d3s.provenance.config_change import config_changes, describe

SAMPLES_FILE, SUMMARY_FILE, RUN_FILE = "samples.jsonl", "summary.json", "run.json"
MANIFEST_FILE = "manifest.json"


class ResumeMismatchError(ValueError):
    """The output directory holds samples generated with different settings."""


@dataclass(frozen=True)
class ScoringOptions:
    ks: tuple[int, ...] = (1, 8)
    bootstrap_resamples: int = 1000
    confidence: float = 0.95
    bootstrap_seed: int = 0
    answer_policy: AnswerPolicy = DEFAULT_ANSWER_POLICY  # primary policy; all are always reported

    def __post_init__(self) -> None:
        check_answer_policy(self.answer_policy)


@dataclass
class BenchmarkRun:
    """Everything :func:`evaluate_benchmark` needs besides the model and the grader."""

    benchmark: str
    problems: Sequence[Problem]
    out_dir: Path  # <out>/<benchmark>
    settings: GenerationSettings
    template: str = "auto"
    model_path: str = ""
    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    data_source: str | None = None
    extra_provenance: dict[str, Any] = field(default_factory=dict)


def _jsonl(records: Any) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def load_completed_samples(path: Path, samples: int) -> dict[str, list[dict[str, Any]]]:
    """Records of every problem whose ``samples`` samples are all in ``path``, by problem id; anything else
    (a cut or invalid line, a problem with missing or duplicated samples) is dropped from the file."""
    if not path.exists():
        return {}
    *complete_lines, tail = path.read_bytes().split(b"\n")  # tail: bytes after the last newline (cut off)
    discarded = 1 if tail.strip() else 0
    by_problem: dict[str, list[tuple[int, dict[str, Any], str]]] = {}
    for line in filter(bytes.strip, complete_lines):
        try:
            record = json.loads(line)
            entry = (int(record["sample_index"]), record, line.decode("utf-8") + "\n")
            by_problem.setdefault(str(record["problem_id"]), []).append(entry)
        except (ValueError, KeyError, TypeError):
            discarded += 1
    completed: dict[str, list[dict[str, Any]]] = {}
    kept_lines: list[str] = []
    for problem_id, entries in by_problem.items():
        entries.sort(key=lambda entry: entry[0])
        if [index for index, _, _ in entries] == list(range(samples)):
            completed[problem_id] = [record for _, record, _ in entries]
            kept_lines.extend(line for _, _, line in entries)
        else:
            discarded += len(entries)
    if discarded:
        warnings.warn(
            f"{path}: discarded {discarded} incomplete or invalid line(s) from an interrupted run; "
            "their problems are generated again",
            stacklevel=2,
        )
        provenance.atomic_write_text(path, "".join(kept_lines))
    return completed


# The settings that make samples comparable (run.json); resuming with different ones is refused.
RUN_IDENTITY = ("benchmark", "model_path", "template", "generation", "answer_extraction")


def _check_resume(out_dir: Path, identity: dict[str, Any]) -> None:
    run_file = out_dir / RUN_FILE
    if run_file.exists():
        previous = json.loads(run_file.read_text(encoding="utf-8"))
        # the one rule (d3s.provenance.config_change); run.json holds only the identity keys
        changes = config_changes({k: previous.get(k) for k in identity}, identity)
        if changes:
            raise ResumeMismatchError(
                f"{out_dir} holds samples generated with other settings ({describe(changes)}). "
                "Use a new --out directory, the same settings, or --overwrite to start again."
            )
    elif (out_dir / SAMPLES_FILE).exists():
        raise ResumeMismatchError(
            f"{out_dir / SAMPLES_FILE} exists without {RUN_FILE}, so its settings are unknown. "
            "Use a new --out directory or --overwrite."
        )
    provenance.write_json(run_file, identity)


def _set_primary(record: dict[str, Any], policy: AnswerPolicy) -> None:
    """Copy the primary policy's verdict to the record's top-level fields."""
    record["answer_policy"] = policy
    record.update(record["by_policy"][policy])


def _grade_records(
    records: Sequence[dict[str, Any]],
    golds: Sequence[Any],
    questions: Sequence[str],
    grader: Grader,
    primary: AnswerPolicy,
) -> None:
    """Add each sample record's verdict under every answer policy (``by_policy``), the primary one on top;
    ``copied``: the answer is an unevaluated expression copied from the question (copied_from_prompt)."""
    grades = grader.grade_many_by_policy([r["completion"] for r in records], golds)
    for index, record in enumerate(records):
        record["by_policy"] = {}
        for policy in ANSWER_POLICIES:
            g = grades[policy][index]
            verdict = {
                "correct": g.correct,
                "extracted": g.extracted,
                "timed_out": g.timed_out,
                "bounded": g.bounded,
                "copied": copied_from_prompt(g.extracted, questions[index]),
            }
            record["by_policy"][policy] = verdict | {"grading_error": g.error}
        record["gold_parsed"] = grades[primary][index].gold_parsed
        record["num_boxes"] = count_boxes(record["completion"])
        _set_primary(record, primary)


def regrade_records(
    completed: dict[str, list[dict[str, Any]]],
    problems: Sequence[Problem],
    grader: Grader,
    primary: AnswerPolicy,
) -> bool:
    """Bring the kept samples of ``problems`` up to date in place: grade under every policy those written
    without one (older files), and make ``primary`` the top-level verdict. Returns whether any changed."""
    gold_of = {p.problem_id: p.gold for p in problems}
    question_of = {p.problem_id: p.question for p in problems}
    records = [record for problem_id, kept in completed.items() if problem_id in gold_of for record in kept]
    stale = [r for r in records if set(r.get("by_policy") or {}) != set(ANSWER_POLICIES)]
    if stale:  # (starting no grading worker when nothing is stale)
        ids = [str(r["problem_id"]) for r in stale]
        _grade_records(stale, [gold_of[i] for i in ids], [question_of[i] for i in ids], grader, primary)
    # samples graded before the copied flag existed: it needs no grading, only the extracted answer
    uncopied = [r for r in records if any("copied" not in v for v in r["by_policy"].values())]
    for record in uncopied:
        question = question_of[str(record["problem_id"])]
        for verdict in record["by_policy"].values():
            verdict["copied"] = copied_from_prompt(verdict["extracted"], question)
    relabel = [r for r in records if r.get("answer_policy") != primary] + uncopied
    for record in relabel:
        _set_primary(record, primary)
    return bool(stale or relabel)


def evaluate_benchmark(
    backend: GenerationBackend,
    grader: Grader,
    run: BenchmarkRun,
    *,
    batch_size: int = 8,
    on_problem_done: Callable[[Problem], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate and grade every problem not already done, then write and return the summary."""
    import torch
    from tqdm.auto import tqdm

    template = resolve_template(
        run.template, backend.tokenizer, get_benchmark(run.benchmark).default_template
    )
    # Chat templates already hold any BOS token; plain prompts get the tokenizer's special tokens.
    add_special_tokens = template != "qwen_math_cot"
    run.out_dir.mkdir(parents=True, exist_ok=True)
    config = _eval_config(run, template, grader, backend.name)
    _check_resume(run.out_dir, {key: config[key] for key in RUN_IDENTITY})
    samples_path = run.out_dir / SAMPLES_FILE
    completed = load_completed_samples(samples_path, run.settings.samples)
    primary = run.scoring.answer_policy
    if regrade_records(completed, run.problems, grader, primary):  # grading is cheap; generation is not
        provenance.atomic_write_text(
            samples_path, _jsonl(r for records in completed.values() for r in records)
        )
    todo = [p for p in run.problems if p.problem_id not in completed]
    resumed = len(run.problems) - len(todo)  # kept from an interrupted run
    manifest = {"kind": "evaluation"} | provenance.build_manifest(
        config, seed=run.settings.seed, threads=torch.get_num_threads(), inputs=_eval_inputs(run)
    )
    manifest["model_run"] = _model_run(manifest["inputs"])
    manifest |= {"problems_resumed": resumed, "problems_generated": len(todo)}
    provenance.write_json(run.out_dir / MANIFEST_FILE, manifest)
    started = time.perf_counter()
    bar = tqdm(
        total=len(run.problems), initial=resumed, desc=run.benchmark, unit="problem", disable=not progress
    )
    with samples_path.open("a", encoding="utf-8") as handle, bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            prompts = [build_prompt(p.question, template, backend.tokenizer) for p in batch]
            seeds = [problem_seed(run.settings.seed, run.benchmark, p.problem_id) for p in batch]
            generated = backend.generate(prompts, run.settings, seeds, add_special_tokens)
            per_problem = [
                [
                    {"problem_id": problem.problem_id, "sample_index": index, "completion": sample.text}
                    | {"num_tokens": sample.num_tokens, "finish_reason": sample.finish_reason}
                    | {"gold": list(problem.gold)}
                    for index, sample in enumerate(samples)
                ]
                for problem, samples in zip(batch, generated, strict=True)
            ]
            flat = [record for records in per_problem for record in records]
            questions = [p.question for p, records in zip(batch, per_problem, strict=True) for _ in records]
            _grade_records(flat, [r["gold"] for r in flat], questions, grader, primary)
            for problem, records in zip(batch, per_problem, strict=True):
                if len(records) != run.settings.samples:
                    raise RuntimeError(
                        f"backend returned {len(records)} samples for problem {problem.problem_id}, "
                        f"expected {run.settings.samples}"
                    )
                # One write per problem, flushed and fsynced: a crash loses at most this problem.
                handle.write(_jsonl(records))
                handle.flush()
                os.fsync(handle.fileno())
                completed[problem.problem_id] = records
                bar.update(1)
                if on_problem_done is not None:
                    on_problem_done(problem)
    summary = summarize_benchmark(run, completed, manifest)
    summary["elapsed_s_this_run"] = round(time.perf_counter() - started, 3)
    provenance.write_json(run.out_dir / SUMMARY_FILE, summary)
    manifest["finished"] = provenance.now()
    provenance.write_json(run.out_dir / MANIFEST_FILE, manifest)
    return summary


def problems_sha256(problems: Sequence[Problem]) -> str:
    """Checksum of the problems as evaluated (ids, questions, gold answers): identifies the problem set
    whatever its source (local file, hub, generated synthetic task) and any --limit."""
    rows = [[p.problem_id, p.question, list(p.gold)] for p in problems]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8")).hexdigest()


def _eval_inputs(run: BenchmarkRun) -> dict[str, Path]:
    """Checksummed inputs: the model's files, the benchmark file, and the manifest of the training run
    the model came from (``<run>/final`` or ``<run>/checkpoint-N``), which names its method settings."""
    inputs: dict[str, Path] = dict(provenance.model_files(run.model_path))
    if run.data_source and Path(run.data_source).is_file():
        inputs[f"benchmark/{run.benchmark}"] = Path(run.data_source)
    run_manifest = Path(run.model_path).expanduser().parent / MANIFEST_FILE
    if Path(run.model_path).expanduser().is_dir() and run_manifest.is_file():
        inputs["model_run_manifest"] = run_manifest
    return inputs


def _eval_config(
    run: BenchmarkRun, resolved_template: str, grader: Grader, backend_name: str
) -> dict[str, Any]:
    """The settings of one benchmark's evaluation, as its manifest records them."""
    return {
        "benchmark": run.benchmark,
        "model_path": run.model_path,
        "template_requested": run.template,
        "template": resolved_template,
        "generation": asdict(run.settings),
        "answer_extraction": grader.answer_extraction,
        "answer_policy": run.scoring.answer_policy,
        "grading_time_limit_s": grader.time_limit,
        "backend": backend_name,
        "scoring": {k: v for k, v in asdict(run.scoring).items() if k != "answer_policy"},  # (recorded above)
        "data_source": run.data_source,
        "n_problems": len(run.problems),
        "problems_sha256": problems_sha256(run.problems),
        **run.extra_provenance,
    }


def _model_run(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """Method, seed and method settings of the training run the model came from (None for other models)."""
    entry = inputs.get("model_run_manifest")
    if entry is None:
        return None
    config = json.loads(Path(entry["path"]).read_text(encoding="utf-8")).get("config") or {}
    keys = ("method", "seed", "method_settings")
    return {"manifest": entry["path"]} | {key: config.get(key) for key in keys}


def write_overall_manifest(out_dir: Path, names: Sequence[str]) -> dict[str, Any]:
    """``<out>/manifest.json``: the benchmarks' manifests merged (one process wrote them all, so versions,
    git state, hardware and threads are shared; settings are kept per benchmark)."""
    parts = {name: json.loads((out_dir / name / MANIFEST_FILE).read_text(encoding="utf-8")) for name in names}
    first = next(iter(parts.values()))
    per_run = ("benchmark", "model_path")
    shared = ("seed", "torch_threads", "torch_interop_threads", "versions", "git", "hardware")
    finished = [part["finished"] for part in parts.values()]
    manifest = {
        "kind": "evaluation",
        "config": {
            "model_path": first["config"]["model_path"],
            "benchmark_names": list(names),
            "benchmarks": {
                name: {k: v for k, v in part["config"].items() if k not in per_run}
                for name, part in parts.items()
            },
        },
        **{key: first[key] for key in shared},
        "inputs": {name: entry for part in parts.values() for name, entry in part["inputs"].items()},
        "started": min(part["started"] for part in parts.values()),
        "finished": None if None in finished else max(finished),
        "model_run": first.get("model_run"),
        "problems_resumed": {name: part.get("problems_resumed") for name, part in parts.items()},
        "parts": {name: f"{name}/{MANIFEST_FILE}" for name in names},
    }
    provenance.write_json(out_dir / MANIFEST_FILE, manifest)
    return manifest


def _policy_scores(counts: Sequence[tuple[int, int]], scoring: ScoringOptions) -> dict[str, Any]:
    """Pass@k with its CI and the mean accuracy for one policy's (samples, correct) counts per problem."""
    options = {"confidence": scoring.confidence, "seed": scoring.bootstrap_seed}
    table = pass_at_k_table(counts, scoring.ks, resamples=scoring.bootstrap_resamples, **options)
    samples = sum(n for n, _ in counts)
    return {
        "pass_at_k": {k: v["value"] for k, v in table.items()},
        "ci": {k: v["ci"] for k, v in table.items()},
        "mean_accuracy": sum(c for _, c in counts) / samples if samples else None,
    }


def summarize_benchmark(
    run: BenchmarkRun, completed: dict[str, list[dict[str, Any]]], manifest: dict[str, Any]
) -> dict[str, Any]:
    """Pass@k under every answer policy over the problems of ``run`` (the primary policy's at the top
    level), and how often the policies disagree; problems with unparsable gold are excluded and counted.
    The settings and provenance are copied from the benchmark's ``manifest``."""
    primary, scoring = run.scoring.answer_policy, run.scoring
    records_of = [completed[p.problem_id] for p in run.problems]
    every = [r for records in records_of for r in records]
    gold_ok = [all(r["gold_parsed"] for r in records) for records in records_of]
    # a problem with an unparsable gold is reported, never scored as wrong
    unparsable = [p.problem_id for p, ok in zip(run.problems, gold_ok, strict=True) if not ok]
    scored = [records for records, ok in zip(records_of, gold_ok, strict=True) if ok]

    def count(policy: AnswerPolicy, key: str, records: Sequence[dict[str, Any]]) -> int:
        return sum(bool(r["by_policy"][policy][key]) for r in records)

    by_policy = {
        policy: _policy_scores([(len(rs), count(policy, "correct", rs)) for rs in scored], scoring)
        | {
            "timeouts": count(policy, "timed_out", every),
            "grading_errors": sum(r["by_policy"][policy]["grading_error"] is not None for r in every),
            # answers copied unevaluated from the question (d3s.grading.copied.copied_from_prompt), of all
            # samples
            "copied_fraction": count(policy, "copied", every) / len(every) if every else None,
        }
        for policy in ANSWER_POLICIES
    }
    scored_samples = [r for records in scored for r in records]
    verdicts = [tuple(bool(r["by_policy"][p]["correct"]) for p in BOXED_POLICIES) for r in scored_samples]
    disagreement = policy_disagreement(verdicts, names=BOXED_POLICIES)
    disagreement["samples_with_2plus_boxes"] = sum(r.get("num_boxes", 0) >= 2 for r in scored_samples)
    return {
        "benchmark": run.benchmark,
        "model_path": run.model_path,
        "n_problems": len(run.problems),
        "n_problems_scored": len(scored),
        "samples_per_problem": run.settings.samples,
        "n_samples": len(run.problems) * run.settings.samples,
        "answer_policy": primary,
        "pass_at_k": by_policy[primary]["pass_at_k"],
        "ci": by_policy[primary]["ci"],
        "ci_confidence": scoring.confidence,
        "bootstrap_resamples": scoring.bootstrap_resamples,
        "mean_accuracy": by_policy[primary]["mean_accuracy"],
        "by_policy": by_policy,
        "policy_disagreement": disagreement,
        "unparsable_gold": len(unparsable),
        "unparsable_gold_ids": unparsable,
        "timeouts": by_policy[primary]["timeouts"],
        "grading_errors": by_policy[primary]["grading_errors"],
        "copied_fraction": by_policy[primary]["copied_fraction"],
        "truncated_samples": sum(r.get("finish_reason") == "length" for r in every),
        **{k: manifest["config"][k] for k in ("generation", "backend", "template", "answer_extraction")},
        **{k: manifest["config"][k] for k in ("grading_time_limit_s", "data_source")},
        **{k: manifest[k] for k in ("versions", "git", "hardware")},
        "data_sha256": manifest["inputs"].get(f"benchmark/{run.benchmark}", {}).get("sha256"),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **run.extra_provenance,
    }


def _primary(summaries: dict[str, dict[str, Any]]) -> AnswerPolicy:
    return next((s["answer_policy"] for s in summaries.values()), DEFAULT_ANSWER_POLICY)


def _averages(summaries: dict[str, dict[str, Any]]) -> dict[AnswerPolicy, dict[str, float]]:
    """The unweighted average of Pass@k over the scored benchmarks, under each answer policy."""
    scored = {name: s["by_policy"] for name, s in summaries.items() if s["pass_at_k"]}
    return {
        policy: average_over_benchmarks({name: by[policy]["pass_at_k"] for name, by in scored.items()})
        for policy in ANSWER_POLICIES
    }


def write_overall_summary(
    out_dir: Path, model_path: str, summaries: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """``<out>/summary.json``: every benchmark's Pass@k and the unweighted average over benchmarks, under
    the primary answer policy and, in ``by_policy`` / ``average_by_policy``, under each policy."""
    primary, averages = _primary(summaries), _averages(summaries)
    keys = ("answer_policy", "pass_at_k", "ci", "n_problems", "unparsable_gold", "timeouts")
    policy_keys = ("pass_at_k", "copied_fraction")  # (a summary written before the copied flag lacks it)
    overall = {
        "model_path": model_path,
        "answer_policy": primary,
        "benchmarks": {
            name: {key: s[key] for key in keys}
            | {
                "by_policy": {p: {k: v.get(k) for k in policy_keys} for p, v in s["by_policy"].items()},
                "copied_fraction": s.get("copied_fraction"),
                "policy_disagreement": s["policy_disagreement"],
            }
            for name, s in summaries.items()
        },
        "average": averages[primary],
        "average_by_policy": averages,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "manifest": MANIFEST_FILE,
    }
    write_overall_manifest(out_dir, list(summaries))
    provenance.write_json(out_dir / SUMMARY_FILE, overall)
    return overall


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def format_results_table(summaries: dict[str, dict[str, Any]], ks: Sequence[int]) -> str:
    """A Markdown table: one row per benchmark plus the average, Pass@k in percent with the CI under the
    primary answer policy, Pass@(first k) under each other one, and how often the boxed policies disagree."""
    primary, averages = _primary(summaries), _averages(summaries)
    others = [p for p in ANSWER_POLICIES if p != primary]
    first_k = str(ks[0])
    header = (
        "| benchmark | problems | "
        + " | ".join(f"Pass@{k} (95% CI)" for k in ks)
        + "".join(f" | Pass@{first_k} {p}" for p in others)
        + " | policies disagree | timeouts |"
    )
    lines = [f"answer policy: {primary}", "", header, "|" + "---|" * (len(ks) + len(others) + 4)]
    for name, s in summaries.items():
        cells = []
        for k in ks:
            value, ci = s["pass_at_k"].get(str(k)), s["ci"].get(str(k))
            cells.append(_pct(value) + ("" if value is None else f" [{_pct(ci[0])}, {_pct(ci[1])}]"))
        cells += [_pct(s["by_policy"][policy]["pass_at_k"].get(first_k)) for policy in others]
        rate = s["policy_disagreement"]["rate"]
        cells.append("n/a" if rate is None else f"{100 * rate:.1f}% of {s['policy_disagreement']['samples']}")
        lines.append(f"| {name} | {s['n_problems']} | " + " | ".join(cells) + f" | {s['timeouts']} |")
    if len(summaries) > 1 and averages[primary]:
        cells = [_pct(averages[primary].get(str(k))) for k in ks]
        cells += [_pct(averages[policy].get(first_k)) for policy in others]
        lines.append("| average | | " + " | ".join(cells) + " | | |")
    return "\n".join(lines)
