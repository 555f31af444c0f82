"""Packing: an optimizer step's kept rows in as few micro-batches as ``per_device_train_batch_size`` holds.

TRL splits every generation batch into ``steps_per_generation`` micro-batches of equal rows, and an optimizer
step takes ``gradient_accumulation_steps`` of them. After sample selection each holds N/G of GRPO's rows: D3S
at N = 8 of 32 ran four 2-row forward passes where one 8-row pass does (issue 48; on a GPU a 2-row
micro-batch costs nearly an 8-row one). Packing joins the micro-batches of each optimizer step and cuts the
rows again into ceil(rows / per_device_train_batch_size) near-equal micro-batches, placed in the step's last
slots. The slots before them are empty: no forward, no backward. The last slot, where DDP all-reduces the
accumulated gradient, is always a real backward.

Exactness: a micro-batch's loss divides its terms by a normaliser of its own rows (the rows or tokens it
counts, docs/fidelity/trainer.md), so packing would change the weights of the rows. Each row carries the scale
its unpacked micro-batch gave it (``LOSS_ROW_SCALE``, from d3s/objective.py ``loss_row_scale``), so the step's
gradient is the unpacked sum in another order, for every loss type. The functions are pure dict and tensor
code; ``PackedMicroBatches`` is the trainer's side (a mixin of D3STrainer, before GRPOTrainer in its MRO).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.utils import logging

from d3s.objective import loss_row_scale

logger = logging.get_logger(__name__)

EMPTY = "packed_away"  # the key of an empty slot: its rows went to a later micro-batch of the step
LOSS_ROW_SCALE = "loss_row_scale"  # per row: the loss's normaliser in the row's unpacked micro-batch


def empty_slot() -> dict[str, Any]:
    return {EMPTY: True}


def is_empty(batch: dict[str, Any]) -> bool:
    return bool(batch.get(EMPTY, False))


def rows_of(batch: dict[str, Any]) -> int:
    """The rows of a micro-batch (its first value with a leading dimension, as TRL's split reads it)."""
    for value in batch.values():
        if isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() > 0):
            return len(value)
    raise ValueError("a micro-batch without any per-row value has no rows")


def join(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rows of ``batches`` in order, as one batch: the inverse of TRL's ``split_tensor_dict``
    (per-row tensors and lists joined, a 0-dim tensor taken once, None kept)."""
    joined: dict[str, Any] = {}
    for key, first in batches[0].items():
        values = [batch[key] for batch in batches]
        if first is None or (isinstance(first, torch.Tensor) and first.dim() == 0):
            joined[key] = first
        elif isinstance(first, list):
            joined[key] = [item for value in values for item in value]
        elif isinstance(first, torch.Tensor):
            joined[key] = torch.cat(values, dim=0)
        else:
            raise ValueError(f"cannot pack the micro-batch value {key!r} of type {type(first).__name__}")
    return joined


def cut(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """``batch``'s rows in ``parts`` near-equal micro-batches, in order (the first ones one row larger)."""
    rows = rows_of(batch)
    sizes = [rows // parts + (1 if part < rows % parts else 0) for part in range(parts)]
    pieces, start = [], 0
    for size in sizes:
        piece = {}
        for key, value in batch.items():
            per_row = isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() > 0)
            piece[key] = value[start : start + size] if per_row else value
        pieces.append(piece)
        start += size
    return pieces


def packed_micro_batches(rows: int, rows_per_micro_batch: int) -> int:
    """The micro-batches ``rows`` rows take at most ``rows_per_micro_batch`` to a micro-batch."""
    return max(1, math.ceil(rows / rows_per_micro_batch))


def pack_step(
    slots: Sequence[dict[str, Any]],
    rows_per_micro_batch: int,
    row_scale: Callable[[dict[str, Any]], torch.Tensor],
) -> list[dict[str, Any]]:
    """One optimizer step's micro-batches, packed: as many slots as given, the rows in the last
    ceil(rows / rows_per_micro_batch), the ones before empty. ``row_scale(micro_batch)`` is the per-row
    normaliser of the loss in an unpacked micro-batch. Slots that pack no tighter are returned unchanged."""
    rows = sum(rows_of(slot) for slot in slots)
    packed = packed_micro_batches(rows, rows_per_micro_batch)
    if packed >= len(slots):
        return list(slots)
    scaled = [{**slot, LOSS_ROW_SCALE: row_scale(slot)} for slot in slots]
    return [empty_slot() for _ in range(len(slots) - packed)] + cut(join(scaled), packed)


def pack_generation_batch(
    slots: Sequence[dict[str, Any]],
    accumulation: int,
    rows_per_micro_batch: int,
    row_scale: Callable[[dict[str, Any]], torch.Tensor],
) -> list[dict[str, Any]]:
    """TRL's micro-batches of a generation batch (``steps_per_generation`` of them), each optimizer step's
    ``accumulation`` packed on their own: rows never move from one optimizer step to another."""
    if len(slots) % accumulation:
        raise ValueError(
            f"{len(slots)} micro-batches per generation batch are not whole optimizer steps of {accumulation}"
        )
    packed: list[dict[str, Any]] = []
    for start in range(0, len(slots), accumulation):
        packed += pack_step(slots[start : start + accumulation], rows_per_micro_batch, row_scale)
    return packed


class PackedMicroBatches:
    """D3STrainer's packing: each optimizer step's micro-batches packed, once TRL cut a generation batch."""

    def _setup_packing(self) -> None:
        """Whether this run packs: the selection loss, ``pack_micro_batches``, and nothing that blocks it."""
        blocker = self._packing_blocker() if self.owns_loss and self.args.pack_micro_batches else None
        if blocker:  # one line, and docs/fidelity/trainer.md says so
            logger.warning("pack_micro_batches is off: %s", blocker)
        self.packs_micro_batches = self.owns_loss and self.args.pack_micro_batches and blocker is None

    def _prepare_inputs(self, generation_batch):
        """TRL's micro-batch of this step; once TRL split a new generation batch, its micro-batches packed."""
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.packs_micro_batches and self.model.training and self._buffered_inputs is not before:
            self._buffered_inputs = pack_generation_batch(
                self._buffered_inputs,
                self.args.gradient_accumulation_steps,
                self.args.per_device_train_batch_size,
                self._unpacked_row_scale,
            )
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _unpacked_row_scale(self, micro_batch: dict) -> torch.Tensor:
        """Each row's loss normaliser in TRL's (unpacked) micro-batch, which packing keeps: exact packing."""
        valid, rows_counted, _ = self._loss_rows(micro_batch)
        token_mask = micro_batch.get("token_mask")
        kept = valid if token_mask is None else valid * token_mask
        return loss_row_scale(
            self.objective,
            self.objective.loss_mask(valid, kept),
            rows_counted,
            self.args.gradient_accumulation_steps,
            self._dapo_denominator(micro_batch),
        )

    def _empty_micro_batch_loss(self) -> torch.Tensor:
        """The loss of a slot packing emptied: zero, no forward, a backward that reaches no weight. The last
        micro-batch of a step is never empty (DDP all-reduces in its backward); if it were, rows were lost."""
        if self.accelerator.sync_gradients:
            raise RuntimeError(
                "packing left the last micro-batch of an optimizer step empty: set pack_micro_batches: false "
                "and report the geometry (steps_per_generation, gradient_accumulation_steps)"
            )
        return torch.zeros((), device=self.accelerator.device, requires_grad=True)

    def _packing_blocker(self) -> str | None:
        """Why this run trains TRL's micro-batches although packing is on; None when it packs."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            engine = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
            return (
                f"{engine} counts the micro-steps of its accumulation boundary itself, and an empty "
                "micro-step with no backward would shift it"
            )
        if self.aux_loss_enabled or self._entropy_bonus_enabled:
            term = "the router's aux loss" if self.aux_loss_enabled else "the entropy bonus"
            return f"{term} is a statistic of each micro-batch's tokens, which packing regroups"
        if self.args.steps_per_generation % self.args.gradient_accumulation_steps:
            return (
                f"steps_per_generation ({self.args.steps_per_generation}) is not a multiple of "
                f"gradient_accumulation_steps ({self.args.gradient_accumulation_steps}): an optimizer step "
                "spans generation batches"
            )
        return None
