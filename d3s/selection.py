"""Selection math of D3S and PODS: pure torch, no TRL import.

Sample level, which rollouts train: max_variance_subset, select_samples, renormalize_advantages (PODS).
Token level, which tokens of the kept rollouts train: token_scores, token_keep_mask. Schedule: N and K over
training, with round_half_up the one rounding rule for keep counts; ScopeSwitch, the adaptive method's
choice between cross- and intra-group selection from the early rewards or the gradient norm's spikes.
vLLM's importance-sampling correction: zeroed_rollouts and corrected_loss_mask, what it zeroed
(docs/fidelity/importance-sampling.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from d3s.keep_counts import round_half_up  # the one rounding rule of N (torch-free for the registry)

SampleRule = Literal["max_variance", "random", "max_reward", "none"]
SampleScope = Literal["group", "batch"]
TokenRule = Literal["adv_entropy", "entropy", "none"]
TokenScope = Literal["batch", "micro_batch", "sequence"]
ScheduleKind = Literal["constant", "linear", "two_phase", "cosine"]
ZeroedRollouts = Literal["excluded", "trl"]
SwitchSignal = Literal["early_reward", "grad_norm_spike"]

SAMPLE_RULES: tuple[str, ...] = get_args(SampleRule)
SAMPLE_SCOPES: tuple[str, ...] = get_args(SampleScope)
TOKEN_RULES: tuple[str, ...] = get_args(TokenRule)
TOKEN_SCOPES: tuple[str, ...] = get_args(TokenScope)
SCHEDULES: tuple[str, ...] = get_args(ScheduleKind)
ZEROED_ROLLOUTS: tuple[str, ...] = get_args(ZeroedRollouts)
SWITCH_SIGNALS: tuple[str, ...] = get_args(SwitchSignal)
# The record of TrainerState.log_history each switch signal reads (TRL logs both every logging step).
SIGNAL_LOG_KEYS: dict[str, str] = {"early_reward": "reward", "grad_norm_spike": "grad_norm"}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_finite(name: str, values: torch.Tensor) -> None:
    if torch.isnan(values).any():
        bad = torch.isnan(values).nonzero()[:5].tolist()
        raise ValueError(
            f"{name} contains NaN (first positions {bad}); drop or fill unscorable rollouts before selection "
            "(e.g. make the reward function return a number instead of None)"
        )


# ---- sample level ------------------------------------------------------------------------------------------


def max_variance_subset(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of a size-k subset of ``values`` (..., n) with the largest population variance.

    Some optimal subset is the i largest plus the k - i smallest values for some i in 0..k (PODS, Lemma 3.1):
    one sort, then all k + 1 splits scored from sums over the k largest and k smallest; indices ascending.
    Ties: a stable sort, every split within ``variance_tie_tolerance`` of the best is optimal, the largest
    such i wins (a constant row keeps its first k).
    """
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension (..., n)")
    n = values.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"k must satisfy 1 <= k <= n = {n}; got k = {k}")
    _check_finite("values", values)
    x = values.to(torch.float64)
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    # Variance ignores a shift. Shifting by a member (the median) keeps small integers and dyadic values
    # exact, so for discrete rewards every sum below is exact and tied splits score bit-identically.
    d = sorted_x - sorted_x[..., n // 2 : n // 2 + 1]
    largest, smallest = d[..., :k], d[..., n - k :].flip(-1)  # smallest: ascending from the minimum
    zeros = d.new_zeros((*d.shape[:-1], 1))
    # Sums over at most k terms (not prefix differences over n), so rounding scales with k, not n.
    top_sum = torch.cat([zeros, largest.cumsum(-1)], dim=-1)  # [i] = sum of the i largest
    top_sq = torch.cat([zeros, (largest * largest).cumsum(-1)], dim=-1)
    bottom_sum = torch.cat([zeros, smallest.cumsum(-1)], dim=-1).flip(-1)  # [i] = sum of the k - i smallest
    bottom_sq = torch.cat([zeros, (smallest * smallest).cumsum(-1)], dim=-1).flip(-1)
    total = top_sum + bottom_sum
    score = k * (top_sq + bottom_sq) - total * total  # k^2 Var of split i: no division, exact on integers
    spread = sorted_x[..., :1] - sorted_x[..., -1:]
    magnitude = torch.maximum(sorted_x[..., :1].abs(), sorted_x[..., -1:].abs())
    tolerance = k * k * variance_tie_tolerance(spread, magnitude, k, values.dtype)
    optimal = score >= score.amax(dim=-1, keepdim=True) - tolerance
    splits = torch.arange(k + 1, device=values.device)
    best_top = torch.where(optimal, splits, -1).amax(dim=-1, keepdim=True)  # the largest optimal i
    slot = torch.arange(k, device=values.device)
    positions = torch.where(slot < best_top, slot, n - k + slot)
    return torch.gather(order, -1, positions).sort(dim=-1).values


def variance_tie_tolerance(
    spread: torch.Tensor | float, magnitude: torch.Tensor | float, k: int, dtype: torch.dtype
) -> torch.Tensor | float:
    """Variances of two size-k splits closer than this are a tie: 16 (u + k 2^-53) R M, with R the row's
    range, M its largest magnitude, u the input's unit roundoff (docs/fidelity/open-questions.md, "Ties")."""
    unit_roundoff = 2.0**-53 if dtype == torch.float64 or not dtype.is_floating_point else 2.0**-24
    return 16 * (unit_roundoff + k * 2.0**-53) * spread * magnitude


def select_samples(
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    num_generations: int,
    keep_per_prompt: int,
    rule: SampleRule = "max_variance",
    scope: SampleScope = "group",
    generator: torch.Generator | None = None,
    eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows to keep from a flat batch of B prompts x G rollouts (rollouts of a prompt adjacent).

    ``scope="group"`` keeps exactly ``keep_per_prompt`` rollouts of every prompt; ``scope="batch"`` keeps
    ``keep_per_prompt * B`` from the pooled batch (the cross-group rule of D3S / D1S-Cross), so groups with
    no signal (A = 0) give their share to groups with signal. ``max_variance`` ranks by the advantages (within
    a group this equals ranking by rewards, since A is an increasing affine map of R); ``max_reward`` ranks
    by the rewards. Returns ascending flat row indices.

    ``eligible`` (flat bool, default all): the rule chooses among the eligible rows of each pool only
    (vLLM's correction zeroed the others, see zeroed_rollouts); a pool with fewer eligible rows than slots
    keeps all of them and fills its remaining slots with its first ineligible rows, which the caller keeps
    out of the loss.
    """
    _check_choice("sample_rule", rule, SAMPLE_RULES)
    _check_choice("sample_scope", scope, SAMPLE_SCOPES)
    if advantages.dim() != 1 or advantages.shape != rewards.shape:
        raise ValueError(
            f"advantages and rewards must be flat tensors of equal shape; got {tuple(advantages.shape)} "
            f"and {tuple(rewards.shape)}"
        )
    total = advantages.numel()
    if num_generations < 1 or total % num_generations:
        raise ValueError(f"batch of {total} rollouts is not a whole number of groups of {num_generations}")
    if not 1 <= keep_per_prompt <= num_generations:
        raise ValueError(
            f"keep_per_prompt must be between 1 and num_generations = {num_generations}; "
            f"got {keep_per_prompt}"
        )
    _check_finite("advantages", advantages)
    _check_finite("rewards", rewards)
    if eligible is not None and eligible.shape != advantages.shape:
        raise ValueError(
            f"eligible must be a flat mask of the {total} rollouts; got shape {tuple(eligible.shape)}"
        )
    num_prompts = total // num_generations
    device = advantages.device
    if rule == "none" or keep_per_prompt == num_generations:
        return torch.arange(total, device=device)

    # Keep k of each pool of `size` rows: every group, or the whole batch as one pool.
    if scope == "batch":
        pools, size, k = 1, total, keep_per_prompt * num_prompts
    else:
        pools, size, k = num_prompts, num_generations, keep_per_prompt
    allowed = (
        torch.ones(pools, size, dtype=torch.bool, device=device)
        if eligible is None
        else eligible.to(device=device, dtype=torch.bool).view(pools, size)
    )
    if rule == "max_variance":
        values = advantages.view(pools, size)
        local = (
            max_variance_subset(values, k)
            if bool(allowed.all())
            else _max_variance_of_eligible(values, allowed, k)
        )
    else:
        if rule == "max_reward":
            order = torch.sort(rewards.view(pools, size), dim=1, descending=True, stable=True).indices
        elif scope == "batch":
            order = torch.randperm(total, generator=generator, device="cpu").to(device).unsqueeze(0)
        else:
            noise = torch.rand(num_prompts, num_generations, generator=generator, device="cpu").to(device)
            order = noise.argsort(dim=1)
        # the eligible rows in the rule's order, then the ineligible ones by index (the order itself when
        # every row is eligible)
        slots = torch.arange(size, device=device).expand_as(order)
        rank = torch.empty_like(order).scatter_(1, order, slots)
        local = torch.where(allowed, rank, size + slots).argsort(dim=1)[:, :k]
    offsets = (torch.arange(pools, device=device) * size).unsqueeze(1)
    return (local.sort(dim=1).values + offsets).flatten()  # pools in order, each ascending: sorted


def _max_variance_of_eligible(values: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """(pools, k) local indices: per pool, a max-variance subset of min(k, eligible) of its eligible values,
    then its first ineligible rows as fillers. Pools with the same eligible count are solved together."""
    first_eligible = (~allowed).int().argsort(dim=1, stable=True)  # eligible indices ascending, then the rest
    counts = allowed.sum(dim=1)
    local = torch.empty(values.shape[0], k, dtype=torch.long, device=values.device)
    for count in counts.unique().tolist():
        rows = (counts == count).nonzero().squeeze(1)
        candidates = first_eligible[rows]
        chosen = min(k, count)
        picked = candidates[:, :0]
        if chosen:
            eligible_values = torch.gather(values[rows], 1, candidates[:, :count])
            picked = torch.gather(candidates, 1, max_variance_subset(eligible_values, chosen))
        local[rows] = torch.cat([picked, candidates[:, count : count + k - chosen]], dim=1)
    return local


def renormalize_advantages(
    rewards: torch.Tensor,
    kept: torch.Tensor,
    num_generations: int,
    scale: bool = True,
    epsilon: float = 1e-4,
) -> torch.Tensor:
    """PODS: advantages of the kept rows, normalised over the kept members of their own group.

    A = (r - mean_S r) / (std_S r + epsilon) with the unbiased std, as the official PODS code and TRL do.
    NaN rewards (unscorable) are left out of the statistics and get A = 0; a group with one kept member has
    no spread and gets A = 0.
    """
    group = kept // num_generations
    r = rewards[kept].to(torch.float64)
    num_groups = rewards.numel() // num_generations
    valid = ~torch.isnan(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, group, valid.double())
    total = torch.zeros_like(count).index_add_(0, group, r0)
    mean = total / count.clamp(min=1)
    dev = torch.where(valid, r - mean[group], torch.zeros_like(r))
    sq = torch.zeros_like(count).index_add_(0, group, dev * dev)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    advantages = dev / (std[group] + epsilon) if scale else dev
    advantages = torch.where(count[group] > 1, advantages, torch.zeros_like(advantages))
    return advantages.to(rewards.dtype)


def zeroed_rollouts(importance_sampling_ratio: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool (B,): rollouts every valid token of which vLLM's importance-sampling correction zeroed.

    ``importance_sampling_ratio`` is TRL's (B, 1) sequence ratio or (B, T) token ratio after its clip or mask;
    its ``*_mask`` modes set a ratio outside [C_min, C_max] to 0 (``sequence_mask``: the whole rollout).
    ``loss_mask`` (B, T) marks the valid tokens; a rollout without any is not counted as zeroed.
    """
    if importance_sampling_ratio.dim() != 2 or importance_sampling_ratio.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"importance_sampling_ratio must be (B, 1) or (B, T) for a (B, T) loss mask; got "
            f"{tuple(importance_sampling_ratio.shape)} and {tuple(loss_mask.shape)}"
        )
    valid = loss_mask.bool()
    live = valid & (importance_sampling_ratio != 0)
    return valid.any(dim=1) & ~live.any(dim=1)


def corrected_loss_mask(importance_sampling_ratio: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The loss mask without the tokens the correction zeroed (they train nothing and leave the denominators);
    same dtype as ``loss_mask``."""
    return loss_mask * (importance_sampling_ratio != 0).to(loss_mask.dtype)


# ---- token level -------------------------------------------------------------------------------------------


def token_scores(advantages: torch.Tensor, entropies: torch.Tensor, rule: TokenRule) -> torch.Tensor:
    """Per-token selection score: |A_{i,t}| * H_{i,t} (``adv_entropy``) or H_{i,t} (``entropy``).

    ``advantages`` is (B,) or (B, T); ``entropies`` is (B, T) in nats. Scores carry no gradient.
    """
    _check_choice("token_rule", rule, TOKEN_RULES)
    entropies = entropies.detach()
    if rule == "entropy":
        return entropies
    if rule == "none":
        return torch.ones_like(entropies)
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    return adv.abs().to(entropies.dtype) * entropies


def token_keep_mask(
    scores: torch.Tensor,
    valid_mask: torch.Tensor,
    token_keep_ratio: float,
    scope: TokenScope = "batch",
) -> torch.Tensor:
    """Boolean (B, T) mask of the top ``token_keep_ratio`` of valid tokens by score.

    ``batch`` (and ``micro_batch``: the caller hands over one micro-batch) ranks all valid tokens of the given
    rows together, ``sequence`` ranks within each sequence. The count kept is ceil(K * valid), exact by rank,
    not a quantile threshold, so ties never inflate it; ties go to the earlier token. Padding is never
    selected. A sequence may keep no token at all: the paper ranks the tokens of the batch, not per sequence.
    """
    _check_choice("token_scope", scope, TOKEN_SCOPES)
    if not 0.0 < token_keep_ratio <= 1.0:
        raise ValueError(f"token_keep_ratio must be in (0, 1]; got {token_keep_ratio}")
    if scores.shape != valid_mask.shape or scores.dim() != 2:
        raise ValueError(
            f"scores and mask must both be (B, T); got {tuple(scores.shape)}, {tuple(valid_mask.shape)}"
        )
    valid = valid_mask.bool()
    _check_finite("token scores", scores[valid])
    masked = scores.detach().to(torch.float32).masked_fill(~valid, float("-inf"))
    rows = masked if scope == "sequence" else masked.view(1, -1)  # the rows ranked: sequences, or one batch
    order = torch.sort(rows, dim=1, descending=True, stable=True).indices
    positions = torch.arange(rows.shape[1], device=rows.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(1, order, positions)
    # ceil(K * n) without floating error turning 0.2 * 50 into 11
    count = torch.ceil(token_keep_ratio * valid.view_as(rows).sum(dim=1).to(torch.float64) - 1e-9).long()
    keep = ranks < count.unsqueeze(1)
    return keep.view_as(valid) & valid


# ---- schedule ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """(keep_per_prompt, token_keep_ratio) as a function of training progress p = step / max_steps.

    Each shape moves a value from its init to its final setting; N is rounded with round_half_up.

    - ``constant``: the initial values throughout.
    - ``linear`` (the paper): (1 - p) init + p final.
    - ``two_phase``: init for the first half (p < 1/2, aggressive down-sampling), final for the second.
    - ``cosine``: final + (init - final) (1 + cos(pi p)) / 2, slow at both ends, fastest at p = 1/2.

    Every shape but ``constant`` stays between init and final, so N's reachable values are that range.
    """

    kind: ScheduleKind
    keep_per_prompt_init: int
    keep_per_prompt_final: int
    token_keep_ratio_init: float
    token_keep_ratio_final: float

    def __post_init__(self) -> None:
        _check_choice("schedule", self.kind, SCHEDULES)

    def weight_of_final(self, progress: float) -> float:
        """w(p) in [0, 1]: a value at progress p is (1 - w) init + w final."""
        if math.isnan(progress):
            raise ValueError("training progress is NaN")
        p = min(max(progress, 0.0), 1.0)
        if self.kind == "constant":
            return 0.0
        if self.kind == "two_phase":
            return 0.0 if p < 0.5 else 1.0
        if self.kind == "cosine":
            return (1.0 - math.cos(math.pi * p)) / 2.0
        return p

    def _at(self, progress: float, init: float, final: float) -> float:
        weight = self.weight_of_final(progress)
        return init if weight == 0.0 else final if weight == 1.0 else (1 - weight) * init + weight * final

    def keep_per_prompt(self, progress: float) -> int:
        return round_half_up(self._at(progress, self.keep_per_prompt_init, self.keep_per_prompt_final))

    def token_keep_ratio(self, progress: float) -> float:
        return self._at(progress, self.token_keep_ratio_init, self.token_keep_ratio_final)

    def reachable_keep_values(self) -> tuple[int, ...]:
        """Every keep_per_prompt the schedule can produce, ascending (for up-front validation): the initial
        value (constant), both ends (two_phase), or every value between them (linear, cosine)."""
        init, final = self.keep_per_prompt_init, self.keep_per_prompt_final
        if self.kind == "constant":
            return (init,)
        if self.kind == "two_phase":
            return tuple(sorted({init, final}))
        low, high = sorted((init, final))
        return tuple(range(low, high + 1))


# ---- the adaptive switch -----------------------------------------------------------------------------------


def spike_ratios(grad_norms: Sequence[float], warmup: int = 3) -> list[float]:
    """g_t / median(g_0 .. g_{t-1}) for every step t with at least ``warmup`` earlier steps: how far a step's
    gradient norm jumps above what training has shown so far. NaN norms are skipped, and so is a step whose
    earlier median is 0 (steps without any learning signal give no scale to compare with)."""
    norms = [float(g) for g in grad_norms if not math.isnan(float(g))]
    ratios = []
    for t in range(max(warmup, 1), len(norms)):
        earlier = sorted(norms[:t])
        middle = len(earlier) // 2
        median = earlier[middle] if len(earlier) % 2 else (earlier[middle - 1] + earlier[middle]) / 2
        if median > 0:
            ratios.append(norms[t] / median)
    return ratios


def early_reward(rewards: Sequence[float], warmup: int = 3) -> float:
    """The mean of the first ``warmup`` steps' mean rewards (NaN ones skipped): how well the model solves its
    training problems before selection has moved it much. NaN until ``warmup`` steps have a reward."""
    logged = [float(r) for r in rewards if not math.isnan(float(r))]
    return math.fsum(logged[:warmup]) / warmup if len(logged) >= warmup else math.nan


@dataclass(frozen=True)
class ScopeSwitch:
    """The adaptive method's sample scope: cross-group (``batch``) selection until the switch fires,
    intra-group (``group``) from then on (the D3S paper's Appendix D.1: cross-group selection suits
    well-aligned models and destabilises poorly aligned ones; D3S-I is stable on them).

    The ``signal`` it reads from the trainer's log, oldest step first:

    - ``early_reward``: fires once the mean reward of the first ``warmup`` steps (``early_reward``) is below
      ``threshold``: a model that solves few of its training problems at the start is a poorly aligned one,
      read from its own rollouts, before it is known. It decides once, at step ``warmup``.
    - ``grad_norm_spike``: fires once a step's gradient norm exceeds ``threshold`` x the median of the
      earlier ones (``spike_ratios``): the instability itself.

    Either latches. The threshold is a setting, chosen on calibration seeds (docs/studies.md, "The adaptive
    switch").
    """

    threshold: float
    warmup: int = 3
    signal: SwitchSignal = "grad_norm_spike"

    def __post_init__(self) -> None:
        if self.signal not in SWITCH_SIGNALS:
            raise ValueError(f"scope switch signal must be one of {SWITCH_SIGNALS}; got {self.signal!r}")
        if self.signal == "grad_norm_spike" and not self.threshold > 1.0:
            raise ValueError(
                f"scope switch threshold must be > 1 (a ratio to the median); got {self.threshold}"
            )
        if not math.isfinite(self.threshold):
            raise ValueError(f"scope switch threshold must be finite; got {self.threshold}")
        if self.warmup < 1:
            raise ValueError(f"scope switch warmup must be >= 1 step; got {self.warmup}")

    @property
    def log_key(self) -> str:
        """The record of TrainerState.log_history the signal reads (``SIGNAL_LOG_KEYS``)."""
        return SIGNAL_LOG_KEYS[self.signal]

    def switched(self, values: Sequence[float]) -> bool:
        """Whether the switch has fired on ``values``, the logged ``log_key`` of the steps so far."""
        if self.signal == "early_reward":
            return early_reward(values, self.warmup) < self.threshold  # NaN (too early) compares False
        return any(ratio > self.threshold for ratio in spike_ratios(values, self.warmup))

    def scope(self, values: Sequence[float]) -> SampleScope:
        return "group" if self.switched(values) else "batch"

    def scope_from_log(self, log_history: Sequence[Mapping[str, Any]]) -> SampleScope:
        """The scope after the optimizer steps of a trainer's log (TrainerState.log_history, restored on
        resume): its records with the signal's value, oldest first."""
        return self.scope([record[self.log_key] for record in log_history if self.log_key in record])
