"""What the selection trainer logs: selection, the loss's terms (TRL's loss metrics), the tokens that trained.

A mixin of D3STrainer, before GRPOTrainer among its bases. It overrides two methods of GRPOTrainer:
``training_step``, to close the metrics of an optimizer step after its last micro-batch, and the public
``log``, to add ``selection/update_tokens_cumulative``.

GRPOTrainer's ``log`` averages each ``_metrics`` list over its entries, appended once per micro-batch. A
mean over each micro-batch's tokens, averaged over micro-batches, changes with the micro-batching (and with
packing, d3s/packing.py), and a count summed that way is wrong. So the loss's metrics of the selecting
methods are kept as this rank's (total, count) over the step's micro-batches, without a sync, and turned into
one entry per optimizer step, every rank, in one gather (``_close_step_metrics``): the mean over the step's
tokens (``selection/update_tokens``: the step's total; the clip extremes: over the step's rollouts). A log
gives the mean over the steps it covers, whatever the micro-batching."""

from __future__ import annotations

import torch

from d3s.callbacks.checkpoints import D3SCheckpointState
from d3s.callbacks.logs import append_anatomy, sample_anatomy, token_anatomy
from d3s.objective import LossTerms

UPDATE_TOKENS = "selection/update_tokens"  # the tokens in the gradient of one optimizer step, every rank


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

    # ---- the loss's metrics: summed over the micro-batches of a step, one entry per optimizer step --------
    # A mean over a micro-batch's tokens, averaged over micro-batches, changes with the micro-batching (and
    # packing changes it: d3s/packing.py). The step's totals do not, and they cost one synchronisation per
    # step instead of about nine per micro-batch.

    def _add_to_step(self, name: str, total: torch.Tensor, count: torch.Tensor) -> None:
        """Add this micro-batch's total and count of a mean metric, on this rank, without a sync."""
        sums = self._hook_state.step_sums
        pair = torch.stack([total.sum(), count.sum()]).detach().to(torch.float64)
        sums[name] = pair if name not in sums else sums[name] + pair

    def _extreme_of_step(self, name: str, values: torch.Tensor, largest: bool) -> None:
        """Keep the step's smallest (or largest) value of a per-rollout metric, NaN ignored, on this rank."""
        values = values.detach().to(torch.float64)
        values = values[~values.isnan()]
        signed = -values if largest else values
        low = signed.min() if values.numel() else torch.tensor(float("inf"), dtype=torch.float64)
        extremes = self._hook_state.step_extremes
        key = (name, largest)
        extremes[key] = low.to(values.device) if key not in extremes else torch.minimum(extremes[key], low)

    def _close_step_metrics(self) -> None:
        """One entry per metric for the optimizer step just ended, all ranks, in one gather."""
        sums, extremes = self._hook_state.step_sums, self._hook_state.step_extremes
        if not sums and not extremes:
            return
        names, keys = list(sums), list(extremes)
        device = self.accelerator.device
        values = [sums[n].to(device) for n in names] + [extremes[k].to(device).view(1) for k in keys]
        local = torch.cat(values)  # the means' (total, count) pairs, then the extremes
        gathered = self.accelerator.gather(local.unsqueeze(0)).view(-1, local.numel())
        totals = gathered[:, : 2 * len(names)].sum(0).view(-1, 2).tolist()
        lows = gathered[:, 2 * len(names) :].min(0).values.tolist() if keys else []
        metrics = self._metrics["train"]
        for name, (total, count) in zip(names, totals, strict=True):
            if name == UPDATE_TOKENS:  # a count of the step, not a mean
                self._checkpoint_state().update_tokens_total += int(total)
                metrics[name].append(total)
            else:
                metrics[name].append(total / max(count, 1.0))
        for (name, largest), low in zip(keys, lows, strict=True):
            metrics[name].append(float("nan") if low == float("inf") else (-low if largest else low))
        sums.clear()
        extremes.clear()

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._step % self.current_gradient_accumulation_steps == 0:  # TRL counted the micro-step
            self._close_step_metrics()
        return loss

    def _log_objective(
        self, terms: LossTerms, advantages: torch.Tensor, entropies: torch.Tensor, valid, token_mask
    ) -> None:
        """TRL's loss metrics (entropy over every valid token, the KL and the clip fractions over the loss
        mask), and the tokens that trained: this micro-batch's share of the step's."""

        def add_mean(name: str, values: torch.Tensor, over: torch.Tensor) -> None:
            if values.shape[1] == 1:  # sequence level: one value per rollout
                self._add_to_step(name, values, torch.ones_like(values))
            else:
                self._add_to_step(name, values * over, over)

        mask = terms.loss_mask
        add_mean("entropy", entropies.detach(), valid)
        if token_mask is None:  # every token trained: the selected entropy is the entropy
            add_mean("selection/entropy_selected", entropies.detach(), valid)
        if terms.kl is not None:
            add_mean("kl", terms.kl.detach(), mask)
        advantage = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        ratio = terms.ratio.detach()
        low = ((ratio < 1 - self.epsilon_low) & (advantage < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (advantage > 0)).float()
        add_mean("clip_ratio/low_mean", low, mask)
        add_mean("clip_ratio/high_mean", high, mask)
        add_mean("clip_ratio/region_mean", torch.maximum(low, high), mask)

        def per_rollout(values: torch.Tensor) -> torch.Tensor:
            return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

        self._extreme_of_step("clip_ratio/low_min", per_rollout(low), largest=False)
        self._extreme_of_step("clip_ratio/high_max", per_rollout(high), largest=True)
        self._count_update_tokens(valid, token_mask)

    def _count_update_tokens(self, valid: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        """The tokens that reached the gradient in this micro-batch: the step's total and its fraction."""
        used = valid.bool() if token_mask is None else token_mask.bool() & valid.bool()
        self._add_to_step(UPDATE_TOKENS, used, torch.zeros_like(used))  # a count: the total is the value
        self._add_to_step("selection/token_keep_fraction", used, valid)

    def _log_update_tokens(self, valid: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        """grpo (TRL's loss and metrics): the tokens of this micro-batch, and the entropy TRL just logged."""
        metrics = self._metrics["train"]
        if token_mask is None:
            metrics["selection/entropy_selected"].append(metrics["entropy"][-1])
        self._count_update_tokens(valid, token_mask)

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
