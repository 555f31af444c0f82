"""`d3s train` end to end on the tiny model, and its refusals before any model is loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import write_run_config as write_config

from d3s.cli import build_parser, build_train_config, main
from d3s.runs.resolve import resolve_config
from d3s.vllm_engine import cpu_vllm_installed


@pytest.mark.slow
def test_d3s_train_cli_writes_a_complete_run_directory(tmp_path):
    path = write_config(tmp_path)
    assert main(["train", "--config", str(path), "--method", "pods", "--set", "learning_rate=0.001"]) == 0
    run = tmp_path / "run"
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["method"] == "pods" and resolved["resolved_trainer"]["learning_rate"] == 0.001
    assert resolved["resolved_trainer"]["sample_rule"] == "max_variance" and resolved["threads"] == 2
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]
    assert (run / "final" / "config.json").is_file() and (run / "final" / "tokenizer.json").is_file()
    assert json.loads((run / "train_summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_d3s_train_with_pods_reward_and_answer_tag_policy(tmp_path):
    """reward: pods trains on accuracy_reward (under trainer.answer_policy) plus PODS's format term."""
    trainer = {"max_steps": 1, "per_device_train_batch_size": 16, "num_generations": 8}
    path = write_config(
        tmp_path,
        reward="pods",
        trainer=trainer | {"max_completion_length": 16, "answer_policy": "answer_tag"},
    )
    assert main(["train", "--config", str(path)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = next(s for s in steps if "loss" in s)
    assert {"rewards/accuracy_reward/mean", "rewards/pods_format_reward/mean"} <= set(logged)
    resolved = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())
    assert resolved["reward"] == "pods" and resolved["resolved_trainer"]["answer_policy"] == "answer_tag"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"method": "d4s"}, "unknown method 'd4s' .*; valid methods: d1s"),
        (
            {"trainer": {"keep_per_prompt": 9, "num_generations": 8}},
            "keep_per_prompt must be an integer between 1",
        ),
        ({"trainer": {"max_step": 3}}, r"unknown trainer option\(s\) \['max_step'\]"),
        ({"optimiser": "adam"}, r"unknown config keys \['optimiser'\]"),
        ({"resume": "later"}, "resume: expected one of auto, never, got 'later'"),
        ({"model": "/no/such/model"}, "model /no/such/model: no model found there"),
        ({"dataset": {"name": "aime26"}}, "unknown benchmark 'aime26'; valid names: aime24"),
        (
            {"dataset": {"name": "gsm8k"}, "data_dir": "/no/such/dir"},
            "looked for local copy /no/such/dir/gsm8k",
        ),
        ({"trainer": {"use_vllm": True, "vllm_mode": "server"}}, "trainer.vllm_mode: server needs CUDA"),
        (
            {"trainer": {"use_vllm": True}},  # colocate: vLLM's CPU build, with a head dim its attention runs
            "tiny.head_dim is 16, which vLLM's CPU attention does not run"
            if cpu_vllm_installed()
            else "trainer.use_vllm is set but this machine has no CUDA GPU and vLLM's CPU build is not",
        ),
        ({"tiny": {"head_dim": 24}}, r"tiny.head_dim must be one of 16, 32; got 24"),
        ({"trainer": {"vllm_dtype": "float64"}}, "trainer.vllm_dtype: expected one of auto, float32"),
        ({"trainer": {"bf16": True}}, "trainer.bf16 is set but this machine has no CUDA GPU"),
        ({"trainer": {"token_keep_ratio": 0}}, r"token_keep_ratio must be in \(0, 1\]"),
        ({"trainer": {"per_device_train_batch_size": 4, "steps_per_generation": 4}}, "TRL would drop rows"),
    ],
)
def test_bad_config_is_refused_before_loading_a_model(tmp_path, overrides, message, capsys, monkeypatch):
    if ("CUDA" in message or "CPU" in message) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if "data_dir" in overrides:  # the Hub is out of reach here: fail over to it at once, not after timeouts
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_config(tmp_path, **overrides)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resolve_config_applies_method_trl_settings(tmp_path):
    out = str(tmp_path / "run")  # never a fixed path: a file there would be refused as output_dir
    args = resolve_config({"method": "gspo_d3s", "output_dir": out, "trainer": {"num_generations": 8}})
    assert args.importance_sampling_level == "sequence" and args.loss_type == "grpo"
    with pytest.raises(ValueError, match="drop the loss_type override"):
        resolve_config({"method": "gspo", "output_dir": out, "trainer": {"loss_type": "dapo"}})


def test_console_entry_point_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "d3s.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "train" in out.stdout and "eval" in out.stdout


# `d3s train` whose run stops once it has imported the trainer (TRL's trainer and generation code, as a run
# imports them), printing whether vLLM was imported.
STOP_AFTER_IMPORTS = """
import sys

import d3s.runs.run


def train(config):
    import d3s.trainer

    print("vllm imported:", sys.modules.get("vllm") is not None)
    return "stopped"


d3s.runs.run.train = train
from d3s.cli import command

raise SystemExit(command())
"""


@pytest.mark.skipif(not cpu_vllm_installed(), reason="vLLM's CPU build is not installed")
@pytest.mark.parametrize("use_vllm", [False, True])
def test_the_d3s_command_imports_vllm_only_for_a_run_that_generates_with_it(tmp_path, use_vllm):
    """TRL imports vLLM whenever it is installed (~7 s of every process start on this CPU): the `d3s`
    command, a process of its own, keeps it out unless the run uses it."""
    path = write_config(tmp_path, trainer={"use_vllm": use_vllm})
    done = subprocess.run(
        [sys.executable, "-c", STOP_AFTER_IMPORTS, "train", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"vllm imported: {use_vllm}" in done.stdout, done.stdout[-2000:]


def resolved_trainer(tmp_path, *argv):
    """The D3SConfig that `d3s train ARGV` would train with (nothing is trained or loaded)."""
    args = build_parser().parse_args(["train", "--config", str(write_config(tmp_path)), *argv])
    return resolve_config(build_train_config(args))


@pytest.mark.parametrize(
    ("option", "text", "field", "expected"),
    [
        ("learning_rate", "1e-4", "learning_rate", 1e-4),  # float (YAML alone would give the string '1e-4')
        ("max_steps", "3", "max_steps", 3),  # int
        ("max_steps", "1e1", "max_steps", 10),  # int written as a float
        ("mask_truncated_completions", "yes", "mask_truncated_completions", True),  # bool
        ("defer_logprob_passes", "0", "defer_logprob_passes", False),  # bool
        ("lr_scheduler_type", "constant", "lr_scheduler_type", "constant"),  # enum (SchedulerType)
        ("save_strategy", "no", "save_strategy", "no"),  # enum (SaveStrategy)
        ("reward_weights", "[2, 0.5e0]", "reward_weights", [2.0, 0.5]),  # list[float]
        ("lr_scheduler_kwargs", '{"min_lr": 1e-6}', "lr_scheduler_kwargs", {"min_lr": 1e-6}),  # dict, JSON
        ("model_init_kwargs", "{dtype: float32}", "model_init_kwargs", {"dtype": "float32"}),  # dict, YAML
        ("scale_rewards", "false", "scale_rewards", "none"),  # str | bool (TRL maps False to 'none')
        ("pad_to_multiple_of", "8", "pad_to_multiple_of", 8),  # int | str
        ("run_name", "007", "run_name", "007"),  # str stays text
        ("torch_empty_cache_steps", "null", "torch_empty_cache_steps", None),  # Optional
    ],
)
def test_set_values_are_coerced_to_the_field_type(tmp_path, option, text, field, expected):
    value = getattr(resolved_trainer(tmp_path, "--set", f"{option}={text}"), field)
    value = getattr(value, "value", value)  # TrainingArguments turns enum strings into enum members
    assert value == expected and type(value) is type(expected)


def test_yaml_config_values_are_coerced_like_set_values(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"output_dir: {tmp_path / 'run'}\n"
        "trainer:\n"
        "  learning_rate: 1e-4    # YAML 1.1 reads this as the string '1e-4'\n"
        "  save_strategy: no      # ... and this as False\n"
        "  max_steps: '2'\n"
        "  per_device_train_batch_size: 16\n"
    )
    assert yaml.safe_load(path.read_text())["trainer"]["learning_rate"] == "1e-4"
    args = resolve_config(build_train_config(build_parser().parse_args(["train", "--config", str(path)])))
    assert args.learning_rate == 1e-4 and args.max_steps == 2 and args.save_strategy.value == "no"
