"""perf/update_cost.py's truncation table: what stopping every kept rollout at its last selected token would
save (tokens, FLOPs of Qwen2.5-Math-1.5B, padded micro-batch columns) at the linear schedule's points, on the
tiny model's own rollouts and on labelled MODELS of token entropies (not measurements)."""

from __future__ import annotations

import torch
from update_cost_geometry import PROMPT_TOKENS
from update_cost_variants import G, kept_rows

# Forward FLOPs of one token at position t in Qwen2.5-Math-1.5B: 2 x (non-embedding parameters + the LM head)
# + 4 x layers x hidden x t (attention scores and weighted sum). The backward pass and checkpointing's
# recompute scale both terms alike, so the ratio of FLOPs saved is the same for forward + backward.
_FLOPS_PER_TOKEN = 2 * 1_543_714_304  # Qwen2.5-Math-1.5B parameters: the body and the (tied) LM head
_FLOPS_PER_POSITION = 4 * 28 * 1536

# A labelled MODEL of token entropies (nats) at 3,000 tokens, not a measurement. Most reasoning tokens are
# near certain and about one in five is a high-entropy "forking" token (the 80/20 observation of Wang et al.,
# 2025, arXiv 2506.01939). Each scenario moves where in the completion the forking tokens fall.
ENTROPY_MODELS = {
    "stationary": "20 % forking tokens (H ~ LogNormal(0, 0.5)), the rest H ~ Exp(mean 0.05), anywhere",
    "falling": "forking share 30 % at the first token, falling linearly to 10 % at the last",
    "rising": "forking share 10 % at the first token, rising linearly to 30 % at the last",
    "answer tail": "stationary, and a finished completion's last 60 tokens (the stated answer) "
    "H ~ Exp(mean 0.02)",
}


def modelled_rollouts(scenario: str, prompts: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Entropies, completion mask, advantages and prompt lengths of prompts x G rollouts under a scenario of
    ``ENTROPY_MODELS``, with the lengths and rewards perf/README.md describes (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    rows = prompts * G
    finished = torch.rand(rows, generator=gen) >= 0.3
    lengths = torch.where(
        finished,
        torch.randint(max_tokens // 5, max_tokens + 1, (rows,), generator=gen),
        torch.tensor(max_tokens),
    )
    position = torch.arange(max_tokens).float() / max(1, max_tokens - 1)
    share = {"falling": 0.3 - 0.2 * position, "rising": 0.1 + 0.2 * position}.get(
        scenario, torch.full_like(position, 0.2)
    )
    forking = torch.rand(rows, max_tokens, generator=gen) < share
    high = torch.exp(0.5 * torch.randn(rows, max_tokens, generator=gen))
    low = -0.05 * torch.log(torch.rand(rows, max_tokens, generator=gen).clamp(min=1e-12))
    answer = -0.02 * torch.log(torch.rand(rows, max_tokens, generator=gen).clamp(min=1e-12))
    entropies = torch.where(forking, high, low)
    index = torch.arange(max_tokens)
    if scenario == "answer tail":  # every scenario draws the same numbers: they differ only in where
        tail = finished[:, None] & (index >= lengths[:, None] - 60)
        entropies = torch.where(tail, answer, entropies)
    mask = (index < lengths[:, None]).long()
    p = 0.1 + 0.8 * torch.rand(prompts, 1, generator=gen)
    rewards = (torch.rand(prompts, G, generator=gen) < p).float()
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    full = {"entropies": entropies * mask, "completion_mask": mask, "advantages": advantages}
    return full | {"prompt_lengths": torch.full((rows,), PROMPT_TOKENS)}


def tail_after_last_selected(
    entropies: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    prompt_lengths: torch.Tensor,
    token_keep_ratio: float,
    micro_batch_rows: int,
) -> dict[str, float]:
    """What stopping every rollout at its last selected token would save under D3S's token selection, per
    micro-batch of ``micro_batch_rows`` rows: the fractions of tokens, of FLOPs and of padded columns."""
    from d3s.selection import token_keep_mask, token_scores

    saved = total = saved_flops = total_flops = saved_padded = total_padded = 0.0
    for start in range(0, entropies.shape[0], micro_batch_rows):
        part = slice(start, start + micro_batch_rows)
        mask, prompt = completion_mask[part], prompt_lengths[part]
        scores = token_scores(advantages[part], entropies[part], "adv_entropy")
        keep = token_keep_mask(scores, mask, token_keep_ratio, "batch")
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=1)  # -1: nothing kept
        lengths = mask.sum(dim=1)
        saved += float((lengths - (last + 1)).sum())
        total += float((lengths + prompt).sum())
        # FLOPs of positions prompt + last + 1 .. prompt + length - 1, against those of all positions
        n_all, n_kept = (prompt + lengths).double(), (prompt + last + 1).double()
        tail = n_all - n_kept
        total_flops += float((_FLOPS_PER_TOKEN * n_all + _FLOPS_PER_POSITION * n_all * (n_all - 1) / 2).sum())
        saved_flops += float((_FLOPS_PER_TOKEN + _FLOPS_PER_POSITION * (n_kept + n_all - 1) / 2) @ tail)
        total_padded += mask.shape[0] * (int(prompt.max()) + mask.shape[1])
        saved_padded += mask.shape[0] * (mask.shape[1] - (int(last.max()) + 1))
    return {
        "token_fraction_after_last_selected": saved / total,
        "flop_fraction_after_last_selected": saved_flops / total_flops,
        "padded_micro_batch_fraction": saved_padded / total_padded,
    }


# The linear schedule's pairs (p = 0, 1/3, 1): N rollouts kept per prompt with K of their tokens.
SCHEDULE_POINTS = [(8, 0.05), (16, 0.10), (32, 0.20)]


def truncation_rows(source: str, full: dict, micro_batch: int, rows_per_step: int) -> list[dict]:
    """tail_after_last_selected at each schedule point, after D3S's sample selection and TRL's split."""
    out = []
    for keep, ratio in SCHEDULE_POINTS:
        batch = kept_rows(full, keep)
        micro_rows = batch["advantages"].shape[0] // (rows_per_step // micro_batch)
        parts = (batch[key] for key in ("entropies", "completion_mask", "advantages", "prompt_lengths"))
        out.append(
            {
                "source": source,
                "keep_per_prompt": keep,
                "token_keep_ratio": ratio,
                "micro_batch_rows": micro_rows,
                "mean_completion_tokens": float(batch["completion_mask"].sum(1).float().mean()),
                **tail_after_last_selected(*parts, ratio, micro_rows),
            }
        )
    return out
