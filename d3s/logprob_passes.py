"""TRL's log-prob passes as D3STrainer runs them: which of TRL's passes a call is, and what d3s adds to it.

TRL's scoring (``_generate_and_score_completions``) calls ``_get_per_token_logps_and_entropies`` once for each
of its passes (old policy, reference) and hands the results on by dict key. The scoring seam names each call
in advance from TRL's own conditions (d3s/trl_contract.py SCORING_PASSES), so the token level can take the
old-policy pass's entropies and the deferred passes (d3s/savings/deferred.py) can return placeholders, never
guessing from the model which pass is running. Length buckets (d3s/length_buckets.py) cut each pass's padding.
"""

from __future__ import annotations

import torch
from trl.models.utils import disable_gradient_checkpointing

from d3s import trl_contract
from d3s.length_buckets import bucketed_pass
from d3s.savings.deferred import has_multimodal_inputs


def scoring_mismatch(expected: list[str], ran: list[str]) -> str:
    """The error of a TRL whose scoring ran other log-prob passes than d3s/trl_contract.py expects."""
    import trl

    return (
        f"TRL {trl.__version__} ran the log-prob passes {ran} while scoring where d3s/trl_contract.py "
        f"SCORING_PASSES (TRL {trl_contract.TRL_VERSION}) expects {expected}: install "
        f"trl=={trl_contract.TRL_VERSION}, or port SCORING_PASSES and TrlLogprobPasses._trl_runs_pass"
    )


class TrlLogprobPasses:
    """D3STrainer's side of TRL's log-prob passes (a mixin before GRPOTrainer in its MRO)."""

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """TRL's log-prob pass, the one place d3s changes it: placeholders for the passes deferred past
        selection (savings), and the entropies of TRL's old-policy pass, which the token level ranks by.
        Which of TRL's passes a call is comes from the scoring seam (_trl_scoring), never from the model."""
        scoring_pass = self._next_scoring_pass()
        placeholder = self.deferred_placeholder(scoring_pass, *args, **kwargs)
        if placeholder is not None:
            return placeholder
        state = self._hook_state
        takes_entropies = scoring_pass == "old_policy" and state.old_policy_entropies_wanted
        if takes_entropies:
            kwargs["compute_entropy"] = True
        logps, entropies, aux = self._logprob_pass(model, *args, **kwargs)
        if takes_entropies:
            state.old_policy_entropies = entropies
        return logps, entropies, aux

    def _logprob_pass(self, model, input_ids, attention_mask, logits_to_keep, **kwargs) -> tuple:
        """TRL's pass, or with ``length_bucket_rows`` the same pass over rows bucketed by length, each bucket
        cut at its longest row (d3s/length_buckets.py; not where the model takes more than text, nor where
        the pass returns the router's aux loss, a statistic of the whole batch's tokens)."""
        trl_pass = super()._get_per_token_logps_and_entropies
        bucket_rows = self.args.length_bucket_rows
        if not bucket_rows or has_multimodal_inputs(kwargs) or kwargs.get("compute_aux_loss"):
            return trl_pass(model, input_ids, attention_mask, logits_to_keep, **kwargs)
        bucket_rows = min(bucket_rows, kwargs.get("batch_size") or bucket_rows)
        return bucketed_pass(
            lambda ids, mask, keep: trl_pass(model, ids, mask, keep, **kwargs),
            input_ids,
            attention_mask,
            logits_to_keep,
            bucket_rows,
        )

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

    # ---- the scoring seam: which of TRL's log-prob passes runs (d3s/trl_contract.py SCORING_PASSES) -------

    def _trl_scoring(self, inputs) -> dict:
        """TRL's _generate_and_score_completions, with each of its log-prob passes named in advance: the
        passes SCORING_PASSES lists whose TRL condition holds, in TRL's order. Raises RuntimeError when TRL
        ran other passes than these (another TRL), rather than take one pass's entropies for another's."""
        passes = trl_contract.SCORING_PASSES
        expected = [scoring.name for scoring in passes if self._trl_runs_pass(scoring.name)]
        state = self._hook_state
        state.scoring_passes = list(expected)
        try:
            output = super()._generate_and_score_completions(inputs)
            unused = state.scoring_passes
        finally:
            state.scoring_passes = None
        ran = [scoring.name for scoring in passes if scoring.output_key in output]
        if unused or ran != expected:
            raise RuntimeError(scoring_mismatch(expected, ran))
        return output

    def _next_scoring_pass(self) -> str | None:
        """The name of the TRL log-prob pass now called: the next one due in TRL's scoring; None outside."""
        due = self._hook_state.scoring_passes
        if due is None:
            return None
        if not due:
            raise RuntimeError(scoring_mismatch([], ["one more log-prob pass"]))
        return due.pop(0)

    def _trl_runs_pass(self, name: str) -> bool:
        """TRL's condition for each pass of SCORING_PASSES, evaluated before TRL scores (the contract pins
        the conditions against TRL's source: tests/test_trl_contract.py)."""
        if name == "old_policy":
            return self._runs_old_policy_pass()
        if name == "reference":
            return self.beta != 0.0
        raise ValueError(f"no condition for the scoring pass {name!r} of d3s/trl_contract.py SCORING_PASSES")

    def _runs_old_policy_pass(self) -> bool:
        """TRL's condition for its old-policy log-prob pass (SCORING_PASSES' first condition)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _take_old_policy_entropies(self, batch: dict) -> None:
        """Move the old-policy pass's entropies into the batch, as a per-rollout tensor selection indexes."""
        if self._hook_state.old_policy_entropies is not None:
            batch["old_policy_entropies"] = self._hook_state.old_policy_entropies
            self._hook_state.old_policy_entropies = None
