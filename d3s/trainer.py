"""D3SConfig / D3STrainer: TRL's GRPO with sample- and token-level down-sampling.

TRL owns generation, rewards, advantages, the clipped loss and logging. We add two things:
  1. after scoring, keep a subset of the rollouts (``_generate_and_score_completions``), decided from the
     gathered batch identically on every rank;
  2. in the loss, keep the top-K% tokens by |A| * H (``get_high_entropy_mask``, TRL's own hook).
With ``method="grpo"`` both are off and the trainer is TRL's GRPOTrainer, step for step.

Dropped work is not paid for: the old-policy, reference and importance-sampling log-prob passes TRL runs while
scoring are deferred until after selection and run on the kept rollouts only (``defer_logprob_passes``), and with
K < 1 the gradient pass projects through the LM head only at the kept tokens (``kept_token_logprobs``,
d3s/kept_head.py). Both give the same losses and gradients as the straightforward computation.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmax, nanmin, use_adapter

from d3s.config_types import check_trainer_ranges
from d3s.kept_head import add_kept_token_head, kept_token_head_unsupported
from d3s.methods import get_method
from d3s.provenance import atomic_write_text
from d3s.rewards import ANSWER_POLICIES, bind_answer_policy
from d3s.selection import (
    SAMPLE_RULES,
    SAMPLE_SCOPES,
    SCHEDULES,
    TOKEN_RULES,
    TOKEN_SCOPES,
    Schedule,
    renormalize_advantages,
    select_samples,
    token_keep_mask,
    token_scores,
)

logger = logging.get_logger(__name__)

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
            "False: TRL's order (every rollout), for comparison; the losses are the same."
        },
    )
    kept_token_logprobs: bool = field(
        default=True,
        metadata={
            "help": "With token_keep_ratio < 1, back-propagate through the LM head only at the kept tokens "
            "(entropies come from a no-gradient pass). False: TRL's head at every position, for comparison; "
            "the losses and gradients are the same."
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
        # ranges first: TRL's own __post_init__ divides by some of these (d3s/config_types.py TRAINER_RANGES)
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
        keep_init, keep_final = method.keep_per_prompt(self.num_generations)
        defaults = {
            "sample_rule": method.sample_rule,
            "sample_scope": method.sample_scope,
            "renormalize": method.renormalize,
            "keep_per_prompt": keep_init,
            "keep_per_prompt_final": keep_final,
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
            keep_init=self.keep_per_prompt,
            keep_final=self.keep_per_prompt_final,
            token_ratio_init=self.token_keep_ratio,
            token_ratio_final=self.token_keep_ratio_final,
        )


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log entry as one JSON line: what the analysis reads."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        record = {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()


class NanGuardCallback(TrainerCallback):
    """Stops training on a NaN loss, reward or gradient norm (after the step's metrics are logged).

    Trainer logs before it saves, so raising here keeps the bad step's checkpoint from being written:
    the last checkpoint on disk stays the last good one.
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        bad = [
            k
            for k in ("loss", "reward", "grad_norm")
            if isinstance(logs.get(k), float) and math.isnan(logs[k])
        ]
        if bad:
            raise FloatingPointError(
                f"{', '.join(bad)} is NaN at step {state.global_step}; training stopped before saving this step. "
                f"Resume from the last checkpoint in {args.output_dir} with a lower learning_rate or check the reward"
            )


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


D3S_STATE_FILE = "d3s_state.json"
# Marks a checkpoint cut to its weights (full_state_checkpoints: latest); written before anything is removed.
WEIGHTS_ONLY_FILE = "d3s_weights_only.txt"
FULL_STATE_CHECKPOINTS = ("all", "latest")
# What a checkpoint holds only for resuming, beside the weights (transformers 5.17 Trainer._save_checkpoint:
# optimizer, scheduler, grad scaler, RNG per rank; DeepSpeed's engine.save_checkpoint: global_step<N>/ with the
# sharded fp32 master weights and optimizer states, `latest`, zero_to_fp32.py).
RESUME_STATE_PATTERNS = (
    "optimizer.pt",
    "optimizer.bin",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "global_step*",
    "latest",
    "zero_to_fp32.py",
)
# Weight files of a checkpoint (save_model); without one, the weights live only in DeepSpeed's global_step*/.
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
)


def has_training_state(checkpoint: str | os.PathLike[str]) -> bool:
    """True when the checkpoint holds optimizer state: optimizer.pt/.bin (an ``optimizer*`` folder under FSDP),
    or DeepSpeed's global_step* folder. save_only_model: true writes neither, so such a checkpoint cannot resume.
    """
    return any(path.name.startswith(("optimizer", "global_step")) for path in Path(checkpoint).iterdir())


def strip_to_weights(checkpoint: str | os.PathLike[str], reason: str) -> list[str]:
    """Remove what ``checkpoint`` holds only for resuming (RESUME_STATE_PATTERNS), keeping its weights, tokenizer,
    trainer state and logs; returns the names removed. A checkpoint without weight files keeps everything (its
    weights exist only inside DeepSpeed's global_step*: ZeRO-3 without zero3_save_16bit_model).

    WEIGHTS_ONLY_FILE is written first, so a crash midway never leaves a checkpoint that looks resumable.
    """
    checkpoint = Path(checkpoint)
    if not any((checkpoint / name).is_file() for name in _WEIGHT_FILES):
        return []
    state = sorted({path for pattern in RESUME_STATE_PATTERNS for path in checkpoint.glob(pattern)})
    if not state:
        return []
    atomic_write_text(
        checkpoint / WEIGHTS_ONLY_FILE,
        f"Weights only: {reason}. Removed (needed only to resume): {', '.join(p.name for p in state)}\n",
    )
    for path in state:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [path.name for path in state]


# Generation outputs that TRL computes with log-prob passes; deferred until after selection.
_DEFERRED_KEYS = ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")

# Losses in which an unselected token's log-prob reaches the loss only through the token mask.
_PER_TOKEN_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")

# Per-rollout tensors of TRL's generation batch (first dimension = rollouts); left-padded ones pad first.
_LEFT_PADDED = {"prompt_ids", "prompt_mask"}


class D3STrainer(GRPOTrainer):
    """GRPOTrainer with D3S/PODS rollout selection and the |A| x H token mask."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # GRPOTrainer(model, reward_funcs, args, ...): d3s's accuracy_reward is graded under args.answer_policy.
        config = kwargs["args"] if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if isinstance(config, D3SConfig):
            if "reward_funcs" in kwargs:
                kwargs["reward_funcs"] = bind_answer_policy(kwargs["reward_funcs"], config.answer_policy)
            elif len(args) > 1:
                args = (args[0], bind_answer_policy(args[1], config.answer_policy), *args[2:])
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, D3SConfig):
            raise TypeError(f"D3STrainer needs a D3SConfig, got {type(self.args).__name__}")
        self.selection_schedule = self.args.selection_schedule
        self.update_tokens_total = 0  # tokens that reached the policy gradient, all ranks, all steps
        self._rewards_per_func: torch.Tensor | None = None
        self._loss_advantages: torch.Tensor | None = None
        self._loss_inputs: dict | None = None
        self._anatomy_tokens_due = False
        self._deferring_logprobs = False
        self._token_mask_from_head: torch.Tensor | None = None
        self.kept_token_head = False  # True when the gradient pass projects only the kept tokens
        if self.args.kept_token_logprobs and self.args.token_rule != "none":
            blocker = self._kept_token_head_blocker()
            if blocker is None:
                add_kept_token_head(self._head_model(), self.temperature, self.args.cast_lm_head_to_fp32)
                self.kept_token_head = True
            else:
                logger.warning(
                    "kept-token log-probs are off, the LM head runs at every position: %s", blocker
                )
        if self.args.metrics_log:
            self.add_callback(JsonlMetricsCallback(os.path.join(self.args.output_dir, self.args.metrics_log)))
        self.add_callback(NanGuardCallback())  # after the metrics log, so the NaN step is recorded

    # ---- schedule -----------------------------------------------------------------------------------------

    def training_progress(self) -> float:
        max_steps = self.state.max_steps or 0
        return self.state.global_step / max_steps if max_steps > 0 else 0.0

    # ---- sample level -------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL returns rewards gathered from all ranks but does not pass them on; selection needs them.
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        progress = self.training_progress()
        keep = self.selection_schedule.keep_per_prompt(progress)
        drops_rollouts = self.args.sample_rule != "none" and keep < self.num_generations
        self._deferring_logprobs = self.model.training and drops_rollouts and self.args.defer_logprob_passes
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            deferred, self._deferring_logprobs = self._deferring_logprobs, False
        if not self.model.training:
            return output
        # TRL filled these from placeholders (see _get_per_token_logps_and_entropies); they are computed below
        pending = [key for key in _DEFERRED_KEYS if deferred and key in output]
        for key in pending:
            del output[key]
        metrics = self._metrics["train"]
        metrics["schedule/keep_per_prompt"].append(float(keep))
        metrics["schedule/token_keep_ratio"].append(self.selection_schedule.token_keep_ratio(progress))

        all_advantages = self.accelerator.gather(output["advantages"])
        anatomy_due = self.args.anatomy_every > 0 and self.state.global_step % self.args.anatomy_every == 0
        self._anatomy_tokens_due = anatomy_due
        if not drops_rollouts:
            self._log_selection(all_advantages, all_advantages, total=all_advantages.numel())
            if anatomy_due:
                everything = torch.arange(all_advantages.numel(), device=all_advantages.device)
                self._write_sample_anatomy(all_advantages, everything, keep)
            return output

        rewards = self._summed_rewards(all_advantages.device)
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.state.global_step)
        kept = select_samples(
            all_advantages,
            torch.nan_to_num(rewards, nan=float("-inf")),  # unscorable rollouts never rank first
            num_generations=self.num_generations,
            keep_per_prompt=keep,
            rule=self.args.sample_rule,
            scope=self.args.sample_scope,
            generator=generator,
        )
        if self.args.renormalize:
            kept_advantages = renormalize_advantages(
                rewards, kept, self.num_generations, scale=self.scale_rewards != "none"
            )
        else:
            kept_advantages = all_advantages[kept]
        self._log_selection(all_advantages, kept_advantages, total=all_advantages.numel())
        if anatomy_due:
            self._write_sample_anatomy(all_advantages, kept, keep)
        selected = self._keep_rows(output, kept, kept_advantages)
        if pending:
            self._run_deferred_logprob_passes(selected, pending)
        return selected

    # ---- log-prob passes on the kept rollouts only -------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_extras,
    ):
        multimodal = any(value is not None for value in model_extras.values())
        if self._deferring_logprobs:
            if multimodal:
                raise ValueError(
                    "rollout selection defers log-prob passes, which multimodal inputs do not support; "
                    "set defer_logprob_passes=False"
                )
            # A stand-in of the right shape: selection first, then the real pass on the kept rows only.
            placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
            return placeholder, None, None
        if (
            self.kept_token_head
            and compute_entropy
            and not compute_aux_loss
            and not multimodal
            and torch.is_grad_enabled()
            and self.model.training
            and self.top_entropy_quantile < 1.0
        ):
            return self._kept_token_logps(model, input_ids, attention_mask, logits_to_keep)
        return super()._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **model_extras,
        )

    def _run_deferred_logprob_passes(self, output: dict, pending: list[str]) -> None:
        """TRL's old-policy, reference and importance-sampling passes, on this rank's kept rows."""
        completion_ids = output["completion_ids"]
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        extras = {key: output[key] for key in ("token_type_ids", "mm_token_type_ids") if key in output}

        def logps(model) -> torch.Tensor:
            return self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
                **extras,
            )[0]

        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            if "old_per_token_logps" in pending:
                output["old_per_token_logps"] = logps(self.model)
            if "ref_per_token_logps" in pending:
                if self.ref_model is not None:
                    output["ref_per_token_logps"] = logps(self.ref_model)
                else:  # PEFT: the reference is the base model (or the "ref" adapter), as in TRL
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    with use_adapter(
                        unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None
                    ):
                        output["ref_per_token_logps"] = logps(self.model)
        if "importance_sampling_ratio" in pending:
            output["importance_sampling_ratio"] = self._importance_sampling_ratio(output)

    def _importance_sampling_ratio(self, output: dict) -> torch.Tensor:
        """TRL's vLLM importance-sampling ratio and its metrics, over the kept rollouts."""
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        old, sampling = output["old_per_token_logps"], output["sampling_per_token_logps"]
        logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)  # NaN: vLLM could not score the token
        mode = self.vllm_importance_sampling_mode
        sequence_level = mode in ("sequence_mask", "sequence_truncate")
        ratio = torch.exp(logps_diff.sum(dim=-1, keepdim=True) if sequence_level else logps_diff)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if mode in ("sequence_truncate", "token_truncate"):
            ratio = torch.clamp(ratio, min=low, max=high)
        else:
            low = -math.inf if low is None else low
            high = math.inf if high is None else high
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

        # TRL logged these from the placeholder: replace its entries with the kept rollouts' values.
        valid = mask.bool()
        delta = torch.abs(old - sampling)[valid]
        delta = delta[~torch.isnan(delta)]
        flat_ratio = ratio.flatten() if sequence_level else ratio[valid]
        zero = torch.tensor(0.0, device=ratio.device)

        def gathered(values: torch.Tensor, reduce) -> torch.Tensor:  # 0 for an empty rank, as TRL does
            return self.accelerator.gather(reduce(values) if values.numel() else zero)

        stats = {
            "sampling/sampling_logp_difference/mean": gathered(delta, torch.mean).mean(),
            "sampling/sampling_logp_difference/max": gathered(delta, torch.max).max(),
            "sampling/importance_sampling_ratio/min": nanmin(gathered(flat_ratio, torch.min)),
            "sampling/importance_sampling_ratio/mean": gathered(flat_ratio, torch.mean).nanmean(),
            "sampling/importance_sampling_ratio/max": nanmax(gathered(flat_ratio, torch.max)),
        }
        for name, value in stats.items():
            self._metrics["train"][name][-1] = value.item()
        return ratio

    def _summed_rewards(self, device: torch.device) -> torch.Tensor:
        rewards_per_func = self._rewards_per_func.to(device)
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _keep_rows(self, output: dict, kept: torch.Tensor, kept_advantages: torch.Tensor) -> dict:
        """Index every per-rollout tensor by the kept rows, each rank taking an equal share."""
        num_processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        local_rows = output["advantages"].shape[0]
        share = kept.numel() // num_processes  # D3SConfig validated the divisibility
        shares = kept.view(num_processes, share)
        owners = torch.arange(num_processes, device=kept.device).unsqueeze(1)
        rank_local = bool(((shares // local_rows) == owners).all())  # identical on every rank

        mine = slice(rank * share, (rank + 1) * share)
        selected = dict(output)
        for key, value in output.items():
            if key == "advantages" or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.shape[0] != local_rows:
                raise ValueError(
                    f"cannot down-sample generation output {key!r} of shape {tuple(value.shape)}"
                )
            if rank_local:
                selected[key] = value[shares[rank] - rank * local_rows]
            else:  # cross-group selection left ranks uneven: pool the rows, then deal out equal shares
                pad = self._tokenizer.pad_token_id if key.endswith("_ids") else 0
                padded = self.accelerator.pad_across_processes(
                    value, dim=1, pad_index=pad, pad_first=key in _LEFT_PADDED
                )
                selected[key] = self.accelerator.gather(padded)[kept[mine]]
        for key, value in output.items():
            if isinstance(value, list) and len(value) == local_rows:
                raise ValueError(f"rollout selection does not support list-valued generation output {key!r}")
        selected["advantages"] = kept_advantages[mine].to(output["advantages"].dtype)
        loss_mask = selected["completion_mask"]
        if "tool_mask" in selected:
            loss_mask = loss_mask * selected["tool_mask"]
        # TRL counted the tokens of all rollouts before we dropped any; dapo's normaliser needs the kept ones.
        selected["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return selected

    def _log_selection(self, before: torch.Tensor, after: torch.Tensor, total: int) -> None:
        metrics = self._metrics["train"]
        metrics["selection/sample_keep_fraction"].append(after.numel() / total)
        metrics["selection/adv_var_before"].append(before.float().var(unbiased=False).item())
        metrics["selection/adv_var_after"].append(after.float().var(unbiased=False).item())
        metrics["selection/useful_fraction_before"].append((before.abs() > 1e-6).float().mean().item())
        metrics["selection/useful_fraction"].append((after.abs() > 1e-6).float().mean().item())

    # ---- token level --------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        training = self.model.training
        active = training and self.args.token_rule != "none"
        ratio = self.selection_schedule.token_keep_ratio(self.training_progress())
        # TRL calls get_high_entropy_mask only when this is < 1; K = 1 means every token trains.
        self.top_entropy_quantile = ratio if active else 1.0
        self._loss_advantages = inputs["advantages"]
        self._loss_inputs = inputs
        self._last_token_mask = None
        self._token_mask_from_head = None
        loss = super()._compute_loss(model, inputs)
        if training:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            used = mask.bool() if self._last_token_mask is None else self._last_token_mask
            counts = self.accelerator.reduce(
                torch.stack([used.sum(), mask.sum()]).to(torch.float64), reduction="sum"
            )
            self.update_tokens_total += int(counts[0].item())
            self._metrics["train"]["selection/update_tokens"].append(counts[0].item())
            if self._last_token_mask is None:  # every token trained: the selected entropy is TRL's entropy
                self._metrics["train"]["selection/entropy_selected"].append(
                    self._metrics["train"]["entropy"][-1]
                )
            self._metrics["train"]["selection/token_keep_fraction"].append(
                (counts[0] / counts[1].clamp(min=1)).item()
            )
        return loss

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """Top-K% tokens by |A| x H (or H) instead of TRL's entropy quantile; K = 1 - threshold."""
        if self._token_mask_from_head is not None:  # the kept-token head already chose them
            keep, self._token_mask_from_head = self._token_mask_from_head, None
            return keep
        return self._select_tokens(entropies, mask)

    def _select_tokens(self, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep_ratio = self.top_entropy_quantile
        scores = token_scores(self._loss_advantages, entropies, self.args.token_rule)
        if self.args.token_scope == "batch" and self.accelerator.num_processes > 1:
            # Rank over the micro-batch of every rank, exactly as a single process would see it.
            rows, cols = scores.shape
            all_scores = self.accelerator.gather(
                self.accelerator.pad_across_processes(scores, dim=1, pad_index=0)
            )
            all_mask = self.accelerator.gather(
                self.accelerator.pad_across_processes(mask, dim=1, pad_index=0)
            )
            rank = self.accelerator.process_index
            keep = token_keep_mask(all_scores, all_mask, keep_ratio, "batch")[
                rank * rows : (rank + 1) * rows, :cols
            ]
        else:
            keep = token_keep_mask(scores, mask, keep_ratio, self.args.token_scope)
        self._last_token_mask = keep
        if self._anatomy_tokens_due:
            self._anatomy_tokens_due = False  # the first micro-batch of the step stands for it
            self._write_token_anatomy(entropies, scores, keep, mask)
        stats = torch.stack([(entropies.detach() * keep).sum(), keep.sum()]).to(torch.float64)
        stats = self.accelerator.reduce(stats, reduction="sum")
        self._metrics["train"]["selection/entropy_selected"].append((stats[0] / stats[1].clamp(min=1)).item())
        return keep

    def _kept_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        """Log-probs with gradient at the kept tokens only (d3s/kept_head.py); the mask is chosen inside."""
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100  # only the completion is scored, as in TRL
        loss_inputs = self._loss_inputs
        loss_mask = loss_inputs["completion_mask"] * loss_inputs.get("tool_mask", 1)

        def select_tokens(entropy: torch.Tensor) -> torch.Tensor:
            keep = torch.zeros_like(entropy, dtype=torch.bool)
            keep[:, -logits_to_keep:] = self._select_tokens(entropy[:, -logits_to_keep:], loss_mask)
            self._token_mask_from_head = keep[:, -logits_to_keep:]
            return keep

        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, select_tokens=select_tokens
            )
        return outputs.log_probs[:, -logits_to_keep:], outputs.entropy[:, -logits_to_keep:], None

    def _head_model(self):
        return self.model.get_base_model() if is_peft_model(self.model) else self.model

    def _kept_token_head_blocker(self) -> str | None:
        """Why unselected tokens may still need a gradient (None: the kept-token head is exact)."""
        if self.beta != 0.0:
            return "beta != 0: the KL term trains every token"
        if self.importance_sampling_level != "token":
            return "a sequence-level importance ratio (GSPO) reaches every token of a kept sequence"
        if self.loss_type not in _PER_TOKEN_LOSSES:
            return f"loss_type {self.loss_type!r} is not one of the per-token losses {', '.join(_PER_TOKEN_LOSSES)}"
        if self._entropy_bonus_enabled:
            return "the entropy bonus trains the entropy of every token"
        return kept_token_head_unsupported(self._head_model())

    # ---- anatomy log ----------------------------------------------------------------------------------------

    def _append_anatomy(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "anatomy.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def _write_sample_anatomy(self, advantages: torch.Tensor, kept: torch.Tensor, keep: int) -> None:
        G = self.num_generations  # noqa: N806
        rewards = self._summed_rewards(advantages.device).view(-1, G)
        kept_mask = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
        kept_mask[kept] = True
        groups = [
            {"rewards": r, "advantages": a, "kept": k}
            for r, a, k in zip(
                rewards.tolist(), advantages.view(-1, G).tolist(), kept_mask.view(-1, G).tolist(), strict=True
            )
        ]
        self._append_anatomy(
            {
                "kind": "samples",
                "step": self.state.global_step,
                "keep_per_prompt": keep,
                "num_generations": G,
                "groups": groups,
            }
        )

    def _write_token_anatomy(
        self, entropies: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor
    ) -> None:
        ids = self._loss_inputs["completion_ids"]
        advantages = self._loss_advantages
        examples = []
        for row in range(min(self.args.anatomy_examples, ids.shape[0])):
            valid = mask[row].bool()
            examples.append(
                {
                    "tokens": [self.processing_class.decode([t]) for t in ids[row][valid].tolist()],
                    "entropy": entropies[row][valid].detach().float().tolist(),
                    "score": scores[row][valid].float().tolist(),
                    "selected": keep[row][valid].tolist(),
                    "advantage": float(advantages[row].float().mean()),
                }
            )
        self._append_anatomy(
            {
                "kind": "tokens",
                "step": self.state.global_step,
                "token_keep_ratio": self.top_entropy_quantile,
                "examples": examples,
            }
        )

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        # Every rank has written its part (DeepSpeed shards, rng_state_<rank>.pth) before the checkpoint is
        # marked complete: d3s.train.latest_checkpoint resumes only from checkpoints with D3S_STATE_FILE.
        self.accelerator.wait_for_everyone()
        if self.args.should_save:  # our running counters, restored on resume like TRL's entropy controller
            run_dir = self._get_output_dir(trial=trial)
            folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
            # The logs up to this step travel with the checkpoint: a resumed run restores them even when a
            # workflow deleted the run's outputs before re-running the job.
            for name in (self.args.metrics_log, "anatomy.jsonl"):
                if name and os.path.isfile(os.path.join(self.args.output_dir, name)):
                    shutil.copyfile(os.path.join(self.args.output_dir, name), os.path.join(folder, name))
            state = json.dumps({"update_tokens_total": self.update_tokens_total})
            atomic_write_text(os.path.join(folder, D3S_STATE_FILE), state)
            if self.args.full_state_checkpoints == "latest":
                self._strip_older_checkpoints(Path(run_dir), self.state.global_step)

    def _strip_older_checkpoints(self, run_dir: Path, step: int) -> None:
        """Cut every checkpoint older than the complete checkpoint-<step> to its weights."""
        for path in run_dir.glob("checkpoint-*"):
            number = path.name.split("-")[-1]
            if number.isdigit() and int(number) < step and not (path / WEIGHTS_ONLY_FILE).exists():
                removed = strip_to_weights(path, f"checkpoint-{step} holds the full state")
                if removed:
                    print(f"{path.name} cut to its weights (removed {', '.join(removed)})", flush=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        optimizer = os.path.join(checkpoint or "", "optimizer.pt")
        scheduler = os.path.join(checkpoint or "", "scheduler.pt")
        cpu_ranks = self.args.world_size > 1 and self.args.device.type == "cpu"
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        if cpu_ranks and plain and os.path.isfile(optimizer) and os.path.isfile(scheduler):
            # transformers 5.17 maps the optimizer state to args.device when world_size > 1, which on CPU
            # processes is "cpu:<rank>", a location torch.load cannot restore; CPU is where it belongs anyway.
            self.optimizer.load_state_dict(torch.load(optimizer, map_location="cpu", weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and os.path.exists(os.path.join(checkpoint, D3S_STATE_FILE)):
            with open(os.path.join(checkpoint, D3S_STATE_FILE), encoding="utf-8") as fh:
                self.update_tokens_total = json.load(fh)["update_tokens_total"]

    # ---- logging ------------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            logs["selection/update_tokens_cumulative"] = float(self.update_tokens_total)
        super().log(logs, start_time)
