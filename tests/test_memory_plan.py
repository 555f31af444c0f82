"""The memory plan (d3s/memory_plan.py, `d3s plan`): traced scaling, the H100 figures, the workflow's
refusal."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ACCELERATE_DIR

from d3s.architectures import ARCHITECTURES
from d3s.memory_plan import (
    GIB,
    ConfigPlan,
    check_fit,
    layer_traces,
    parameter_count,
    plan_config,
    scale_to_layers,
)
from d3s.orchestration.run_config import train_launch

REPO_ROOT = Path(__file__).resolve().parents[1]
PAPER = sorted((REPO_ROOT / "config" / "paper").glob("*.yaml"))
H100_FIGURES_GIB = {1536: 42.0, 3000: 57.0}  # ../shared/docs/gpu-device-notes.md


def _config(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "config" / "paper" / name).read_text())


def _plan(config: dict) -> ConfigPlan | None:
    """The cached plan of ``config``, its training launched as the workflow launches it."""
    return plan_config(config, train_launch(config["train"], ACCELERATE_DIR), trace=False)


def _check(config: dict) -> str | None:
    return check_fit(config, train_launch(config["train"], ACCELERATE_DIR))


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_every_paper_config_fits_from_the_cache(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    plan = _plan(config)
    assert plan is not None, f"{path.name}: a geometry is missing from d3s/memory_plan_cache.json (d3s plan)"
    assert not plan.too_big()
    assert _check(config) is None


def test_a_config_that_cannot_fit_is_refused_in_one_line_naming_the_setting() -> None:
    config = _config("single-gpu-qwen2.5-math-1.5b.yaml")
    config["train"]["memory_plan"] = {"gpu_memory_gib": 40}
    problem = _check(config)
    assert problem is not None and "\n" not in problem
    assert "trainer.vllm_gpu_memory_utilization" in problem or "trainer.max_completion_length" in problem
    assert "train.memory_plan.check: false" in problem
    config["train"]["memory_plan"]["check"] = False
    assert _check(config) is None


def test_cpu_configs_have_no_plan() -> None:
    config = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    assert _plan(config) is None and _check(config) is None


def test_snakemake_dry_run_refuses_a_config_that_cannot_fit(tmp_path: Path) -> None:
    config = _config("single-gpu-qwen2.5-math-1.5b.yaml")
    config["train"]["memory_plan"] = {"gpu_memory_gib": 40}
    path = tmp_path / "too-big.yaml"
    path.write_text(yaml.safe_dump(config))
    snakemake = Path(sys.executable).with_name("snakemake")
    done = subprocess.run(
        [str(snakemake), "-n", "--configfile", str(path), "--directory", str(tmp_path), "-s", "Snakefile"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "train.memory_plan" in done.stdout + done.stderr


def test_the_cli_finds_the_workflow_files_where_it_is_told(tmp_path, monkeypatch, capsys) -> None:
    """`d3s plan` reads the workflow's schema and accelerate configs from the working directory (the
    repository root) or from --schema and --accelerate-dir; elsewhere, one line naming the flags."""
    from d3s.cli import main

    config = str(REPO_ROOT / "config/paper/qwen2.5-math-7b.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", config]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "give --schema and --accelerate-dir" in err, err
    workflow_files = [
        "--schema",
        str(REPO_ROOT / "config/schema.yaml"),
        "--accelerate-dir",
        str(ACCELERATE_DIR),
    ]
    assert main(["plan", "--config", config, *workflow_files]) == 0


def test_the_cli_prints_the_plan(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from d3s.cli import main

    monkeypatch.chdir(REPO_ROOT)  # the workflow's schema and accelerate configs, as the command finds them

    assert main(["plan", "--config", str(REPO_ROOT / "config/paper/qwen2.5-math-7b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "| train grpo" in out and "| eval: vLLM" in out and "ZeRO-3" in out


def test_parameter_counts_match_the_published_sizes() -> None:
    assert round(parameter_count(ARCHITECTURES["qwen2.5-math-1.5b"]) / 1e9, 2) == 1.54
    assert round(parameter_count(ARCHITECTURES["qwen2.5-math-7b"]) / 1e9, 2) == 7.62
    assert round(parameter_count(ARCHITECTURES["llama-3.1-8b"]) / 1e9, 2) == 8.03


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["amp", "bf16"])
def test_scaling_from_two_layers_agrees_with_a_full_trace(precision: str) -> None:
    from d3s.memory_trace import trace_step

    small = dict(
        family="qwen2", hidden=256, intermediate=704, layers=6, heads=4, kv_heads=2, vocab=2048, tied=False,
        max_positions=1024, rms_norm_eps=1e-6,
    )  # fmt: skip
    geometry = dict(rows=8, prompt_tokens=64, completion_tokens=448, precision=precision, kl=True)
    scaled = scale_to_layers(layer_traces(small, 8, 64, 448, precision, True, cache={}), small["layers"])
    full = trace_step(small, layers=small["layers"], **geometry)
    assert scaled["Total"] == pytest.approx(full["Total"], rel=0.01)
    assert scaled["Parameter"] == pytest.approx(full["Parameter"], rel=0.001)


@pytest.mark.slow
@pytest.mark.parametrize("completion", sorted(H100_FIGURES_GIB))
def test_the_trace_agrees_with_the_h100_figures(completion: int) -> None:
    """Qwen2.5-Math-1.5B, 32 rollouts, 256 prompt tokens, fp32 weights, bf16 autocast, gradient checkpointing,
    the reference model (fp32) for beta = 0.001: within 15 % of the peak measured on an H100 80 GB."""
    arch = ARCHITECTURES["qwen2.5-math-1.5b"]
    traced = scale_to_layers(layer_traces(arch, 32, 256, completion, "amp", True, cache={}), arch["layers"])
    peak = (traced["Total"] + 4 * parameter_count(arch)) / GIB
    assert peak == pytest.approx(H100_FIGURES_GIB[completion], rel=0.15)


def test_selection_methods_plan_their_kept_rows() -> None:
    config = copy.deepcopy(_config("qwen2.5-math-7b.yaml"))
    plan = _plan(config)
    labels = [job.job for job in plan.jobs]
    assert any("pods" in label and "8 rows" in label for label in labels)
    assert any("d3s" in label and "32 rows" in label for label in labels)


def test_server_mode_plans_the_gpus_the_vllm_server_leaves() -> None:
    """Server mode: the job's GPUs less tensor_parallel_size x data_parallel_size serve, the rest train and
    shard the optimizer state; a server the user runs (vllm_server_base_url) takes none of the job's."""
    config = _config("qwen2.5-math-1.5b.yaml")  # 8 GPUs, ZeRO-2
    trainer = config["train"]["trainer"]
    trainer["vllm_mode"] = "server"
    config["train"]["launch"]["vllm_server"] = {"tensor_parallel_size": 2}
    served = _plan(config).jobs[0]
    psi = parameter_count(ARCHITECTURES["qwen2.5-math-1.5b"])
    assert "6 x ZeRO-2" in served.job and served.gpus == 8 and "vLLM" not in served.components
    assert served.components["optimizer"] == pytest.approx(12 * psi / 6 / GIB)
    del config["train"]["launch"]["vllm_server"]
    trainer["vllm_server_base_url"] = "http://elsewhere:8000"
    assert "8 x ZeRO-2" in _plan(config).jobs[0].job


def test_the_planned_micro_batch_is_the_packed_one_where_training_packs() -> None:
    """d3s at N = 2 of 8 in TRL's micro-batches of 8, accumulation 4: 2 kept rows each, packed into one of
    8 rows (d3s/packing.py), which the plan must trace; DeepSpeed and pack_micro_batches: false keep TRL's."""
    from d3s.memory_plan import kept_rows

    trainer = {"per_device_train_batch_size": 8, "num_generations": 8, "keep_per_prompt": 2}
    assert kept_rows("d3s", trainer) == 2  # one micro-batch per step: nothing to pack
    trainer["gradient_accumulation_steps"] = 4
    assert kept_rows("d3s", trainer) == 8
    assert kept_rows("d3s", trainer, deepspeed=True) == 2
    assert kept_rows("d3s", trainer | {"pack_micro_batches": False}) == 2
    assert kept_rows("d3s", trainer | {"token_scope": "micro_batch"}) == 2
    assert kept_rows("d3s", trainer | {"keep_per_prompt": 6}) == 8  # 24 rows in 3 micro-batches of 8
    assert kept_rows("d3s", trainer | {"keep_per_prompt": 3, "per_device_train_batch_size": 16}) == 12
