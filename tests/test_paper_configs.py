"""Every paper configuration (config/paper/*.yaml): a Snakemake dry run (jobs and declared resources) and
every method's trainer settings, resolved as its training job resolves them, against the paper's values.
(A bad paper config refused before any job starts: tests/test_dry_run_offline.py.)

Where the paper gives a value (../shared/docs/paper-notes.md) the test says [paper]; the rest are the
documented choices of DESIGN.md and the configs, pinned here so a change is deliberate.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from helpers import ACCELERATE_DIR, ANALYSIS_RULES, REPO_ROOT, SHARED_DATA, dry_run_jobs

from d3s.orchestration.run_config import resolved_trainer_configs, training_processes

PAPER_DIR = REPO_ROOT / "config" / "paper"
SEVEN_BENCHMARKS = [
    "aime24",
    "aime25",
    "amc23",
    "gsm8k",
    "math500",
    "minerva_math",
    "olympiadbench",
]  # [paper]
# Per file: the backbone and the methods the paper shows it with [paper]; hardware, steps, batch [choice].
BACKBONES = {
    "qwen2.5-math-7b.yaml": dict(
        model="Qwen/Qwen2.5-Math-7B",
        methods={"grpo", "pods", "d3s", "gspo_d3s", "d1s", "d1s_cross", "d2s", "gspo"},  # Tables 1, 2, 3
        gpus=8, accelerate="zero3_offload", prompts=32, steps=500, completion=3000,
    ),
    "qwen2.5-math-1.5b.yaml": dict(
        model="Qwen/Qwen2.5-Math-1.5B", methods={"grpo", "d3s"},  # Table 3
        gpus=8, accelerate="zero2", prompts=32, steps=500, completion=3000,
    ),
    "llama-3.1-8b-instruct.yaml": dict(
        model="meta-llama/Llama-3.1-8B-Instruct", methods={"grpo", "d3s", "d3s_i"},  # Table 1, Appendix D.1
        gpus=8, accelerate="zero3_offload", prompts=32, steps=500, completion=3000,
    ),
    "openmath2-llama3.1-8b.yaml": dict(
        model="nvidia/OpenMath2-Llama3.1-8B", methods={"grpo", "d3s"},  # Fig. 4 (entropy)
        gpus=8, accelerate="zero3_offload", prompts=32, steps=500, completion=3000,
    ),
    "single-gpu-qwen2.5-math-1.5b.yaml": dict(
        model="Qwen/Qwen2.5-Math-1.5B", methods={"grpo", "d3s"},
        gpus=1, accelerate="ddp", prompts=8, steps=150, completion=1536,
    ),
}  # fmt: skip

# Selection per method (d3s/methods.py; [paper] N 8 -> 32 of G = 32 and K 5 % -> 20 %, from a secondary
# source): (sample rule, scope, re-normalise, N_init, N_final, token rule, K_init, K_final, schedule).
G = 32
SELECTION = {
    "grpo": ("none", "group", False, G, G, "none", 1.0, 1.0, "constant"),
    "pods": ("max_variance", "group", True, 8, 8, "none", 1.0, 1.0, "constant"),
    "d1s": ("max_variance", "group", False, 8, 8, "none", 1.0, 1.0, "constant"),
    "d1s_cross": ("max_variance", "batch", False, 8, 8, "none", 1.0, 1.0, "constant"),
    "d2s": ("max_variance", "batch", False, 8, 8, "adv_entropy", 0.05, 0.05, "constant"),
    "d3s": ("max_variance", "batch", False, 8, 32, "adv_entropy", 0.05, 0.20, "linear"),
    "d3s_i": ("max_variance", "group", False, 8, 32, "adv_entropy", 0.05, 0.20, "linear"),
    "gspo": ("none", "group", False, G, G, "none", 1.0, 1.0, "constant"),
    "gspo_d3s": ("max_variance", "batch", False, 8, 32, "adv_entropy", 0.05, 0.20, "linear"),
}
GSPO = {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4, "loss_type": "grpo"}
# TRL 1.16's token-level clipped objective for every other method (its defaults, pinned).
GRPO_OBJECTIVE = {
    "importance_sampling_level": "token",
    "epsilon": 0.2,
    "epsilon_high": 0.2,
    "loss_type": "dapo",
}

ALL_CONFIGS = sorted(PAPER_DIR.glob("*.yaml"))
PODS_CONFIGS = sorted(PAPER_DIR.glob("pods-*.yaml"))  # PODS's own protocol (test_pods_own_protocol)
CONFIGS = [path for path in ALL_CONFIGS if path not in PODS_CONFIGS]  # the D3S paper's
# PODS (arXiv 2504.13818) single-GPU arms [paper]: (GRPO's n = m, PODS's n, benchmarks)
PODS_ARMS = {
    "pods-qwen2.5-3b-instruct-gsm8k.yaml": (16, 64, ["gsm8k"], "gsm8k_train"),
    "pods-qwen2.5-3b-instruct-math.yaml": (8, 32, ["math500", "amc23"], "math_level3to5"),
}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_one_file_per_backbone_and_the_single_gpu_one():
    assert {p.name for p in CONFIGS} == set(BACKBONES)
    assert {p.name for p in PODS_CONFIGS} == set(PODS_ARMS)


@pytest.mark.parametrize("config_path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_dry_run_jobs_and_resources(config_path, dry_run):
    cfg = _load(config_path)
    expected = BACKBONES.get(config_path.name, {"gpus": 1})  # PODS's runs: one GPU [paper]
    jobs = dry_run_jobs(dry_run(config_path))  # offline, no data: parsing needs neither
    by_rule: dict[str, list[dict]] = {}
    for job in jobs:
        by_rule.setdefault(job["rule"], []).append(job)
    runs = {(m, str(s)) for m in cfg["methods"] for s in cfg["seeds"]}
    for rule in ("train", "evaluate_final"):  # one job per method x seed
        assert {(j["wildcards"]["method"], j["wildcards"]["seed"]) for j in by_rule[rule]} == runs
        assert len(by_rule[rule]) == len(runs)
    # one evaluation job per intermediate checkpoint of every run
    trainer = cfg["train"]["trainer"]
    steps = {str(s) for s in range(trainer["save_steps"], trainer["max_steps"], trainer["save_steps"])}
    evaluated = [
        tuple(j["wildcards"][k] for k in ("method", "seed", "step")) for j in by_rule["evaluate_checkpoint"]
    ]
    assert sorted(evaluated) == sorted((m, s, step) for m, s in runs for step in steps)
    assert len(by_rule["evaluate_base"]) == 1 and "base_model" not in by_rule  # a given model: no build
    assert set(by_rule) >= ANALYSIS_RULES
    for job in by_rule["train"]:
        res = job["resources"]
        assert int(res["gpu"]) == expected["gpus"] == cfg["train"]["resources"]["gpu"]
        assert int(res["cpus_per_gpu"]) >= 4 and int(res["mem_mb"]) >= 64000 and int(res["runtime"]) >= 60
    for job in by_rule["evaluate_checkpoint"] + by_rule["evaluate_final"] + by_rule["evaluate_base"]:
        res = job["resources"]
        assert int(res["gpu"]) == 1 and int(res["cpus_per_gpu"]) >= 1 and int(res["runtime"]) >= 60
    for rule in ANALYSIS_RULES:
        assert all("gpu" not in job["resources"] for job in by_rule[rule])


@pytest.fixture(scope="module")
def resolved():
    """{file name: (config, {method: D3SConfig})}, resolved once per file."""
    data = SHARED_DATA
    if not data.is_dir():
        pytest.skip(f"benchmark copies not found at {data}")
    previous = os.environ.get("D3S_DATA_DIR")
    os.environ["D3S_DATA_DIR"] = str(data)
    try:
        out = {}
        for path in ALL_CONFIGS:
            cfg = _load(path)
            out[path.name] = (cfg, resolved_trainer_configs(cfg, ACCELERATE_DIR, cfg.get("task")))
        return out
    finally:
        if previous is None:
            os.environ.pop("D3S_DATA_DIR", None)
        else:
            os.environ["D3S_DATA_DIR"] = previous


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: p.stem)
def test_backbone_data_and_evaluation(config_path):
    cfg, expected = _load(config_path), BACKBONES[config_path.name]
    assert cfg["base_model"] == {"kind": "path", "path": expected["model"]}
    assert set(cfg["methods"]) == expected["methods"]
    assert cfg["train"]["dataset"]["name"] == "math_level3to5"
    assert cfg["train"]["template"] == cfg["eval"]["template"] == "qwen_math_cot"
    ev = cfg["eval"]
    assert ev["benchmarks"] == SEVEN_BENCHMARKS  # [paper]
    assert ev["samples"] == 32 and {1, 8} <= set(ev["k"])  # [paper] Avg@32 = Pass@1, and Pass@8
    assert (ev["temperature"], ev["top_p"], ev["backend"]) == (0.6, 0.95, "vllm")  # DESIGN.md
    assert ev["max_tokens"] >= expected["completion"]
    assert cfg["analysis"]["reference"] == "grpo"
    assert set(cfg["analysis"]["headline"]) <= expected["methods"]
    # the KL the paper plots, measured without gradient at every evaluated checkpoint (d3s.evaluation.kl)
    assert ev["kl"]["prompts"] * ev["kl"]["samples"] >= 32


@pytest.mark.parametrize("config_path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_beta_is_marked_paper(config_path):
    """A nonzero beta is kept only where a paper gives one, and the line says so."""
    (line,) = [line for line in config_path.read_text().splitlines() if line.strip().startswith("beta:")]
    assert "[paper]" in line, line


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: p.stem)
def test_resolved_trainer_settings(config_path, resolved):
    cfg, configs = resolved[config_path.name]
    expected = BACKBONES[config_path.name]
    processes = training_processes(cfg["train"], ACCELERATE_DIR)
    assert processes == expected["gpus"]
    launch = cfg["train"].get("launch", {})
    assert launch.get("accelerate_config", "ddp") == expected["accelerate"]
    assert set(configs) == expected["methods"]
    for method, args in configs.items():
        where = f"{config_path.name} {method}"
        # batch: prompts x G rollouts per optimizer step, one optimizer step per generation batch
        assert args.num_generations == G, where
        assert args.per_device_train_batch_size == G, where
        # GSPO: 4 mini-batches (optimizer steps) per generation batch; every other method one
        minibatches = 4 if method.startswith("gspo") else 1
        assert args.minibatches_per_generation == minibatches, where
        assert args.generation_batch_size * processes == minibatches * expected["prompts"] * G, where
        assert args.steps_per_generation == minibatches * args.gradient_accumulation_steps, where
        assert args.num_iterations == 1 and args.max_steps == expected["steps"], where
        # selection (d3s/methods.py)
        rule, scope, renorm, n0, n1, token, k0, k1, schedule = SELECTION[method]
        assert (args.sample_rule, args.renormalize, args.token_rule, args.schedule) == (
            rule, renorm, token, schedule,
        ), where  # fmt: skip
        if rule != "none":
            assert args.sample_scope == scope, where
        assert (args.keep_per_prompt, args.keep_per_prompt_final) == (n0, n1), where
        assert (args.token_keep_ratio, args.token_keep_ratio_final) == pytest.approx((k0, k1)), where
        # objective
        objective = GSPO if method.startswith("gspo") else GRPO_OBJECTIVE
        actual = {
            "importance_sampling_level": args.importance_sampling_level,
            "epsilon": args.epsilon,
            "epsilon_high": args.epsilon_high if args.epsilon_high is not None else args.epsilon,
            "loss_type": args.loss_type,
        }
        assert actual == pytest.approx(objective), where
        # no KL term in the Qwen runs (the papers'); Llama: PODS's 0.04, the only beta a paper gives
        beta = 0.04 if "llama" in config_path.name else 0.0
        assert args.scale_rewards == "group" and args.beta == pytest.approx(beta), where
        assert args.report_to == ["tensorboard"], where  # logs to <run>/runs/ (docs/gpu/configurations.md)
        # optimisation and sampling [choice]
        assert (
            args.learning_rate == pytest.approx(1e-6) and str(args.lr_scheduler_type.value) == "constant"
        ), where
        assert args.max_grad_norm == 1.0 and args.temperature == 1.0 and args.top_p == 1.0, where
        assert args.max_completion_length == expected["completion"], where
        # GPU settings (resolved without the hardware check)
        assert args.bf16 and args.gradient_checkpointing and args.model_init_kwargs == {"dtype": "float32"}, (
            where
        )
        assert args.use_vllm and args.vllm_mode == "colocate", where
        assert args.vllm_max_model_length >= args.max_completion_length + 512, where
        # learning curves: a checkpoint every save_steps (resumable: test_checkpoints_resume)
        assert args.save_strategy.value == "steps", where
        assert args.max_steps % args.save_steps == 0 and args.max_steps // args.save_steps >= 4, where


@pytest.mark.parametrize("config_path", PODS_CONFIGS, ids=lambda p: p.stem)
def test_pods_own_protocol(config_path, resolved):
    """GRPO with n = m against PODS generating n = 4m and training the same m, PODS's reward and answer
    format, PODS's optimiser settings; every value line marked [paper] or [choice] where it is set."""
    cfg, configs = resolved[config_path.name]
    m, n, benchmarks, dataset = PODS_ARMS[config_path.name]
    grpo, pods = configs["grpo"], configs["pods"]
    assert (grpo.num_generations, grpo.keep_per_prompt) == (m, m)
    assert (pods.num_generations, pods.keep_per_prompt, pods.sample_rule, pods.renormalize) == (
        n, m, "max_variance", True,
    )  # fmt: skip
    assert cfg["train"]["prompts_per_step"] == 1 and cfg["train"]["dataset"]["name"] == dataset
    assert (cfg["train"]["template"], cfg["train"]["reward"], cfg["eval"]["template"]) == ("pods",) * 3
    assert cfg["eval"]["benchmarks"] == benchmarks and cfg["eval"]["samples"] == 5
    for args in (grpo, pods):
        assert args.answer_policy == "answer_tag" and args.loss_type == "grpo" and args.beta == 0.0
        assert (args.learning_rate, args.max_grad_norm, args.weight_decay) == (5e-6, 0.1, 0.1)
        assert (args.temperature, args.max_completion_length) == (0.9, 512)
        # as the D3S paper files: logs to <run>/runs/ (docs/gpu/configurations.md)
        assert args.report_to == ["tensorboard"]
    # the same prompts per optimizer step, and the update trains m rollouts per prompt in both arms
    assert (
        grpo.generation_batch_size // grpo.num_generations
        == pods.generation_batch_size // pods.num_generations
    )
    from d3s.analysis.claims import pods_protocol
    from d3s.analysis.report import method_generations

    assert pods_protocol("pods", "grpo", method_generations(cfg)).startswith("PODS's own")
    trainer_lines = config_path.read_text().split("\n  trainer:\n", 1)[1].split("\n  method_overrides:", 1)[0]
    for line in trainer_lines.splitlines():
        key = line.strip().split(":", 1)[0]
        if key in ("learning_rate", "max_grad_norm", "weight_decay", "temperature", "max_completion_length"):
            assert "[paper]" in line, line


@pytest.mark.parametrize("config_path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_checkpoints_resume(config_path, resolved):
    """A cut-off paper run resumes exactly: its newest checkpoint keeps the training state (optimizer,
    scheduler, RNG, DeepSpeed's global_step folder), which save_only_model: true would drop; the older ones
    are cut to 16-bit weights, which ZeRO-3 writes only with zero3_save_16bit_model; and Trainer deletes none
    of them."""
    cfg, configs = resolved[config_path.name]
    for method, args in configs.items():
        where = f"{config_path.name} {method}"
        assert not args.save_only_model and args.full_state_checkpoints == "latest", where
        assert args.save_total_limit is None, where  # every checkpoint is evaluated for the learning curves
    accelerate = cfg["train"].get("launch", {}).get("accelerate_config", "ddp")
    launcher = yaml.safe_load((ACCELERATE_DIR / f"{accelerate}.yaml").read_text())
    deepspeed = launcher.get("deepspeed_config", {})
    if deepspeed.get("zero_stage") == 3:
        assert deepspeed.get("zero3_save_16bit_model") is True, accelerate
