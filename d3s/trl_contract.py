"""What d3s needs from TRL beyond its public API, in one place, checked when d3s.trainer is imported.

TRL has no hook to filter rollouts before its log-prob passes (docs/trl-hooks-proposal.md), so the trainer
overrides private methods of ``GRPOTrainer``, pinned to one TRL version (DEVELOPERS.md, "The TRL contract").
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass

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
    "_get_per_token_logps_and_entropies": "TrlLogprobPasses: old-policy entropies; deferred placeholders",
    "_prepare_inputs": "PackedMicroBatches: packs the micro-batches TRL cut a generation batch into",
    "training_step": "SelectionMetrics: after a step's last micro-batch, one entry per metric for the step",
    "log": "SelectionMetrics: adds selection/update_tokens_cumulative and the step total of update_tokens, "
    "then TRL's log",
    "_save_checkpoint": "CheckpointSaveErrors: a full disk ends in one line naming the checkpoint",
    "_load_optimizer_and_scheduler": "CpuRanksOptimizerLoad: CPU ranks load on the CPU (under GRPOTrainer's)",
}
# The transformers.Trainer methods among OVERRIDES, and those called: checked against the pinned transformers.
TRANSFORMERS_TRAINER_METHODS = (
    "log",
    "_prepare_inputs",  # GRPOTrainer's replaces Trainer's; D3STrainer's wraps GRPOTrainer's
    "training_step",  # GRPOTrainer's wraps Trainer's; SelectionMetrics' wraps GRPOTrainer's
    "_save_checkpoint",
    "_load_optimizer_and_scheduler",  # replaced below GRPOTrainer's own (d3s/callbacks/optimizer_load.py)
    "_get_output_dir",  # CheckpointSaveErrors: the checkpoint's folder, named in a full-disk error
)
# Attributes of a built GRPOTrainer that are read (checked once the trainer is built).
TRAINER_ATTRIBUTES = (
    "_metrics",  # the per-step metric lists TRL averages in log()
    "_buffered_inputs",  # with the next one: TRL's micro-batches of a generation batch, which packing packs
    "_step",
    "is_deepspeed_enabled",  # with the next one (transformers.Trainer's): no packing under DeepSpeed, FSDP
    "is_fsdp_enabled",
    "reward_weights",
    "num_generations",
    "scale_rewards",
    "_tokenizer",
    "temperature",  # kept-token head: log-probs of logits / temperature, as TRL's
    "beta",  # kept-token head: a KL over every token needs every token's log-prob
    "epsilon_low",  # with the next one: the clip fractions logged from the selection loss's ratio
    "epsilon_high",
    "aux_loss_enabled",  # with the next one: the router's aux loss, added to the selection loss as in TRL
    "router_aux_loss_coef",
    "_entropy_bonus_enabled",  # with the next four: the entropy bonus and its adaptive controller's state
    "entropy_coef",
    "use_adaptive_entropy",
    "_last_world_entropy",
    "_entropy_window_stats",
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
# VLLMGeneration attributes read by d3s/vllm_engine.py (tests/test_trl_contract.py: VLLMGeneration sets them).
VLLM_GENERATION_ATTRIBUTES = (
    "mode",  # only the colocated engine's sync is replaced; a server syncs itself
    "llm",  # the colocated engine, whose model runner reloads the synced weights
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


@dataclass(frozen=True)
class ScoringPass:
    """One log-prob pass of TRL's ``_generate_and_score_completions`` (a no-gradient call of
    ``_get_per_token_logps_and_entropies``), which D3STrainer tells apart by its place in SCORING_PASSES."""

    name: str
    output_key: str  # the generation output TRL fills from the pass (and leaves out when it skips it)
    condition: str  # TRL's condition for running it, as TRL 1.16 writes it (ast.unparse)
    why: str


# TRL's log-prob passes while it scores a generation batch, in the order it runs them (grpo_trainer.py, the
# no-gradient block after the rewards). D3STrainer evaluates each condition before TRL scores and names each
# call of _get_per_token_logps_and_entropies by the next expected pass: no guess from the model's identity or
# the grad mode, which cannot tell the old-policy pass from the reference pass of a PEFT model (the same
# module, its adapter disabled). After scoring, each output_key must be present exactly when its pass was
# expected, so a TRL that reorders, adds or skips a pass fails loudly (TrlLogprobPasses._trl_scoring), and
# tests/test_trl_contract.py checks the order and the conditions against TRL's source.
SCORING_PASSES = (
    ScoringPass(
        "old_policy",
        "old_per_token_logps",
        "self.args.gradient_accumulation_steps % generate_every != 0 or "
        "(self.use_vllm and self.vllm_importance_sampling_correction)",
        "its entropies rank the token level (no pass of d3s's own); with vLLM's masked ratio it runs before "
        "selection even when the others are deferred",
    ),
    ScoringPass(
        "reference",
        "ref_per_token_logps",
        "self.beta != 0.0",
        "the KL's reference; deferred past selection with the old-policy pass (savings/deferred.py)",
    ),
)


@dataclass(frozen=True)
class CopiedTrlCode:
    """TRL code that d3s copies because TRL offers no function to call: the copy, and the TRL blocks copied,
    pinned by the digest of their normalised AST (comments and layout do not count)."""

    copy: str  # "module:function" of d3s's copy
    trl_method: str  # the GRPOTrainer method that holds the copied blocks
    block_condition: str  # the copied blocks are the `if` statements of that method with this condition
    digests: tuple[str, ...]  # sha256 of ast.dump of each block, in source order
    why: str


# tests/test_trl_contract.py recomputes each digest from the installed TRL: a TRL that changes a copied block
# fails it, naming TRL's file and line and d3s's copy, which must then be ported and the digest updated.
COPIED_TRL_CODE = (
    CopiedTrlCode(
        copy="d3s.savings.deferred:DeferredLogprobPasses._importance_sampling_ratio",
        trl_method="_generate_and_score_completions",
        block_condition="self.use_vllm and self.vllm_importance_sampling_correction",
        digests=(
            "7d10f262bf357984746fb5dfebbedd406a8c74b0f2c9d2850e1e1134d6657dfe",  # the ratio (1.16: line 2660)
            "6b7863fe63fa942f2bcc2cc659de203e8adf43db976171d2781f5a042c061834",  # its metrics (line 2860)
            "7da35d11bb15b0d016539628391a8af16a0f7472981e48338673856bb886fa4b",  # the output key (line 2908)
        ),
        why="the vLLM importance-sampling ratio and its sampling/* metrics, which TRL computes inline while "
        "scoring: deferred passes recompute them on the kept rollouts and replace the metrics TRL logged "
        "from the placeholders (their names are TRL's, in the pinned blocks)",
    ),
)


def trl_blocks(method: str, condition: str) -> list[tuple[str, int, ast.If]]:
    """The ``if <condition>:`` statements of GRPOTrainer.``method``, in source order: (TRL's file, line,
    node)."""
    from trl import GRPOTrainer

    function = getattr(GRPOTrainer, method)
    lines, first = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    path = inspect.getsourcefile(function) or "trl/trainer/grpo_trainer.py"
    blocks = [
        (path, first + node.lineno - 1, node)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == condition
    ]
    return sorted(blocks, key=lambda block: block[1])


def block_digest(node: ast.AST) -> str:
    """sha256 of a statement's AST without positions: its code, comments and layout aside."""
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode()).hexdigest()


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
