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
                                  # (TRL's defaults, but logging_steps: 1, a metrics.jsonl record every step)

Everything is validated (method, trainer fields, batch geometry) before a model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from d3s.methods import get_method
from d3s.provenance.config_change import describe, plain
from d3s.provenance.integrity import record_files, reporting_full_disk
from d3s.provenance.manifest import atomic_write_text, build_manifest, write_json
from d3s.runs.config import coerce_run_config
from d3s.runs.publish import input_files, publish_final, save_for_vllm, training_finished, wait_for_everyone
from d3s.runs.resolve import load_run_model, model_init_kwargs, resolve_config, training_rows
from d3s.runs.resume import (
    config_differences,
    cut_logs,
    finish_from_checkpoint,
    latest_checkpoint,
    supersede_run,
    verified_checkpoint,
)


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
        wait_for_everyone()
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
    manifest = build_manifest(resolved, seed=args.seed, threads=threads, inputs=input_files(config))
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
            cut_logs(output_dir, args.metrics_log or "metrics.jsonl", step)
            print(f"resuming from {resume_from} (step {step})", flush=True)
    if resume_from is not None and training_finished(resume_from):
        # The newest checkpoint is the last step (killed during or after the final save): train nothing more,
        # Trainer would take a step past max_steps; the checkpoint's weights are the final model.
        finish_from_checkpoint(output_dir, resume_from, manifest, threads=threads, is_main=is_main)
        return output_dir

    from datasets import Dataset

    from d3s.rewards import reward_functions
    from d3s.trainer import D3STrainer

    model, tokenizer = load_run_model(config, output_dir, model_init_kwargs(args))
    if args.use_vllm and args.vllm_mode == "colocate" and str(config.get("model", "tiny")) == "tiny":
        save_for_vllm(model, tokenizer, output_dir / "tiny_model", is_main=is_main)
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
        publish_final(output_dir, manifest, record, elapsed, steps, threads, tokens, manifest["resumed_from"])
    trainer.accelerator.wait_for_everyone()
    return output_dir
