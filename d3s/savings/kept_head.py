"""The kept-token head (``D3SConfig.kept_token_logprobs``): with K < 1 the gradient pass projects through the
LM head only at the kept tokens; unselected positions carry their no-gradient log-probability, so losses,
metrics and gradients equal the masked computation (docs/fidelity.md, "Compute savings")."""

from __future__ import annotations

import types
from contextlib import nullcontext

import torch
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.utils import logging
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

from d3s.savings.deferred import has_multimodal_inputs

logger = logging.get_logger(__name__)

# Vocabulary tile width of TRL's fused head (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
VOCAB_CHUNK = 32768

# Losses in which an unselected token's log-prob reaches the loss only through the token mask.
PER_TOKEN_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


def kept_token_head_unsupported(model: PreTrainedModel) -> str | None:
    """Why the kept-position head cannot serve ``model`` (None: it can). Those models use TRL's head."""
    config = model.config.get_text_config()
    for name in (
        "final_logit_softcapping",
        "logit_scale",
        "output_multiplier",
        "lm_head_multiplier",
        "logits_scaling",
    ):
        if getattr(config, name, None) is not None:
            return f"the model's config sets {name}, which the kept-position head does not apply"
    if getattr(config, "output_router_logits", False):
        return "mixture-of-experts router losses are not computed by the kept-position head"
    if config is not model.config:
        return "vision-language models are not supported by the kept-position head"
    return None


def add_kept_token_head(
    model: PreTrainedModel, temperature: float, cast_lm_head_to_fp32: bool = False
) -> None:
    """Let ``model(..., labels=labels, select_tokens=mask)`` back-propagate through the LM head only where the
    boolean ``mask`` (the shape of ``labels[:, 1:]``) is true."""
    reason = kept_token_head_unsupported(model)
    if reason:
        raise ValueError(reason)
    inner_forward = model.forward  # TRL's fused head: every call without select_tokens goes there unchanged

    def forward(self, *args, select_tokens: torch.Tensor | None = None, labels=None, **kwargs):
        if select_tokens is None:
            return inner_forward(*args, labels=labels, **kwargs)
        kwargs.pop("fused_lm_head", None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        lm_head = self.get_output_embeddings()
        hidden = hidden.to(lm_head.weight.device)
        labels = labels[:, 1:].to(lm_head.weight.device)
        valid = labels != -100
        autocast_ctx = nullcontext()
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
            autocast_ctx = torch.autocast(hidden.device.type, enabled=False)
        weight, bias = lm_head.weight, lm_head.bias
        if isinstance(weight, DTensor):  # FSDP2 shards: gather the head once, as TRL's fused head does
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None

        def head(rows: torch.Tensor, outputs: tuple[str, ...]) -> tuple:  # TRL's chunked kernel at ``rows``
            return ChunkedLogProbFunction.apply(
                hidden[rows], weight, bias, labels[rows], temperature, VOCAB_CHUNK, None, 1.0, outputs
            )

        with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):
            with torch.no_grad():
                scored_logps, scored_entropy, *_ = head(valid, ("entropy",))
            entropy = scored_entropy.new_zeros(valid.shape).masked_scatter(valid, scored_entropy)
            keep = select_tokens.to(valid.device) & valid
            kept_logps, *_ = head(keep, ())
        # masked_scatter keeps the output connected to the graph even when nothing is kept
        log_probs = scored_logps.new_zeros(valid.shape).masked_scatter(valid, scored_logps)
        log_probs = log_probs.masked_scatter(keep, kept_logps)
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, label_mask=valid)

    model.forward = types.MethodType(forward, model)


class KeptTokenHead:
    """Mixin for D3STrainer (before GRPOTrainer in its bases): installs the head when it is exact."""

    kept_token_head = False  # True when the gradient pass projects only the kept tokens

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.args.kept_token_logprobs and self.args.token_rule != "none":
            blocker = self._kept_token_head_blocker()
            if blocker is None:
                add_kept_token_head(self._head_model(), self.temperature, self.args.cast_lm_head_to_fp32)
                self.kept_token_head = True
            else:
                logger.warning(
                    "kept-token log-probs are off, the LM head runs at every position: %s", blocker
                )

    def _head_model(self):
        return self.model.get_base_model() if is_peft_model(self.model) else self.model

    def _kept_token_head_blocker(self) -> str | None:
        """Why unselected tokens may still need a gradient (None: the kept-token head is exact)."""
        if self.args.token_scope == "micro_batch":
            return "token_scope micro_batch chooses the token mask inside the loss, after the forward pass"
        if self.beta != 0.0 and self.args.kl_tokens == "all":
            return "beta != 0 with kl_tokens all: the KL term trains every token"
        if self.loss_type not in PER_TOKEN_LOSSES:
            losses = ", ".join(PER_TOKEN_LOSSES)
            return f"loss_type {self.loss_type!r} is not one of the per-token losses {losses}"
        if self._entropy_bonus_enabled:
            return "the entropy bonus trains the entropy of every token"
        return kept_token_head_unsupported(self._head_model())

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if (
            self.kept_token_head
            and kwargs.get("compute_entropy")  # the gradient pass of _compute_loss
            and not kwargs.get("compute_aux_loss")
            and not has_multimodal_inputs(kwargs)
            and torch.is_grad_enabled()
            and self.model.training
            and self._hook_state.token_mask is not None
        ):
            return self._kept_token_logps(model, *args)
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _kept_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        """Log-probs with gradient only at the tokens of the trainer's mask, chosen before the loss."""
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100  # only the completion is scored, as in TRL
        keep = torch.zeros_like(labels[:, 1:], dtype=torch.bool)
        keep[:, -logits_to_keep:] = self._hook_state.token_mask
        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, select_tokens=keep
            )
        return outputs.log_probs[:, -logits_to_keep:], outputs.entropy[:, -logits_to_keep:], None
