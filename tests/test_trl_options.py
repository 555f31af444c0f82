"""TRL's contract, option by option (issue 57): every GRPOConfig field is classified here; with
``method="grpo"`` each option exercisable on the CPU trains exactly as GRPOTrainer trains it (loss, gradient,
parameters, logged keys and values); every selecting method honours each of those options or refuses it in one
line naming it when its config is built (docs/fidelity/objectives.md, "What composes").

A new TRL field fails ``test_every_grpo_config_field_is_classified`` with its name: classify it below, and if
it changes what a step computes, add it to a run of RUNS and to CASES.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_trainer
from test_trl_defaults import D3S_KEY_PREFIXES
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from d3s.methods import METHODS
from d3s.rewards import accuracy_reward
from d3s.trainer import D3SConfig, D3STrainer

# ---- what is not exercised here, by group, with the reason ------------------------------------------------

NOT_EXERCISED: dict[str, tuple[str, frozenset[str]]] = {
    "logs and reports": (
        "what the run prints, logs and reports, and where: not the loss or the gradient (the runs below log "
        "every step, to compare the logs)",
        frozenset(
            {
                "logging_strategy",
                "logging_steps",
                "logging_first_step",
                "log_on_each_node",
                "logging_nan_inf_filter",
                "log_level",
                "log_level_replica",
                "disable_tqdm",
                "report_to",
                "run_name",
                "project",
                "trackio_space_id",
                "trackio_bucket_id",
                "trackio_static_space_id",
                "skip_memory_metrics",
                "debug",
                "log_completions",
                "log_multimodal",
                "num_completions_to_print",
                "log_unique_prompts",
                "log_completions_hub_repo",
            }
        ),
    ),
    "checkpoints, resumption and the Hub": (
        "what is saved, where and when, what is pushed, and how a run resumes: not what a step computes "
        "(resumption: tests/test_resume.py)",
        frozenset(
            {
                "output_dir",
                "save_only_model",
                "save_strategy",
                "save_steps",
                "save_on_each_node",
                "save_total_limit",
                "enable_jit_checkpoint",
                "push_to_hub",
                "hub_token",
                "hub_private_repo",
                "hub_model_id",
                "hub_strategy",
                "hub_always_push",
                "hub_revision",
                "resume_from_checkpoint",
                "ignore_data_skip",
                "restore_callback_states_from_checkpoint",
                "load_best_model_at_end",
                "metric_for_best_model",
                "greater_is_better",
            }
        ),
    ),
    "evaluation": (
        "read by evaluation only, which no training step runs (evaluation under a selecting method: "
        "tests/test_trl_defaults.py)",
        frozenset(
            {
                "eval_strategy",
                "eval_steps",
                "eval_delay",
                "per_device_eval_batch_size",
                "prediction_loss_only",
                "eval_on_start",
                "eval_do_concat_batches",
                "eval_use_gather_object",
                "eval_accumulation_steps",
                "include_for_metrics",
                "batch_eval_metrics",
                "bf16_full_eval",
                "fp16_full_eval",
                "num_generations_eval",
            }
        ),
    ),
    "data loading": (
        "how the batches are loaded, not what they hold: GRPOTrainer's RepeatSampler sets which prompts a "
        "step gets, and it reads the dataset's columns itself",
        frozenset(
            {
                "dataloader_drop_last",
                "dataloader_num_workers",
                "dataloader_pin_memory",
                "dataloader_persistent_workers",
                "dataloader_prefetch_factor",
                "dataloader_multiprocessing_context",
                "dataloader_in_order",
                "remove_unused_columns",
                "label_names",
            }
        ),
    ),
    "not read by GRPOTrainer's training": (
        "transformers.Trainer's, replaced in GRPOTrainer: its own loss (no label smoothing), its "
        "RepeatSampler seeded by seed (not data_seed, the sampling strategy or a length column); do_train, "
        "do_eval and do_predict are for scripts; num_train_epochs gives way to max_steps, which every run "
        "sets",
        frozenset(
            {
                "label_smoothing_factor",
                "train_sampling_strategy",
                "length_column_name",
                "data_seed",
                "do_train",
                "do_eval",
                "do_predict",
                "num_train_epochs",
            }
        ),
    ),
    "the model's loading": (
        "used when the trainer loads the model from its name; these tests hand it a loaded model",
        frozenset({"model_init_kwargs", "trust_remote_code"}),
    ),
    "process-wide switches and memory housekeeping": (
        "full_determinism sets torch's deterministic algorithms for the whole process, which outlives a test "
        "(the CPU kernels here are deterministic already); the others free or measure accelerator memory",
        frozenset({"full_determinism", "torch_empty_cache_steps"}),
    ),
    "the device": (
        "every run here is on the CPU (use_cpu true): which device trains is the GPU runs' question",
        frozenset({"use_cpu"}),
    ),
    "needs hardware: vLLM": (
        "vLLM generation: an engine (a GPU, or vLLM's CPU backend in tests/test_vllm_colocate.py) or a "
        "server; the importance-sampling correction acts only with use_vllm "
        "(docs/fidelity/importance-sampling.md)",
        frozenset(
            {
                "use_vllm",
                "vllm_mode",
                "vllm_model_impl",
                "vllm_enable_sleep_mode",
                "vllm_structured_outputs_regex",
                "vllm_server_base_url",
                "vllm_server_host",
                "vllm_server_port",
                "vllm_server_timeout",
                "vllm_group_port",
                "vllm_gpu_memory_utilization",
                "vllm_max_model_length",
                "vllm_tensor_parallel_size",
                "vllm_importance_sampling_correction",
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max",
                "vllm_importance_sampling_clip_min",
                "vllm_importance_sampling_cap",
            }
        ),
    ),
    "needs hardware: several processes or a sharding backend": (
        "DDP, DeepSpeed, FSDP and the accelerator's process options need several processes or GPUs "
        "(tests/test_multiprocess.py runs two CPU processes; DeepSpeed and FSDP: the GPU runs)",
        frozenset(
            {
                "average_tokens_across_devices",
                "accelerator_config",
                "parallelism_config",
                "ddp_find_unused_parameters",
                "ddp_bucket_cap_mb",
                "ddp_broadcast_buffers",
                "ddp_static_graph",
                "ddp_backend",
                "ddp_timeout",
                "fsdp",
                "fsdp_config",
                "deepspeed",
                "ds3_gather_for_generation",
                "local_rank",
            }
        ),
    ),
    "needs hardware: precision, compilers and kernels": (
        "fp16 needs CUDA's grad scaler, tf32 an Ampere GPU, bf16 is TRL's GPU default; torch.compile needs a "
        "compiler toolchain and minutes of compilation; Liger's kernels are Triton's (GPU); "
        "auto_find_batch_size retries after an accelerator out-of-memory error",
        frozenset(
            {
                "bf16",
                "fp16",
                "tf32",
                "torch_compile",
                "torch_compile_backend",
                "torch_compile_mode",
                "use_liger_kernel",
                "liger_kernel_config",
                "auto_find_batch_size",
            }
        ),
    ),
    "needs hardware: transformers' continuous batching": (
        "transformers' continuous-batching generation (a paged KV cache sized as a share of accelerator "
        "memory): a GPU serving path; use_transformers_paged is its deprecated name",
        frozenset(
            {
                "use_transformers_continuous_batching",
                "transformers_continuous_batching_config",
                "use_transformers_paged",
            }
        ),
    ),
    "needs optional packages": (
        "arguments of the optimizers from optional packages (GaLore, APOLLO, torchao, ...): the AdamW and "
        "SGD runs below read neither",
        frozenset({"optim_args", "optim_target_modules"}),
    ),
    "needs another model or data": (
        "router_aux_loss_coef needs a mixture-of-experts model (TRL refuses it on a dense one; the tiny "
        "Qwen3-MoE of tests/test_loss_composition.py trains with it); chat_template_kwargs needs "
        "conversational prompts and a chat template, max_tool_calling_iterations tools",
        frozenset({"router_aux_loss_coef", "chat_template_kwargs", "max_tool_calling_iterations"}),
    ),
}

# ---- what is exercised: one optimizer step or two of GRPOTrainer and of D3STrainer(method="grpo") ----------

# Every run: 2 prompts x 4 rollouts of up to 12 tokens a generation batch, on the CPU, a record every step.
BASE_RUN: dict[str, Any] = dict(
    use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1
)
# The loss and generation options every run sets (to values other than TRL's defaults, but for the batch).
BASE_OPTIONS: dict[str, Any] = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=12,
    learning_rate=5e-3,
    seed=0,
    max_steps=1,
    gradient_checkpointing=False,
)
# Two optimizer steps on one generation batch: the second is off-policy, so the ratios, clips, masks and the
# old-policy log-probs act.
OFF_POLICY = dict(steps_per_generation=2, max_steps=2)
# Each run: one loss type and the options stacked on it (a run costs 10-20 s on two cores). Each option is set
# to a value that changes what its run computes.
RUNS: dict[str, dict[str, Any]] = {
    "dapo-geometry-optimizer": dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        optim="sgd",
        max_grad_norm=0.05,
        weight_decay=0.1,
        use_cache=True,
        include_num_input_tokens_seen="all",
    ),
    "grpo-clip-kl": dict(
        loss_type="grpo",
        epsilon=0.1,
        epsilon_high=0.15,
        delta=1.05,
        beta=0.04,
        use_bias_correction_kl=False,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        **OFF_POLICY,
    ),
    "dr_grpo-sampling-iterations": dict(
        loss_type="dr_grpo",
        scale_rewards="none",
        num_iterations=2,
        max_steps=2,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.3,
    ),
    "bnpo-rewards-entropy_mask": dict(
        loss_type="bnpo",
        scale_rewards="batch",
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 0.5],
        top_entropy_quantile=0.5,
        **OFF_POLICY,
    ),
    "cispo-off_policy_mask-entropy_bonus": dict(
        loss_type="cispo",
        epsilon_high=5.0,
        off_policy_mask_threshold=0.0,
        entropy_coef=0.05,
        generation_batch_size=16,
        max_steps=2,
        adam_beta1=0.8,
        adam_beta2=0.99,
        adam_epsilon=1e-6,
    ),
    "sapo-adaptive_entropy-schedule": dict(
        loss_type="sapo",
        sapo_temperature_pos=0.5,
        sapo_temperature_neg=2.0,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_min=0.001,
        entropy_coef_max=0.5,
        entropy_coef_delta=0.01,
        entropy_target=5.0,
        shuffle_dataset=False,
        # the warm-up's first step has learning rate 0: three steps, the last one off-policy
        warmup_steps=1,
        lr_scheduler_type="polynomial",
        lr_scheduler_kwargs={"power": 2.0},
        steps_per_generation=3,
        max_steps=3,
    ),
    "luspo-sequence-ref_sync": dict(
        loss_type="luspo",
        importance_sampling_level="sequence",
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
        max_steps=2,  # one generation a step: the second step's KL is to the synced reference
        disable_dropout=True,
        cast_lm_head_to_fp32=True,
        pad_to_multiple_of=16,
        neftune_noise_alpha=5.0,
        # the second generation, after a step: some completions reach 13 tokens, others end before
        mask_truncated_completions=True,
        max_completion_length=13,
    ),
    "vespo-generation_kwargs": dict(
        loss_type="vespo",
        vespo_k_pos=1.5,
        vespo_lambda_pos=2.0,
        vespo_k_neg=2.5,
        vespo_lambda_neg=1.5,
        generation_kwargs={"min_new_tokens": 3},
        cache_implementation="static",
        **OFF_POLICY,
    ),
}
EXERCISED = frozenset(BASE_OPTIONS).union(*RUNS.values())
# Logged keys whose values are wall-clock times (TRL's step_time, transformers' summary)
TIMING_KEYS = {
    "step_time",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_tokens_per_second",
}


def grpo_config_defaults() -> dict[str, Any]:
    return {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(GRPOConfig)
    }


def test_every_grpo_config_field_is_classified() -> None:
    """Every public GRPOConfig field (TrainingArguments' included) is exercised below or in exactly one group
    with its reason: a field TRL adds fails here, named."""
    groups = {name: fields for name, (_, fields) in NOT_EXERCISED.items()} | {"exercised": EXERCISED}
    fields = {f.name for f in dataclasses.fields(GRPOConfig) if not f.name.startswith("_")}
    classified = [name for group in groups.values() for name in group]
    unclassified = fields - set(classified)
    assert not unclassified, f"GRPOConfig fields in no group (classify them here): {sorted(unclassified)}"
    assert not set(classified) - fields, f"not GRPOConfig fields: {sorted(set(classified) - fields)}"
    twice = {
        name: [g for g, f in groups.items() if name in f] for name in classified if classified.count(name) > 1
    }
    assert not twice, f"fields in more than one group: {twice}"
    assert all(reason for reason, _ in NOT_EXERCISED.values())


@pytest.mark.parametrize("run", sorted(RUNS))
def test_each_option_of_a_run_changes_its_setting(run: str) -> None:
    """Each option a run sets differs from what that run would use without it (TRL's default, or BASE's):
    an option listed at its default would be exercised by nothing."""
    defaults = grpo_config_defaults() | BASE_OPTIONS
    same = {name: value for name, value in RUNS[run].items() if defaults[name] == value}
    assert not same, same


# ---- the comparison --------------------------------------------------------------------------------------


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A second reward with a spread in every group (even where accuracy is all 0 or all 1)."""
    return [min(len(completion), 24) / 24 for completion in completions]


class Recorder(TrainerCallback):
    """Each optimizer step's gradient (clipped, before the optimizer's step) and parameters after it."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def train(trainer_cls: type, model_path: Path, output_dir: Path, settings: dict[str, Any]) -> Any:
    config = (GRPOConfig if trainer_cls is GRPOTrainer else D3SConfig)(output_dir=str(output_dir), **settings)
    trainer = make_trainer(model_path, config, [accuracy_reward, length_reward], trainer_cls=trainer_cls)
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    return trainer, recorder


def assert_same_tensors(ours: list[dict], trl: list[dict], what: str) -> None:
    assert len(ours) == len(trl), what
    for step, (mine, theirs) in enumerate(zip(ours, trl, strict=True), start=1):
        assert mine.keys() == theirs.keys(), (what, step)
        differ = {
            name: (mine[name] - theirs[name]).abs().max().item()
            for name in theirs
            if not torch.equal(mine[name], theirs[name])
        }
        assert not differ, f"{what} of step {step} differs (largest difference by parameter): {differ}"


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(RUNS))
def test_method_grpo_trains_as_grpo_trainer(tmp_path: Path, tiny_sft_model: Path, run: str) -> None:
    """The same seed, model and prompts: D3STrainer(method="grpo") takes GRPOTrainer's steps exactly, the
    same loss, gradient and parameters at every step, and logs GRPOTrainer's keys with the same values (plus
    its own selection/, schedule/ keys)."""
    settings = BASE_RUN | BASE_OPTIONS | RUNS[run]
    trl, trl_record = train(GRPOTrainer, tiny_sft_model, tmp_path / "trl", settings)
    ours, record = train(D3STrainer, tiny_sft_model, tmp_path / "d3s", settings)
    assert type(ours.args) is D3SConfig and ours.args.method == "grpo" and not ours.owns_loss
    assert len(trl_record.grads) == settings["max_steps"]
    assert any(g.any() for g in trl_record.grads[-1].values()), "a zero gradient compares nothing"
    assert_same_tensors(record.grads, trl_record.grads, "the gradient")
    assert_same_tensors(record.params, trl_record.params, "the parameters")
    trl_log, log = trl.state.log_history, ours.state.log_history
    assert len(log) == len(trl_log)
    for step, (mine, theirs) in enumerate(zip(log, trl_log, strict=True), start=1):
        missing, extra = set(theirs) - set(mine), set(mine) - set(theirs)
        assert not missing, (step, missing)
        assert all(key.startswith(D3S_KEY_PREFIXES) for key in extra), (step, extra)
        differ = {
            key: (mine[key], theirs[key]) for key in set(theirs) - TIMING_KEYS if mine[key] != theirs[key]
        }
        assert not differ, f"logged values of record {step} differ (ours, TRL's): {differ}"
    assert "loss" in trl_log[0]
    if settings.get("mask_truncated_completions"):  # it masked some completions, not all
        assert any(0 < record.get("completions/clipped_ratio", 0) < 1 for record in trl_log)


# ---- the selecting methods: each option honoured, or refused in one line naming it -------------------------

SELECTING = sorted(name for name in METHODS if name not in ("grpo", "gspo"))
# methods with a token level, which ranks tokens of each rollout (check_token_loss)
TOKEN_LEVEL = {"d2s", "d3s", "d3s_i", "d3s_adaptive", "entropy_8020", "gspo_d3s"}
PODS = {"pods", "pods_random", "pods_max_reward"}  # re-normalise the kept rollouts' advantages
GSPO = {"gspo_d3s"}  # GSPO's TRL settings are the method's (d3s.methods.GSPO_TRL): not overridable
GENERATION_GEOMETRY = ("steps_per_generation", "generation_batch_size")  # set by GSPO's 4 mini-batches
NEEDS: dict[str, dict[str, Any]] = {  # what an option needs to act at all
    **dict.fromkeys(["sapo_temperature_pos", "sapo_temperature_neg"], {"loss_type": "sapo"}),
    **dict.fromkeys(
        ["vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"], {"loss_type": "vespo"}
    ),
    **dict.fromkeys(
        ["entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"],
        {"use_adaptive_entropy": True, "entropy_coef": 0.01},
    ),
    **dict.fromkeys(
        ["ref_model_sync_steps", "ref_model_mixup_alpha"], {"sync_ref_model": True, "beta": 0.04}
    ),
    **dict.fromkeys(["sync_ref_model", "use_bias_correction_kl"], {"beta": 0.04}),
    "gradient_checkpointing_kwargs": {"gradient_checkpointing": True},
    "lr_scheduler_kwargs": {"lr_scheduler_type": "polynomial"},
}


def option_cases() -> dict[str, dict[str, Any]]:
    """One case per exercised option and value (each loss type its own), with what it needs to act."""
    values: dict[str, dict[str, Any]] = {}
    for settings in [BASE_OPTIONS, *RUNS.values()]:
        for name, value in settings.items():
            values.setdefault(name, {})[repr(value)] = value
    cases = {}
    for name, by_repr in values.items():
        for text, value in by_repr.items():
            label = name if len(by_repr) == 1 else f"{name}={text}"
            cases[label] = NEEDS.get(name, {}) | {name: value}
    return cases


CASES = option_cases()
REFUSED_FOR_ALL = {  # docs/fidelity/objectives.md, "What composes": refused with every selecting method
    "loss_type='vespo'": "loss_type",
    **dict.fromkeys(["vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"], "loss_type"),
    "top_entropy_quantile": "top_entropy_quantile",
}


def expected_refusal(method: str, case: str) -> str | None:
    """The option a method's config must name in refusing ``case``; None: honoured."""
    settings = CASES[case]
    if case in REFUSED_FOR_ALL:
        return REFUSED_FOR_ALL[case]
    if method in GSPO:  # GSPO's settings, and its 4 mini-batches per generation batch
        fixed = METHODS[method].trl_settings
        for name, value in settings.items():
            if (name in fixed and value != fixed[name]) or name in GENERATION_GEOMETRY:
                return name
    if method in TOKEN_LEVEL - GSPO and settings.get("importance_sampling_level") == "sequence":
        return "importance_sampling_level"  # with loss_type dapo: the ratio summed over the kept tokens
    if method in PODS and settings.get("multi_objective_aggregation") == "normalize_then_sum":
        return "multi_objective_aggregation"  # PODS re-normalises the summed reward
    if method in PODS and settings.get("scale_rewards") == "batch":
        return "scale_rewards"  # PODS scales by each group's kept rollouts
    return None


def build(method: str, tmp_path: Path, settings: dict[str, Any]) -> D3SConfig:
    return D3SConfig.for_method(method, output_dir=str(tmp_path), **BASE_RUN | BASE_OPTIONS | settings)


def test_trl_accepts_every_case(tmp_path: Path) -> None:
    """Each case is a valid GRPOConfig and D3SConfig of method grpo, which keeps every value."""
    for case, settings in CASES.items():
        GRPOConfig(output_dir=str(tmp_path), **BASE_RUN | BASE_OPTIONS | settings)
        config = build("grpo", tmp_path, settings)
        assert {name: getattr(config, name) for name in settings} == settings, case


def test_the_selecting_methods_are_all_but_grpo_and_gspo(tmp_path: Path) -> None:
    uses = {name for name in METHODS if build(name, tmp_path, {}).uses_selection_loss()}
    assert uses == set(SELECTING)
    assert {name for name in METHODS if METHODS[name].token_rule != "none"} == TOKEN_LEVEL
    assert {name for name in METHODS if METHODS[name].renormalize} == PODS
    assert {name for name in SELECTING if METHODS[name].trl_settings.get("loss_type")} == GSPO


@pytest.mark.parametrize("method", SELECTING)
def test_a_selecting_method_honours_each_option_or_refuses_it_naming_it(tmp_path: Path, method: str) -> None:
    wrong = {}
    for case, settings in CASES.items():
        named = expected_refusal(method, case)
        try:
            config = build(method, tmp_path, settings)
        except ValueError as error:
            message = str(error)
            if named is None or "\n" in message or named not in message:
                wrong[case] = f"refused (expected {named or 'honoured'}): {message}"
            continue
        if named is not None:
            wrong[case] = f"honoured, expected refused naming {named}"
        elif (kept := {name: getattr(config, name) for name in settings}) != settings:
            wrong[case] = f"built with {kept}, not {settings}"
    assert not wrong, wrong
