"""Snakemake script of rules evaluate_run (a run's checkpoints and final model, in training order),
evaluate_checkpoint, evaluate_final and evaluate_base (one model each): every model's STEPS in order, all
inside one process and one GPU lease; each model resumes only the same model and sample settings
(docs/workflow.md, "Evaluation resumes" and "eval.kl")."""

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import yaml

from d3s.cli import main as d3s_main
from d3s.evaluation.kl import KL_FILE, KLProbeSettings, measure_checkpoint_kl
from d3s.methods import method_trainer
from d3s.orchestration.gpu_slots import gpu_job
from d3s.provenance.config_change import EVALUATION_PER_ATTEMPT, keep_or_move_aside
from d3s.provenance.manifest import model_files, sha256_file, write_json

RESUME_KEY_FILE = "resume_key.json"

smk = snakemake  # noqa: F821 - injected by Snakemake
ev, task = smk.params.eval, smk.params.task
gpus = int(getattr(smk.resources, "gpu", 0) or 0)  # what Snakemake granted
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(int(smk.threads))


@dataclass(frozen=True)
class EvalJob:
    model: str  # directory or hub id
    out: Path  # the evaluation directory (<out>/summary.json is the rule's output)
    samples: int
    ks: list[int]
    limit: int | None
    gpu_ids: list[str]


def eval_options(job: EvalJob) -> dict[str, str]:
    """The `d3s eval` options of the job; those not in EVALUATION_PER_ATTEMPT are its resume key."""
    ks = [k for k in job.ks if k <= job.samples] or [1]
    sampling = ("max_tokens", "temperature", "top_p", "template", "backend")  # defaults: config/schema.yaml
    options = {"--model": job.model, "--samples": str(job.samples)} | {_flag(k): str(ev[k]) for k in sampling}
    # each benchmark resumes on its own (d3s eval's run.json): adding one keeps the others
    options["--benchmarks"] = ",".join(ev["benchmarks"])
    options |= {"--k": ",".join(map(str, ks)), "--out": str(job.out), "--grading-workers": "1"}
    if "synthetic" in ev["benchmarks"]:
        synthetic = task | dict(ev.get("synthetic") or {})
        options["--synthetic"] = ",".join(
            f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in synthetic.items()
        )
    if job.limit:
        options["--limit"] = str(job.limit)
    options |= {_flag(key): str(ev[key]) for key in ("max_model_len", "dtype") if ev.get(key) is not None}
    if job.gpu_ids:
        options["--tensor-parallel-size"] = str(ev.get("tensor_parallel_size", len(job.gpu_ids)))
    per_attempt = ("answer_policy", "batch_size", "data_dir", "gpu_memory_utilization")
    return options | {_flag(key): str(ev[key]) for key in per_attempt if ev.get(key)}


def _flag(key: str) -> str:
    return f"--{key.replace('_', '-')}"


def generate_and_grade(job: EvalJob) -> None:
    """`d3s eval`: resumes from <out>/<benchmark>/samples.jsonl; writes <out>/summary.json last."""
    args = ["eval", *(word for pair in eval_options(job).items() for word in pair), "--no-progress"]
    print("d3s", " ".join(args), flush=True)
    code = d3s_main(args)
    if code:
        raise SystemExit(f"d3s eval failed with exit code {code}: see {smk.log[0]}")


def measure_kl(job: EvalJob) -> None:
    """eval.kl into <out>/kl.json; one of the same model (the resume key moved others aside) and the same
    probe settings is kept."""
    from trl import GRPOConfig

    # the sampling settings training used (TRL's defaults where it set none), where eval.kl leaves them out
    trained = {f.name: f.default for f in fields(GRPOConfig)}
    trained |= method_trainer(smk.params.train, smk.wildcards.method)
    sampling = {"max_new_tokens": trained["max_completion_length"], "temperature": trained["temperature"]}
    settings = KLProbeSettings(**(sampling | dict(ev["kl"])))  # checked by measure_checkpoint_kl
    path = job.out / KL_FILE
    if path.is_file() and json.loads(path.read_text(encoding="utf-8")).get("settings") == asdict(settings):
        print(f"KL to the initial policy: kept {path}", flush=True)
        return
    train_config = yaml.safe_load(Path(smk.input.train_config).read_text(encoding="utf-8"))
    labels = {"method": smk.wildcards.method, "seed": int(smk.wildcards.seed), "point": job.out.name}
    device = "cuda" if job.gpu_ids else "cpu"
    record = measure_checkpoint_kl(
        job.model, str(smk.params.reference), train_config, path, settings, labels=labels, device=device
    )
    summary = {key: record[key] for key in ("k1", "k3", "k1_per_sequence", "tokens", "seconds")}
    print(f"KL to the initial policy ({path}): {json.dumps(summary)}", flush=True)


# The job's steps, in order. Each takes the EvalJob, writes under job.out and resumes on its own.
STEPS: list[tuple[str, Callable[[EvalJob], None]]] = [("generate and grade (d3s eval)", generate_and_grade)]
if ev.get("kl") and smk.rule != "evaluate_base":  # the base model has KL 0
    # Before generation, so summary.json (the rule's output, written by d3s eval) still comes last.
    STEPS.insert(0, ("KL to the initial policy (eval.kl)", measure_kl))


def evaluated_models() -> list[tuple[str, Path, dict]]:
    """(model, evaluation directory, its point's settings) of each model the job evaluates, in order."""
    outs = [Path(path).parent for path in smk.output]
    if smk.rule == "evaluate_run":
        run = Path(smk.params.run)
        points = zip(smk.params.points, outs, strict=True)
        return [(str(run / point["model"]), out, point) for point, out in points]
    point = {"samples": smk.params.samples, "k": smk.params.k, "limit": smk.params.limit}
    return [(str(smk.params.model), outs[0], point)]


def evaluate(job: EvalJob) -> None:
    """One model: its resume key checked (older work of another model or settings moved aside), then STEPS."""
    print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {smk.rule} {job.model}", flush=True)
    # the resume key: the model's files (checksums; a hub id has none) and the sample settings
    files = {name: sha256_file(path) for name, path in model_files(job.model).items()}
    settings = {k: v for k, v in eval_options(job).items() if k not in EVALUATION_PER_ATTEMPT}
    key = {"model_files": files, "settings": settings}
    outcome = keep_or_move_aside(job.out, key, RESUME_KEY_FILE)
    if outcome:
        print(outcome, flush=True)
    job.out.mkdir(parents=True, exist_ok=True)
    write_json(job.out / RESUME_KEY_FILE, key)
    for name, step in STEPS:
        print(f"step: {name}", flush=True)
        step(job)


models = evaluated_models()
if smk.rule != "evaluate_base":  # a run's models: every checkpoint must still be there
    missing = [model for model, _, _ in models if not (Path(model) / "config.json").is_file()]
    if missing:
        fix = "re-run training for this run (delete its train_summary.json)"
        raise SystemExit(f"checkpoint {missing[0]} is missing: {fix}")
with gpu_job(smk.log[0], gpus, label=f"{smk.rule} {dict(smk.wildcards)}", mode="a") as gpu_ids:
    if gpus:  # before vLLM or torch touch CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        print(f"GPU(s) {gpu_ids}", flush=True)
    for number, (model, out, point) in enumerate(models, start=1):
        if len(models) > 1:
            print(f"=== model {number} of {len(models)}: {out.name}", flush=True)
        limit = int(point["limit"]) if point["limit"] else None
        ks, devices = list(point["k"]), list(gpu_ids) if gpus else []
        evaluate(EvalJob(model, out, int(point["samples"]), ks, limit, devices))
