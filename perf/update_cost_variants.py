"""perf/update_cost.py's variants and one update of each as training runs it: GRPO on every rollout, D3S on
its kept rows (N of G rollouts, K of their tokens) in TRL's micro-batches, packed (d3s/packing.py), and with
the masked LM head; a D3STrainer set up as ``Trainer.train`` sets it up (:func:`make_trainer`), the step's
micro-batches, the gradient accumulated over them and the optimizer step (:func:`update`), the kept rows
(:func:`kept_rows`) and the token mask chosen from a no-gradient pass's entropies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _common import build_tiny_trainer

G, KEEP, TOKEN_RATIO = 32, 8, 0.05
D3S_OVERRIDES = {"keep_per_prompt": KEEP, "token_keep_ratio": TOKEN_RATIO, "schedule": "constant"}
KEPT_HEAD, MASKED_HEAD = {"kept_token_logprobs": True}, {"kept_token_logprobs": False}
VARIANTS = {  # name -> (method, trainer overrides, rows it trains on)
    "grpo": ("grpo", {}, "all"),
    # TRL's micro-batches: D3S's kept rows in as many micro-batches as GRPO's rows, N/G as large
    "d3s": ("d3s", D3S_OVERRIDES | KEPT_HEAD | {"pack_micro_batches": False}, "kept"),
    # d3s/packing.py: an optimizer step's kept rows in ceil(rows / per_device_train_batch_size) micro-batches
    "d3s (packed)": ("d3s", D3S_OVERRIDES | KEPT_HEAD | {"pack_micro_batches": True}, "kept"),
    "d3s (masked head)": ("d3s", D3S_OVERRIDES | MASKED_HEAD | {"pack_micro_batches": False}, "kept"),
}


def make_trainer(
    variant: str,
    model: Path | Any,
    out: Path,
    micro_batch: int,
    rows: int,
    device: str = "cpu",
    weights: str = "fp32",
    checkpointing: bool = True,
    max_completion_length: int = 64,
) -> Any:
    """A D3STrainer for ``variant`` set up as ``Trainer.train`` does (checkpointing, optimizer), accumulating
    ``rows`` (GRPO's rollouts per optimizer step) in micro-batches of ``micro_batch`` rows."""
    if rows % micro_batch:
        raise ValueError(f"rollouts per step ({rows}) must be a multiple of the micro-batch ({micro_batch})")
    method, overrides, _ = VARIANTS[variant]
    settings: dict[str, Any] = {
        "num_generations": G,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": rows // micro_batch,
        "gradient_checkpointing": checkpointing,
        "max_completion_length": max_completion_length,
    }
    if device == "cuda":
        settings |= {"bf16": True, "use_cpu": False}
    trainer = build_tiny_trainer(method, model, out / variant.replace(" ", "_"), 1, **settings, **overrides)
    if weights == "bf16":
        trainer.model.to(torch.bfloat16)
    if checkpointing:  # as Trainer._inner_training_loop turns it on (no every_n_layers or offload here)
        kwargs = trainer.args.gradient_checkpointing_kwargs
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs or {}) or None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    trainer.create_optimizer()
    return trainer


def micro_batches(trainer: Any, batch: dict, split: bool = True) -> list[dict]:
    """The micro-batches the update runs, with a forward and a backward each: TRL's split of the step's batch
    into ``steps_per_generation`` parts (``split``; as ``_prepare_inputs`` splits it, without its shuffle,
    which timing does not depend on), packed as the trainer packs them (``trainer.packs_micro_batches``, its
    empty slots left out: no forward, no backward), or the whole batch in one pass."""
    from trl.trainer.utils import split_tensor_dict

    from d3s.packing import is_empty, pack_generation_batch

    if not split:
        return [batch]
    parts = split_tensor_dict(batch, trainer.args.steps_per_generation)
    if trainer.packs_micro_batches:
        args = trainer.args
        parts = pack_generation_batch(
            parts,
            args.gradient_accumulation_steps,
            args.per_device_train_batch_size,
            trainer._unpacked_row_scale,
        )
    return [part for part in parts if not is_empty(part)]


def accumulate_gradient(trainer: Any, batch: dict, split: bool = True) -> None:
    """Backward of the step's loss, micro-batch by micro-batch (``micro_batches``); then the step's metrics
    closed, as the training loop closes them after an optimizer step's last micro-batch."""
    from d3s.packing import rows_of

    trainer.model.train()
    if "token_mask" not in batch and trainer.args.token_rule != "none":
        # chosen once per generation batch, before the update: the warm-up call adds it, timed calls reuse it
        batch["token_mask"] = token_mask(trainer, batch)
    tokens_before = trainer.update_tokens_total
    parts = micro_batches(trainer, batch, split)
    for part in parts:
        with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(trainer.model, part)
        trainer.accelerator.backward(loss)
    trainer._close_step_metrics()  # update_tokens_total grows here, once per optimizer step
    # log-probs that reached the gradient, and the rows of each forward pass
    trainer.trained_tokens = trainer.update_tokens_total - tokens_before
    trainer.micro_batch_rows = [rows_of(part) for part in parts]


def token_mask(trainer: Any, batch: dict) -> torch.Tensor:
    """The batch's token mask as the trainer chooses it: d3s.selection on a no-gradient pass's entropies."""
    from d3s.selection import token_keep_mask, token_scores

    scores = token_scores(batch["advantages"], token_entropies(trainer, batch), trainer.args.token_rule)
    ratio = trainer.selection_schedule.token_keep_ratio(0.0)
    return token_keep_mask(scores, batch["completion_mask"].bool(), ratio, trainer.args.token_scope)


def update(trainer: Any, batch: dict) -> None:
    """One optimizer step: the micro-batches' backward passes, clipping, AdamW."""
    trainer.optimizer.zero_grad(set_to_none=True)
    accumulate_gradient(trainer, batch)
    if trainer.args.max_grad_norm:
        trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kept_rows(full: dict, keep: int = KEEP) -> dict:
    """D3S's cross-group max-variance selection of ``keep`` rollouts per prompt (d3s.selection)."""
    from d3s.selection import select_samples

    advantages, rows = full["advantages"], full["advantages"].shape[0]
    kept = select_samples(advantages.cpu(), advantages.cpu(), G, keep, "max_variance", "batch")
    kept = kept.to(advantages.device)
    kept_batch = {k: (v[kept] if v.dim() and v.shape[0] == rows else v) for k, v in full.items()}
    kept_batch["num_items_in_batch"] = kept_batch["completion_mask"].sum()
    return kept_batch


def token_entropies(trainer: Any, full: dict) -> torch.Tensor:
    """Token entropies (nats) of the trainer's model on ``full``: TRL's scoring pass, without gradient."""
    from trl.models.utils import disable_gradient_checkpointing

    input_ids = torch.cat([full["prompt_ids"], full["completion_ids"]], dim=1)
    attention = torch.cat([full["prompt_mask"], full["completion_mask"]], dim=1)
    no_checkpointing = disable_gradient_checkpointing(
        trainer.model, trainer.args.gradient_checkpointing_kwargs
    )
    width, batch_size = full["completion_ids"].shape[1], trainer.args.per_device_train_batch_size
    with torch.no_grad(), no_checkpointing:
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention, width, batch_size=batch_size, compute_entropy=True
        )
    return entropies.float() * full["completion_mask"]
