"""What the selection trainer logs: selection, the loss's terms (TRL's loss metrics), the tokens that trained.

A mixin of D3STrainer. It overrides one method, the public ``log`` (transformers' ``Trainer.log``, which
GRPOTrainer overrides too): it adds ``selection/update_tokens_cumulative`` to a training log and turns the
micro-batches' token counts into one total per optimizer step, then calls GRPOTrainer's. So it must come
before GRPOTrainer among D3STrainer's bases (no other base overrides ``log``).

GRPOTrainer's ``log`` averages each ``_metrics`` list over its entries, one per micro-batch: right for means
and fractions, wrong for a count. So ``selection/update_tokens`` is summed per optimizer step first
(``HookState.update_tokens_by_step``) and handed to that average as one entry per step: a log gives the
tokens of one step (the mean over the steps it covers), whatever the gradient accumulation.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanmax, nanmin

from d3s.callbacks.checkpoints import D3SCheckpointState
from d3s.callbacks.logs import append_anatomy, sample_anatomy, token_anatomy
from d3s.objective import LossTerms


class SelectionMetrics:
    def _log_selection(
        self,
        keep: int,
        token_keep_ratio: float,
        before: torch.Tensor,
        kept: torch.Tensor,
        after: torch.Tensor,
        zeroed: torch.Tensor | None = None,
    ) -> None:
        metrics = self._metrics["train"]
        if zeroed is not None:  # what vLLM's correction zeroed: of every rollout, and of the kept ones
            metrics["selection/zeroed_fraction_before"].append(zeroed.float().mean().item())
            metrics["selection/zeroed_fraction"].append(zeroed[kept].float().mean().item())
        metrics["schedule/keep_per_prompt"].append(float(keep))
        metrics["schedule/token_keep_ratio"].append(token_keep_ratio)  # the K selection used
        metrics["selection/sample_keep_fraction"].append(after.numel() / before.numel())
        metrics["selection/adv_var_before"].append(before.float().var(unbiased=False).item())
        metrics["selection/adv_var_after"].append(after.float().var(unbiased=False).item())
        metrics["selection/useful_fraction_before"].append((before.abs() > 1e-6).float().mean().item())
        metrics["selection/useful_fraction"].append((after.abs() > 1e-6).float().mean().item())
        anatomy_due = self.args.anatomy_every > 0 and self.state.global_step % self.args.anatomy_every == 0
        self._hook_state.anatomy_tokens_due = anatomy_due
        if anatomy_due and self.accelerator.is_main_process:
            rewards = self._summed_rewards(before.device)
            record = sample_anatomy(self.state.global_step, keep, self.num_generations, rewards, before, kept)
            append_anatomy(self.args.output_dir, record)

    def _summed_over_ranks(self, *values: torch.Tensor) -> torch.Tensor:
        """The sum of each tensor over every rank, in float64."""
        return self.accelerator.reduce(
            torch.stack([v.sum() for v in values]).to(torch.float64), reduction="sum"
        )

    def _log_objective(
        self, terms: LossTerms, advantages: torch.Tensor, entropies: torch.Tensor, valid, token_mask
    ) -> None:
        """TRL's loss metrics (entropy over every valid token, the KL and the clip fractions over the loss
        mask), and the tokens that trained."""
        metrics, mask = self._metrics["train"], terms.loss_mask

        def masked_mean(values: torch.Tensor, over: torch.Tensor) -> float:
            if values.shape[1] == 1:  # sequence level: one value per rollout
                total, count = self._summed_over_ranks(values, torch.ones_like(values))
            else:
                total, count = self._summed_over_ranks(values * over, over)
            return (total / count.clamp(min=1)).item()

        metrics["entropy"].append(masked_mean(entropies.detach(), valid))
        if terms.kl is not None:
            metrics["kl"].append(masked_mean(terms.kl.detach(), mask))
        advantage = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        ratio = terms.ratio.detach()
        low = ((ratio < 1 - self.epsilon_low) & (advantage < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (advantage > 0)).float()
        metrics["clip_ratio/low_mean"].append(masked_mean(low, mask))
        metrics["clip_ratio/high_mean"].append(masked_mean(high, mask))
        metrics["clip_ratio/region_mean"].append(masked_mean(torch.maximum(low, high), mask))

        def per_rollout(values: torch.Tensor) -> torch.Tensor:
            return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(per_rollout(low))).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(per_rollout(high))).item())
        self._log_update_tokens(valid, token_mask)

    def _log_update_tokens(self, valid: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        metrics = self._metrics["train"]
        used = valid.bool() if token_mask is None else token_mask.bool() & valid.bool()
        trained, count = self._summed_over_ranks(used, valid)
        tokens = int(trained.item())
        self._checkpoint_state().update_tokens_total += tokens
        # every micro-batch of an optimizer step runs at the same global_step (it counts finished steps)
        by_step = self._hook_state.update_tokens_by_step
        by_step[self.state.global_step] = by_step.get(self.state.global_step, 0) + tokens
        if token_mask is None:  # every token trained: the selected entropy is the entropy
            metrics["selection/entropy_selected"].append(metrics["entropy"][-1])
        metrics["selection/token_keep_fraction"].append((trained / count.clamp(min=1)).item())

    @property
    def update_tokens_total(self) -> int:
        """Tokens that reached the policy gradient, all ranks, all steps (saved with checkpoints)."""
        return self._checkpoint_state().update_tokens_total

    def _checkpoint_state(self) -> D3SCheckpointState:
        # looked up: Trainer replaces the instance when it restores callback states from a checkpoint
        return next(cb for cb in self.callback_handler.callbacks if isinstance(cb, D3SCheckpointState))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            logs["selection/update_tokens_cumulative"] = float(self.update_tokens_total)
            by_step = self._hook_state.update_tokens_by_step
            if by_step:  # one entry per step: GRPOTrainer's log averages them over the steps of this log
                self._metrics["train"]["selection/update_tokens"] = [float(n) for n in by_step.values()]
                by_step.clear()
        super().log(logs, start_time)

    def _log_token_selection(self, inputs, entropies, scores, keep, valid, token_keep_ratio: float) -> None:
        """The selected tokens' entropy, and the anatomy log's token record at its steps."""
        if self._hook_state.anatomy_tokens_due:
            self._hook_state.anatomy_tokens_due = False  # the first selection of the step stands for it
            if self.accelerator.is_main_process:
                record = token_anatomy(
                    self.state.global_step,
                    token_keep_ratio,
                    inputs,
                    entropies,
                    scores,
                    keep,
                    valid,
                    self.args.anatomy_examples,
                    self.processing_class.decode,
                )
                append_anatomy(self.args.output_dir, record)
        entropy, count = self._summed_over_ranks(entropies.detach() * keep, keep)
        self._metrics["train"]["selection/entropy_selected"].append((entropy / count.clamp(min=1)).item())
