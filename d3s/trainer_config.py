"""D3SConfig: TRL's GRPOConfig plus the selection options, the compute savings and the run's logs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from d3s.callbacks.checkpoints import FULL_STATE_CHECKPOINTS
from d3s.grading.policies import ANSWER_POLICIES
from d3s.methods import get_method
from d3s.objective import CLIPPED_LOSSES, Objective
from d3s.selection import (
    SAMPLE_RULES,
    SAMPLE_SCOPES,
    SCHEDULES,
    TOKEN_RULES,
    TOKEN_SCOPES,
    ZEROED_ROLLOUTS,
    Schedule,
    ScopeSwitch,
)

# Value ranges of the trainer options that matter here; None always passes (the field's "unset"). Checked
# once, in D3SConfig.__post_init__, before TRL's own __post_init__, which divides by some of these. The
# workflow's schema (config/schema.yaml, $defs.trainer) bounds the ones it reads with the same ranges:
# tests/test_workflow.py::test_trainer_ranges_agree_with_the_schema fails when the two disagree.
TRAINER_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(
        ("learning_rate", "num_train_epochs", "repetition_penalty", "adam_epsilon", "logging_steps")
        + ("save_steps", "eval_steps"),
        (lambda v: v > 0, "> 0"),
    ),
    **dict.fromkeys(
        ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
        + ("steps_per_generation", "generation_batch_size", "num_iterations", "max_completion_length")
        + ("save_total_limit", "keep_per_prompt", "keep_per_prompt_final", "vllm_max_model_length"),
        (lambda v: v >= 1, ">= 1"),
    ),
    **dict.fromkeys(
        ("top_k", "beta", "epsilon", "epsilon_high", "weight_decay", "max_grad_norm", "warmup_steps")
        + ("dataloader_num_workers", "anatomy_every", "anatomy_examples"),
        (lambda v: v >= 0, ">= 0"),
    ),
    **dict.fromkeys(
        ["seed", "data_seed"], (lambda v: 0 <= v < 2**32, "in [0, 2**32 - 1] (numpy's seed range)")
    ),
    **dict.fromkeys(["adam_beta1", "adam_beta2"], (lambda v: 0 <= v < 1, "in [0, 1)")),
    **dict.fromkeys(
        ["top_p", "token_keep_ratio", "token_keep_ratio_final", "vllm_gpu_memory_utilization"],
        (lambda v: 0 < v <= 1, "in (0, 1]"),
    ),
    "scope_switch_threshold": (lambda v: v == 0 or v > 1, "0 (off) or > 1"),
    "num_generations": (lambda v: v >= 2, ">= 2 (GRPO needs two rollouts per prompt for an advantage)"),
    # TRL samples num_generations_eval completions per prompt in evaluation, 1 included (no selection there)
    "num_generations_eval": (lambda v: v >= 1, ">= 1"),
    "max_steps": (lambda v: v >= 1 or v == -1, ">= 1, or -1 to train for num_train_epochs"),
    "temperature": (lambda v: v > 0, "> 0 (rollouts must be sampled)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def _trl_choices(name: str, *choices: Any) -> Any:
    """TRL's field ``name`` (default, help) with the values it accepts as ``choices`` metadata: TRL states
    them only in its help text; HfArgumentParser and D3SConfig._validate read them from here."""
    trl_field = GRPOConfig.__dataclass_fields__[name]
    return field(default=trl_field.default, metadata={**trl_field.metadata, "choices": list(choices)})


def _option(default: Any, help_text: str, choices: Sequence[Any] | None = None) -> Any:
    """A field of D3SConfig; ``choices`` are what HfArgumentParser and D3SConfig._validate accept."""
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
        "Adaptive scope: cross-group until the gradient norm's spike ratio exceeds this, then intra-group "
        "(d3s.selection.ScopeSwitch); 0: off."
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
        self._mini_batch_generation()
        # the trainer's one range check (the values given and the method's), before TRL's own __post_init__,
        # which divides by some of them
        for name in (f.name for f in fields(self) if f.name in TRAINER_RANGES):
            accepts, description = TRAINER_RANGES[name]
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not accepts(value):
                raise ValueError(f"trainer.{name} must be {description}; got {value!r}")
        super().__post_init__()
        self._validate()

    def _mini_batch_generation(self) -> None:
        """steps_per_generation = mini-batches x gradient accumulation (before TRL derives its geometry)."""
        minibatches = self.minibatches_per_generation
        if not isinstance(minibatches, int) or minibatches < 1:
            raise ValueError(f"minibatches_per_generation must be an integer >= 1; got {minibatches!r}")
        if minibatches == 1:
            return
        wanted = minibatches * self.gradient_accumulation_steps
        if self.generation_batch_size is not None or self.steps_per_generation not in (None, wanted):
            raise ValueError(
                f"method {self.method!r} updates {minibatches} times per generation batch, so "
                f"steps_per_generation must be {minibatches} x gradient_accumulation_steps = {wanted} (got "
                f"steps_per_generation={self.steps_per_generation}, generation_batch_size="
                f"{self.generation_batch_size}): unset both, or set minibatches_per_generation: 1"
            )
        self.steps_per_generation = wanted

    def _resolve_from_method(self, method) -> None:
        keep_init, keep_final = method.keep_per_prompt(self.num_generations)
        same_names = ("sample_rule", "sample_scope", "renormalize", "token_rule", "token_scope", "schedule")
        same_names += ("minibatches_per_generation", "zeroed_rollouts", "scope_switch_threshold")
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

    def _validate(self) -> None:
        for f in fields(D3SConfig):  # the choices of the fields declared here (TRL's with _trl_choices)
            choices = f.metadata.get("choices") if f.name in D3SConfig.__annotations__ else None
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{f.name} must be one of {', '.join(map(str, choices))}; got {getattr(self, f.name)!r}"
                )
        G = self.num_generations  # noqa: N806 - the paper's symbol
        for name in ("keep_per_prompt", "keep_per_prompt_final"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= G:
                raise ValueError(
                    f"{name} must be an integer between 1 and num_generations = {G} at every point of the "
                    f"schedule; got {value!r}. Lower it or raise num_generations."
                )
        if (
            isinstance(self.length_bucket_rows, bool)
            or not isinstance(self.length_bucket_rows, int)
            or (self.length_bucket_rows < 0)
        ):
            raise ValueError(
                f"length_bucket_rows must be an integer >= 0 (0: off); got {self.length_bucket_rows!r}"
            )
        self._resolve_packing()
        switches = (
            "defer_logprob_passes",
            "kept_token_logprobs",
            "reward_copied_answers",
            "pack_micro_batches",
        )
        for name in switches:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if self.full_state_checkpoints == "latest" and self.save_only_model:
            raise ValueError(
                "full_state_checkpoints: latest keeps the training state in the newest checkpoint, but "
                "save_only_model: true saves none (such a run cannot resume): set save_only_model: false"
            )
        if self.renormalize and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "renormalize=True re-normalises the summed reward per group; it needs "
                "multi_objective_aggregation='sum_then_normalize'"
            )
        self._validate_token_loss()
        self._validate_selection_loss()
        self._validate_scope_switch()
        # TRL splits the kept rows into steps_per_generation micro-batches and silently drops a remainder,
        # and every rank must hold the same number of rows: N x (per-device batch) / G must be whole.
        micro = self.per_device_train_batch_size
        for keep in self.selection_schedule.reachable_keep_values():
            if (keep * micro) % G:
                raise ValueError(
                    f"keep_per_prompt = {keep} (reached by the schedule) gives {keep} x {micro} / {G} kept "
                    "rows per micro-batch, not a whole number: TRL would drop rows. Make "
                    f"per_device_train_batch_size ({micro}) a multiple of num_generations ({G}), or choose "
                    f"keep values N with N x {micro} divisible by {G}."
                )

    def _resolve_packing(self) -> None:
        """Packing is exact unless the token level ranks inside each micro-batch, which packing changes."""
        ranks_per_micro_batch = self.token_rule != "none" and self.token_scope == "micro_batch"
        if self.pack_micro_batches is None:
            self.pack_micro_batches = not ranks_per_micro_batch
        elif self.pack_micro_batches is True and ranks_per_micro_batch:
            raise ValueError(
                "pack_micro_batches: true changes which tokens token_scope micro_batch ranks together (it "
                "ranks each micro-batch): set pack_micro_batches: false, or token_scope: batch"
            )

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
        )

    def uses_selection_loss(self) -> bool:
        """Whether the trainer computes the loss itself (d3s/objective.py): every method that selects rollouts
        or tokens, or takes what vLLM's correction zeroed out of the loss. Otherwise (grpo, and gspo without
        vLLM's correction) it is TRL's own loss, unchanged."""
        return self.sample_rule != "none" or self.token_rule != "none" or self.excludes_zeroed()

    def _validate_selection_loss(self) -> None:
        """What TRL's loss offers beyond the selection loss's clipped-ratio family, refused up front."""
        if not self.uses_selection_loss():
            return
        unsupported = {
            "loss_type": (self.loss_type not in CLIPPED_LOSSES, f"one of {', '.join(CLIPPED_LOSSES)}"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold is not None, "unset"),
            "entropy_coef": (self.entropy_coef != 0.0, "0"),
            "use_adaptive_entropy": (self.use_adaptive_entropy, "false"),
            "use_liger_kernel": (self.use_liger_kernel, "false"),
            # TRL's entropy mask acts inside TRL's loss only, which the selection loss replaces
            "top_entropy_quantile": (
                self.top_entropy_quantile < 1.0,
                "1.0 (TRL's entropy mask, inside TRL's loss: select tokens with token_rule entropy and "
                "token_keep_ratio instead, as method entropy_8020 does)",
            ),
        }
        for name, (refused, wanted) in unsupported.items():
            if refused:
                raise ValueError(
                    f"method {self.method!r} trains with the selection loss (d3s/objective.py, "
                    f"docs/fidelity/objectives.md), which needs {name} {wanted}; "
                    f"got {getattr(self, name)!r}. Change {name}, or train method grpo (TRL's own loss)"
                )

    def _validate_scope_switch(self) -> None:
        """The adaptive scope: cross-group selection switched to intra-group by every step's gradient norm."""
        threshold = self.scope_switch_threshold
        if not threshold:
            return
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 1:
            raise ValueError(
                f"scope_switch_threshold must be 0 (off) or a ratio > 1 to the median gradient norm; got "
                f"{threshold!r}"
            )
        if self.sample_rule == "none" or self.sample_scope != "batch":
            raise ValueError(
                "scope_switch_threshold switches cross-group selection to intra-group: it needs a "
                f"sample_rule and sample_scope batch (got sample_rule {self.sample_rule!r}, sample_scope "
                f"{self.sample_scope!r}); set scope_switch_threshold: 0 or sample_scope: batch"
            )
        if self.logging_steps != 1 or self.logging_strategy != "steps":
            raise ValueError(
                "scope_switch_threshold reads every step's gradient norm from the trainer's log: set "
                f"logging_steps: 1 (got {self.logging_steps}, logging_strategy {self.logging_strategy!r})"
            )

    def scope_switch(self) -> ScopeSwitch | None:
        """The adaptive scope's switch; None when the scope is fixed."""
        return ScopeSwitch(float(self.scope_switch_threshold)) if self.scope_switch_threshold else None

    def _validate_token_loss(self) -> None:
        """Combinations of the token level with the loss that cannot mean what they say, refused up front."""
        if self.token_rule == "none":
            return
        sequence_level = self.importance_sampling_level == "sequence"
        if self.token_scope == "micro_batch" and (sequence_level or self.token_norm == "selected"):
            raise ValueError(
                "token_scope micro_batch chooses the token mask inside the loss, too late for sequence-level "
                "ratios or token_norm selected, which need it before: set token_scope: batch"
            )
        if sequence_level and self.loss_type != "grpo":
            raise ValueError(
                f"sequence-level ratios with token selection average the ratio over the kept tokens and need "
                f"loss_type grpo (GSPO's sequence mean); got loss_type {self.loss_type!r}"
            )
        if self.kl_tokens == "all" and (sequence_level or self.token_norm == "selected"):
            raise ValueError(
                "kl_tokens all needs token_norm all and token-level ratios (the kept tokens are the loss "
                "mask otherwise): set kl_tokens: selected"
            )

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
