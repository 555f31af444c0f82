"""``method="grpo"`` is GRPOTrainer, its defaults and its logs included (issue 57): D3SConfig resolves every
GRPOConfig field as TRL does, D3STrainer builds TRL's default config when given none, accepts what TRL accepts
(``num_generations_eval=1``), and logs the keys GRPOTrainer logs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from d3s.methods import METHODS
from d3s.rewards import accuracy_reward
from d3s.tiny_model import build_model, build_tokenizer
from d3s.trainer import D3SConfig, D3STrainer

# TRL's default bf16 needs a GPU unless use_cpu is set (TrainingArguments refuses it otherwise): both
# configs are built for this machine.
HERE: dict[str, Any] = {} if torch.cuda.is_available() else {"use_cpu": True}
# GRPOConfig fields whose resolved value names the run rather than configures it: compared as equal
# output_dir, their value derives from it (TrainingArguments.__post_init__).
DERIVED_FROM_THE_OUTPUT_DIR = {
    "logging_dir": "TrainingArguments sets it under output_dir (and, when unset, a timestamped runs/ folder)",
}
# D3SConfig fields that a selecting method sets beyond its trl_settings: GSPO's 4 optimizer steps per
# generation batch (d3s.methods.Method.minibatches_per_generation) make the generation batch 4 x larger.
GENERATION_GEOMETRY = {"steps_per_generation", "generation_batch_size"}


def resolved(config: GRPOConfig) -> dict[str, Any]:
    """Every GRPOConfig field's value after __post_init__ (D3SConfig's own fields left out)."""
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(GRPOConfig)
        if f.name not in DERIVED_FROM_THE_OUTPUT_DIR
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {name: (a[name], b[name]) for name in a if a[name] != b[name]}


def test_d3s_config_of_method_grpo_resolves_every_grpo_config_field_as_trl(tmp_path: Path) -> None:
    trl_config = GRPOConfig(output_dir=str(tmp_path), **HERE)
    d3s_config = D3SConfig(output_dir=str(tmp_path), method="grpo", **HERE)
    assert len(resolved(trl_config)) > 150  # every field, not a hand-picked list
    assert differences(resolved(trl_config), resolved(d3s_config)) == {}
    assert d3s_config.logging_steps == trl_config.logging_steps == 10  # TRL's, not a record every step
    assert D3SConfig.for_method("grpo", output_dir=str(tmp_path), **HERE).logging_steps == 10


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_selecting_method_changes_only_the_trl_fields_it_needs(method: str, tmp_path: Path) -> None:
    """Each method changes TRL's defaults only where its registry entry says it needs to (trl_settings,
    and GSPO's generation geometry); building it without them is refused with the reason."""
    trl_config = GRPOConfig(output_dir=str(tmp_path), **HERE)
    changed = differences(
        resolved(trl_config), resolved(D3SConfig.for_method(method, output_dir=str(tmp_path), **HERE))
    )
    needed = set(METHODS[method].trl_settings)
    if METHODS[method].minibatches_per_generation > 1:
        needed |= GENERATION_GEOMETRY
    assert set(changed) <= needed, changed
    for name, value in METHODS[method].trl_settings.items():
        assert changed[name][1] == value
    if METHODS[method].trl_settings:  # without the method's settings: refused, naming one
        with pytest.raises(ValueError, match=rf"method {method!r} needs \w+=.*D3SConfig.for_method"):
            D3SConfig(output_dir=str(tmp_path), method=method, **HERE)


@pytest.mark.parametrize("method", ["grpo", "d3s"])
def test_num_generations_eval_of_one_is_accepted(method: str, tmp_path: Path) -> None:
    # TRL documents and handles one completion per prompt in evaluation; selection acts in training only
    config = D3SConfig.for_method(method, output_dir=str(tmp_path), num_generations_eval=1, **HERE)
    assert config.num_generations_eval == 1
    with pytest.raises(ValueError, match="num_generations_eval must be >= 1"):
        D3SConfig.for_method(method, output_dir=str(tmp_path), num_generations_eval=-1, **HERE)


# ---- the trainer on the tiny model -------------------------------------------------------------------------

# One step of 2 prompts x 4 rollouts of up to 8 tokens on the CPU: a few seconds.
ONE_STEP = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    max_steps=1,
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    seed=0,
)
# Keys D3STrainer logs beyond GRPOTrainer's: its selection, schedule and grading metrics
# (docs/fidelity/options.md).
D3S_KEY_PREFIXES = ("selection/", "schedule/", "reward/copied_fraction")


def tiny_model() -> tuple[Any, Any]:
    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=0), tokenizer


def rows(count: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Q: {i}+1=\nA:", "answer": str(i + 1)} for i in range(count)])


def test_trainer_without_args_builds_grpo_trainers_default_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative: "<model name>-GRPO"
    torch.set_num_threads(2)
    kwargs = dict(reward_funcs=[accuracy_reward], train_dataset=rows())

    def build(trainer_cls: type) -> Any:
        model, tokenizer = tiny_model()
        model.config._name_or_path = "someone/tiny-qwen2"
        return trainer_cls(model=model, processing_class=tokenizer, **kwargs)

    if not torch.cuda.is_available():
        # TRL's default config trains in bf16, which TrainingArguments refuses without a GPU: D3STrainer
        # refuses it the same way; then both are built as on a GPU machine
        with pytest.raises(ValueError, match="doesn't support bf16/gpu") as trl_error:
            build(GRPOTrainer)
        with pytest.raises(ValueError, match="doesn't support bf16/gpu") as d3s_error:
            build(D3STrainer)
        assert str(trl_error.value) == str(d3s_error.value)
        monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    trl_trainer, d3s_trainer = build(GRPOTrainer), build(D3STrainer)
    assert type(d3s_trainer.args) is D3SConfig and d3s_trainer.args.method == "grpo"
    assert d3s_trainer.args.output_dir == trl_trainer.args.output_dir == "tiny-qwen2-GRPO"
    assert differences(resolved(trl_trainer.args), resolved(d3s_trainer.args)) == {}


def _log_history(trainer_cls: type, tmp_path: Path, name: str, **settings: Any) -> list[dict[str, Any]]:
    torch.set_num_threads(2)
    model, tokenizer = tiny_model()
    config_cls = D3SConfig if trainer_cls is D3STrainer else GRPOConfig
    trainer = trainer_cls(
        model=model,
        args=config_cls(output_dir=str(tmp_path / name), **ONE_STEP | settings),
        reward_funcs=[accuracy_reward],
        train_dataset=rows(),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer.state.log_history


def test_one_step_logs_what_grpo_trainer_logs(tmp_path: Path) -> None:
    """TRL's default logging_steps (10) on a 1-step run: GRPOTrainer folds its step metrics (reward,
    rewards/<func>/mean, ...) into the last record, the training summary; D3STrainer of method grpo logs
    the same keys there, and with logging_steps 1 the same keys in the step's record."""
    for settings in ({}, {"logging_steps": 1}):
        label = "every step" if settings else "default"
        trl_log = _log_history(GRPOTrainer, tmp_path, f"trl-{label}", **settings)
        d3s_log = _log_history(D3STrainer, tmp_path, f"d3s-{label}", **settings)
        assert len(trl_log) == len(d3s_log), label
        for trl_record, d3s_record in zip(trl_log, d3s_log, strict=True):
            extra = set(d3s_record) - set(trl_record)
            assert set(trl_record) <= set(d3s_record), (label, set(trl_record) - set(d3s_record))
            assert all(key.startswith(D3S_KEY_PREFIXES) for key in extra), (label, extra)
        assert {"reward", "rewards/accuracy_reward/mean", "train_runtime"} <= set(d3s_log[-1]) or settings


def test_evaluation_with_one_generation_under_a_selecting_method(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    model, tokenizer = tiny_model()
    trainer = D3STrainer(
        model=model,
        args=D3SConfig.for_method(
            "d3s",
            output_dir=str(tmp_path),
            num_generations_eval=1,
            per_device_eval_batch_size=2,
            **ONE_STEP,
        ),
        reward_funcs=[accuracy_reward],
        train_dataset=rows(),
        eval_dataset=rows(2),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_rewards/accuracy_reward/mean" in metrics
