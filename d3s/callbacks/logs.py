"""What a D3S run writes besides checkpoints: metrics.jsonl, the anatomy log, and the NaN stop."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log entry as one JSON line: what the analysis reads."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        append_jsonl(self.path, {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}})


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
                f"{', '.join(bad)} is NaN at step {state.global_step}; training stopped before saving this "
                f"step. Resume from the last checkpoint in {args.output_dir} with a lower learning_rate or "
                "check the reward"
            )


# ---- the anatomy log (D3SConfig.anatomy_every): what selection did, for the selection_anatomy notebook -----


def append_anatomy(output_dir: str, record: dict) -> None:
    append_jsonl(os.path.join(output_dir, "anatomy.jsonl"), record)


def sample_anatomy(
    step: int,
    keep: int,
    num_generations: int,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    kept: torch.Tensor,
) -> dict:
    """Per group: the summed rewards, the advantages and which rollouts were kept (gathered batch)."""
    G = num_generations  # noqa: N806 - the paper's symbol
    kept_mask = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
    kept_mask[kept] = True
    columns = {"rewards": rewards, "advantages": advantages, "kept": kept_mask}
    rows = {name: values.view(-1, G).tolist() for name, values in columns.items()}  # one row a group
    groups = [dict(zip(rows, group, strict=True)) for group in zip(*rows.values(), strict=True)]
    return {"kind": "samples", "step": step, "keep_per_prompt": keep, "num_generations": G, "groups": groups}


def informative_rows(advantages: torch.Tensor, any_kept: torch.Tensor, count: int) -> list[int]:
    """Up to ``count`` row indices: first the rows with A != 0 and a selected token, alternating A > 0 and
    A < 0 (each sign in row order), then the other rows in order."""
    positive = [i for i in range(len(advantages)) if advantages[i] > 0 and any_kept[i]]
    negative = [i for i in range(len(advantages)) if advantages[i] < 0 and any_kept[i]]
    alternating = [i for pair in itertools.zip_longest(positive, negative) for i in pair if i is not None]
    rest = [i for i in range(len(advantages)) if i not in set(alternating)]
    return (alternating + rest)[:count]


def token_anatomy(
    step: int,
    token_keep_ratio: float,
    loss_inputs: dict,
    entropies: torch.Tensor,
    scores: torch.Tensor,
    keep: torch.Tensor,
    mask: torch.Tensor,
    examples: int,
    decode: Callable[[list[int]], str],
) -> dict:
    """``examples`` completions of a micro-batch: tokens, entropies, scores and the token mask. Rows that show
    the token level come first (informative_rows), so a record is not all A = 0 rollouts, which score 0 on
    every token and keep none."""
    ids, advantages = loss_inputs["completion_ids"], loss_inputs["advantages"]
    row_advantages = advantages.float().reshape(ids.shape[0], -1).mean(1)
    records = []
    for row in informative_rows(row_advantages, (keep.bool() & mask.bool()).any(1), examples):
        valid = mask[row].bool()
        records.append(
            {
                "tokens": [decode([t]) for t in ids[row][valid].tolist()],
                "entropy": entropies[row][valid].detach().float().tolist(),
                "score": scores[row][valid].float().tolist(),
                "selected": keep[row][valid].tolist(),
                "advantage": float(row_advantages[row]),
            }
        )
    return {"kind": "tokens", "step": step, "token_keep_ratio": token_keep_ratio, "examples": records}
