"""config/gpu-smoke.yaml, the first run on a GPU: a ~100M-parameter Qwen2 model built in code, every stage on
the GPU, nothing downloaded. Checked here without a GPU: the model's size (built on the meta device), every
method's trainer settings as its training job resolves them, the jobs' declared resources in a dry run, and
the base model's SFT refusing CUDA where there is none. The SFT on CUDA runs where a GPU is present.
(`snakemake -n` of it offline: tests/test_dry_run_offline.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import ACCELERATE_DIR, ANALYSIS_RULES, REPO_ROOT, dry_run_jobs

from d3s.orchestration.base_model_job import build_base
from d3s.orchestration.run_config import resolved_trainer_configs, train_launch, training_processes

CONFIG = REPO_ROOT / "config" / "gpu-smoke.yaml"
GPU_RULES = {"base_model", "train", "evaluate_base", "evaluate_checkpoint", "evaluate_final"}


@pytest.fixture(scope="module")
def cfg() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_base_model_has_about_100m_parameters_as_the_comment_says(cfg):
    from d3s.tiny_model import build_model, build_tokenizer

    base = cfg["base_model"]
    assert base["kind"] == "tiny"  # built in code: nothing downloaded
    with torch.device("meta"):  # the real builder, no memory or time spent on weights
        model = build_model(build_tokenizer(), seed=base["seed"], **base["model"])
    parameters = sum(p.numel() for p in model.parameters())
    assert 95e6 <= parameters <= 105e6, parameters
    assert model.config.model_type == "qwen2"
    assert f"{parameters:,} parameters" in CONFIG.read_text()  # the count stated in the config's comments


def test_every_stage_asks_for_one_gpu_and_nothing_is_downloaded(cfg):
    for section in (cfg["base_model"], cfg["train"], cfg["eval"]):
        assert section["resources"]["gpu"] == 1
    assert cfg["train"]["dataset"]["name"] == "synthetic" and cfg["eval"]["benchmarks"] == ["synthetic"]
    assert cfg["eval"]["backend"] == "transformers"  # no vLLM anywhere
    assert set(cfg["methods"]) == {"grpo", "pods", "d3s"} and len(cfg["seeds"]) == 1
    launch = train_launch(cfg["train"], ACCELERATE_DIR)
    assert launch.train_gpus == 1 and launch.server is None
    assert launch.accelerate_config.name == "single_gpu.yaml"


def test_every_method_resolves_to_bf16_transformers_generation(cfg):
    resolved = resolved_trainer_configs(cfg, ACCELERATE_DIR, cfg["task"])
    assert set(resolved) == set(cfg["methods"])
    assert training_processes(cfg["train"], ACCELERATE_DIR) == 1
    trainer = cfg["train"]["trainer"]
    for method, args in resolved.items():
        assert args.bf16 and not args.use_vllm and not args.gradient_checkpointing, method
        assert args.model_init_kwargs == {"dtype": "float32"}, method  # fp32 weights under bf16 autocast
        assert args.num_generations == 8 and args.generation_batch_size == 64, method
        assert args.steps_per_generation == args.gradient_accumulation_steps == 1, method
        assert args.max_steps == trainer["max_steps"] and args.save_strategy.value == "steps", method
        assert args.max_steps % args.save_steps == 0 and args.max_steps // args.save_steps == 2, method
    assert resolved["grpo"].sample_rule == "none"
    assert resolved["pods"].sample_rule == resolved["d3s"].sample_rule == "max_variance"
    assert resolved["d3s"].token_rule == "adv_entropy"


def test_completions_fit_in_the_generation_budget(cfg):
    """A completion cut off at max_completion_length earns no reward: the SFT targets must fit, with the
    EOS."""
    from d3s.data.synthetic import arithmetic_problems
    from d3s.tiny_model import build_tokenizer

    tokenizer, task, base = build_tokenizer(), cfg["task"], cfg["base_model"]
    problems = arithmetic_problems(base["sft_problems"], seed=1000 + base["seed"], **task)
    longest = max(len(tokenizer(p.completion, add_special_tokens=False)["input_ids"]) + 1 for p in problems)
    assert longest <= cfg["train"]["trainer"]["max_completion_length"]
    assert longest <= cfg["eval"]["max_tokens"]
    prompt = max(len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) for p in problems)
    positions = base["model"].get("max_positions", 256)  # d3s.tiny_model.build_model's default
    assert prompt + cfg["train"]["trainer"]["max_completion_length"] <= positions


def test_dry_run_gives_every_gpu_job_one_gpu(dry_run):
    jobs = dry_run_jobs(dry_run(CONFIG))
    rules = {job["rule"] for job in jobs}
    assert rules >= GPU_RULES | ANALYSIS_RULES
    for job in jobs:
        gpus = int(job["resources"].get("gpu", 0))
        assert gpus == (1 if job["rule"] in GPU_RULES else 0), job
    assert sorted(int(j["wildcards"]["step"]) for j in jobs if j["rule"] == "evaluate_checkpoint") == [10] * 3


TASK = {"min_ops": 1, "max_ops": 1, "max_operand": 9, "bounded": False}


def _sft(steps: int, problems: int) -> dict:
    """A base_model section as the schema fills it in: ``steps`` SFT steps on ``problems`` problems."""
    settings = {"sft_steps": steps, "sft_problems": problems, "seed": 0, "learning_rate": 3e-3}
    return settings | {"sft_box_error": [0.0, 0.0], "model": {}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_sft_on_cuda_without_a_gpu_is_refused_with_the_fix(tmp_path):
    with pytest.raises(SystemExit, match=r"no CUDA GPU.*remove base_model.resources.gpu"):
        build_base(tmp_path, _sft(1, 8), TASK, threads=1, device="cuda")
    assert not any(tmp_path.iterdir())  # refused before anything was built or written


def test_the_sft_learns_the_chain_lengths_of_its_sft_task(tmp_path):
    """base_model.sft_task replaces the task's chain lengths for the SFT only (the generalization study's base
    model knows chains of 7 operations that its RL task, 3-6, holds out): the demonstrations are drawn on
    them, as arithmetic_problems draws them for that task."""
    from d3s.data.synthetic import arithmetic_problems
    from d3s.tiny_model import build_tokenizer

    task = {"min_ops": 3, "max_ops": 6, "max_operand": 9, "bounded": True}
    summary = build_base(tmp_path / "a", _sft(1, 40) | {"sft_task": {"max_ops": 7}}, task, threads=1)
    assert (summary["min_ops"], summary["max_ops"]) == (3, 7)
    problems = arithmetic_problems(40, seed=1000, **(task | {"max_ops": 7}))
    assert max(p.num_ops for p in problems) == 7  # the SFT saw chains its RL task holds out
    tokenizer = build_tokenizer()
    tokens = [len(tokenizer(p.completion, add_special_tokens=False)["input_ids"]) + 1 for p in problems]
    assert summary["completion_tokens_mean"] == pytest.approx(sum(tokens) / len(tokens))
    plain = build_base(tmp_path / "b", _sft(1, 40), task, threads=1)  # no sft_task: the task's lengths
    assert (plain["min_ops"], plain["max_ops"]) == (3, 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sft_runs_on_cuda_and_saves_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    summary = build_base(tmp_path, _sft(60, 500), TASK, threads=1, device="cuda")
    assert summary["device"] == "cuda" and summary["parameters"] > 0
    losses = json.loads((tmp_path / "sft_losses.json").read_text())
    assert len(losses) == 60 and sum(losses[-10:]) < sum(losses[:10])  # it learned on the GPU
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert next(model.parameters()).dtype == torch.float32  # saved fp32, as on the CPU
