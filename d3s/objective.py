"""The selection methods' loss, in the order and notation of docs/fidelity/objectives.md ("Objectives").

For the rollouts i of a micro-batch, their valid completion tokens m_i, the kept tokens T_i (m_i without a
token level), advantages A_i, log-probs of the policy, the old policy (that generated) and the reference:

    token level      r_it = exp(log pi_theta - log pi_old)_it
    sequence (GSPO)  r_i  = exp(mean_{t in T_i} (log pi_theta - log pi_old)_it)
    policy term      P_it = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i) w_it o_i   on T
                     (cispo: -sg(min(r, eps_high)) A_i log pi_theta; sapo: -sigmoid(tau (r - 1)) 4 / tau A_i,
                      tau = tau_pos where A_i > 0, else tau_neg)
    off-policy mask  o_i  = 0 where A_i < 0 and mean_{t in m_i} (log pi_sampling - log pi_theta) > delta_op
    KL term          K_it = beta (exp(ref - logp) - (ref - logp) - 1) [x r_it]              on T (or all of m)
    loss             the sum of P + K over the loss mask, divided as ``loss_type`` divides it
    entropy bonus    - c mean_{t in T} H_t / accumulation   (``entropy_bonus``, added by the trainer)

w_it is vLLM's importance-sampling weight (1 without vLLM's correction), [x r] TRL's bias-corrected KL. The
loss mask is T where the kept tokens set the denominator (``token_norm: selected``) or the sequence mean, m
otherwise. Pure tensor math: the trainer computes the log-probs and the masks (d3s/trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The clipped-ratio losses of TRL; each divides the summed terms differently.
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Every TRL loss type the selection loss computes: the clipped family, CISPO's clipped-weight REINFORCE and
# SAPO's soft gate (TRL's vespo is refused: d3s/trainer_config_checks.py says why).
SELECTION_LOSSES = (*CLIPPED_LOSSES, "cispo", "sapo")
# loss types whose rows each contribute their token mean (as TRL's grpo and sapo)
ROW_MEAN_LOSSES = ("grpo", "sapo")
# loss types divided by D, the loss tokens of the generation batch (no division by the accumulation)
TOKEN_COUNT_LOSSES = ("dapo", "cispo")


@dataclass(frozen=True)
class Objective:
    """The settings of the loss (the trainer's, from its D3SConfig)."""

    loss_type: str  # grpo, sapo: mean of the rows' token means; bnpo: token mean; dr_grpo: / rows x L;
    # dapo, cispo: / D; luspo: mean of the rows' token sums
    sequence_level: bool  # GSPO's sequence ratio r_i
    epsilon_low: float
    epsilon_high: float
    delta: float | None  # two-sided clipping: r capped at delta (TRL's `delta`)
    beta: float
    kl_on_kept_tokens: bool  # kl_tokens "selected" (the paper); False: every valid token
    kl_bias_correction: bool  # TRL's use_bias_correction_kl: K_it x r_it
    kept_tokens_normalise: bool  # the loss mask is T (token_norm "selected", or the sequence mean)
    max_completion_length: int  # dr_grpo's L
    sapo_temperature_pos: float = 1.0  # sapo's tau where A > 0
    sapo_temperature_neg: float = 1.05  # ... and where A <= 0
    off_policy_threshold: float | None = (
        None  # delta_op of the off-policy mask (TRL's off_policy_mask_threshold)
    )

    def loss_mask(self, valid: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """The tokens the loss's terms are summed and normalised over: T or m."""
        return kept if self.kept_tokens_normalise else valid


@dataclass
class LossTerms:
    loss: torch.Tensor
    ratio: torch.Tensor  # r, after the delta cap: (B, T), or (B, 1) at the sequence level
    kl: torch.Tensor | None  # (B, T), unmasked
    loss_mask: torch.Tensor  # (B, T)


def selection_loss(
    objective: Objective,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    kept: torch.Tensor,
    is_weight: torch.Tensor | None,
    *,
    rows_counted: torch.Tensor,
    accumulation: float,
    dapo_denominator: torch.Tensor | float,
    row_scale: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
) -> LossTerms:
    """The loss of one micro-batch. ``valid`` m and ``kept`` T (a subset of m) are 0/1 tensors of ``logps``'s
    shape; ``rows_counted`` the rows a mean over rows counts (vLLM's correction may zero a whole rollout);
    ``accumulation`` the micro-batches of the optimizer step; ``dapo_denominator`` D per accumulation
    window. ``row_scale``: each row's normaliser where it differs from this micro-batch's own (packed rows
    keep their unpacked micro-batch's, d3s/packing.py); None: ``loss_row_scale`` of these rows.
    ``sampling_logps``: the log-probs the rollouts were sampled with, for the off-policy mask (vLLM's when
    vLLM generated; None: ``old_logps``)."""
    o = objective
    advantage = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if o.sequence_level:
        log_ratio = (log_ratio * kept).sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    capped = ratio
    if o.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=o.epsilon_high).detach() * advantage * logps
    elif o.loss_type == "sapo":
        pos, neg = advantage.new_tensor(o.sapo_temperature_pos), advantage.new_tensor(o.sapo_temperature_neg)
        tau = torch.where(advantage > 0, pos, neg)  # in the advantages' dtype (TRL's scalars: float32)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage
    else:
        clipped = torch.clamp(ratio, 1 - o.epsilon_low, 1 + o.epsilon_high)
        capped = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)
        per_token = -torch.min(capped * advantage, clipped * advantage)
    per_token = per_token * kept
    if o.off_policy_threshold is not None:
        sampled = old_logps if sampling_logps is None else sampling_logps
        per_token = per_token * off_policy_mask(advantage, logps, sampled, valid, o.off_policy_threshold)
    if is_weight is not None:
        per_token = per_token * is_weight
    kl = None
    if o.beta != 0.0:
        log_ref_ratio = ref_logps - logps
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if o.kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + o.beta * kl * (kept if o.kl_on_kept_tokens else valid)

    loss_mask = o.loss_mask(valid, kept)
    summed = (per_token * loss_mask).sum(-1)
    if o.loss_type in ROW_MEAN_LOSSES:  # the row's token mean
        summed = summed / loss_mask.sum(-1).clamp(min=1.0)
    if row_scale is None:
        row_scale = loss_row_scale(o, loss_mask, rows_counted, accumulation, dapo_denominator)
    loss = (summed * row_scale.to(summed.dtype)).sum()
    return LossTerms(loss=loss, ratio=capped, kl=kl, loss_mask=loss_mask)


def loss_row_scale(
    objective: Objective,
    loss_mask: torch.Tensor,
    rows_counted: torch.Tensor,
    accumulation: float,
    dapo_denominator: torch.Tensor | float,
) -> torch.Tensor:
    """What the loss multiplies each row's summed terms (grpo: the row's token mean) by in a micro-batch of
    these rows, as ``loss_type`` divides: grpo, sapo and luspo by the rows counted, bnpo by the loss-mask
    tokens, dr_grpo by the rows counted x L, each x ``accumulation``; dapo and cispo by D. One value per row,
    the same for all."""
    o = objective
    if o.loss_type in (*ROW_MEAN_LOSSES, "luspo"):
        denominator = rows_counted.sum().clamp(min=1) * accumulation
    elif o.loss_type == "bnpo":
        denominator = loss_mask.sum().clamp(min=1.0) * accumulation
    elif o.loss_type == "dr_grpo":
        denominator = rows_counted.sum().clamp(min=1) * o.max_completion_length * accumulation
    elif o.loss_type in TOKEN_COUNT_LOSSES:
        denominator = torch.as_tensor(dapo_denominator, device=loss_mask.device)
    else:
        raise ValueError(
            f"the selection loss has no loss_type {o.loss_type!r}; use one of {SELECTION_LOSSES}"
        )
    return (1.0 / denominator.float()).expand(loss_mask.shape[0])


def off_policy_mask(
    advantage: torch.Tensor,
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    valid: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """o_i (B, 1): 0 for a rollout with a negative advantage whose sampling policy drifted from the current
    one by more than ``threshold`` (the mean over its valid tokens of log pi_sampling - log pi_theta, tokens
    without a sampling log-prob counting 0), else 1: DeepSeek-V3.2's off-policy sequence mask, TRL's
    ``off_policy_mask_threshold``. Over every valid token m_i: it measures the rollout, not what trains."""
    drift = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_drift = (drift * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantage >= 0) | (mean_drift <= threshold)).to(valid.dtype)


def entropy_bonus(entropies: torch.Tensor, kept: torch.Tensor, accumulation: float) -> torch.Tensor:
    """mean_{t in T} H_t / accumulation: the entropy the bonus raises, over the kept tokens T of this
    micro-batch (the tokens the policy term trains, as TRL's bonus acts on the tokens its entropy mask keeps),
    scaled only for gradient accumulation, never by the loss type's normaliser (TRL's definition)."""
    return (entropies * kept).sum() / kept.sum().clamp(min=1.0) / accumulation
