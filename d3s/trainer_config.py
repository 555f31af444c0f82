"""D3SConfig: TRL's GRPOConfig plus the selection options, the compute savings and the run's logs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from d3s.methods import get_method
from d3s.rewards import ANSWER_POLICIES
from d3s.runs.checkpoints import FULL_STATE_CHECKPOINTS
from d3s.runs.config import check_trainer_ranges
from d3s.selection import SAMPLE_RULES, SAMPLE_SCOPES, SCHEDULES, TOKEN_RULES, TOKEN_SCOPES, Schedule

_FROM_METHOD = "default: from the method registry (d3s/methods.py)"


@dataclass
class D3SConfig(GRPOConfig):
    """GRPOConfig plus the selection options. Unset selection fields (None) come from ``method``.

    Build with ``D3SConfig.for_method(name, **overrides)`` to also get the TRL settings a method needs
    (GSPO's sequence-level ratio); every field here can still be overridden.
    """

    method: str = field(
        default="grpo",
        metadata={
            "help": "Method name from d3s.methods.METHODS (grpo, pods, d1s, d1s_cross, d2s, d3s, d3s_i, ...)."
        },
    )
    sample_rule: str | None = field(
        default=None,
        metadata={"help": f"Rollout selection rule: {', '.join(SAMPLE_RULES)}. {_FROM_METHOD}."},
    )
    sample_scope: str | None = field(
        default=None,
        metadata={
            "help": "'group': keep exactly keep_per_prompt rollouts of every prompt; 'batch': keep "
            f"keep_per_prompt x prompts from the pooled batch (cross-group). {_FROM_METHOD}."
        },
    )
    renormalize: bool | None = field(
        default=None,
        metadata={
            "help": "Re-normalise advantages over the kept rollouts of each group (PODS); False keeps the "
            f"advantages computed over all G rollouts (D-family). {_FROM_METHOD}."
        },
    )
    keep_per_prompt: int | None = field(
        default=None,
        metadata={
            "help": f"Rollouts kept per prompt, N (the initial value under a linear schedule). {_FROM_METHOD}."
        },
    )
    keep_per_prompt_final: int | None = field(
        default=None,
        metadata={"help": f"N at the end of training under a linear schedule. {_FROM_METHOD}."},
    )
    token_rule: str | None = field(
        default=None,
        metadata={
            "help": f"Token score: {', '.join(TOKEN_RULES)} ('adv_entropy' = |A| x entropy, 'entropy' = the 80/20 "
            f"rule). {_FROM_METHOD}."
        },
    )
    token_scope: str | None = field(
        default=None,
        metadata={
            "help": "'batch': top-K% over the valid tokens of the micro-batch, gathered across ranks; "
            f"'sequence': top-K% within each completion. {_FROM_METHOD}."
        },
    )
    token_keep_ratio: float | None = field(
        default=None,
        metadata={
            "help": f"K in (0, 1], the fraction of tokens kept (initial value under linear). {_FROM_METHOD}."
        },
    )
    token_keep_ratio_final: float | None = field(
        default=None,
        metadata={"help": f"K at the end of training under a linear schedule. {_FROM_METHOD}."},
    )
    schedule: str | None = field(
        default=None,
        metadata={
            "help": f"{', '.join(SCHEDULES)}: linear moves N and K from their initial to final values in "
            f"p = step / max_steps. {_FROM_METHOD}."
        },
    )
    metrics_log: str | None = field(
        default="metrics.jsonl",
        metadata={"help": "One JSON object per logging step, relative to output_dir (None: off)."},
    )
    anatomy_every: int = field(
        default=0,
        metadata={
            "help": "Every this many steps, append what selection did (per-group rewards, advantages and kept "
            "rollouts; scored tokens of a few kept completions) to output_dir/anatomy.jsonl. 0: off."
        },
    )
    anatomy_examples: int = field(
        default=4,
        metadata={
            "help": "Completions per anatomy record whose tokens, entropies, scores and mask are written."
        },
    )
    defer_logprob_passes: bool = field(
        default=True,
        metadata={
            "help": "Run the old-policy, reference and vLLM importance-sampling log-prob passes after rollout "
            "selection, on the kept rollouts only, so a dropped rollout costs only its generation and reward. "
            "False: TRL's order (every rollout), for comparison; the losses are the same "
            "(d3s/savings/deferred.py)."
        },
    )
    kept_token_logprobs: bool = field(
        default=True,
        metadata={
            "help": "With token_keep_ratio < 1, back-propagate through the LM head only at the kept tokens "
            "(entropies come from a no-gradient pass). False: TRL's head at every position, for comparison; "
            "the losses and gradients are the same (d3s/savings/kept_head.py)."
        },
    )
    answer_policy: str = field(
        default="math_verify",
        metadata={
            "help": "Which boxed answer the accuracy reward grades (d3s.rewards.accuracy_reward, replaced by the "
            "trainer): 'math_verify' reads every \\boxed{} of a completion as one set answer (math-verify's "
            "behaviour, the default), 'last_boxed' only the last box (the Qwen2.5-Math evaluation toolkit's "
            "convention). Evaluation reports both."
        },
    )
    logging_steps: float = field(
        default=1,
        metadata={"help": "Log every step (TRL's default is 10); the analysis reads per-step metrics."},
    )
    full_state_checkpoints: str = field(
        default="all",
        metadata={
            "help": "'all': every checkpoint keeps the optimizer, scheduler, RNG and DeepSpeed state (Trainer's "
            "way). 'latest': only the newest one does; an older one is cut to its weights, tokenizer, trainer "
            "state and logs (what learning curves need) once a newer one is completely written, so a run "
            "resumes exactly for the disk of one full state. Needs save_only_model false."
        },
    )

    @classmethod
    def for_method(cls, method: str, **overrides: Any) -> D3SConfig:
        """A config for ``method`` with the method's TRL settings applied under ``overrides``."""
        settings = {**get_method(method).trl_settings, **overrides}
        return cls(method=method, **settings)

    def __post_init__(self) -> None:
        # ranges first: TRL's own __post_init__ divides by some of these (d3s/runs/config.py TRAINER_RANGES)
        check_trainer_ranges({f.name: getattr(self, f.name) for f in fields(self)})
        method = get_method(self.method)
        for name, value in method.trl_settings.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"method {self.method!r} needs {name}={value!r} (got {getattr(self, name)!r}): drop the "
                    f"{name} override, or build the config with D3SConfig.for_method({self.method!r}, ...), "
                    "which sets it"
                )
        super().__post_init__()
        self._resolve_from_method(method)
        self._validate()

    def _resolve_from_method(self, method) -> None:
        keep_per_prompt_init, keep_per_prompt_final = method.keep_per_prompt(self.num_generations)
        defaults = {
            "sample_rule": method.sample_rule,
            "sample_scope": method.sample_scope,
            "renormalize": method.renormalize,
            "keep_per_prompt": keep_per_prompt_init,
            "keep_per_prompt_final": keep_per_prompt_final,
            "token_rule": method.token_rule,
            "token_scope": method.token_scope,
            "token_keep_ratio": method.token_keep_ratio_init,
            "token_keep_ratio_final": method.token_keep_ratio_final,
            "schedule": method.schedule,
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
        for name, value, choices in [
            ("sample_rule", self.sample_rule, SAMPLE_RULES),
            ("sample_scope", self.sample_scope, SAMPLE_SCOPES),
            ("token_rule", self.token_rule, TOKEN_RULES),
            ("token_scope", self.token_scope, TOKEN_SCOPES),
            ("schedule", self.schedule, SCHEDULES),
            ("answer_policy", self.answer_policy, ANSWER_POLICIES),
        ]:
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        G = self.num_generations  # noqa: N806 - the paper's symbol
        for name in ("keep_per_prompt", "keep_per_prompt_final"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= G:
                raise ValueError(
                    f"{name} must be an integer between 1 and num_generations = {G} at every point of the "
                    f"schedule; got {value!r}. Lower it or raise num_generations."
                )
        for name in ("defer_logprob_passes", "kept_token_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if self.full_state_checkpoints not in FULL_STATE_CHECKPOINTS:
            raise ValueError(
                f"full_state_checkpoints must be one of {', '.join(FULL_STATE_CHECKPOINTS)}; "
                f"got {self.full_state_checkpoints!r}"
            )
        if self.full_state_checkpoints == "latest" and self.save_only_model:
            raise ValueError(
                "full_state_checkpoints: latest keeps the training state in the newest checkpoint, but "
                "save_only_model: true saves none (such a run cannot resume): set save_only_model: false"
            )
        if self.anatomy_every < 0 or self.anatomy_examples < 0:
            raise ValueError("anatomy_every and anatomy_examples must be >= 0 (0 turns the anatomy log off)")
        for name in ("token_keep_ratio", "token_keep_ratio_final"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]; got {value!r}")
        if self.renormalize and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "renormalize=True re-normalises the summed reward per group; it needs "
                "multi_objective_aggregation='sum_then_normalize'"
            )
        if self.token_rule != "none" and self.use_liger_kernel:
            raise ValueError(
                "token-level selection uses TRL's entropy-mask hook, which Liger kernels skip; "
                "set use_liger_kernel=False or token_rule='none'"
            )
        # TRL splits the kept rows into steps_per_generation micro-batches and silently drops a remainder,
        # and every rank must hold the same number of rows: N x (per-device batch) / G must be whole.
        micro = self.per_device_train_batch_size
        for keep in self.selection_schedule.reachable_keep_values():
            if (keep * micro) % G:
                raise ValueError(
                    f"keep_per_prompt = {keep} (reached by the schedule) gives {keep} x {micro} / {G} kept rows per "
                    f"micro-batch, not a whole number: TRL would drop rows. Make per_device_train_batch_size "
                    f"({micro}) a multiple of num_generations ({G}), or choose keep values N with N x {micro} "
                    f"divisible by {G}."
                )

    @property
    def selection_schedule(self) -> Schedule:
        return Schedule(
            kind=self.schedule,
            keep_per_prompt_init=self.keep_per_prompt,
            keep_per_prompt_final=self.keep_per_prompt_final,
            token_keep_ratio_init=self.token_keep_ratio,
            token_keep_ratio_final=self.token_keep_ratio_final,
        )
