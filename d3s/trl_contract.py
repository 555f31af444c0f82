"""What d3s needs from TRL beyond its public API, in one place, checked when d3s.trainer is imported.

TRL has no hook to filter rollouts before its log-prob passes (docs/trl-hooks-proposal.md), so the trainer
overrides private methods of ``GRPOTrainer``, pinned to one TRL version (DEVELOPERS.md, "TRL hooks").
"""

from __future__ import annotations

import importlib

TRL_VERSION = "1.16.0"
TRANSFORMERS_VERSION = "5.17.0"

# Every method of GRPOTrainer (its own, or inherited from transformers.Trainer) that a d3s class of
# D3STrainer's MRO overrides: the overriding class, and why.
# tests/test_trl_contract.py walks the MRO: an override missing here, or one TRL lacks, fails it.
OVERRIDES = {
    "__init__": "D3STrainer: accuracy_reward under answer_policy, vLLM's engine options, d3s's callbacks",
    "_calculate_rewards": "D3STrainer: keeps the gathered rewards, which TRL's scoring does not return",
    "_generate_and_score_completions": "D3STrainer: keeps the selected rollouts, chooses the token mask",
    "_compute_loss": "D3STrainer: TRL's loss for grpo; the selection loss replaces it (d3s/objective.py)",
    "_get_per_token_logps_and_entropies": "D3STrainer: old-policy entropies; savings: deferred placeholders",
    "log": "SelectionMetrics: adds selection/update_tokens_cumulative to a training log, then TRL's log",
    "_save_checkpoint": "CheckpointSaveErrors: a full disk ends in one line naming the checkpoint",
    "_load_optimizer_and_scheduler": "CpuRanksOptimizerLoad: CPU ranks load on the CPU (under GRPOTrainer's)",
}
# The transformers.Trainer methods among OVERRIDES, and those called: checked against the pinned transformers.
TRANSFORMERS_TRAINER_METHODS = (
    "log",
    "_save_checkpoint",
    "_load_optimizer_and_scheduler",  # replaced below GRPOTrainer's own (d3s/callbacks/optimizer_load.py)
    "_get_output_dir",  # CheckpointSaveErrors: the checkpoint's folder, named in a full-disk error
)
# Attributes of a built GRPOTrainer that are read (checked once the trainer is built).
TRAINER_ATTRIBUTES = (
    "_metrics",  # the per-step metric lists TRL averages in log()
    "reward_weights",
    "num_generations",
    "scale_rewards",
    "_tokenizer",
    "temperature",  # kept-token head: log-probs of logits / temperature, as TRL's
    "beta",  # kept-token head: a KL over every token needs every token's log-prob
    "epsilon_low",  # with the next one: the clip fractions logged from the selection loss's ratio
    "epsilon_high",
    "aux_loss_enabled",  # refused with the selection loss, which adds no router aux loss
    "ref_model",
    "num_iterations",  # with the next two: whether TRL runs its old-policy pass (the token entropies)
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",  # deferred passes: the vLLM importance-sampling ratio, recomputed
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)
# Attributes of a built GRPOTrainer with use_vllm (checked then).
VLLM_TRAINER_ATTRIBUTES = ("vllm_generation",)  # TRL's engine, whose weight sync vLLM's CPU backend replaces
# Attributes transformers.Trainer sets only once training runs (tests/test_trl_contract.py reads its source).
TRAINING_LOOP_ATTRIBUTES = (
    "current_gradient_accumulation_steps",  # the selection loss divides by it, as TRL's loss does
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

    for name in OVERRIDES:
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
    """Raise ImportError naming the first attribute of TRAINER_ATTRIBUTES (and, with vLLM,
    VLLM_TRAINER_ATTRIBUTES) a built trainer lacks."""
    for name in TRAINER_ATTRIBUTES + (VLLM_TRAINER_ATTRIBUTES if getattr(trainer, "use_vllm", False) else ()):
        if not hasattr(trainer, name):
            raise _mismatch(f"the GRPOTrainer attribute {name}")


check_trl_contract()
