"""`d3s train`: one RL run from a small YAML/dict config.

    method: d3s                   # d3s.methods.METHODS
    model: tiny                   # "tiny" (built in code and warm-started by SFT) or a path / hub id
    seed: 0
    threads: 1                    # torch threads (recorded; results depend on it on CPU)
    output_dir: runs/d3s
    dataset: {name: synthetic, count: 2000, max_ops: 1, max_operand: 9}
    template: raw                 # raw | plain | qwen_math_cot | auto (d3s.data.templates)
    tiny: {sft_steps: 150}        # only for model: tiny
    resume: auto                  # auto: continue from the newest complete checkpoint made by this same config;
                                  # never: start over (removes the checkpoints in output_dir)
    trainer: {max_steps: 20, per_device_train_batch_size: 16, num_generations: 8, ...}  # any D3SConfig field

Everything is validated (method, trainer fields, batch geometry) before a model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from d3s import provenance
from d3s.methods import get_method
from d3s.provenance import atomic_write_text, build_manifest, now, write_manifest
from d3s.trainer import D3S_STATE_FILE

TOP_LEVEL_KEYS = {
    "method",
    "model",
    "seed",
    "threads",
    "output_dir",
    "dataset",
    "template",
    "tiny",
    "trainer",
    "data_dir",
    "resume",
}

# Trainer defaults that differ from TRL's because they matter on CPU or for reproducibility.
CPU_DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    "save_strategy": "no",
    "bf16": False,
    "gradient_checkpointing": False,
    "beta": 0.0,
}


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return config


def resolve_config(config: dict[str, Any], *, check_hardware: bool = True):
    """Check the config and build the D3SConfig; raises ValueError naming the field to change.

    ``check_hardware=False`` validates a GPU config on a machine without GPUs (the workflow's parse-time
    check, the paper-config tests): GPU-only settings pass, everything else is checked.
    """
    from d3s.trainer import D3SConfig

    unknown = set(config) - TOP_LEVEL_KEYS
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; valid keys: {sorted(TOP_LEVEL_KEYS)}")
    if config.get("resume", "auto") not in ("auto", "never"):
        raise ValueError(f"resume must be 'auto' or 'never', got {config['resume']!r}")
    method = config.get("method", "grpo")
    get_method(method)
    trainer = dict(config.get("trainer") or {})
    valid_fields = {f.name for f in dataclasses.fields(D3SConfig)}
    bad = sorted(set(trainer) - valid_fields)
    if bad:
        raise ValueError(
            f"unknown trainer option(s) {bad}: every option must be a field of D3SConfig / GRPOConfig"
        )
    use_cpu = not torch.cuda.is_available()
    settings = {**CPU_DEFAULTS, "use_cpu": use_cpu} if use_cpu else {"report_to": "none"}
    settings |= {
        "seed": int(config.get("seed", 0)),
        "output_dir": str(config.get("output_dir", f"runs/{method}")),
    }
    settings |= trainer
    if check_hardware:
        _check_hardware(settings)
    _check_inputs(config)
    return D3SConfig.for_method(method, **settings)


def _check_hardware(settings: dict[str, Any]) -> None:
    """GPU-only settings on a machine without a GPU fail here, not after the model has loaded."""
    if torch.cuda.is_available():
        return
    wants_gpu = {
        "use_vllm": "generation with vLLM needs a CUDA GPU: set trainer.use_vllm: false",
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


def _check_inputs(config: dict[str, Any]) -> None:
    """Model path and training data must exist before any compute is spent."""
    model = str(config.get("model", "tiny"))
    looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model).exists()
    if model != "tiny" and looks_local and not (Path(model).expanduser() / "config.json").is_file():
        raise ValueError(f"model: {model} has no config.json; give a model directory, a hub id, or 'tiny'")
    dataset = dict(config.get("dataset") or {})
    name = dataset.get("name", "synthetic")
    if name != "synthetic":
        from d3s.data.benchmarks import BenchmarkError, load_benchmark

        try:
            load_benchmark(name, config.get("data_dir"), limit=1)
        except BenchmarkError as err:
            raise ValueError(f"dataset.name: {err}") from None


def _training_rows(config: dict[str, Any], tokenizer) -> list[dict[str, Any]]:
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
    """The trainer's model_init_kwargs, which TRL applies only to a model it loads itself (dtype as torch's).

    e.g. ``{dtype: float32}`` keeps fp32 master weights under bf16 autocast: transformers loads in the
    checkpoint's dtype by default, and an optimizer on bf16 weights loses updates as small as lr 1e-6.
    """
    kwargs = args.model_init_kwargs or {}
    kwargs = dict(json.loads(kwargs) if isinstance(kwargs, str) else kwargs)
    if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return kwargs


def _load_model(config: dict[str, Any], output_dir: Path, model_kwargs: dict[str, Any] | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_name = config.get("model", "tiny")
    if model_name != "tiny":
        model = AutoModelForCausalLM.from_pretrained(model_name, **(model_kwargs or {}))
        return model, AutoTokenizer.from_pretrained(model_name)
    from d3s.data.synthetic import arithmetic_problems
    from d3s.toy import build_model, build_tokenizer, sft_warm_start

    tiny = {"sft_steps": 150, "sft_problems": 2000, "max_ops": 1, "max_operand": 9} | dict(
        config.get("tiny") or {}
    )
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=int(config.get("seed", 0)))
    problems = arithmetic_problems(
        tiny["sft_problems"], seed=1000, max_ops=tiny["max_ops"], max_operand=tiny["max_operand"]
    )
    losses = sft_warm_start(
        model, tokenizer, [(p.prompt, p.completion) for p in problems], steps=tiny["sft_steps"]
    )
    (output_dir / "sft_losses.json").write_text(json.dumps(losses))
    return model, tokenizer


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint that was written completely (Trainer's state and ours both present)."""
    complete = [
        path
        for path in Path(output_dir).glob("checkpoint-*")
        if path.name.split("-")[-1].isdigit()
        and (path / "trainer_state.json").is_file()
        and (path / D3S_STATE_FILE).is_file()
    ]
    return max(complete, key=lambda path: int(path.name.split("-")[-1]), default=None)


def checkpoint_config_changes(output_dir: str | os.PathLike[str], config: dict[str, Any]) -> list[str]:
    """Config keys whose values differ from those of the run that wrote ``output_dir`` (its resolved_config.yaml).

    A checkpoint is only resumed by the configuration that made it; empty when there is nothing to compare.
    """
    path = Path(output_dir) / "resolved_config.yaml"
    if not path.is_file():
        return []
    previous = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    current = {**config, "threads": int(config.get("threads", 1))}
    keys = (set(current) | (set(previous) & TOP_LEVEL_KEYS) | {"threads"}) - {"resume"}
    return sorted(key for key in keys if _plain(previous.get(key)) != _plain(current.get(key)))


def _restore_logs(checkpoint: Path, output_dir: Path, metrics_log: str, last_step: int) -> None:
    """Put back the logs as they were at the checkpoint (saved with it), or cut the run's own back to it."""
    for name in (metrics_log, "anatomy.jsonl"):
        saved = checkpoint / name
        if saved.is_file():
            atomic_write_text(output_dir / name, saved.read_text(encoding="utf-8"))
        else:
            _truncate_metrics(output_dir / name, last_step)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            break  # a line cut by a crash ends the trustworthy part
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def train(config: dict[str, Any]) -> Path:
    """Run one training job; returns the run directory.

    The run directory gets manifest.json (provenance), resolved_config.yaml, metrics.jsonl, checkpoints
    (if the trainer saves them), train_summary.json and final/. A re-run of an interrupted job resumes
    from its newest complete checkpoint (``resume: auto``).
    """
    args = resolve_config(config)
    # Under `accelerate launch` every process runs this; only the main one writes the run's files.
    is_main = args.process_index == 0
    threads = int(config.get("threads", 1))
    torch.set_num_threads(threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    resume_from = latest_checkpoint(output_dir) if config.get("resume", "auto") == "auto" else None
    if resume_from is not None:
        changed = checkpoint_config_changes(output_dir, config)
        if changed:
            raise ValueError(
                f"{output_dir} holds checkpoints of a run with a different configuration (changed: "
                f"{', '.join(changed)}); resuming would mix the two. Use another output_dir, or resume: never to "
                "start over (it deletes the old checkpoints)"
            )

    from datasets import Dataset

    from d3s.rewards import accuracy_reward
    from d3s.trainer import D3STrainer

    model, tokenizer = _load_model(config, output_dir, _model_init_kwargs(args))
    rows = _training_rows(config, tokenizer)
    resolved = {
        **config,
        "threads": threads,
        "resolved_trainer": {k: _plain(v) for k, v in args.to_dict().items()},
        "method_settings": dataclasses.asdict(get_method(args.method)),
    }
    manifest = build_manifest(resolved, seed=args.seed, threads=threads, inputs=_input_files(config))
    manifest["resumed_from"] = str(resume_from) if resume_from else None
    if is_main:
        atomic_write_text(output_dir / "resolved_config.yaml", yaml.safe_dump(resolved, sort_keys=False))
        write_manifest(output_dir / "manifest.json", manifest)
        if resume_from is not None:
            step = json.loads((resume_from / "trainer_state.json").read_text())["global_step"]
            _restore_logs(resume_from, output_dir, args.metrics_log or "metrics.jsonl", step)
            print(f"resuming from {resume_from} (step {step})", flush=True)
        else:  # a fresh run starts fresh logs and never meets an older run's checkpoints
            for name in (args.metrics_log, "anatomy.jsonl"):
                if name:
                    (output_dir / name).unlink(missing_ok=True)
            for stale in output_dir.glob("checkpoint-*"):
                shutil.rmtree(stale, ignore_errors=True)
    trainer = D3STrainer(
        model=model,
        args=args,
        reward_funcs=[accuracy_reward],
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
    trainer.save_model(str(partial))  # on every process: DeepSpeed ZeRO-3 gathers the weights from all
    if is_main:
        tokenizer.save_pretrained(str(partial))
        shutil.rmtree(output_dir / "final", ignore_errors=True)
        os.replace(partial, output_dir / "final")  # a crash never leaves a half-written final model
        summary = {
            "train_seconds": elapsed,
            "steps": trainer.state.global_step,
            "threads": threads,
            "update_tokens_total": trainer.update_tokens_total,
            "resumed_from": manifest["resumed_from"],
        }
        atomic_write_text(output_dir / "train_summary.json", json.dumps(summary, indent=2))
        manifest["finished"] = now()
        write_manifest(output_dir / "manifest.json", manifest)
    trainer.accelerator.wait_for_everyone()
    return output_dir


def _input_files(config: dict[str, Any]) -> dict[str, Path]:
    """Files whose checksums go into the manifest: the local benchmark copy and the model config."""
    files: dict[str, Path] = {}
    name = (config.get("dataset") or {}).get("name", "synthetic")
    if name != "synthetic":
        from d3s.data.benchmarks import get_benchmark, resolve_data_dir

        root = resolve_data_dir(config.get("data_dir"))
        if root is not None and (root / get_benchmark(name).local_path).is_file():
            files["dataset"] = root / get_benchmark(name).local_path
    files |= provenance.model_files(str(config.get("model", "tiny")))  # weights, config, tokenizer
    return files


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
