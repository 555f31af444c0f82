"""D3STrainer: TRL's GRPO with sample- and token-level down-sampling (D3S, PODS and the methods they compare).

TRL owns generation, rewards, advantages, the clipped loss and logging. D3S adds, once per generation batch
and identically on every rank: (1) keep a subset of the scored rollouts and re-index every per-rollout tensor;
(2) over the kept rollouts of every rank, the top-K% tokens by |A| x H as the per-rollout ``token_mask`` the
loss trains. With ``method="grpo"`` both are off: TRL's GRPOTrainer, step for step. What vLLM's
importance-sampling correction zeroed takes no slot at either level and leaves the loss (section 3).
Opt-in savings: d3s/savings/; TRL internals used: d3s/trl_contract.py; each method's objective:
docs/fidelity.md.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from d3s import trl_contract
from d3s.callbacks.checkpoints import CheckpointSaveErrors, CpuRanksOptimizerLoad, D3SCheckpointState
from d3s.callbacks.logs import (
    JsonlMetricsCallback,
    NanGuardCallback,
    append_anatomy,
    sample_anatomy,
    token_anatomy,
)
from d3s.rewards import bind_answer_policy
from d3s.savings import DeferredLogprobPasses, KeptTokenHead
from d3s.selection import (
    corrected_loss_mask,
    renormalize_advantages,
    select_samples,
    token_keep_mask,
    token_scores,
    zeroed_rollouts,
)
from d3s.trainer_config import D3SConfig
from d3s.vllm_engine import (
    check_vllm_without_cuda,
    engine_options,
    use_a_free_rendezvous_port,
    use_exact_cpu_weight_sync,
)

__all__ = ["D3SConfig", "D3STrainer"]


@dataclass
class HookState:
    """Values TRL's call chain does not hand to the hook that needs them (docs/trl-hooks-proposal.md)."""

    rewards_per_func: torch.Tensor | None = None  # TRL's rewards, which it does not return
    loss_inputs: dict | None = None  # the loss call's inputs, for the hooks TRL calls without them
    token_mask: torch.Tensor | None = None  # the loss call's token mask (None: every token trains)
    loss_entropies: torch.Tensor | None = None  # the loss call's gradient-pass entropies
    anatomy_tokens_due: bool = False  # the next token selection writes the anatomy log's token record
    old_policy_entropies_wanted: bool = False  # until the old-policy pass ran, which then computes entropies
    old_policy_entropies: torch.Tensor | None = None
    deferring_logprobs: bool = False  # savings/deferred.py: TRL's log-prob passes return placeholders
    old_policy_pass_eager: bool = False  # ... but the old-policy pass: its vLLM ratio decides eligibility
    old_policy_pass_done: bool = False  # that pass ran for real in this scoring


class SelectedTokensBeta(float):
    """beta for TRL's ``per_token_loss + self.beta * per_token_kl`` (added after its token mask): the KL then
    trains the selected tokens only (the paper's "only selected tokens contribute to the gradient")."""

    def __new__(cls, beta: float, hook_state: HookState) -> SelectedTokensBeta:
        coefficient = super().__new__(cls, beta)
        coefficient.hook_state = hook_state
        return coefficient

    def __mul__(self, other: Any) -> Any:
        mask = self.hook_state.token_mask
        if isinstance(other, torch.Tensor) and mask is not None:
            return float(self) * (other * mask)
        return float(self) * other

    __rmul__ = __mul__


class D3STrainer(
    KeptTokenHead, DeferredLogprobPasses, CpuRanksOptimizerLoad, CheckpointSaveErrors, GRPOTrainer
):
    """GRPOTrainer with D3S/PODS rollout selection and the |A| x H token mask."""

    # ---- 1. sample level: keep N of G rollouts per prompt, after TRL scored them ---------------------------

    def _calculate_rewards(self, *args):  # (inputs, prompts, completions, completion_ids_list)
        self._hook_state.rewards_per_func = super()._calculate_rewards(*args)
        return self._hook_state.rewards_per_func

    def _generate_and_score_completions(self, inputs):
        keep = self.selection_schedule.keep_per_prompt(self.training_progress())
        drops_rollouts = (
            self.model.training and self.args.sample_rule != "none" and keep < self.num_generations
        )
        selects_tokens = self.model.training and self._token_keep_ratio() < 1.0
        self._hook_state.old_policy_entropies_wanted = selects_tokens and self._runs_old_policy_pass()
        excluding = self.model.training and self._excludes_zeroed()
        defer = drops_rollouts and self.args.defer_logprob_passes
        with self.logprob_passes_deferred(
            defer, old_policy_pass_eager=excluding and self._may_zero_rollouts()
        ):
            output = super()._generate_and_score_completions(inputs)  # TRL: generate, reward, advantages
        self._take_old_policy_entropies(output)
        if not self.model.training:
            return output
        all_advantages = self.accelerator.gather(output["advantages"])  # the batch of every rank
        zeroed = None  # rollouts of every rank that vLLM's correction zeroed, where selection avoids them
        if excluding and (not defer or self._hook_state.old_policy_pass_done):
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            zeroed = zeroed_rollouts(output["importance_sampling_ratio"], loss_mask)
            zeroed = self.accelerator.gather(zeroed.int()).bool()  # gloo: no bool
        kept = torch.arange(all_advantages.numel(), device=all_advantages.device)
        kept_advantages, selected = all_advantages, output
        if drops_rollouts:
            rewards = self._summed_rewards(all_advantages.device)
            kept = select_samples(
                all_advantages,
                torch.nan_to_num(rewards, nan=float("-inf")),  # unscorable rollouts never rank first
                num_generations=self.num_generations,
                keep_per_prompt=keep,
                rule=self.args.sample_rule,
                scope=self.args.sample_scope,
                generator=torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.state.global_step),
                eligible=None if zeroed is None else ~zeroed,
            )
            kept_advantages = all_advantages[kept]
            if self.args.renormalize:  # PODS: over the kept subset; D-family: over all G
                scale = self.scale_rewards != "none"
                if zeroed is not None:  # a filler the correction zeroed is out of its group's statistics
                    rewards = rewards.masked_fill(zeroed, float("nan"))
                kept_advantages = renormalize_advantages(rewards, kept, self.num_generations, scale=scale)
            selected = self._keep_rows(output, kept, kept_advantages)
            if defer:  # savings: only the kept rows are forwarded
                selected = self.run_deferred_logprob_passes(selected)
                self._take_old_policy_entropies(selected)
        if excluding and "importance_sampling_ratio" in selected:
            selected = self._exclude_zeroed(selected)
        self._log_selection(keep, all_advantages, kept, kept_advantages, zeroed)
        self._hook_state.old_policy_entropies_wanted = False
        entropies = selected.pop("old_policy_entropies", None)
        if selects_tokens and self.args.token_scope != "micro_batch":
            selected["token_mask"] = self._select_tokens(selected, entropies)
            if self.args.token_norm == "selected":  # dapo's normaliser: the kept tokens of every rank
                selected["num_items_in_batch"] = self.accelerator.gather(selected["token_mask"].sum()).sum()
        return selected

    # ---- 2. token level: the top-K% tokens by |A| x H of the kept rollouts -------------------------------

    def _select_tokens(self, batch: dict, entropies: torch.Tensor | None = None) -> torch.Tensor:
        """The token mask of a generation batch, ranked over the kept rollouts of every rank (the paper's T),
        by the old-policy pass's entropies, else a no-gradient pass's (docs/fidelity.md: which entropies)."""
        if entropies is None:
            _, entropies, _ = self._no_grad_pass(self.model, batch, compute_entropy=True)
        valid = batch["completion_mask"] * batch.get("tool_mask", 1)  # without what _exclude_zeroed took out
        return self._rank_tokens(batch, entropies, valid.bool())

    def _rank_tokens(self, inputs: dict, entropies: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        scores = token_scores(inputs["advantages"], entropies, self.args.token_rule)
        token_keep_ratio, scope = self._token_keep_ratio(), self.args.token_scope
        # Rank over the rows of every rank, exactly as a single process would see them (one process: as is).
        rows, cols = scores.shape
        pad = self.accelerator.pad_across_processes
        all_scores = self.accelerator.gather(pad(scores, dim=1, pad_index=0))
        all_valid = self.accelerator.gather(pad(valid.int(), dim=1, pad_index=0)).bool()  # gloo: no bool
        rank = self.accelerator.process_index
        all_keep = token_keep_mask(all_scores, all_valid, token_keep_ratio, scope)
        keep = all_keep[rank * rows : (rank + 1) * rows, :cols]
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
        return keep

    def _compute_loss(self, model, inputs):
        training = self.model.training
        token_mask = inputs.get("token_mask") if training else None
        micro_batch = training and self.args.token_scope == "micro_batch" and self._token_keep_ratio() < 1.0
        # TRL calls get_high_entropy_mask (which returns the mask) only while this is < 1
        self.top_entropy_quantile = 0.0 if token_mask is not None or micro_batch else 1.0
        self._hook_state.token_mask, given = token_mask, inputs
        # TRL's loss mask becomes the kept tokens: the sequence ratio averages over them, and every
        # denominator counts them (token_norm "selected")
        kept_as_loss_mask = token_mask is not None and (
            self.importance_sampling_level == "sequence" or self.args.token_norm == "selected"
        )
        if kept_as_loss_mask:
            inputs = {**inputs, "tool_mask": inputs.get("tool_mask", 1) * token_mask}
        self._hook_state.loss_inputs = inputs
        with self._kl_on_selected_tokens(training):
            loss = super()._compute_loss(model, inputs)
        if training:
            self._log_loss_call(given, kept_as_loss_mask)
            loss = loss * self._zeroed_rows_out_of_mean(inputs)
        return loss

    # ---- 3. vLLM's importance-sampling correction: what it zeroed is out of the update -------------------

    def _excludes_zeroed(self) -> bool:
        """Whether this run takes what vLLM's correction zeroed out of selection and the loss (the method's
        ``zeroed_rollouts``, with the correction on)."""
        return (
            self.args.zeroed_rollouts == "excluded"
            and self.use_vllm
            and self.vllm_importance_sampling_correction
        )

    def _may_zero_rollouts(self) -> bool:
        """TRL's *_mask modes set a ratio outside the clip range to zero (the truncate modes clip it)."""
        return self.vllm_importance_sampling_mode in ("sequence_mask", "token_mask")

    def _exclude_zeroed(self, batch: dict) -> dict:
        """The zeroed tokens leave the loss mask (no policy or KL term), so every denominator drops them."""
        loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        batch["tool_mask"] = corrected_loss_mask(batch["importance_sampling_ratio"], loss_mask)
        batch["num_items_in_batch"] = self.accelerator.gather(batch["tool_mask"].sum()).sum()
        return batch

    def _zeroed_rows_out_of_mean(self, inputs: dict) -> float:
        """Losses that average over the micro-batch's rows (grpo, sapo, dr_grpo, luspo) still count a zeroed
        rollout, whose terms are all zero: rescale so the mean is over the other rows."""
        if self.loss_type not in ROW_MEAN_LOSSES or "importance_sampling_ratio" not in inputs:
            return 1.0
        if not self._excludes_zeroed():
            return 1.0
        rows = inputs["completion_mask"].shape[0]
        zeroed = int(zeroed_rollouts(inputs["importance_sampling_ratio"], inputs["completion_mask"]).sum())
        return rows / (rows - zeroed) if zeroed < rows else 1.0

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """The mask chosen for the generation batch, not TRL's entropy quantile (``threshold`` unused)."""
        state = self._hook_state
        if state.token_mask is None:  # token_scope "micro_batch": TRL's place, ranked here
            state.token_mask = self._rank_tokens(state.loss_inputs, entropies, mask.bool())
        return state.token_mask

    @contextmanager
    def _kl_on_selected_tokens(self, training: bool):
        """kl_tokens "selected": TRL's beta * KL counts the selected tokens only, for this loss call."""
        beta = self.beta
        if training and beta != 0.0 and self.args.kl_tokens == "selected":
            self.beta = SelectedTokensBeta(beta, self._hook_state)
        try:
            yield
        finally:
            self.beta = beta

    # ---- set-up, schedule, and the plumbing of the two levels ----------------------------------------------

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # GRPOTrainer's arguments by name: accuracy_reward is graded under args.answer_policy.
        call = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = call.arguments.get("args")
        if not isinstance(config, D3SConfig):
            raise TypeError(f"D3STrainer needs a D3SConfig, got {type(config).__name__}")
        reward_funcs = call.arguments.get("reward_funcs")
        call.arguments["reward_funcs"] = bind_answer_policy(reward_funcs, config.answer_policy)
        self._hook_state = HookState()
        on_cpu = config.use_vllm and not torch.cuda.is_available()
        if on_cpu:
            check_vllm_without_cuda(config, where="")  # before TRL loads the model and builds the engine
        if config.use_vllm and config.vllm_mode == "colocate":
            use_a_free_rendezvous_port()
        with engine_options(config.vllm_dtype if config.use_vllm else "auto", on_cpu=on_cpu):
            super().__init__(*call.args[1:], **call.kwargs)
        trl_contract.check_trainer_attributes(self)
        if self.use_vllm:
            use_exact_cpu_weight_sync(self.vllm_generation)  # on vLLM's CPU backend; TRL's own sync elsewhere
        self.selection_schedule = self.args.selection_schedule
        if self.args.metrics_log:
            self.add_callback(JsonlMetricsCallback(os.path.join(self.args.output_dir, self.args.metrics_log)))
        self.add_callback(NanGuardCallback())  # after the metrics log, so the NaN step is recorded
        self.add_callback(D3SCheckpointState())
        if (
            self._excludes_zeroed()
            and self.loss_type in ROW_MEAN_LOSSES
            and (self._entropy_bonus_enabled or self.aux_loss_enabled)
        ):
            raise ValueError(
                f"zeroed_rollouts excluded rescales loss_type {self.loss_type!r}'s mean over rows, which "
                "would scale the entropy bonus or router aux loss too: set zeroed_rollouts: trl, or "
                "entropy_coef 0 and no router aux loss"
            )

    def _token_keep_ratio(self) -> float:
        """K at the current point of the schedule; 1 when the method has no token level."""
        if self.args.token_rule == "none":
            return 1.0
        return self.selection_schedule.token_keep_ratio(self.training_progress())

    def training_progress(self) -> float:
        """p = step / max_steps, where the schedule of N and K is read."""
        return self.state.global_step / self.state.max_steps if self.state.max_steps > 0 else 0.0

    @property
    def update_tokens_total(self) -> int:
        """Tokens that reached the policy gradient, all ranks, all steps (saved with checkpoints)."""
        return self._checkpoint_state().update_tokens_total

    def _checkpoint_state(self) -> D3SCheckpointState:
        # looked up: Trainer replaces the instance when it restores callback states from a checkpoint
        return next(cb for cb in self.callback_handler.callbacks if isinstance(cb, D3SCheckpointState))

    def _no_grad_pass(self, model, batch: dict, **kwargs) -> tuple:
        """TRL's log-prob pass over the rows of a generation batch, without gradient (as TRL's own passes)."""
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        size, micro_batch = batch["completion_ids"].size(1), self.args.per_device_train_batch_size
        no_checkpointing = disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs)
        with torch.no_grad(), no_checkpointing:
            return self._get_per_token_logps_and_entropies(
                model, ids, attention, size, batch_size=micro_batch, **kwargs
            )

    def _summed_rewards(self, device: torch.device) -> torch.Tensor:
        rewards_per_func = self._hook_state.rewards_per_func.to(device)
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _keep_rows(self, output: dict, kept: torch.Tensor, kept_advantages: torch.Tensor) -> dict:
        """Index every per-rollout tensor by the kept rows, each rank taking an equal share."""
        num_processes, rank = self.accelerator.num_processes, self.accelerator.process_index
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
                raise ValueError(
                    f"cannot down-sample generation output {key!r} of shape {tuple(value.shape)}"
                )
            if rank_local:
                selected[key] = value[shares[rank] - rank * local_rows]
            else:  # cross-group selection left ranks uneven: pool the rows, then deal out equal shares
                pad = self._tokenizer.pad_token_id if key.endswith("_ids") else 0
                padded = self.accelerator.pad_across_processes(
                    value, dim=1, pad_index=pad, pad_first=key in _LEFT_PADDED
                )
                selected[key] = self.accelerator.gather(padded)[shares[rank]]
        selected["advantages"] = kept_advantages.view_as(shares)[rank].to(output["advantages"].dtype)
        loss_mask = selected["completion_mask"] * selected.get("tool_mask", 1)
        # TRL counted the tokens of all rollouts before we dropped any; dapo's normaliser needs the kept ones.
        selected["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return selected

    # ---- metrics and the anatomy log -----------------------------------------------------------------------

    def _log_selection(
        self,
        keep: int,
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
        metrics["schedule/token_keep_ratio"].append(
            self.selection_schedule.token_keep_ratio(self.training_progress())
        )
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

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        state = self._hook_state
        # TRL's (or the deferred) old-policy pass is the first no-gradient pass of the policy while scoring
        old_policy_pass = (
            state.old_policy_entropies_wanted and model is self.model and not torch.is_grad_enabled()
        )
        if old_policy_pass:
            kwargs["compute_entropy"] = True
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if old_policy_pass and entropies is not None:  # None: a placeholder while the pass is deferred
            state.old_policy_entropies, state.old_policy_entropies_wanted = entropies, False
        if kwargs.get("compute_entropy") and torch.is_grad_enabled():  # the gradient pass of _compute_loss
            state.loss_entropies = entropies
        return logps, entropies, aux

    def _runs_old_policy_pass(self) -> bool:
        """TRL's condition for its old-policy log-prob pass (in _generate_and_score_completions), which runs
        before its reference pass: the first no-gradient pass of the policy while scoring is that one."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _take_old_policy_entropies(self, batch: dict) -> None:
        """Move the old-policy pass's entropies into the batch, as a per-rollout tensor selection indexes."""
        if self._hook_state.old_policy_entropies is not None:
            batch["old_policy_entropies"] = self._hook_state.old_policy_entropies
            self._hook_state.old_policy_entropies = None

    def _log_loss_call(self, inputs: dict, kept_as_loss_mask: bool) -> None:
        chosen, metrics = self._hook_state.token_mask, self._metrics["train"]
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        if kept_as_loss_mask:  # TRL logged the entropy over its loss mask, the kept tokens: log every token's
            entropy, count = self._summed_over_ranks(self._hook_state.loss_entropies.detach() * mask, mask)
            metrics["entropy"][-1] = (entropy / count.clamp(min=1)).item()
        used = mask.bool() if chosen is None else chosen
        trained, count = self._summed_over_ranks(used, mask)
        self._checkpoint_state().update_tokens_total += int(trained.item())
        metrics["selection/update_tokens"].append(trained.item())
        if chosen is None:  # every token trained: the selected entropy is TRL's entropy
            metrics["selection/entropy_selected"].append(metrics["entropy"][-1])
        metrics["selection/token_keep_fraction"].append((trained / count.clamp(min=1)).item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            logs["selection/update_tokens_cumulative"] = float(self.update_tokens_total)
        super().log(logs, start_time)


# Per-rollout tensors of TRL's generation batch that are left-padded: they pad first when pooled across ranks.
# TRL's loss types that average over the rows of a micro-batch (not over a token count).
ROW_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")
_LEFT_PADDED = {"prompt_ids", "prompt_mask"}
