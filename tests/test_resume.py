"""Reliability of `d3s train`: a killed run resumes to the same end, NaN stops cleanly, manifests exist."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from d3s.train import latest_checkpoint

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def run_config(tmp_path: Path, name: str, **trainer) -> Path:
    config = {
        "method": "d3s",
        "model": "tiny",
        "seed": 0,
        "threads": 1,
        "output_dir": str(tmp_path / name),
        "tiny": {"sft_steps": 30},
        "dataset": {"name": "synthetic", "count": 200, "max_ops": 1, "max_operand": 9},
        "trainer": {
            "max_steps": 6,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 16,
            "learning_rate": 1e-3,
            "save_strategy": "steps",
            "save_steps": 2,
        }
        | trainer,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "d3s.cli", "train", "--config", str(config)]


def step_metrics(run: Path) -> list[dict]:
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in entries if "loss" in e]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_and_metrics(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = run_config(tmp_path, "reference")
    subprocess.run(train_command(reference), env=env, check=True, capture_output=True, timeout=600)

    interrupted = run_config(tmp_path, "interrupted")
    run = tmp_path / "interrupted"
    proc = subprocess.Popen(
        train_command(interrupted), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        checkpoint = latest_checkpoint(run)
        if checkpoint is not None and checkpoint.name == "checkpoint-4":
            proc.send_signal(signal.SIGKILL)  # mid-run, as a cluster pre-emption would
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (run / "final").exists()

    resumed = subprocess.run(train_command(interrupted), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumed_from"].endswith("checkpoint-4") and manifest["finished"]

    assert step_metrics(run) == step_metrics(tmp_path / "reference")
    ours, theirs = final_weights(run), final_weights(tmp_path / "reference")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    summary = json.loads((run / "train_summary.json").read_text())
    reference_summary = json.loads((tmp_path / "reference" / "train_summary.json").read_text())
    assert summary["update_tokens_total"] == reference_summary["update_tokens_total"] > 0


@pytest.mark.slow
def test_manifest_records_provenance(tmp_path):
    config = run_config(tmp_path, "run", max_steps=1, save_strategy="no")
    from d3s.cli import main

    assert main(["train", "--config", str(config)]) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["torch_threads"] == 1
    assert manifest["versions"]["trl"] == "1.16.0" and manifest["versions"]["torch"].startswith("2.13.0")
    assert manifest["config"]["resolved_trainer"]["method"] == "d3s"
    assert set(manifest["git"]) == {"commit", "dirty"}
    assert manifest["hardware"]["cpu_count"] >= 1 and manifest["started"] <= manifest["finished"]


@pytest.mark.slow
def test_nan_loss_stops_training_and_keeps_the_last_checkpoint(tmp_path, tiny_sft_model):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s.data.synthetic import arithmetic_problems
    from d3s.trainer import D3SConfig, D3STrainer

    class LossBlowsUpAtStep3(D3STrainer):
        """A numerical blow-up in the loss, made deterministic: step 3's loss is NaN."""

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss * math.nan if self.state.global_step == 2 else loss

    def length_reward(completions, **kwargs):
        return [float(len(c) % 3) for c in completions]

    args = D3SConfig.for_method(
        "d3s",
        output_dir=str(tmp_path / "nan"),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=16,
        max_steps=5,
        use_cpu=True,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="steps",
        save_steps=1,
        learning_rate=1e-3,
    )
    rows = [
        {"prompt": p.prompt, "answer": p.answer} for p in arithmetic_problems(50, max_ops=1, max_operand=9)
    ]
    trainer = LossBlowsUpAtStep3(
        model=AutoModelForCausalLM.from_pretrained(tiny_sft_model),
        args=args,
        reward_funcs=[length_reward],
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tiny_sft_model),
    )
    with pytest.raises(
        FloatingPointError, match=r"is NaN at step 3; training stopped before saving this step"
    ):
        trainer.train()
    assert latest_checkpoint(tmp_path / "nan").name == "checkpoint-2"
    assert not (tmp_path / "nan" / "checkpoint-3").exists()
    logged = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    # Trainer filters NaN losses out of its logs (logging_nan_inf_filter); the gradient norm shows it
    assert [e["step"] for e in logged] == [1, 2, 3] and math.isnan(logged[-1]["grad_norm"])


@pytest.mark.slow
def test_same_seed_and_threads_give_bitwise_identical_runs(tmp_path):
    from d3s.train import load_config, train

    for name in ("first", "second"):
        config = load_config(run_config(tmp_path, name, max_steps=3, save_strategy="no"))
        train(config)
    assert step_metrics(tmp_path / "first") == step_metrics(tmp_path / "second")
    first, second = final_weights(tmp_path / "first"), final_weights(tmp_path / "second")
    assert all(torch.equal(first[k], second[k]) for k in first)


def eval_command(model: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "d3s.cli", "eval", "--model", str(model), "--benchmarks", "synthetic",
        "--synthetic", "count=16,max_ops=1,max_operand=9", "--samples", "4", "--k", "1,4", "--max-tokens", "16",
        "--temperature", "1.0", "--top-p", "1.0", "--backend", "transformers", "--batch-size", "1",
        "--grading-workers", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip


@pytest.mark.slow
def test_killed_evaluation_resumes_without_duplicates_or_gaps(tmp_path, tiny_sft_model):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        eval_command(tiny_sft_model, tmp_path / "reference"), env=env, check=True, capture_output=True
    )
    out = tmp_path / "killed"
    samples = out / "synthetic" / "samples.jsonl"
    proc = subprocess.Popen(
        eval_command(tiny_sft_model, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if samples.exists() and len(samples.read_text().splitlines()) >= 20:  # 5 of 16 problems done
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the evaluation finished before it could be killed"
    assert not (out / "synthetic" / "summary.json").exists()
    subprocess.run(eval_command(tiny_sft_model, out), env=env, check=True, capture_output=True)

    def records(path: Path) -> list[tuple]:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [(r["problem_id"], r["sample_index"], r["completion"], r["correct"]) for r in rows]

    resumed, reference = records(samples), records(tmp_path / "reference" / "synthetic" / "samples.jsonl")
    assert len(resumed) == len(set(resumed)) == 16 * 4  # nothing duplicated, nothing missing
    assert sorted(resumed) == sorted(reference)  # and the same samples as an uninterrupted run
    summary = json.loads((out / "synthetic" / "summary.json").read_text())
    assert summary["n_problems"] == 16 and summary["n_samples"] == 64
