"""Reliability of `d3s train`: a killed run resumes to the same end, a restart moves the old run aside (never
deletes it), only resumable checkpoints are resumed, NaN stops cleanly, manifests exist."""

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
from helpers import REPO_ROOT
from safetensors.torch import load_file

from d3s.callbacks.checkpoints import WEIGHTS_ONLY_FILE, strip_to_weights
from d3s.launch import TrainLaunch, VllmServerSettings
from d3s.orchestration.run_config import SERVER_FIELDS_SET_BY_WORKFLOW, build_run_config, prepare_training_job
from d3s.provenance.config_change import PER_ATTEMPT_TRAINER_KEYS
from d3s.runs.resume import config_differences, latest_checkpoint, supersede_run
from d3s.trainer import D3SConfig

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
    """The interrupted run keeps the full training state in its newest checkpoint only (the paper configs'
    setting): the older ones are cut to their weights, and the resumed run still ends bitwise where an
    uninterrupted run that keeps every full state ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # TRL's 2 micro-batches of 8 rows per step; d3s keeps 2 of 8 rollouts, 4 rows, which packing
    # (pack_micro_batches, on) trains as 1 micro-batch: the resume restores a packed run
    packed = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}
    reference = run_config(tmp_path, "reference", **packed)
    subprocess.run(train_command(reference), env=env, check=True, capture_output=True, timeout=600)

    interrupted = run_config(tmp_path, "interrupted", full_state_checkpoints="latest", **packed)
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

    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["resolved_trainer"]["pack_micro_batches"] is True
    assert step_metrics(run) == step_metrics(tmp_path / "reference")
    ours, theirs = final_weights(run), final_weights(tmp_path / "reference")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    summary = json.loads((run / "train_summary.json").read_text())
    reference_summary = json.loads((tmp_path / "reference" / "train_summary.json").read_text())
    assert summary["update_tokens_total"] == reference_summary["update_tokens_total"] > 0
    # the counter travels in trainer_state.json (an ExportableState callback), which the resume restored
    saved = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["D3SCheckpointState"]["attributes"]["update_tokens_total"] == summary["update_tokens_total"]
    # full state in the newest checkpoint only; the older ones keep the weights the learning curves evaluate
    assert (run / "checkpoint-6" / "optimizer.pt").is_file() and latest_checkpoint(run).name == "checkpoint-6"
    for step in (2, 4):
        older = run / f"checkpoint-{step}"
        assert (older / WEIGHTS_ONLY_FILE).is_file() and not (older / "optimizer.pt").exists()
        assert not list(older.glob("rng_state*")) and not (older / "scheduler.pt").exists()
        ours = load_file(str(older / "model.safetensors"))
        theirs = load_file(str(tmp_path / "reference" / f"checkpoint-{step}" / "model.safetensors"))
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert (tmp_path / "reference" / "checkpoint-2" / "optimizer.pt").is_file()  # the default keeps them all


@pytest.mark.slow
def test_manifest_records_provenance_and_a_restart_moves_the_old_run_aside(tmp_path, capsys):
    config = run_config(tmp_path, "run", max_steps=1, save_steps=1)
    from d3s.cli import main

    assert main(["train", "--config", str(config)]) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["torch_threads"] == 1
    assert manifest["versions"]["trl"] == "1.16.0" and manifest["versions"]["torch"].startswith("2.13.0")
    assert manifest["config"]["resolved_trainer"]["method"] == "d3s"
    assert set(manifest["git"]) == {"commit", "dirty"}
    assert manifest["hardware"]["cpu_count"] >= 1 and manifest["started"] <= manifest["finished"]

    first = final_weights(tmp_path / "run")
    config.write_text(yaml.safe_dump(yaml.safe_load(config.read_text()) | {"resume": "never"}))
    assert main(["train", "--config", str(config)]) == 0
    (aside,) = (tmp_path / "run").glob("superseded-*-resume-never")
    assert (
        f"starting over (resume: never): the previous run's files are in {aside}" in capsys.readouterr().out
    )
    assert "resume: never" in (aside / "README.txt").read_text()
    kept = {
        "checkpoint-1",
        "metrics.jsonl",
        "final",
        "train_summary.json",
        "resolved_config.yaml",
        "manifest.json",
    }
    assert kept <= {p.name for p in aside.iterdir()}
    assert (aside / "checkpoint-1" / "optimizer.pt").is_file()  # the old checkpoint whole, not deleted
    assert all(torch.equal(first[k], v) for k, v in final_weights(aside).items())
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["resumed_from"] is None


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
        logging_steps=1,  # the NaN guard reads the NaN step's record
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
    from d3s.runs.config import read_config_file
    from d3s.runs.run import train

    for name in ("first", "second"):
        config = read_config_file(run_config(tmp_path, name, max_steps=3, save_strategy="no"))
        train(config)
    assert step_metrics(tmp_path / "first") == step_metrics(tmp_path / "second")
    first, second = final_weights(tmp_path / "first"), final_weights(tmp_path / "second")
    assert all(torch.equal(first[k], second[k]) for k in first)


def eval_command(model: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "d3s.cli", "eval", "--model", str(model), "--benchmarks", "synthetic",
        "--synthetic", "count=16,max_ops=1,max_operand=9", "--samples", "4", "--k", "1,4",
        "--max-tokens", "16",
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


# ---- what counts as a configuration change ----------------------------------------------------------------


def _job_config(tmp_path: Path, train_cfg: dict, *, threads: int, processes: int) -> dict:
    return build_run_config(
        method="d3s", seed=0, model="some/model", train_cfg=train_cfg, task={}, output_dir=str(tmp_path),
        threads=threads, processes=processes,
    )  # fmt: skip


def _as_run_by_d3s_train(output_dir: Path, config: dict) -> None:
    """resolved_config.yaml as `d3s train` writes it: the config it ran with, plus resolved fields."""
    resolved = {**config, "threads": int(config["threads"]), "resolved_trainer": {"seed": 0}}
    (output_dir / "resolved_config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))


def test_a_second_server_mode_attempt_with_new_ports_is_the_same_configuration(tmp_path):
    """Each attempt of a server-mode job gets free ports (and a 64-thread job runs 8 threads per process):
    neither counts as a change, so the job resumes; a real change still does."""
    train_cfg = {
        "trainer": {"use_vllm": True, "vllm_mode": "server", "per_device_train_batch_size": 8,
                    "num_generations": 8},
    }  # fmt: skip
    launch = TrainLaunch(9, REPO_ROOT / "workflow" / "accelerate" / "zero3.yaml", VllmServerSettings())
    gpus = [str(i) for i in range(9)]
    run = _job_config(tmp_path, train_cfg, threads=64, processes=launch.train_gpus)
    assert run["threads"] == 8  # the workflow compares the per-process count, as d3s train records it
    _, first, _ = prepare_training_job(run, tmp_path / "train.yaml", launch=launch, gpu_ids=gpus, threads=64)
    _as_run_by_d3s_train(tmp_path, first)
    _, second, _ = prepare_training_job(run, tmp_path / "train.yaml", launch=launch, gpu_ids=gpus, threads=64)
    assert set(SERVER_FIELDS_SET_BY_WORKFLOW) <= PER_ATTEMPT_TRAINER_KEYS
    assert config_differences(tmp_path, second) == {}  # the job itself, ports set for this attempt ...
    assert config_differences(tmp_path, run) == {}  # ... and the workflow's view of it, before
    elsewhere = {"vllm_server_host": "10.0.0.2", "vllm_server_port": 1, "vllm_group_port": 2}  # another node
    assert config_differences(tmp_path, second | {"trainer": second["trainer"] | elsewhere}) == {}
    assert config_differences(tmp_path, second | {"resume": "never"}) == {}

    changed = second | {"trainer": second["trainer"] | {"learning_rate": 1e-3}, "seed": 1}
    assert list(config_differences(tmp_path, changed)) == ["seed", "trainer.learning_rate"]
    assert config_differences(tmp_path, changed)["seed"] == (0, 1)


def test_threads_are_compared_per_process(tmp_path):
    train_cfg = {"trainer": {"per_device_train_batch_size": 16, "num_generations": 8}}
    run = _job_config(tmp_path, train_cfg, threads=4, processes=2)
    launch = TrainLaunch(2, REPO_ROOT / "workflow" / "accelerate" / "ddp.yaml")
    _, job, _ = prepare_training_job(
        run, tmp_path / "train.yaml", launch=launch, gpu_ids=["0", "1"], threads=4
    )
    assert run["threads"] == job["threads"] == 2
    _as_run_by_d3s_train(tmp_path, job)
    assert config_differences(tmp_path, run) == {}
    # the same job given 8 threads runs 4 per process: a real change (CPU results depend on it)
    more = _job_config(tmp_path, train_cfg, threads=8, processes=2)
    assert config_differences(tmp_path, more) == {"threads": (2, 4)}


# ---- checkpoints are moved aside, never deleted; only resumable ones are resumed ---------------------------


def _fake_checkpoint(run: Path, step: int, *, optimizer: bool = True) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in (
        "model.safetensors",
        "trainer_state.json",
        "d3s_state.json",
        "rng_state.pth",
        "scheduler.pt",
    ):
        (folder / name).write_text(name)
    if optimizer:
        (folder / "optimizer.pt").write_text("adam")
    return folder


def test_a_changed_configuration_moves_the_old_run_aside_with_the_reason(tmp_path):
    run = tmp_path / "run"
    _fake_checkpoint(run, 2)
    _fake_checkpoint(run, 4)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "resolved_config.yaml").write_text(yaml.safe_dump({"seed": 0, "threads": 1, "trainer": {}}))
    (run / "sft_losses.json").write_text("[]")
    changes = config_differences(run, {"seed": 1, "threads": 1, "trainer": {}})
    moved = supersede_run(run, "configuration changed: seed 0 -> 1", label="config-changed")
    assert changes == {"seed": (0, 1)}
    assert (
        moved.parent == run
        and moved.name.startswith("superseded-")
        and moved.name.endswith("-config-changed")
    )
    assert sorted(p.name for p in moved.iterdir()) == [
        "README.txt", "checkpoint-2", "checkpoint-4", "metrics.jsonl", "resolved_config.yaml",
    ]  # fmt: skip
    assert (moved / "checkpoint-4" / "optimizer.pt").read_text() == "adam"  # moved whole, not copied or cut
    assert "configuration changed: seed 0 -> 1" in (moved / "README.txt").read_text()
    assert latest_checkpoint(run) is None and (run / "sft_losses.json").is_file()
    assert supersede_run(run, "again", label="resume-never") is None  # nothing left that is work
    _fake_checkpoint(run, 2)
    again = supersede_run(run, "resume: never", label="resume-never")
    assert again != moved and (again / "checkpoint-2").is_dir() and (moved / "checkpoint-2").is_dir()


def test_latest_checkpoint_skips_checkpoints_that_cannot_resume(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 6, optimizer=False)  # save_only_model: true - weights only
    incomplete = _fake_checkpoint(tmp_path, 8)
    (incomplete / "d3s_state.json").unlink()  # killed while saving
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    removed = strip_to_weights(tmp_path / "checkpoint-4", "checkpoint-6 holds the full state")
    assert removed == ["optimizer.pt", "rng_state.pth", "scheduler.pt"]
    assert (tmp_path / "checkpoint-4" / WEIGHTS_ONLY_FILE).is_file()
    assert (tmp_path / "checkpoint-4" / "model.safetensors").is_file()
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"


def test_strip_to_weights_keeps_deepspeed_state_that_holds_the_only_weights(tmp_path):
    """ZeRO-3 without zero3_save_16bit_model writes no weight file: its global_step folder is the model."""
    folder = tmp_path / "checkpoint-2"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_text("shard")
    for name in ("latest", "zero_to_fp32.py", "trainer_state.json", "d3s_state.json"):
        (folder / name).write_text(name)
    assert strip_to_weights(folder, "newer") == [] and (folder / "global_step2").is_dir()
    assert latest_checkpoint(tmp_path) == folder  # DeepSpeed's state counts as training state
    (folder / "model.safetensors").write_text("16-bit weights")  # zero3_save_16bit_model: true
    assert strip_to_weights(folder, "newer") == ["global_step2", "latest", "zero_to_fp32.py"]
    kept = {WEIGHTS_ONLY_FILE, "d3s_state.json", "model.safetensors", "trainer_state.json"}
    assert {p.name for p in folder.iterdir()} == kept


def test_full_state_checkpoints_is_checked():
    common = {"output_dir": "o", "use_cpu": True, "report_to": "none", "per_device_train_batch_size": 8}
    with pytest.raises(ValueError, match="full_state_checkpoints must be one of all, latest"):
        D3SConfig.for_method("grpo", full_state_checkpoints="newest", **common)
    with pytest.raises(ValueError, match="set save_only_model: false"):
        D3SConfig.for_method("grpo", full_state_checkpoints="latest", save_only_model=True, **common)
    assert (
        D3SConfig.for_method("grpo", full_state_checkpoints="latest", **common).full_state_checkpoints
        == "latest"
    )


def test_checkpoint_state_is_restored_from_trainer_state_or_from_an_older_checkpoint(tmp_path):
    """Resume reads the counter from trainer_state.json; a checkpoint written before it was there (only
    d3s_state.json) still gives it back, and gets an entry for Trainer's next save."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from d3s.callbacks.checkpoints import D3SCheckpointState

    args = SimpleNamespace(output_dir=str(tmp_path))
    saved = TrainerState(global_step=4, stateful_callbacks=[D3SCheckpointState(update_tokens_total=123)])
    callback = D3SCheckpointState()
    callback.on_train_begin(args, saved, None)
    assert callback.update_tokens_total == 123

    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "d3s_state.json").write_text('{"update_tokens_total": 77}')
    older = TrainerState(global_step=4, stateful_callbacks={})
    callback = D3SCheckpointState()
    callback.on_train_begin(args, older, None)
    assert callback.update_tokens_total == 77
    assert older.stateful_callbacks["D3SCheckpointState"]["attributes"] == {"update_tokens_total": 77}


@pytest.mark.parametrize("world_size", [2, 1])
def test_a_resumed_optimizer_load_keeps_grpo_trainers_own_state(tmp_path, world_size):
    """D3STrainer's checkpoint load (two CPU ranks: CpuRanksOptimizerLoad's, onto the CPU; one process:
    transformers') runs inside GRPOTrainer's own, which restores TRL's adaptive-entropy controller from the
    entropy_ctrl_state.json its _save_checkpoint writes."""
    from types import SimpleNamespace

    from d3s.trainer import D3STrainer

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    weight.grad = torch.full((3,), 0.5)
    optimizer.step()
    scheduler.step()
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    torch.save(optimizer.state_dict(), checkpoint / "optimizer.pt")
    torch.save(scheduler.state_dict(), checkpoint / "scheduler.pt")
    (checkpoint / "entropy_ctrl_state.json").write_text(
        json.dumps({"entropy_coef": 0.0125, "last_world_entropy": 0.75})
    )

    trainer = D3STrainer.__new__(D3STrainer)  # the state the load reads, without a model
    trainer.args = SimpleNamespace(world_size=world_size, device=torch.device("cpu"))
    trainer.is_deepspeed_enabled = trainer.is_fsdp_enabled = trainer.is_fsdp_xla_v1_enabled = False
    fresh = torch.nn.Parameter(torch.ones(3))
    trainer.optimizer = torch.optim.AdamW([fresh], lr=0.1)
    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    trainer.use_adaptive_entropy, trainer.entropy_coef, trainer._last_world_entropy = True, 0.01, float("inf")
    trainer._load_optimizer_and_scheduler(str(checkpoint))

    assert (trainer.entropy_coef, trainer._last_world_entropy) == (0.0125, 0.75)  # GRPOTrainer's own
    loaded = trainer.optimizer.state_dict()["state"][0]
    torch.testing.assert_close(loaded["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert trainer.lr_scheduler.last_epoch == scheduler.last_epoch == 1
