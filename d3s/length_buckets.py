"""Log-prob passes by length: rows sorted by where their tokens end, in buckets each cut at its longest row.

TRL pads every rollout of a batch to the longest completion of the batch, and its log-prob passes (the old
policy's, the reference's, the loss's) run the whole padded width: on the tiny default a third of every pass
is padding (57 real tokens of 86 positions). Cutting right padding changes no token's log-prob or entropy (a
causal model's position t never sees t + 1 ...; left padding is kept: TRL's passes give the model no
position ids, so a prompt's offset is part of what they compute). Sorting rows by their last real token and
running buckets of ``bucket_rows`` rows, each cut at its own longest row, leaves most of the padding out.

The result is the same tensor as one pass over the padded batch, up to float rounding (the matrix kernels
sum in another order for another batch shape: 5e-6 in log-prob on the tiny model, see
tests/test_length_buckets.py), with zeros at the padding positions the buckets cut (TRL masks them everywhere
it reads them). Gradients flow through the reassembly. ``D3SConfig.length_bucket_rows`` switches it on (0:
TRL's passes, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# A pass on (input_ids, attention_mask, logits_to_keep) -> (log-probs, entropies or None, aux loss or None),
# each per-token tensor of shape (rows, logits_to_keep).
Pass = Callable[
    [torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
]


def row_ends(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row, one past the position of its last real token (0 for a row with none)."""
    positions = torch.arange(1, attention_mask.size(1) + 1, device=attention_mask.device)
    return (attention_mask.to(torch.long) * positions).amax(dim=1)


def length_buckets(
    attention_mask: torch.Tensor, bucket_rows: int, logits_to_keep: int
) -> list[tuple[torch.Tensor, int]]:
    """The buckets of a pass: (row indices, width to keep) each, rows sorted by their end (stably, so ties
    keep TRL's order), ``bucket_rows`` rows a bucket; a width never cuts into the prompt (at least one
    completion position stays, as TRL's pass needs one)."""
    if bucket_rows < 1:
        raise ValueError(f"bucket_rows must be >= 1, got {bucket_rows}")
    width = attention_mask.size(1)
    ends = row_ends(attention_mask)
    order = torch.argsort(ends, stable=True)
    smallest = width - logits_to_keep + 1
    return [(rows, max(int(ends[rows].max()), smallest)) for rows in order.split(bucket_rows)]


def bucketed_pass(
    run_pass: Pass,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    bucket_rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``run_pass`` over the batch in length buckets (module docstring), reassembled in the batch's order
    and width: the padding a bucket cut gets log-prob and entropy 0. An aux loss (MoE) is the mean over the
    buckets, as TRL averages it over its own chunks."""
    width = input_ids.size(1)
    buckets = length_buckets(attention_mask, bucket_rows, logits_to_keep)
    logps, entropies, aux_losses, order = [], [], [], []
    for rows, kept_width in buckets:
        keep = logits_to_keep - (width - kept_width)
        bucket_logps, bucket_entropies, aux = run_pass(
            input_ids[rows, :kept_width], attention_mask[rows, :kept_width], keep
        )
        cut = logits_to_keep - keep  # the padding columns this bucket left out, back as zeros
        logps.append(F.pad(bucket_logps, (0, cut)))
        if bucket_entropies is not None:
            entropies.append(F.pad(bucket_entropies, (0, cut)))
        if aux is not None:
            aux_losses.append(aux)
        order.append(rows)
    inverse = torch.argsort(torch.cat(order))  # sorted position of each original row
    all_logps = torch.cat(logps).index_select(0, inverse)
    all_entropies = torch.cat(entropies).index_select(0, inverse) if entropies else None
    aux_loss = torch.stack(aux_losses).mean() if aux_losses else None
    return all_logps, all_entropies, aux_loss
