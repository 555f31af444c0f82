"""D3STrainer: TRL's GRPO with sample- and token-level down-sampling (D3S, PODS and the methods they compare).

TRL owns generation, rewards, advantages and logging. D3S adds, once per generation batch and identically on
every rank: (1) keep a subset of the scored rollouts and re-index every per-rollout tensor; (2) over the kept
rollouts of every rank, the top-K% tokens by |A| x H as the per-rollout ``token_mask``; (3) the loss of the
selecting methods, one function in docs/fidelity/objectives.md's notation (d3s/objective.py). With
``method="grpo"`` all three are off: TRL's GRPOTrainer, its loss included, step for step. What vLLM's
importance-sampling correction zeroed takes no slot at either level and leaves the loss
(``D3SConfig.excludes_zeroed``). Opt-in savings: d3s/savings/; TRL internals used: d3s/trl_contract.py.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from d3s import trl_contract
from d3s.callbacks.checkpoints import CheckpointSaveErrors, D3SCheckpointState
from d3s.callbacks.logs import JsonlMetricsCallback, NanGuardCallback
from d3s.callbacks.optimizer_load import CpuRanksOptimizerLoad
from d3s.logprob_passes import TrlLogprobPasses
from d3s.loss_terms import SelectionLossTerms
from d3s.objective import selection_loss
from d3s.packing import LOSS_ROW_SCALE, PackedMicroBatches, is_empty
from d3s.rewards import bind_answer_policy
from d3s.rows import keep_rows, loss_mask, valid_tokens
from d3s.savings import DeferredLogprobPasses
from d3s.savings.deferred import has_multimodal_inputs
from d3s.savings.kept_head import head_model, kept_token_head_enabled, kept_token_logps
from d3s.selection import (
    renormalize_advantages,
    select_samples,
    token_keep_mask,
    token_scores,
    zeroed_rollouts,
)
from d3s.trainer_config import D3SConfig
from d3s.trainer_metrics import SelectionMetrics
from d3s.vllm_engine import building_engine, use_exact_cpu_weight_sync

__all__ = ["D3SConfig", "D3STrainer"]


def default_config(model: Any) -> D3SConfig:
    """The config D3STrainer builds when given none: GRPOTrainer's (trl 1.16, ``GRPOTrainer.__init__``),
    ``GRPOConfig(f"{model_name}-GRPO")``, as a D3SConfig of method grpo, so every TRL default holds."""
    name = model if isinstance(model, str) else get_config_model_id(model.config)
    return D3SConfig(f"{name.split('/')[-1]}-GRPO")


@dataclass
class HookState:
    """Values TRL's call chain does not hand to the hook that needs them (docs/trl-hooks-proposal.md)."""

    rewards_per_func: torch.Tensor | None = None  # TRL's rewards, which it does not return
    anatomy_tokens_due: bool = False  # the next token selection writes the anatomy log's token record
    # TRL's log-prob passes still due in the scoring now running, by trl_contract.SCORING_PASSES names; None
    # outside TRL's scoring (the loss's pass, d3s's own passes)
    scoring_passes: list[str] | None = None
    old_policy_entropies_wanted: bool = False  # the token level ranks this batch by the old-policy entropies
    old_policy_entropies: torch.Tensor | None = None  # ... which the old-policy pass of TRL's scoring gave
    deferring_logprobs: bool = False  # savings/deferred.py: TRL's log-prob passes return placeholders
    old_policy_pass_eager: bool = False  # ... but the old-policy pass: its vLLM ratio decides eligibility
    old_policy_pass_done: bool = False  # that pass ran for real in this scoring
    # the loss's metrics of the optimizer step now running, this rank, unsynced (trainer_metrics.py): a mean's
    # (total, count), and a per-rollout metric's extreme by (name, largest)
    step_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    step_extremes: dict[tuple[str, bool], torch.Tensor] = field(default_factory=dict)


class D3STrainer(
    SelectionMetrics,
    DeferredLogprobPasses,
    TrlLogprobPasses,
    SelectionLossTerms,
    PackedMicroBatches,
    CheckpointSaveErrors,
    GRPOTrainer,
    CpuRanksOptimizerLoad,
):
    """GRPOTrainer with D3S/PODS rollout selection and the |A| x H token mask.

    The mixins before GRPOTrainer: the step's metrics (d3s/trainer_metrics.py), the deferred log-prob passes
    (d3s/savings/deferred.py), TRL's log-prob passes and the scoring seam (d3s/logprob_passes.py), the entropy
    bonus and the router's aux loss (d3s/loss_terms.py), packing (d3s/packing.py), a full disk at a
    checkpoint (d3s/callbacks/checkpoints.py). CpuRanksOptimizerLoad, a transformers.Trainer subclass, comes
    after GRPOTrainer: in the MRO it sits between GRPOTrainer and
    Trainer, so GRPOTrainer's own checkpoint load runs and calls it."""

    # ---- 1. sample level: keep N of G rollouts per prompt, after TRL scored them ---------------------------

    def _calculate_rewards(self, *args):  # (inputs, prompts, completions, completion_ids_list)
        self._hook_state.rewards_per_func = super()._calculate_rewards(*args)
        return self._hook_state.rewards_per_func

    def _generate_and_score_completions(self, inputs):
        progress = self.training_progress()  # N and K of this generation batch, both from the one schedule
        keep = self.selection_schedule.keep_per_prompt(progress)
        token_keep_ratio = self.selection_schedule.token_keep_ratio(progress)
        drops_rollouts = (
            self.model.training and self.args.sample_rule != "none" and keep < self.num_generations
        )
        selects_tokens = self.model.training and token_keep_ratio < 1.0
        self._hook_state.old_policy_entropies_wanted = selects_tokens
        excluding = self.model.training and self.args.excludes_zeroed()
        defer = drops_rollouts and self.args.defer_logprob_passes
        with self.logprob_passes_deferred(
            defer, old_policy_pass_eager=excluding and self.vllm_importance_sampling_mode.endswith("_mask")
        ):
            output = self._trl_scoring(inputs)  # TRL: generate, reward, advantages, its log-prob passes
        self._take_old_policy_entropies(output)
        if not self.model.training:
            return output
        all_advantages = self.accelerator.gather(output["advantages"])  # the batch of every rank
        zeroed = None  # rollouts of every rank that vLLM's correction zeroed, where selection avoids them
        if excluding and (not defer or self._hook_state.old_policy_pass_done):
            zeroed = zeroed_rollouts(output["importance_sampling_ratio"], loss_mask(output))
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
                scope=self._sample_scope(),
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
            if defer:  # savings: only the kept rows are forwarded (the old-policy pass gives the entropies)
                selected = self.run_deferred_logprob_passes(selected)
        self._log_selection(keep, token_keep_ratio, all_advantages, kept, kept_advantages, zeroed)
        self._hook_state.old_policy_entropies_wanted = False
        entropies = selected.pop("old_policy_entropies", None)
        if selects_tokens and self.args.token_scope != "micro_batch":
            selected["token_mask"] = self._select_tokens(selected, entropies)
        if self.owns_loss:  # the loss tokens of the generation batch, every rank: dapo's D
            counted = valid_tokens(self.args.excludes_zeroed(), selected)
            if self.args.token_norm == "selected" and "token_mask" in selected:
                counted = selected["token_mask"]
            selected["num_items_in_batch"] = self.accelerator.gather(counted.sum()).sum()
        return selected

    # ---- 2. token level: the top-K% tokens by |A| x H of the kept rollouts -------------------------------

    def _select_tokens(self, batch: dict, entropies: torch.Tensor | None = None) -> torch.Tensor:
        """The token mask of a generation batch, ranked over the kept rollouts of every rank (the paper's T),
        by the old-policy pass's entropies, else a no-gradient pass's (docs/fidelity/objectives.md: which
        entropies)."""
        if entropies is None:
            _, entropies, _ = self._no_grad_pass(self.model, batch, compute_entropy=True)
        return self._rank_tokens(batch, entropies, valid_tokens(self.args.excludes_zeroed(), batch).bool())

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
        self._log_token_selection(inputs, entropies, scores, keep, valid, token_keep_ratio)
        return keep

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        if not self.owns_loss:  # grpo: TRL's loss, untouched
            loss = super()._compute_loss(model, inputs)
            self._log_update_tokens(valid_tokens(self.args.excludes_zeroed(), inputs), None)
            return loss
        if is_empty(inputs):  # packing moved this micro-batch's rows to a later one of the step
            return self._empty_micro_batch_loss()
        valid, rows_counted, is_weight = self._loss_rows(inputs)
        token_mask = inputs.get("token_mask")
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        size, extras = inputs["completion_ids"].size(1), {k: inputs[k] for k in _MODEL_INPUTS if k in inputs}
        if self.kept_token_head and token_mask is not None and not has_multimodal_inputs(extras):
            with self.accelerator.autocast():  # savings: the LM head's gradient only at the kept tokens
                logps, entropies = kept_token_logps(
                    model,
                    head_model(self.model),
                    ids,
                    attention,
                    size,
                    token_mask,
                    self.temperature,
                    self.args.cast_lm_head_to_fp32,
                )
        else:
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                ids,
                attention,
                size,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
                **extras,
            )
        if token_mask is None and self._token_keep_ratio() < 1.0:  # token_scope micro_batch: ranked here
            token_mask = self._rank_tokens(inputs, entropies.detach(), valid.bool())
        kept = valid if token_mask is None else valid * token_mask
        old_logps = inputs.get("old_per_token_logps")
        terms = selection_loss(
            self.objective,
            logps,
            logps.detach() if old_logps is None else old_logps,  # on-policy: TRL skipped the old pass
            inputs.get("ref_per_token_logps"),
            inputs["advantages"],
            valid,
            kept,
            is_weight,
            rows_counted=rows_counted,
            accumulation=self.current_gradient_accumulation_steps,
            dapo_denominator=self._dapo_denominator(inputs),
            row_scale=inputs.get(LOSS_ROW_SCALE),  # packed rows: their unpacked micro-batch's normaliser
            sampling_logps=inputs.get("sampling_per_token_logps"),  # vLLM's, for the off-policy mask
        )
        self._log_objective(terms, inputs["advantages"], entropies, valid, token_mask)
        return terms.loss + self._loss_terms(
            terms.loss, entropies, kept, aux_loss if self.aux_loss_enabled else None
        )

    def _loss_rows(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The loss's valid tokens m, the rows a mean over rows counts, and vLLM's importance weights."""
        valid = valid_tokens(self.args.excludes_zeroed(), inputs)
        rows_counted = torch.ones_like(valid[:, 0], dtype=torch.bool)
        is_weight = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_weight = inputs["importance_sampling_ratio"]
            if self.args.excludes_zeroed():  # a rollout the correction zeroed is out of a mean over rows
                rows_counted = ~zeroed_rollouts(is_weight, loss_mask(inputs))
        return valid, rows_counted, is_weight

    def _dapo_denominator(self, inputs: dict) -> torch.Tensor:
        """dapo's D: the loss tokens of the generation batch, every rank, per micro-batch of the step."""
        accumulation = self.current_gradient_accumulation_steps
        return (
            inputs["num_items_in_batch"].clamp(min=1.0)
            / self.accelerator.num_processes
            * accumulation
            / self.args.steps_per_generation
        )

    # ---- set-up, schedule, and the plumbing of the two levels ----------------------------------------------

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # GRPOTrainer's arguments by name: accuracy_reward is graded under args.answer_policy.
        call = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = call.arguments.get("args")
        if config is None:  # as GRPOTrainer: its default config (method grpo: TRL's defaults, all of them)
            config = call.arguments["args"] = default_config(call.arguments["model"])
        if not isinstance(config, D3SConfig):
            raise TypeError(f"D3STrainer needs a D3SConfig, got {type(config).__name__}")
        reward_funcs = call.arguments.get("reward_funcs")
        call.arguments["reward_funcs"] = bind_answer_policy(
            reward_funcs, config.answer_policy, reward_copied_answers=config.reward_copied_answers
        )
        self._hook_state = HookState()
        with building_engine(config):  # vLLM's checks before TRL loads the model, the engine's options
            super().__init__(*call.args[1:], **call.kwargs)
        trl_contract.check_trainer_attributes(self)
        if self.use_vllm:
            use_exact_cpu_weight_sync(self.vllm_generation)  # on vLLM's CPU backend; TRL's own sync elsewhere
        self.selection_schedule = self.args.selection_schedule
        if self.args.metrics_log:
            self.add_callback(JsonlMetricsCallback(os.path.join(self.args.output_dir, self.args.metrics_log)))
        self.add_callback(NanGuardCallback())  # after the metrics log, so the NaN step is recorded
        self.add_callback(D3SCheckpointState())
        self.owns_loss = self.args.uses_selection_loss()  # else TRL's loss (grpo)
        self.kept_token_head = self.args.kept_token_logprobs and kept_token_head_enabled(self)  # savings
        self.objective = self.args.objective()
        self._setup_packing()

    def _sample_scope(self) -> str:
        """The sample scope of this generation batch: the method's, or the adaptive switch's verdict on the
        gradient norms of the optimizer steps so far (TrainerState.log_history, restored on resume)."""
        switch = self.args.scope_switch()
        if switch is None:
            return self.args.sample_scope
        scope = switch.scope_from_log(self.state.log_history)
        self._metrics["train"]["selection/cross_group"].append(float(scope == "batch"))
        return scope

    def _token_keep_ratio(self) -> float:
        """K at the current point of the schedule (1 when the method has no token level, as the schedule
        says: D3SConfig.selection_schedule), from the schedule the trainer built once and logs from."""
        return self.selection_schedule.token_keep_ratio(self.training_progress())

    def training_progress(self) -> float:
        """p = step / max_steps, where the schedule of N and K is read."""
        return self.state.global_step / self.state.max_steps if self.state.max_steps > 0 else 0.0

    def _summed_rewards(self, device: torch.device) -> torch.Tensor:
        rewards_per_func = self._hook_state.rewards_per_func.to(device)
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _keep_rows(self, output: dict, kept: torch.Tensor, kept_advantages: torch.Tensor) -> dict:
        return keep_rows(output, kept, kept_advantages, self.accelerator, self._tokenizer.pad_token_id)


# Model inputs of a generation batch beyond the text, passed to the log-prob pass by keyword (as TRL does).
_MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
