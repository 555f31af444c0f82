"""What d3s needs from TRL beyond its public API, in one place, checked when d3s.trainer is imported.

TRL has no hook to filter rollouts before its log-prob passes (docs/trl-hooks-proposal.md), so the trainer
overrides private methods of ``GRPOTrainer``, pinned to one TRL version (DEVELOPERS.md, "TRL hooks").
"""

from __future__ import annotations

import importlib

TRL_VERSION = "1.16.0"
TRANSFORMERS_VERSION = "5.17.0"

# GRPOTrainer methods overridden or called, and what for.
TRAINER_METHODS = (
    "_calculate_rewards",  # the gathered rewards, which _generate_and_score_completions does not return
    "_generate_and_score_completions",  # select the kept rollouts and re-index the batch
    "_compute_loss",  # TRL's loss for grpo; the selection methods' loss replaces it (d3s/objective.py)
    "_get_per_token_logps_and_entropies",  # old-policy entropies; savings: placeholders, kept-token head
)
# transformers.Trainer methods overridden (d3s/callbacks/checkpoints.py).
TRANSFORMERS_TRAINER_METHODS = (
    "_load_optimizer_and_scheduler",  # multi-process CPU runs resume their optimizer state on the CPU
)
# Attributes of a built GRPOTrainer that are read (checked once the trainer is built).
TRAINER_ATTRIBUTES = (
    "_metrics",  # the per-step metric lists TRL averages in log()
    "reward_weights",
    "num_generations",
    "scale_rewards",
    "_tokenizer",
    "temperature",  # kept-token head: log-probs of logits / temperature, as TRL's
    "beta",  # with the next five: the selection loss's settings (d3s.objective.Objective)
    "loss_type",
    "importance_sampling_level",
    "epsilon_low",
    "epsilon_high",
    "max_completion_length",
    "_entropy_bonus_enabled",  # kept-token head: the bonus trains every token's entropy
    "aux_loss_enabled",  # refused with the selection loss, which adds no router aux loss
    "ref_model",
    "num_iterations",  # with the next two: whether TRL runs its old-policy pass (the token entropies)
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",  # deferred passes: the vLLM importance-sampling ratio, recomputed
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)
# VLLMGeneration (trl.generation.vllm_generation) methods used by d3s/vllm_engine.py on vLLM's CPU backend.
VLLM_GENERATION_METHODS = (
    "sync_weights",  # the colocate sync, replaced by an exact one (vLLM's layer-wise reload, the tied head)
    "_iter_named_params",  # the trained weights under vLLM's names, one gathered at a time (ZeRO-3, FSDP)
)
# Helpers imported from TRL modules outside its public API.
MODULE_NAMES = {
    "trl.trainer.utils": (
        "nanmax",
        "nanmin",
        "use_adapter",
        "maybe_gather_lm_head_ctx",
        # the fused head GRPOTrainer puts on the policy: the kept-token head calls the model with
        # fused_lm_head=True and no label to score (d3s/savings/kept_head.py); memory_trace.py adds it too
        "add_fused_lm_head",
    ),
    "trl.models.utils": ("disable_gradient_checkpointing",),
    "trl.kernels": ("ChunkedLogProbFunction", "chunked_logprob"),  # chunked_logprob: memory_trace.py
    # LLM: the engine class TRL builds its colocated engine with, given a dtype while it does (vllm_dtype)
    "trl.generation.vllm_generation": ("VLLMGeneration", "LLM"),
}


def _mismatch(missing: str) -> ImportError:
    import trl

    return ImportError(
        f"d3s relies on {missing} of TRL {TRL_VERSION} (the pinned version; d3s/trl_contract.py lists every "
        f"private name it uses), which the installed TRL {trl.__version__} does not have. Install "
        f"trl=={TRL_VERSION}, or port d3s/trainer.py and d3s/savings/ to this TRL."
    )


def check_trl_contract() -> None:
    """Raise ImportError naming the pinned TRL version and the first private name TRL lacks."""
    from trl import GRPOTrainer
    from trl.import_utils import is_vllm_available

    for name in TRAINER_METHODS:
        if not callable(getattr(GRPOTrainer, name, None)):
            raise _mismatch(f"GRPOTrainer.{name}")
    for module_name, names in MODULE_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise _mismatch(f"the module {module_name}") from None
        for name in names:
            if name == "LLM" and not is_vllm_available():  # TRL imports it only when vLLM is installed
                continue
            if not hasattr(module, name):
                raise _mismatch(f"{module_name}.{name}")
    from transformers import Trainer

    for name in TRANSFORMERS_TRAINER_METHODS:
        if not callable(getattr(Trainer, name, None)):
            import transformers

            raise ImportError(
                f"d3s relies on transformers.Trainer.{name} of transformers {TRANSFORMERS_VERSION} (the "
                f"pinned version; d3s/trl_contract.py), which the installed {transformers.__version__} does "
                f"not have. Install transformers=={TRANSFORMERS_VERSION}, or port d3s/callbacks/."
            )
    from trl.generation.vllm_generation import VLLMGeneration

    for name in VLLM_GENERATION_METHODS:
        if not callable(getattr(VLLMGeneration, name, None)):
            raise _mismatch(f"VLLMGeneration.{name}")


def check_trainer_attributes(trainer: object) -> None:
    """Raise ImportError naming the first attribute of TRAINER_ATTRIBUTES a built trainer lacks."""
    for name in TRAINER_ATTRIBUTES:
        if not hasattr(trainer, name):
            raise _mismatch(f"the GRPOTrainer attribute {name}")


check_trl_contract()
