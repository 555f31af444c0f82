"""Snakemake script of rules evaluate and evaluate_base: `d3s eval` on each model, in one process.

Rule evaluate: every intermediate checkpoint with eval.checkpoint_samples, then the final model with
eval.samples. Rule evaluate_base: the base model with eval.samples. Outputs: <out>/summary.json and
samples.jsonl per model (the files of `d3s eval`). A job with resources.gpu gets that many GPUs of its own
(d3s.launch.assign_gpus) and generates with vLLM, tensor-parallel over them unless eval.tensor_parallel_size.
"""

import contextlib
import os
from pathlib import Path

import torch

from d3s.cli import main as d3s_main
from d3s.launch import assign_gpus, job_gpus, signals_raise_system_exit

smk = snakemake  # noqa: F821 - injected by Snakemake
ev, task = smk.params.eval, smk.params.task
gpus = job_gpus({"gpu": int(getattr(smk.resources, "gpu", 0) or 0)}, "eval")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(int(smk.threads))


def eval_args(model: str, out: Path, samples: int, ks, limit=None) -> list[str]:
    ks = [k for k in ks if k <= samples] or [1]
    args = [
        "eval",
        "--model", model,
        "--benchmarks", ",".join(ev["benchmarks"]),
        "--samples", str(samples),
        "--k", ",".join(map(str, ks)),
        "--max-tokens", str(ev.get("max_tokens", 4096)),
        "--temperature", str(ev.get("temperature", 0.6)),
        "--top-p", str(ev.get("top_p", 0.95)),
        "--template", ev.get("template", "auto"),
        "--backend", ev.get("backend", "auto"),
        "--out", str(out),
        "--overwrite",
        "--no-progress",
        "--grading-workers", "1",
    ]  # fmt: skip
    if "synthetic" in ev["benchmarks"]:
        synthetic = task | dict(ev.get("synthetic") or {})
        args += ["--synthetic", ",".join(f"{k}={v}" for k, v in synthetic.items())]
    if ev.get("batch_size"):
        args += ["--batch-size", str(ev["batch_size"])]
    if ev.get("data_dir"):
        args += ["--data-dir", str(ev["data_dir"])]
    limit = limit or ev.get("limit")
    if limit:
        args += ["--limit", str(limit)]
    if gpus:
        args += ["--tensor-parallel-size", str(ev.get("tensor_parallel_size", gpus))]
    for key in ("gpu_memory_utilization", "max_model_len", "dtype"):
        if ev.get(key) is not None:
            args += [f"--{key.replace('_', '-')}", str(ev[key])]
    return args


jobs = []
checkpoints = list(getattr(smk.params, "checkpoints", []))  # rule evaluate_base has none
missing = [ckpt for ckpt in checkpoints if not (Path(ckpt) / "config.json").is_file()]
if missing:
    raise SystemExit(
        f"checkpoints {missing} are missing: re-run training for this run (delete its train_summary.json)"
    )
if checkpoints:
    for _step, ckpt, out in zip(smk.params.steps, checkpoints, smk.output.steps, strict=True):
        samples = int(ev.get("checkpoint_samples", 4))
        jobs.append(
            eval_args(
                ckpt, Path(out).parent, samples, ev.get("checkpoint_k", [1]), ev.get("checkpoint_limit")
            )
        )
    jobs.append(eval_args(smk.input.final, Path(smk.output.final).parent, int(ev["samples"]), ev["k"]))
else:
    jobs.append(eval_args(smk.params.model, Path(smk.output.summary).parent, int(ev["samples"]), ev["k"]))

with (
    open(smk.log[0], "w") as log,
    contextlib.redirect_stdout(log),
    contextlib.redirect_stderr(log),
    signals_raise_system_exit(),
    assign_gpus(gpus, label=f"{smk.rule} {dict(smk.wildcards)}") as gpu_ids,
):
    if gpus:  # before vLLM or torch touch CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        print(f"GPU(s) {gpu_ids}", flush=True)
    for args in jobs:
        print("d3s", " ".join(args), flush=True)
        code = d3s_main(args)
        if code:
            raise SystemExit(f"d3s eval failed with exit code {code}: see {smk.log[0]}")
