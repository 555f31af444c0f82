"""Deferred log-prob passes (``D3SConfig.defer_logprob_passes``): a dropped rollout costs only its generation
and reward. While TRL scores, its log-prob passes get zero placeholders; after selection TRL's passes run on
the kept rows and replace them (docs/fidelity/trainer.md, "Compute savings")."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from trl.trainer.utils import nanmax, nanmin, use_adapter

from d3s.rows import loss_mask

# Generation outputs that TRL computes with log-prob passes; deferred until after selection.
DEFERRED_KEYS = ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")
# The keyword arguments of TRL's _get_per_token_logps_and_entropies that are not model inputs.
PASS_OPTIONS = ("batch_size", "compute_entropy", "compute_aux_loss")


def has_multimodal_inputs(kwargs: dict) -> bool:
    """Whether a log-prob pass has model inputs beyond the text (TRL passes them by keyword)."""
    return any(value is not None for key, value in kwargs.items() if key not in PASS_OPTIONS)


class DeferredLogprobPasses:
    """Mixin for D3STrainer: the deferral's state and passes (its log-prob pass asks deferred_placeholder)."""

    @contextmanager
    def logprob_passes_deferred(self, defer: bool, old_policy_pass_eager: bool = False) -> Iterator[None]:
        """While TRL scores: its log-prob passes return placeholders when ``defer``; with
        ``old_policy_pass_eager`` its first one, the old-policy pass, runs for real on every rollout (vLLM's
        masked importance-sampling ratio, which it gives, decides which rollouts selection may keep)."""
        state = self._hook_state
        state.deferring_logprobs = defer
        state.old_policy_pass_eager, state.old_policy_pass_done = defer and old_policy_pass_eager, False
        try:
            yield
        finally:
            state.deferring_logprobs = state.old_policy_pass_eager = False

    def deferred_placeholder(self, scoring_pass: str | None, *args, **kwargs) -> tuple | None:
        """What TRL's log-prob pass ``scoring_pass`` (a d3s/trl_contract.py SCORING_PASSES name; None outside
        TRL's scoring), called with ``args``, ``kwargs``, returns while deferred: zeros of its shape; None
        where the pass runs for real (not deferring, or the eager old-policy pass)."""
        state = self._hook_state
        if scoring_pass is None or not state.deferring_logprobs:
            return None
        if scoring_pass == "old_policy" and state.old_policy_pass_eager:
            state.old_policy_pass_done = True
            return None
        if has_multimodal_inputs(kwargs):
            raise ValueError(
                "rollout selection defers log-prob passes, which multimodal inputs do not support; "
                "set defer_logprob_passes=False"
            )
        input_ids, _, logits_to_keep = args
        # A stand-in of the right shape: selection first, then the real pass on the kept rows only.
        return torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device), None, None

    def run_deferred_logprob_passes(self, output: dict) -> dict:
        """TRL's old-policy, reference and importance-sampling passes, on this rank's kept rows; the
        old-policy pass gives the token level's entropies too (``old_policy_entropies``) when it wants."""
        pending = [key for key in DEFERRED_KEYS if key in output]  # placeholders, indexed by selection
        if self._hook_state.old_policy_pass_done:  # these two are real already
            pending = [
                key for key in pending if key not in ("old_per_token_logps", "importance_sampling_ratio")
            ]
        extras = {key: output[key] for key in ("token_type_ids", "mm_token_type_ids") if key in output}

        def logps(model) -> torch.Tensor:
            return self._no_grad_pass(model, output, **extras)[0]

        if "old_per_token_logps" in pending:
            wanted = self._hook_state.old_policy_entropies_wanted
            old, entropies, _ = self._no_grad_pass(self.model, output, compute_entropy=wanted, **extras)
            output["old_per_token_logps"] = old
            if wanted:
                output["old_policy_entropies"] = entropies
        if "ref_per_token_logps" in pending:
            if self.ref_model is not None:
                output["ref_per_token_logps"] = logps(self.ref_model)
            else:  # PEFT: the reference is the base model (or the "ref" adapter), as in TRL
                unwrapped = self.accelerator.unwrap_model(self.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    output["ref_per_token_logps"] = logps(self.model)
        if "importance_sampling_ratio" in pending:
            output["importance_sampling_ratio"] = self._importance_sampling_ratio(output)
        return output

    def _importance_sampling_ratio(self, output: dict) -> torch.Tensor:
        """TRL's vLLM importance-sampling ratio and its metrics, over the kept rollouts: a copy of TRL's
        inline code, pinned to it by d3s/trl_contract.py COPIED_TRL_CODE (TRL has no function to call)."""
        mask = loss_mask(output)
        old, sampling = output["old_per_token_logps"], output["sampling_per_token_logps"]
        logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)  # NaN: vLLM could not score the token
        mode = self.vllm_importance_sampling_mode
        sequence_level = mode in ("sequence_mask", "sequence_truncate")
        ratio = torch.exp(logps_diff.sum(dim=-1, keepdim=True) if sequence_level else logps_diff)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if mode in ("sequence_truncate", "token_truncate"):
            ratio = torch.clamp(ratio, min=low, max=high)
        else:
            low = -math.inf if low is None else low
            high = math.inf if high is None else high
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

        # TRL logged these from the placeholder: replace its entries with the kept rollouts' values.
        valid = mask.bool()
        delta = torch.abs(old - sampling)[valid]
        delta = delta[~torch.isnan(delta)]
        flat_ratio = ratio.flatten() if sequence_level else ratio[valid]
        zero = torch.tensor(0.0, device=ratio.device)

        def gathered(values: torch.Tensor, reduce) -> torch.Tensor:  # 0 for an empty rank, as TRL does
            return self.accelerator.gather(reduce(values) if values.numel() else zero)

        stats = {
            "sampling/sampling_logp_difference/mean": gathered(delta, torch.mean).mean(),
            "sampling/sampling_logp_difference/max": gathered(delta, torch.max).max(),
            "sampling/importance_sampling_ratio/min": nanmin(gathered(flat_ratio, torch.min)),
            "sampling/importance_sampling_ratio/mean": gathered(flat_ratio, torch.mean).nanmean(),
            "sampling/importance_sampling_ratio/max": nanmax(gathered(flat_ratio, torch.max)),
        }
        for name, value in stats.items():
            self._metrics["train"][name][-1] = value.item()
        return ratio
