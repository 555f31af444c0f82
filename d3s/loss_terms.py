"""The terms TRL adds to its policy loss, added to the selection loss the same way: the entropy bonus (static
or adaptive) and a mixture-of-experts model's router aux loss.

Both are TRL's definitions (trl 1.16 ``GRPOTrainer._compute_loss``), computed by the selection methods on what
they train: the entropy bonus on the kept tokens T (d3s/objective.py ``entropy_bonus``), the router's
load-balancing loss on the micro-batch's forward, whose tokens selection does not change. Each is a
statistic of a whole micro-batch, which is why packing stays off with either (d3s/packing.py).
"""

from __future__ import annotations

import torch

from d3s.objective import TOKEN_COUNT_LOSSES, entropy_bonus


def adapted_entropy_coef(
    coef: float, entropy: float, target: float, delta: float, low: float, high: float
) -> float:
    """The adaptive bonus's coefficient after an optimizer step whose tokens had mean entropy ``entropy``:
    up by ``delta`` (at most ``high``) while the entropy is at or below ``target``, down (at least ``low``)
    above it (TRL's use_adaptive_entropy)."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


class SelectionLossTerms:
    """D3STrainer's side: ``_loss_terms`` is what the selection loss adds, with TRL's logged keys."""

    def _loss_terms(self, policy_loss: torch.Tensor, entropies: torch.Tensor, kept: torch.Tensor, aux_loss):
        accumulation = self.current_gradient_accumulation_steps
        metrics, extra = self._metrics["train"], torch.zeros((), device=policy_loss.device)
        if self._entropy_bonus_enabled:
            apply = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
                apply = 0.0  # the coefficient of the step before, as TRL applies it to the whole window
            extra = extra - apply * entropy_bonus(entropies, kept, accumulation)
            unscaled = policy_loss.detach() * (
                1.0 if self.args.loss_type in TOKEN_COUNT_LOSSES else accumulation
            )
            metrics["policy_loss"].append(self.accelerator.gather(unscaled).nanmean().item())
            if self.use_adaptive_entropy:
                self._adapt_entropy_coef(entropies, kept)
            if self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if aux_loss is not None:
            extra = extra + self.router_aux_loss_coef * aux_loss / accumulation
            metrics["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        return extra

    def _adapt_entropy_coef(self, entropies: torch.Tensor, kept: torch.Tensor) -> None:
        """The window's (sum of H, tokens) over the kept tokens of every micro-batch; at the optimizer step,
        over every rank, the mean entropy sets the coefficient of the next step (TRL's state attributes, which
        TRL's checkpoints save and restore)."""
        stats = torch.stack([(entropies * kept).sum(), kept.sum()]).detach()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        entropy = (total[0] / total[1].clamp(min=1.0)).item()
        args = self.args
        self.entropy_coef = adapted_entropy_coef(
            self.entropy_coef,
            entropy,
            args.entropy_target,
            args.entropy_coef_delta,
            args.entropy_coef_min,
            args.entropy_coef_max,
        )
        self._last_world_entropy, self._entropy_window_stats = entropy, None
