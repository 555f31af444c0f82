"""One evaluation job of the workflow (rules evaluate_run, evaluate_checkpoint, evaluate_final and the base
models' evaluations): every model's STEPS in order, all inside one process and one GPU lease; each model
resumes only the same model and sample settings (docs/workflow/resume.md; eval.kl:
docs/workflow/configuration.md)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from d3s.evaluation.cli import EvalOptions, run_eval
from d3s.evaluation.kl import KL_FILE, KLProbeSettings, measure_checkpoint_kl
from d3s.orchestration.gpu_slots import gpu_job
from d3s.provenance.config_change import EVALUATION_PER_ATTEMPT, keep_or_move_aside
from d3s.provenance.integrity import IntegrityError, model_weights_problem, set_aside
from d3s.provenance.manifest import model_files, sha256_file, write_json

RESUME_KEY_FILE = "resume_key.json"
RESOLVED_CONFIG_FILE = "resolved_config.yaml"  # written by `d3s train` into the run's folder
# the sampling settings of `d3s eval` the workflow always passes (defaults: config/schema.yaml)
SAMPLING = ("max_tokens", "temperature", "top_p", "template", "backend")
# settings passed only when set; those in EVALUATION_PER_ATTEMPT never change the samples
OPTIONAL = ("max_model_len", "dtype")
PER_ATTEMPT = ("answer_policy", "batch_size", "data_dir", "gpu_memory_utilization")


@dataclass(frozen=True)
class EvalPoint:
    """One model the job evaluates: ``model`` (a directory or hub id) into ``out`` (its summary.json is the
    rule's output), with ``samples`` per problem, Pass@``ks`` and the first ``limit`` problems (None: all)."""

    model: str
    out: Path
    samples: int
    ks: tuple[int, ...]
    limit: int | None


@dataclass(frozen=True)
class TrainedRun:
    """The run whose models a job evaluates: its folder (``<method>/seed<seed>``), and for eval.kl the initial
    policy (``reference``) and the run's train.yaml (the probe's prompts)."""

    folder: Path
    method: str
    seed: int
    reference: str | None = None
    train_config: Path | None = None


@dataclass(frozen=True)
class EvalJob:
    """One model's evaluation inside the job: ``point`` on ``gpu_ids`` (none: the CPU)."""

    point: EvalPoint
    ev: Mapping[str, Any]  # the eval section of the config
    task: Mapping[str, Any]  # the synthetic task's options
    gpu_ids: tuple[str, ...]
    run: TrainedRun | None  # None: a base model

    @property
    def out(self) -> Path:
        return self.point.out


def eval_values(job: EvalJob) -> dict[str, Any]:
    """The `d3s eval` settings of the job by EvalOptions field name, as the config gives them."""
    ev, point = job.ev, job.point
    values: dict[str, Any] = {"model": point.model, "samples": point.samples}
    values |= {key: ev[key] for key in SAMPLING}
    # each benchmark resumes on its own (d3s eval's run.json): adding one keeps the others
    values["benchmarks"] = list(ev["benchmarks"])
    values["k"] = [k for k in point.ks if k <= point.samples] or [1]
    values |= {"out": point.out, "grading_workers": 1}
    if "synthetic" in ev["benchmarks"]:
        values["synthetic"] = dict(job.task) | dict(ev.get("synthetic") or {})
    if point.limit:
        values["limit"] = point.limit
    values |= {key: ev[key] for key in OPTIONAL if ev.get(key) is not None}
    if job.gpu_ids:
        values["tensor_parallel_size"] = ev.get("tensor_parallel_size", len(job.gpu_ids))
    return values | {key: ev[key] for key in PER_ATTEMPT if ev.get(key)}


def resume_settings(job: EvalJob) -> dict[str, str]:
    """The settings that decide whether old samples are reused: the job's `d3s eval` options as flag: text,
    less EVALUATION_PER_ATTEMPT (the spelling resume_key.json files have always had, so they still match)."""
    options = {f"--{name.replace('_', '-')}": _text(value) for name, value in eval_values(job).items()}
    return {flag: text for flag, text in options.items() if flag not in EVALUATION_PER_ATTEMPT}


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    return str(value)


def eval_options(job: EvalJob) -> EvalOptions:
    """The job's `d3s eval` call, typed."""
    values = eval_values(job)
    values["benchmarks"] = ",".join(values["benchmarks"])
    if "synthetic" in values:
        values["synthetic"] = {key: int(value) for key, value in values["synthetic"].items()}
    if "data_dir" in values:
        values["data_dir"] = Path(values["data_dir"])
    return EvalOptions(**values, no_progress=True)


def generate_and_grade(job: EvalJob, log: str) -> None:
    """`d3s eval`: resumes from <out>/<benchmark>/samples.jsonl; writes <out>/summary.json last."""
    options = eval_options(job)
    print(f"d3s eval {options}", flush=True)
    code = run_eval(options)
    if code:
        raise SystemExit(f"d3s eval failed with exit code {code}: see {log}")


def kl_sampling(run_folder: Path) -> dict[str, Any]:
    """The sampling settings training used (``max_completion_length``, ``temperature``), from the run's own
    record: eval.kl's defaults for ``max_new_tokens`` and ``temperature``."""
    path = run_folder / RESOLVED_CONFIG_FILE
    if not path.is_file():
        raise SystemExit(
            f"{path} is missing: eval.kl samples as the run trained and reads its settings there; "
            f"run the run's training again (move its train_summary.json aside)"
        )
    trainer = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("resolved_trainer") or {}
    missing = [key for key in ("max_completion_length", "temperature") if key not in trainer]
    if missing:
        raise SystemExit(f"{path}: resolved_trainer has no {', '.join(missing)}; run its training again")
    return {"max_new_tokens": trainer["max_completion_length"], "temperature": trainer["temperature"]}


def measure_kl(job: EvalJob, log: str) -> None:
    """eval.kl into <out>/kl.json; one of the same model (the resume key moved others aside) and the same
    probe settings is kept."""
    run = job.run
    if run is None or run.reference is None or run.train_config is None:
        raise ValueError("eval.kl measures a run's models: give the run's reference model and train.yaml")
    settings = KLProbeSettings(**(kl_sampling(run.folder) | dict(job.ev["kl"])))  # checked when measured
    path = job.out / KL_FILE
    if path.is_file() and json.loads(path.read_text(encoding="utf-8")).get("settings") == asdict(settings):
        print(f"KL to the initial policy: kept {path}", flush=True)
        return
    train_config = yaml.safe_load(run.train_config.read_text(encoding="utf-8"))
    labels = {"method": run.method, "seed": run.seed, "point": job.out.name}
    device = "cuda" if job.gpu_ids else "cpu"
    record = measure_checkpoint_kl(
        job.point.model, run.reference, train_config, path, settings, labels=labels, device=device
    )
    summary = {key: record[key] for key in ("k1", "k3", "k1_per_sequence", "tokens", "seconds")}
    print(f"KL to the initial policy ({path}): {json.dumps(summary)}", flush=True)


Step = Callable[[EvalJob, str], None]


def steps(ev: Mapping[str, Any], run: TrainedRun | None) -> list[tuple[str, Step]]:
    """The job's steps, in order. Each takes the EvalJob, writes under its out and resumes on its own."""
    chosen: list[tuple[str, Step]] = [("generate and grade (d3s eval)", generate_and_grade)]
    if ev.get("kl") and run is not None:  # a run's models only: the base model has KL 0
        # Before generation, so summary.json (the rule's output, written by d3s eval) still comes last.
        chosen.insert(0, ("KL to the initial policy (eval.kl)", measure_kl))
    return chosen


def evaluate(job: EvalJob, label: str, log: str) -> None:
    """One model: its resume key checked (older work of another model or settings moved aside), then STEPS."""
    print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {label} {job.point.model}", flush=True)
    # the resume key: the model's files (checksums; a hub id has none) and the sample settings
    files = {name: sha256_file(path) for name, path in model_files(job.point.model).items()}
    key = {"model_files": files, "settings": resume_settings(job)}
    outcome = keep_or_move_aside(job.out, key, RESUME_KEY_FILE)
    if outcome:
        print(outcome, flush=True)
    job.out.mkdir(parents=True, exist_ok=True)
    write_json(job.out / RESUME_KEY_FILE, key)
    for name, step in steps(job.ev, job.run):
        print(f"step: {name}", flush=True)
        step(job, log)


def check_run_models(run: TrainedRun, points: Sequence[EvalPoint]) -> None:
    """SystemExit in one line when a run's model cannot be evaluated: a checkpoint is missing, or the final
    model's weights do not load. A corrupt final/ is moved aside with train_summary.json (never deleted), so
    the same command run again trains the run again, from its newest sound checkpoint, and then evaluates."""
    missing = [point.model for point in points if not (Path(point.model) / "config.json").is_file()]
    if missing:
        fix = "re-run training for this run (delete its train_summary.json)"
        raise SystemExit(f"checkpoint {missing[0]} is missing: {fix}")
    final = run.folder / "final"
    if not any(Path(point.model) == final for point in points):
        return
    try:
        problem = model_weights_problem(final, trust_unchanged=True)
    except IntegrityError as err:
        problem = str(err)
    if problem:
        reason = f"the final model of {run.folder} does not load: {problem}"
        note = "Run the workflow again: the run trains again from its newest sound checkpoint. Moved here:"
        summary = run.folder / "train_summary.json"
        moved = set_aside(run.folder, [final, summary], label="corrupt-final", reason=reason, note=note)
        raise SystemExit(
            f"{reason}; moved it and train_summary.json to {moved}: run the same command again, which trains "
            "the run again from its newest sound checkpoint and then evaluates it"
        )


def run_evaluation_job(
    points: Sequence[EvalPoint],
    ev: Mapping[str, Any],
    task: Mapping[str, Any],
    *,
    run: TrainedRun | None,
    gpus: int,
    threads: int,
    label: str,
    log: str,
) -> None:
    """Evaluate ``points`` in order (``run``: the run they belong to; None: a base model) in one process,
    holding ``gpus`` GPUs of its own (0: the CPU), its output appended to ``log``."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    if run is not None:  # a run's models: every checkpoint must still be there, its final model load
        check_run_models(run, points)
    with gpu_job(log, gpus, label=label, mode="a") as gpu_ids:
        if gpus:  # before vLLM or torch touch CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
            print(f"GPU(s) {gpu_ids}", flush=True)
        for number, point in enumerate(points, start=1):
            if len(points) > 1:
                print(f"=== model {number} of {len(points)}: {point.out.name}", flush=True)
            devices = tuple(gpu_ids) if gpus else ()
            evaluate(EvalJob(point, ev, task, devices, run), label, log)
