"""`d3s train`: one RL run from a small YAML/dict config.

    method: d3s                   # d3s.methods.METHODS
    model: tiny                   # "tiny" (built in code and warm-started by SFT) or a path / hub id
    seed: 0
    threads: 1                    # torch threads (recorded; results depend on it on CPU)
    output_dir: runs/d3s
    dataset: {name: synthetic, count: 2000, max_ops: 1, max_operand: 9}
    template: raw                 # raw | plain | qwen_math_cot | pods | auto (d3s.data.templates)
    reward: accuracy              # accuracy | pods (d3s.rewards.REWARD_SETS: pods adds PODS's format term;
                                  # grade its answers with trainer: {answer_policy: answer_tag})
    tiny: {sft_steps: 150}        # only for model: tiny; head_dim: 32 for vLLM on the CPU (default 16)
    resume: auto                  # auto: continue from the newest complete checkpoint of this same config;
                                  # never: start over (the old run's checkpoints and logs are moved aside to
                                  # output_dir/superseded-<UTC time>-resume-never/, never deleted)
    trainer: {max_steps: 20, per_device_train_batch_size: 16, num_generations: 8, ...}  # any D3SConfig field

Everything is validated (method, trainer fields, batch geometry) before a model is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from d3s.callbacks.checkpoints import (
    CHECKPOINT_ONLY_FILES,
    D3S_STATE_FILE,
    RESUME_STATE_PATTERNS,
    WEIGHT_FILES,
    WEIGHTS_ONLY_FILE,
    has_training_state,
)
from d3s.methods import get_method
from d3s.provenance.config_change import TRAINING_PER_ATTEMPT, config_changes, describe, plain
from d3s.provenance.integrity import (
    IntegrityError,
    check_files,
    record_files,
    reporting_full_disk,
    safetensors_problem,
    set_aside,
    write_final_record,
)
from d3s.provenance.manifest import atomic_write_text, build_manifest, model_files, now, write_json
from d3s.runs.config import TOP_LEVEL_KEYS, ConfigError, TinyOptions, check_model_dir, coerce_run_config

# The tiny model's head dim for vLLM on the CPU (d3s.tiny_model.HEADS_BY_HEAD_DIM).
VLLM_CPU_HEAD_DIM = 32
# Trainer defaults that differ from TRL's because they matter on CPU or for reproducibility.
CPU_DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    "save_strategy": "no",
    "bf16": False,
    "gradient_checkpointing": False,
    "beta": 0.0,
}


def resolve_config(config: dict[str, Any], *, check_hardware: bool = True, check_inputs: bool = True):
    """Check the config and build the D3SConfig; raises ValueError naming the field to change.

    ``check_hardware=False`` lets GPU-only settings pass on a machine without GPUs (the workflow's checks);
    ``check_inputs=False`` skips the model path and training data (workflow/scripts/check_inputs.py has them).
    """
    from d3s.trainer import D3SConfig

    config = coerce_run_config(config)  # once: a parsed RunConfig is returned as is
    method = config.get("method", "grpo")
    use_cpu = not torch.cuda.is_available()
    settings = {**CPU_DEFAULTS, "use_cpu": use_cpu} if use_cpu else {"report_to": "none"}
    output_dir = str(config.get("output_dir", f"runs/{method}"))
    settings |= {"seed": int(config.get("seed", 0)), "output_dir": output_dir} | (config.get("trainer") or {})
    if check_hardware:
        _check_hardware(settings)
    if check_inputs:
        _check_inputs(config)
    args = D3SConfig.for_method(method, **settings)
    if check_hardware and use_cpu:
        _check_vllm_on_cpu(args, config)
    return args


def _check_hardware(settings: dict[str, Any]) -> None:
    """GPU-only settings on a machine without a GPU fail here, not after the model has loaded."""
    if torch.cuda.is_available():
        return
    wants_gpu = {
        "bf16": "bf16 training needs a GPU here: set trainer.bf16: false",
        "fp16": "fp16 training needs a GPU: set trainer.fp16: false",
    }
    for key, fix in wants_gpu.items():
        if settings.get(key):
            raise ValueError(
                f"trainer.{key} is set but this machine has no CUDA GPU; {fix} (or run on a GPU node)"
            )
    if settings.get("use_cpu") is False:
        raise ValueError("trainer.use_cpu: false asks for a GPU, but this machine has none; remove it")


def _check_vllm_on_cpu(args, config: dict[str, Any]) -> None:
    """vLLM without CUDA: its CPU build in colocate mode (d3s.vllm_engine), and a tiny model whose head dim
    its attention runs."""
    from d3s.vllm_engine import check_vllm_without_cuda

    check_vllm_without_cuda(args)
    tiny = TinyOptions(**(config.get("tiny") or {}))
    if args.use_vllm and str(config.get("model", "tiny")) == "tiny" and tiny.head_dim != VLLM_CPU_HEAD_DIM:
        raise ValueError(
            f"tiny.head_dim is {tiny.head_dim}, which vLLM's CPU attention does not run: set tiny: "
            f"{{head_dim: {VLLM_CPU_HEAD_DIM}}} (or trainer.use_vllm: false)"
        )


def _check_inputs(config: dict[str, Any]) -> None:
    """Model path and training data must exist before any compute is spent."""
    model = str(config.get("model", "tiny"))
    if model != "tiny":
        check_model_dir(model, "model")
    name = (config.get("dataset") or {}).get("name", "synthetic")
    if name != "synthetic":
        from d3s.data.benchmarks import BenchmarkError, load_benchmark

        try:
            load_benchmark(name, config.get("data_dir"), limit=1)
        except BenchmarkError as err:
            raise ValueError(f"dataset.name: {err}") from None


def training_rows(config: dict[str, Any], tokenizer) -> list[dict[str, Any]]:
    dataset = dict(config.get("dataset") or {"name": "synthetic"})
    name = dataset.pop("name", "synthetic")
    if name == "synthetic":
        from d3s.data.synthetic import arithmetic_problems

        problems = arithmetic_problems(
            split="train", seed=int(config.get("seed", 0)), **{"count": 2000} | dataset
        )
        return [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    from d3s.data.benchmarks import load_benchmark
    from d3s.data.templates import build_prompt

    problems = load_benchmark(name, config.get("data_dir"), limit=dataset.get("limit"))
    template = config.get("template", "auto")
    return [
        {"prompt": build_prompt(p.question, template, tokenizer), "answer": list(p.gold)} for p in problems
    ]


def _model_init_kwargs(args) -> dict[str, Any]:
    """The trainer's model_init_kwargs (TRL applies them only to a model it loads), dtype as torch's: e.g.
    ``{dtype: float32}`` keeps fp32 master weights, where bf16 weights lose updates as small as lr 1e-6."""
    kwargs = dict(args.model_init_kwargs or {})  # a mapping: the parser reads JSON or YAML text
    if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return kwargs


def load_run_model(config: dict[str, Any], output_dir: Path, model_kwargs: dict[str, Any] | None = None):
    """(model, tokenizer) of a run: loaded from its path, or ``tiny`` built and warm-started by SFT (its
    losses written to ``output_dir``/sft_losses.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_name = config.get("model", "tiny")
    if model_name != "tiny":
        model = AutoModelForCausalLM.from_pretrained(model_name, **(model_kwargs or {}))
        return model, AutoTokenizer.from_pretrained(model_name)
    from d3s.data.synthetic import arithmetic_problems
    from d3s.tiny_model import HEADS_BY_HEAD_DIM, build_model, build_tokenizer, sft_warm_start

    tiny = TinyOptions(**(config.get("tiny") or {}))
    tokenizer = build_tokenizer()
    heads, kv_heads = HEADS_BY_HEAD_DIM[tiny.head_dim]
    model = build_model(tokenizer, num_heads=heads, num_kv_heads=kv_heads, seed=int(config.get("seed", 0)))
    problems = arithmetic_problems(
        tiny.sft_problems, seed=1000, max_ops=tiny.max_ops, max_operand=tiny.max_operand
    )
    losses = sft_warm_start(
        model, tokenizer, [(p.prompt, p.completion) for p in problems], steps=tiny.sft_steps
    )
    (output_dir / "sft_losses.json").write_text(json.dumps(losses))
    return model, tokenizer


# What a fresh start moves aside with the checkpoints, so it never mixes with or overwrites an older run: the
# run's work (its logs, summary and final model) and, when there is work, the files that describe it.
_RUN_WORK = ("train_summary.json", "anatomy.jsonl", "final")
_RUN_DESCRIPTION = ("resolved_config.yaml", "manifest.json")


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint a run can resume from: complete (Trainer's state and ours, written after every
    rank finished), holding the training state, not cut to its weights (docs/gpu.md, "Resume")."""
    resumable = [
        path
        for path in Path(output_dir).glob("checkpoint-*")
        if path.name.split("-")[-1].isdigit()
        and (path / "trainer_state.json").is_file()
        and (path / D3S_STATE_FILE).is_file()
        and not (path / WEIGHTS_ONLY_FILE).exists()
        and has_training_state(path)
    ]
    return max(resumable, key=lambda path: int(path.name.split("-")[-1]), default=None)


def config_differences(
    output_dir: str | os.PathLike[str], config: dict[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``{key: (previous, current)}`` for every setting that differs from the run that wrote ``output_dir``
    (its resolved_config.yaml; per-attempt values left out: d3s.provenance.config_change)."""
    path = Path(output_dir) / "resolved_config.yaml"
    if not path.is_file():
        return {}
    previous = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    old = {key: value for key, value in previous.items() if key in TOP_LEVEL_KEYS}
    with contextlib.suppress(ConfigError):  # a config this version no longer accepts is compared as written
        old = coerce_run_config(old)
    new = coerce_run_config(config)  # both typed: a "1e-4" written by hand equals the 0.0001 recorded
    return config_changes(old, {**new, "threads": new.get("threads", 1)}, TRAINING_PER_ATTEMPT)


def supersede_run(
    output_dir: str | os.PathLike[str], reason: str, *, label: str, metrics_log: str | None = "metrics.jsonl"
) -> Path | None:
    """Move a previous run's checkpoints, logs, resolved config, manifest and final model into
    ``output_dir/superseded-<UTC time>-<label>/`` with a README.txt giving ``reason``; nothing is deleted.
    Returns the new folder, or None when there was no previous work (checkpoint, log or final model)."""
    output_dir = Path(output_dir)
    checkpoints = sorted(path for path in output_dir.glob("checkpoint-*") if path.is_dir())
    work = checkpoints + [output_dir / name for name in (metrics_log, *_RUN_WORK) if name]
    if not any(path.exists() for path in work):
        return None
    note = f"A new run started in {output_dir}; these files of the previous run were moved here, not deleted:"
    paths = work + [output_dir / name for name in _RUN_DESCRIPTION]
    return set_aside(output_dir, paths, label=label, reason=reason, note=note)


def checkpoint_problem(checkpoint: str | os.PathLike[str]) -> str | None:
    """Why ``checkpoint`` cannot be trusted, in one line naming the file; None when every file its
    completion mark records is there with its recorded size and checksum. A checkpoint marked before marks
    recorded files gets the safetensors length check only."""
    checkpoint = Path(checkpoint)
    try:
        files = json.loads((checkpoint / D3S_STATE_FILE).read_text(encoding="utf-8")).get("files")
    except (ValueError, AttributeError):
        return f"{checkpoint / D3S_STATE_FILE} is not valid JSON"
    if files:
        return check_files(checkpoint, files)
    for path in sorted(checkpoint.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            return problem
    return None


def verified_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest resumable checkpoint (latest_checkpoint) that passes its integrity check. One that fails
    is moved aside into ``output_dir/superseded-<UTC time>-corrupt-checkpoint-<N>/`` (never deleted), with
    the reason in one line, and the next newest is tried."""
    while (checkpoint := latest_checkpoint(output_dir)) is not None:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        note = "This checkpoint failed its integrity check; it was moved here, not deleted:"
        reason = f"{checkpoint.name} failed its integrity check: {problem}"
        label = f"corrupt-{checkpoint.name}"
        moved = set_aside(output_dir, [checkpoint], label=label, reason=reason, note=note)
        print(f"{reason}; moved to {moved}, not resumed", flush=True)
    return None


def _cut_logs(output_dir: Path, metrics_log: str, last_step: int) -> None:
    """Cut the run's logs back to the checkpoint's step: the lines after it will be written again. (The logs
    are not workflow outputs, so Snakemake never deletes them before a re-run: docs/workflow.md.)"""
    for name in (metrics_log, "anatomy.jsonl"):
        log = output_dir / name
        if log.is_file():
            kept = []
            for line in log.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line)["step"] <= last_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    break  # a line cut by a crash ends the trustworthy part
            atomic_write_text(log, "".join(line + "\n" for line in kept))


def train(config: dict[str, Any]) -> Path:
    """Run one training job (resumed from its newest complete checkpoint under ``resume: auto``); returns the
    run directory, which gets manifest.json, resolved_config.yaml, metrics.jsonl, checkpoints and final/."""
    config = coerce_run_config(config)
    args = resolve_config(config)
    # Under `accelerate launch` every process runs this; only the main one writes the run's files.
    is_main = args.process_index == 0
    threads = int(config.get("threads", 1))
    torch.set_num_threads(threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    resume_from = None
    if config.get("resume", "auto") == "auto":
        if is_main:  # one process reads the checkpoints through and moves a corrupt one aside
            verified_checkpoint(output_dir)
        _wait_for_everyone()
        resume_from = latest_checkpoint(output_dir)
    if resume_from is not None:
        changed = config_differences(output_dir, config)  # a checkpoint resumes only the config that made it
        if changed:
            raise ValueError(
                f"{output_dir} holds checkpoints of a run with a different configuration (changed: "
                f"{describe(changed)}); resuming would mix the two. Use another output_dir, or resume: never "
                "to start over (the old run's checkpoints and logs are moved aside, not deleted)"
            )

    resolved = {
        **config,
        "threads": threads,
        "resolved_trainer": {k: plain(v) for k, v in args.to_dict().items()},
        "method_settings": dataclasses.asdict(get_method(args.method)),
    }
    manifest = build_manifest(resolved, seed=args.seed, threads=threads, inputs=_input_files(config))
    manifest["resumed_from"] = str(resume_from) if resume_from else None
    if is_main:
        if resume_from is None:  # a fresh run never meets, mixes with or deletes an older run's files
            never = config.get("resume", "auto") == "never"
            reason = "resume: never" if never else "no complete checkpoint with training state to resume from"
            label = "resume-never" if never else "not-resumable"
            moved = supersede_run(output_dir, reason, label=label, metrics_log=args.metrics_log)
            if moved is not None:
                print(f"starting over ({reason}): the previous run's files are in {moved}", flush=True)
        atomic_write_text(output_dir / "resolved_config.yaml", yaml.safe_dump(resolved, sort_keys=False))
        write_json(output_dir / "manifest.json", manifest)
        if resume_from is not None:
            step = json.loads((resume_from / "trainer_state.json").read_text())["global_step"]
            _cut_logs(output_dir, args.metrics_log or "metrics.jsonl", step)
            print(f"resuming from {resume_from} (step {step})", flush=True)
    if resume_from is not None and training_finished(resume_from):
        # The newest checkpoint is the last step (killed during or after the final save): train nothing more,
        # Trainer would take a step past max_steps; the checkpoint's weights are the final model.
        _finish_from_checkpoint(output_dir, resume_from, manifest, threads=threads, is_main=is_main)
        return output_dir

    from datasets import Dataset

    from d3s.rewards import reward_functions
    from d3s.trainer import D3STrainer

    model, tokenizer = load_run_model(config, output_dir, _model_init_kwargs(args))
    if args.use_vllm and args.vllm_mode == "colocate" and str(config.get("model", "tiny")) == "tiny":
        _save_for_vllm(model, tokenizer, output_dir / "tiny_model", is_main=is_main)
    rows = training_rows(config, tokenizer)
    trainer = D3STrainer(
        model=model,
        args=args,
        reward_funcs=reward_functions(config.get("reward", "accuracy")),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    elapsed = time.perf_counter() - start
    partial = output_dir / "final.partial"
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    with reporting_full_disk(partial, "the final model"):
        trainer.save_model(str(partial))  # on every process: DeepSpeed ZeRO-3 gathers the weights from all
        if is_main:
            tokenizer.save_pretrained(str(partial))
            record = record_files(partial)
    if is_main:
        steps, tokens = trainer.state.global_step, trainer.update_tokens_total
        _publish(output_dir, manifest, record, elapsed, steps, threads, tokens, manifest["resumed_from"])
    trainer.accelerator.wait_for_everyone()
    return output_dir


def _save_for_vllm(model, tokenizer, path: Path, *, is_main: bool) -> None:
    """The colocated vLLM engine loads the model from a directory (TRL gives it ``model.name_or_path``): the
    tiny model, built in code and warm-started, is written to ``path`` first (by the main process,
    atomically; every process builds the same model)."""
    from accelerate import PartialState

    if is_main:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(partial, path)
    PartialState().wait_for_everyone()
    model.name_or_path = model.config.name_or_path = str(path)


def training_finished(checkpoint: str | os.PathLike[str]) -> bool:
    """True when ``checkpoint`` was saved at the run's last step (its trainer_state.json's max_steps, which
    Trainer also computes for an epoch-based run)."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    return 0 < int(state.get("max_steps") or 0) <= int(state["global_step"])


def _finish_from_checkpoint(
    output_dir: Path, checkpoint: Path, manifest: dict[str, Any], *, threads: int, is_main: bool
) -> None:
    """final/ and train_summary.json from a checkpoint at the last step: its weight, config and tokenizer
    files are what the final save writes (Trainer.save_model); what is kept only to resume is left out."""
    if is_main:
        step = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))["global_step"]
        if not any((checkpoint / name).is_file() for name in WEIGHT_FILES):
            raise ValueError(
                f"{checkpoint} is the run's last step but holds no weight file (ZeRO-3 without "
                "zero3_save_16bit_model): convert it with its zero_to_fp32.py into final/, or set "
                "zero3_save_16bit_model: true in the accelerate config"
            )
        partial = output_dir / "final.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        counters = json.loads((checkpoint / D3S_STATE_FILE).read_text(encoding="utf-8"))
        copied = []
        with reporting_full_disk(partial, "the final model"):
            for path in checkpoint.iterdir():
                resume_state = any(path.match(pattern) for pattern in RESUME_STATE_PATTERNS)
                if path.is_file() and path.name not in CHECKPOINT_ONLY_FILES and not resume_state:
                    shutil.copy2(path, partial / path.name)
                    copied.append(path.name)
        # the checkpoint's record (verified when it was chosen) checks the copy; mtimes are the copy's
        recorded = counters.get("files") or {}  # none in a checkpoint marked before marks recorded files
        record = {
            name: {**recorded[name], "mtime_ns": (partial / name).stat().st_mtime_ns}
            for name in copied
            if name in recorded
        }
        record |= record_files(partial, exclude=record)  # what the checkpoint's mark did not record
        # train_seconds 0: this attempt trained nothing; the steps' time is in the earlier attempts
        tokens = counters["update_tokens_total"]
        _publish(output_dir, manifest, record, 0.0, step, threads, tokens, str(checkpoint))
        print(f"{checkpoint.name} is the last step (max_steps): final model written from it", flush=True)
    _wait_for_everyone()  # every process returns once the final model exists


def _wait_for_everyone() -> None:
    from accelerate import PartialState

    PartialState().wait_for_everyone()


def _publish(output_dir: Path, manifest: dict[str, Any], record: dict[str, Any], *summary: Any) -> None:
    """final.partial/ becomes final/ (a crash never leaves a half-written model) with ``record`` (its files'
    sizes and checksums, d3s_files.json), verified against it; then train_summary.json (``summary``:
    seconds, steps, threads, update tokens, resumed from) and the manifest's end time."""
    partial = output_dir / "final.partial"
    with reporting_full_disk(partial, "the final model"):
        write_final_record(partial, record)
    shutil.rmtree(output_dir / "final", ignore_errors=True)
    os.replace(partial, output_dir / "final")
    problem = check_files(output_dir / "final", record)  # read back: the run reports success on a sound model
    if problem:
        raise IntegrityError(
            f"the final model failed its check right after it was written: {problem}; the storage under "
            f"{output_dir} does not keep what is written to it: check it, then run again"
        )
    keys = ("train_seconds", "steps", "threads", "update_tokens_total", "resumed_from")
    write_json(output_dir / "train_summary.json", dict(zip(keys, summary, strict=True)))
    manifest["finished"] = now()
    write_json(output_dir / "manifest.json", manifest)


def _input_files(config: dict[str, Any]) -> dict[str, Path]:
    """Files whose checksums go into the manifest: the local benchmark copy and the model config."""
    from d3s.data.benchmarks import local_copy

    dataset = local_copy((config.get("dataset") or {}).get("name", "synthetic"), config.get("data_dir"))
    files = {"dataset": dataset} if dataset is not None else {}
    return files | model_files(str(config.get("model", "tiny")))  # weights, config, tokenizer
