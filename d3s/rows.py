"""A generation batch re-indexed by the kept rollouts, each rank taking an equal share (sample selection)."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from d3s.selection import corrected_loss_mask

# Per-rollout tensors of TRL's generation batch that are left-padded: they pad first when pooled across ranks.
_LEFT_PADDED = {"prompt_ids", "prompt_mask"}


def keep_rows(
    output: dict,
    kept: torch.Tensor,
    kept_advantages: torch.Tensor,
    accelerator: Accelerator,
    pad_token_id: int,
) -> dict:
    """Index every per-rollout tensor by the kept rows, each rank taking an equal share."""
    num_processes, rank = accelerator.num_processes, accelerator.process_index
    local_rows = output["advantages"].shape[0]
    share = kept.numel() // num_processes  # D3SConfig validated the divisibility
    shares = kept.view(num_processes, share)
    owners = torch.arange(num_processes, device=kept.device).unsqueeze(1)
    rank_local = bool(((shares // local_rows) == owners).all())  # identical on every rank
    selected = dict(output)
    for key, value in output.items():
        if isinstance(value, list) and len(value) == local_rows:
            raise ValueError(f"rollout selection does not support list-valued generation output {key!r}")
        if key == "advantages" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.shape[0] != local_rows:
            raise ValueError(f"cannot down-sample generation output {key!r} of shape {tuple(value.shape)}")
        if rank_local:
            selected[key] = value[shares[rank] - rank * local_rows]
        else:  # cross-group selection left ranks uneven: pool the rows, then deal out equal shares
            pad = pad_token_id if key.endswith("_ids") else 0
            padded = accelerator.pad_across_processes(
                value, dim=1, pad_index=pad, pad_first=key in _LEFT_PADDED
            )
            selected[key] = accelerator.gather(padded)[shares[rank]]
    selected["advantages"] = kept_advantages.view_as(shares)[rank].to(output["advantages"].dtype)
    return selected


def loss_mask(batch: dict) -> torch.Tensor:
    """TRL's mask of the completion tokens that may train: ``completion_mask`` x ``tool_mask`` (the mask of
    TRL's loss, of its vLLM importance-sampling ratio, and of d3s's count of the rollouts it zeroed). The one
    place d3s builds it; ``valid_tokens`` narrows it further."""
    return batch["completion_mask"] * batch.get("tool_mask", 1)


def valid_tokens(excludes_zeroed: bool, batch: dict) -> torch.Tensor:
    """m: the completion tokens that may train (``loss_mask``), without what vLLM's correction zeroed (when
    excluded)."""
    valid = loss_mask(batch)
    if excludes_zeroed and "importance_sampling_ratio" in batch:
        valid = corrected_loss_mask(batch["importance_sampling_ratio"], valid)
    return valid
