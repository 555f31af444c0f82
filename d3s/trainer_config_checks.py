"""D3SConfig's checks: each a function of the config a test can call alone, run by D3SConfig.__post_init__.

Ranges first (before TRL's own __post_init__, which divides by some of them), then the choices, the values the
selection schedule reaches, the compute savings' switches, and the combinations of the selection loss with
TRL's options that cannot mean what they say: each refused in one line naming what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from d3s.objective import SELECTION_LOSSES

# the loss types whose rows weigh a sequence-level ratio once each: the rows' means (grpo: GSPO, sapo) or
# LUSPO's length-unbiased sums
SEQUENCE_LEVEL_LOSSES = ("grpo", "sapo", "luspo")

# a d3s.trainer_config.D3SConfig, which imports this module: its type is not imported here (no import circle)
D3SConfig = Any

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
    "scope_switch_threshold": (lambda v: v >= 0, ">= 0 (0: off)"),
    "num_generations": (lambda v: v >= 2, ">= 2 (GRPO needs two rollouts per prompt for an advantage)"),
    # TRL samples num_generations_eval completions per prompt in evaluation, 1 included (no selection there)
    "num_generations_eval": (lambda v: v >= 1, ">= 1"),
    "max_steps": (lambda v: v >= 1 or v == -1, ">= 1, or -1 to train for num_train_epochs"),
    "temperature": (lambda v: v > 0, "> 0 (rollouts must be sampled)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def check_ranges(config: D3SConfig) -> None:
    """Every option of TRAINER_RANGES that holds a number is in its range (None: unset, always passes)."""
    for name in (f.name for f in fields(config) if f.name in TRAINER_RANGES):
        accepts, description = TRAINER_RANGES[name]
        value = getattr(config, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not accepts(value):
            raise ValueError(f"trainer.{name} must be {description}; got {value!r}")


def set_mini_batch_generation(config: D3SConfig) -> None:
    """steps_per_generation = mini-batches x gradient accumulation (before TRL derives its geometry)."""
    minibatches = config.minibatches_per_generation
    if not isinstance(minibatches, int) or minibatches < 1:
        raise ValueError(f"minibatches_per_generation must be an integer >= 1; got {minibatches!r}")
    if minibatches == 1:
        return
    wanted = minibatches * config.gradient_accumulation_steps
    if config.generation_batch_size is not None or config.steps_per_generation not in (None, wanted):
        raise ValueError(
            f"method {config.method!r} updates {minibatches} times per generation batch, so "
            f"steps_per_generation must be {minibatches} x gradient_accumulation_steps = {wanted} (got "
            f"steps_per_generation={config.steps_per_generation}, generation_batch_size="
            f"{config.generation_batch_size}): unset both, or set minibatches_per_generation: 1"
        )
    config.steps_per_generation = wanted


def check_config(config: D3SConfig, own_fields: Iterable[str]) -> None:
    """Every check after TRL's __post_init__, in order; ``own_fields``: the fields D3SConfig declares."""
    check_choices(config, own_fields)
    check_schedule_values(config)
    resolve_packing(config)
    check_switches(config)
    check_state_and_rewards(config)
    check_token_loss(config)
    check_selection_loss(config)
    check_scope_switch(config)
    check_kept_rows(config)


def check_choices(config: D3SConfig, own_fields: Iterable[str]) -> None:
    """The fields declared in D3SConfig (TRL's with _trl_choices) hold one of their ``choices``."""
    own = set(own_fields)
    for f in fields(config):
        choices = f.metadata.get("choices") if f.name in own else None
        if choices and getattr(config, f.name) not in choices:
            raise ValueError(
                f"{f.name} must be one of {', '.join(map(str, choices))}; got {getattr(config, f.name)!r}"
            )


def check_schedule_values(config: D3SConfig) -> None:
    """N is a whole number of rollouts in [1, G] at both ends of the schedule."""
    G = config.num_generations  # noqa: N806 - the paper's symbol
    for name in ("keep_per_prompt", "keep_per_prompt_final"):
        value = getattr(config, name)
        if not isinstance(value, int) or not 1 <= value <= G:
            raise ValueError(
                f"{name} must be an integer between 1 and num_generations = {G} at every point of the "
                f"schedule; got {value!r}. Lower it or raise num_generations."
            )


def check_switches(config: D3SConfig) -> None:
    """The compute savings' settings: a bucket size >= 0 and true/false switches."""
    rows = config.length_bucket_rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"length_bucket_rows must be an integer >= 0 (0: off); got {rows!r}")
    for name in (
        "defer_logprob_passes",
        "kept_token_logprobs",
        "reward_copied_answers",
        "pack_micro_batches",
    ):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be true or false; got {getattr(config, name)!r}")


def check_state_and_rewards(config: D3SConfig) -> None:
    """A run that can resume from its newest checkpoint; PODS's re-normalisation of the summed reward, by each
    group's kept rollouts (their std, or none)."""
    if config.full_state_checkpoints == "latest" and config.save_only_model:
        raise ValueError(
            "full_state_checkpoints: latest keeps the training state in the newest checkpoint, but "
            "save_only_model: true saves none (such a run cannot resume): set save_only_model: false"
        )
    if config.renormalize and config.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            "renormalize=True re-normalises the summed reward per group; it needs "
            "multi_objective_aggregation='sum_then_normalize'"
        )
    if config.renormalize and config.scale_rewards == "batch":
        # d3s.selection.renormalize_advantages scales by the std of each group's kept rollouts, or not at all
        raise ValueError(
            "renormalize=True re-normalises the advantages within each group's kept rollouts, scaled by "
            "their std (scale_rewards group) or not (none); scale_rewards batch is not computed: set "
            "scale_rewards group or none"
        )


def check_kept_rows(config: D3SConfig) -> None:
    """TRL splits the kept rows into steps_per_generation micro-batches and silently drops a remainder, and
    every rank must hold the same number of rows: N x (per-device batch) / G must be whole."""
    G, micro = config.num_generations, config.per_device_train_batch_size  # noqa: N806 - the paper's symbol
    for keep in config.selection_schedule.reachable_keep_values():
        if (keep * micro) % G:
            raise ValueError(
                f"keep_per_prompt = {keep} (reached by the schedule) gives {keep} x {micro} / {G} kept "
                "rows per micro-batch, not a whole number: TRL would drop rows. Make "
                f"per_device_train_batch_size ({micro}) a multiple of num_generations ({G}), or choose "
                f"keep values N with N x {micro} divisible by {G}."
            )


def resolve_packing(config: D3SConfig) -> None:
    """Packing is exact unless the token level ranks inside each micro-batch, which packing changes."""
    ranks_per_micro_batch = config.token_rule != "none" and config.token_scope == "micro_batch"
    if config.pack_micro_batches is None:
        config.pack_micro_batches = not ranks_per_micro_batch
    elif config.pack_micro_batches is True and ranks_per_micro_batch:
        raise ValueError(
            "pack_micro_batches: true changes which tokens token_scope micro_batch ranks together (it "
            "ranks each micro-batch): set pack_micro_batches: false, or token_scope: batch"
        )


def check_selection_loss(config: D3SConfig) -> None:
    """What TRL's loss offers that the selection loss does not compute, refused up front with the reason
    (docs/fidelity/objectives.md, "What composes")."""
    if not config.uses_selection_loss():
        return
    unsupported = {
        "loss_type": (
            config.loss_type not in SELECTION_LOSSES,
            f"one of {', '.join(SELECTION_LOSSES)} (vespo's gamma weight is a function of every token ratio "
            "of a rollout and of vLLM's weights, with no written form on the kept tokens T yet)",
        ),
        "use_liger_kernel": (config.use_liger_kernel, "false (Liger's fused loss is TRL's own loss)"),
        # TRL's entropy mask acts inside TRL's loss only, which the selection loss replaces
        "top_entropy_quantile": (
            config.top_entropy_quantile < 1.0,
            "1.0 (a second token ranking on top of the method's own token level: select tokens with "
            "token_rule entropy and token_keep_ratio instead, as method entropy_8020 does)",
        ),
    }
    for name, (refused, wanted) in unsupported.items():
        if refused:
            raise ValueError(
                f"method {config.method!r} trains with the selection loss (d3s/objective.py, "
                f"docs/fidelity/objectives.md), which needs {name} {wanted}; "
                f"got {getattr(config, name)!r}. Change {name}, or train method grpo (TRL's own loss)"
            )


def check_scope_switch(config: D3SConfig) -> None:
    """The adaptive scope: cross-group selection switched to intra-group by a signal of every step's log."""
    threshold = config.scope_switch_threshold
    if not threshold:
        return
    signal = config.scope_switch_signal
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"scope_switch_threshold must be a number (0: off); got {threshold!r}")
    if signal == "grad_norm_spike" and threshold <= 1:
        raise ValueError(
            "scope_switch_threshold must be 0 (off) or a ratio > 1 to the median gradient norm under "
            f"scope_switch_signal grad_norm_spike; got {threshold!r}"
        )
    if config.sample_rule == "none" or config.sample_scope != "batch":
        raise ValueError(
            "scope_switch_threshold switches cross-group selection to intra-group: it needs a "
            f"sample_rule and sample_scope batch (got sample_rule {config.sample_rule!r}, sample_scope "
            f"{config.sample_scope!r}); set scope_switch_threshold: 0 or sample_scope: batch"
        )
    if config.logging_steps != 1 or config.logging_strategy != "steps":
        reads = "mean reward" if signal == "early_reward" else "gradient norm"
        raise ValueError(
            f"scope_switch_threshold reads every step's {reads} from the trainer's log: set "
            f"logging_steps: 1 (got {config.logging_steps}, logging_strategy {config.logging_strategy!r})"
        )


def check_token_loss(config: D3SConfig) -> None:
    """Combinations of the token level with the loss that cannot mean what they say, refused up front."""
    if config.token_rule == "none":
        return
    sequence_level = config.importance_sampling_level == "sequence"
    if config.token_scope == "micro_batch" and (sequence_level or config.token_norm == "selected"):
        raise ValueError(
            "token_scope micro_batch chooses the token mask inside the loss, too late for sequence-level "
            "ratios or token_norm selected, which need it before: set token_scope: batch"
        )
    if sequence_level and config.loss_type not in SEQUENCE_LEVEL_LOSSES:
        raise ValueError(
            "importance_sampling_level sequence with token selection averages the ratio over the kept "
            f"tokens; loss_type {config.loss_type!r} then sums that one ratio over every kept token, "
            f"weighting each rollout by its kept length: use loss_type {', '.join(SEQUENCE_LEVEL_LOSSES)}"
        )
    if config.kl_tokens == "all" and (sequence_level or config.token_norm == "selected"):
        raise ValueError(
            "kl_tokens all needs token_norm all and token-level ratios (the kept tokens are the loss "
            "mask otherwise): set kl_tokens: selected"
        )
