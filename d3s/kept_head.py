"""Log-probabilities with gradient only where the update trains.

With a token keep ratio K < 1 the loss multiplies every unselected token by zero, yet TRL's fused LM head still
projects, and back-propagates through, every completion position. ``add_kept_token_head`` wraps the model's
forward (after TRL's ``add_fused_lm_head``) with one more keyword, ``select_tokens``. Given it, the forward

  1. runs the backbone once (with gradient),
  2. scores every labelled position without gradient: log-probability and entropy, in TRL's chunked kernel,
  3. asks ``select_tokens(entropy)`` which positions train (the |A| x H top-K% mask needs the entropies),
  4. projects only those positions through the LM head with gradient.

Unselected positions carry their no-gradient log-probability, so the loss, every logged metric and the gradients
equal the straightforward masked computation, while the head's backward (and its tile buffer) shrinks with K.
The call goes through the model's own forward, so DDP, DeepSpeed and PEFT wrappers see an ordinary forward.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

# Vocabulary tile width of TRL's fused head (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
VOCAB_CHUNK = 32768

TokenSelector = Callable[[torch.Tensor], torch.Tensor]


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
    """Let ``model(..., labels=labels, select_tokens=fn)`` back-propagate through the LM head only where fn says."""
    reason = kept_token_head_unsupported(model)
    if reason:
        raise ValueError(reason)
    inner_forward = model.forward  # TRL's fused head: every call without select_tokens goes there unchanged

    def forward(self, *args, select_tokens: TokenSelector | None = None, labels=None, **kwargs):
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
        with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):
            with torch.no_grad():
                scored_logps, scored_entropy, *_ = ChunkedLogProbFunction.apply(
                    hidden[valid],
                    weight,
                    bias,
                    labels[valid],
                    temperature,
                    VOCAB_CHUNK,
                    None,
                    1.0,
                    ("entropy",),
                )
            entropy = scored_entropy.new_zeros(valid.shape).masked_scatter(valid, scored_entropy)
            keep = select_tokens(entropy) & valid
            kept_logps, *_ = ChunkedLogProbFunction.apply(
                hidden[keep], weight, bias, labels[keep], temperature, VOCAB_CHUNK, None, 1.0, ()
            )
        # masked_scatter keeps the output connected to the graph even when nothing is kept
        log_probs = scored_logps.new_zeros(valid.shape).masked_scatter(valid, scored_logps)
        log_probs = log_probs.masked_scatter(keep, kept_logps)
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, label_mask=valid)

    model.forward = types.MethodType(forward, model)
