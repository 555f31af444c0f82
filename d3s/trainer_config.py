"""D3SConfig: TRL's GRPOConfig plus the selection options, the compute savings and the run's logs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from d3s import trainer_config_checks as checks
from d3s.callbacks.checkpoints import FULL_STATE_CHECKPOINTS
from d3s.grading.policies import ANSWER_POLICIES
from d3s.methods import get_method
from d3s.objective import Objective
from d3s.selection import (
    SAMPLE_RULES,
    SAMPLE_SCOPES,
    SCHEDULES,
    SWITCH_SIGNALS,
    TOKEN_RULES,
    TOKEN_SCOPES,
    ZEROED_ROLLOUTS,
    Schedule,
    ScopeSwitch,
)
from d3s.trainer_config_checks import TRAINER_RANGES

__all__ = ["TRAINER_RANGES", "D3SConfig"]


def _trl_choices(name: str, *choices: Any) -> Any:
    """TRL's field ``name`` (default, help) with the values it accepts as ``choices`` metadata: TRL states
    them only in its help text; HfArgumentParser and trainer_config_checks.check_choices read them here."""
    trl_field = GRPOConfig.__dataclass_fields__[name]
    return field(default=trl_field.default, metadata={**trl_field.metadata, "choices": list(choices)})


def _option(default: Any, help_text: str, choices: Sequence[Any] | None = None) -> Any:
    """A field of D3SConfig; ``choices`` are what HfArgumentParser and check_choices accept."""
    return field(
        default=default, metadata={"help": help_text} | ({"choices": list(choices)} if choices else {})
    )


def _from_method(help_text: str, choices: Sequence[str] | None = None) -> Any:
    """A selection field: unset (None) means the method's value (d3s/methods.py)."""
    return _option(None, f"{help_text} Default: from the method registry (d3s/methods.py).", choices)


@dataclass
class D3SConfig(GRPOConfig):
    """GRPOConfig plus the selection options. Unset selection fields (None) come from ``method``.

    Build with ``D3SConfig.for_method(name, **overrides)`` to also get the TRL settings a method needs
    (GSPO's sequence-level ratio); every field here can still be overridden. docs/fidelity/options.md explains
    the options ("The trainer options D3SConfig adds").
    """

    vllm_mode: str = _trl_choices("vllm_mode", "colocate", "server")
    vllm_model_impl: str = _trl_choices("vllm_model_impl", "vllm", "transformers")
    importance_sampling_level: str = _trl_choices("importance_sampling_level", "token", "sequence")
    multi_objective_aggregation: str = _trl_choices(
        "multi_objective_aggregation", "sum_then_normalize", "normalize_then_sum"
    )
    scale_rewards: str = _trl_choices("scale_rewards", "group", "batch", "none", True, False)
    loss_type: str = _trl_choices(
        "loss_type", "grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"
    )
    vllm_importance_sampling_mode: str = _trl_choices(
        "vllm_importance_sampling_mode", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    )
    include_num_input_tokens_seen: str | bool = _trl_choices(
        "include_num_input_tokens_seen", "no", "all", "non_padding", True, False
    )
    method: str = _option("grpo", "Method name from d3s.methods.METHODS (grpo, pods, d1s, d3s, ...).")
    sample_rule: str | None = _from_method("Rollout selection rule.", SAMPLE_RULES)
    sample_scope: str | None = _from_method(
        "Rollouts kept per prompt (group) or pooled (batch).", SAMPLE_SCOPES
    )
    renormalize: bool | None = _from_method("Re-normalise advantages over the kept rollouts (PODS).")
    keep_per_prompt: int | None = _from_method("Rollouts kept per prompt, N (initial value under linear).")
    keep_per_prompt_final: int | None = _from_method("N at the end of training under a linear schedule.")
    token_rule: str | None = _from_method(
        "Token score: adv_entropy (|A| x H) or entropy (80/20).", TOKEN_RULES
    )
    token_scope: str | None = _from_method("Where the top-K% of tokens is ranked.", TOKEN_SCOPES)
    token_keep_ratio: float | None = _from_method("K in (0, 1], the fraction of tokens kept (initial value).")
    token_keep_ratio_final: float | None = _from_method("K at the end of training under a linear schedule.")
    schedule: str | None = _from_method(
        "How N and K move with step / max_steps (constant, linear, two_phase, cosine).", SCHEDULES
    )
    scope_switch_threshold: float | None = _from_method(
        "Adaptive scope: cross-group until the switch's signal crosses this, then intra-group "
        "(d3s.selection.ScopeSwitch): a mean reward it falls below (early_reward), a ratio to the median "
        "gradient norm it exceeds (grad_norm_spike); 0: off."
    )
    scope_switch_signal: str | None = _from_method(
        "What the adaptive scope's switch reads from the log: early_reward (the first 3 steps' mean reward) "
        "or grad_norm_spike (a step's gradient norm over the median of the earlier ones).",
        SWITCH_SIGNALS,
    )
    minibatches_per_generation: int | None = _from_method("Optimizer steps per generation batch (GSPO: 4).")
    zeroed_rollouts: str | None = _from_method(
        "Rollouts and tokens vLLM's importance-sampling correction zeroed: 'excluded' takes no sample or "
        "token slot and leaves the loss (KL included) and its denominators; 'trl': TRL's zero weight.",
        ZEROED_ROLLOUTS,
    )
    token_norm: str = _option("all", "Loss denominators under token selection.", ["all", "selected"])
    kl_tokens: str = _option("selected", "Tokens of the KL term under token selection.", ["selected", "all"])
    metrics_log: str | None = _option("metrics.jsonl", "Per-step JSON log in output_dir (None: off).")
    anatomy_every: int = _option(0, "Steps between records of what selection did (anatomy.jsonl; 0: off).")
    anatomy_examples: int = _option(4, "Completions per anatomy record whose tokens are written.")
    defer_logprob_passes: bool = _option(False, "Compute saving: log-prob passes on the kept rollouts only.")
    kept_token_logprobs: bool = _option(False, "Compute saving: LM head gradient at the kept tokens only.")
    length_bucket_rows: int = _option(
        0,
        "Compute saving: log-prob passes over rows sorted by length in buckets of this many rows, each cut "
        "at its longest row (d3s/length_buckets.py; equal up to float rounding). 0: TRL's passes exactly.",
    )
    pack_micro_batches: bool | None = _option(
        None,
        "Train the kept rows of an optimizer step in ceil(rows / per_device_train_batch_size) micro-batches, "
        "not gradient_accumulation_steps smaller ones (exact, d3s/packing.py). None: on, except where the "
        "token level ranks each micro-batch (token_scope micro_batch); false: TRL's micro-batches.",
    )
    answer_policy: str = _option("math_verify", "Which boxed answer the reward grades.", ANSWER_POLICIES)
    reward_copied_answers: bool = _option(
        True,
        "False: an answer copied unevaluated from the prompt (\\boxed{12+7-3} for 16) gets reward 0 "
        "(d3s.grading.copied.copied_from_prompt); True: math-verify's verdict.",
    )
    full_state_checkpoints: str = _option(
        "all", "Checkpoints keeping the training state: all, or the newest.", FULL_STATE_CHECKPOINTS
    )
    vllm_dtype: str = _option(
        "auto",
        "dtype of the colocated vLLM engine (TRL sets none; vLLM's auto runs a float32 model in bfloat16).",
        ["auto", "float32", "bfloat16", "float16"],
    )

    @classmethod
    def for_method(cls, method: str, **overrides: Any) -> D3SConfig:
        """A config for ``method`` with the method's TRL settings applied under ``overrides``."""
        return cls(method=method, **{**get_method(method).trl_settings, **overrides})

    def __post_init__(self) -> None:
        method = get_method(self.method)
        for name, value in method.trl_settings.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"method {self.method!r} needs {name}={value!r} (got {getattr(self, name)!r}): drop the "
                    f"{name} override, or build the config with D3SConfig.for_method({self.method!r}, ...), "
                    "which sets it"
                )
        self._resolve_from_method(method)
        checks.set_mini_batch_generation(self)
        checks.check_ranges(self)  # the values given and the method's, before TRL's own __post_init__
        super().__post_init__()
        checks.check_config(self, D3SConfig.__annotations__)  # d3s/trainer_config_checks.py

    def _resolve_from_method(self, method) -> None:
        keep_init, keep_final = method.keep_per_prompt(self.num_generations)
        same_names = ("sample_rule", "sample_scope", "renormalize", "token_rule", "token_scope", "schedule")
        same_names += ("minibatches_per_generation", "zeroed_rollouts", "scope_switch_threshold")
        same_names += ("scope_switch_signal",)
        defaults = {name: getattr(method, name) for name in same_names} | {
            "keep_per_prompt": keep_init,
            "keep_per_prompt_final": keep_final,
            "token_keep_ratio": method.token_keep_ratio_init,
            "token_keep_ratio_final": method.token_keep_ratio_final,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.schedule == "constant":  # a constant schedule has one value; keep the pair consistent
            self.keep_per_prompt_final = self.keep_per_prompt
            self.token_keep_ratio_final = self.token_keep_ratio
        if self.sample_rule == "none":
            self.keep_per_prompt = self.keep_per_prompt_final = self.num_generations

    def excludes_zeroed(self) -> bool:
        """Whether what vLLM's correction zeroed leaves selection and the loss (``zeroed_rollouts``, with the
        correction on). The one definition, read before and during training: TRL's GRPOTrainer copies
        ``use_vllm`` and ``vllm_importance_sampling_correction`` from the config at its init, unchanged."""
        return (
            self.zeroed_rollouts == "excluded" and self.use_vllm and self.vllm_importance_sampling_correction
        )

    def objective(self) -> Objective:
        """The selection loss's settings (d3s/objective.py)."""
        sequence_level = self.importance_sampling_level == "sequence"
        return Objective(
            loss_type=self.loss_type,
            sequence_level=sequence_level,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
            delta=self.delta,
            beta=self.beta,
            kl_on_kept_tokens=self.kl_tokens == "selected",
            kl_bias_correction=self.use_bias_correction_kl,
            kept_tokens_normalise=self.token_rule != "none"
            and (sequence_level or self.token_norm == "selected"),
            max_completion_length=self.max_completion_length,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            off_policy_threshold=self.off_policy_mask_threshold,
        )

    def uses_selection_loss(self) -> bool:
        """Whether the trainer computes the loss itself (d3s/objective.py): every method that selects rollouts
        or tokens, or takes what vLLM's correction zeroed out of the loss. Otherwise (grpo, and gspo without
        vLLM's correction) it is TRL's own loss, unchanged."""
        return self.sample_rule != "none" or self.token_rule != "none" or self.excludes_zeroed()

    def scope_switch(self) -> ScopeSwitch | None:
        """The adaptive scope's switch; None when the scope is fixed."""
        if not self.scope_switch_threshold:
            return None
        return ScopeSwitch(float(self.scope_switch_threshold), signal=self.scope_switch_signal)

    @property
    def selection_schedule(self) -> Schedule:
        """N and K as functions of training progress: the trainer builds it once and reads the N and K it
        selects with and the ones it logs from it. K is 1 throughout when the method has no token level
        (``token_rule`` none), whatever ``token_keep_ratio`` says: that is the K it trains with."""
        token_level = self.token_rule != "none"
        return Schedule(
            kind=self.schedule,
            keep_per_prompt_init=self.keep_per_prompt,
            keep_per_prompt_final=self.keep_per_prompt_final,
            token_keep_ratio_init=self.token_keep_ratio if token_level else 1.0,
            token_keep_ratio_final=self.token_keep_ratio_final if token_level else 1.0,
        )
