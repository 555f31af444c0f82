"""The kept-token head (``D3SConfig.kept_token_logprobs``): with K < 1 the gradient pass projects through the
LM head only at the kept tokens; unselected positions carry their no-gradient log-probability, so losses,
metrics and gradients equal the masked computation (docs/fidelity/trainer.md, "Compute savings"). The
selection loss calls ``kept_token_logps`` in place of TRL's log-prob pass (d3s/trainer.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.utils import logging
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import maybe_gather_lm_head_ctx

logger = logging.get_logger(__name__)

# Vocabulary tile width of TRL's fused head (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
VOCAB_CHUNK = 32768


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


def kept_token_head_blocker(trainer) -> str | None:
    """Why unselected tokens may still need a gradient in ``trainer``'s loss (None: the kept-token head is
    exact there)."""
    args = trainer.args
    if args.token_scope == "micro_batch":
        return "token_scope micro_batch chooses the token mask inside the loss, after the forward pass"
    if trainer.beta != 0.0 and args.kl_tokens == "all":
        return "beta != 0 with kl_tokens all: the KL term trains every token"
    if trainer._entropy_bonus_enabled:
        return (
            "the entropy bonus trains the entropies, which the kept-position head computes without gradient"
        )
    return kept_token_head_unsupported(head_model(trainer.model))


def kept_token_head_enabled(trainer) -> bool:
    """Whether the kept-token head is exact in ``trainer``'s loss; where it is not, a warning says why."""
    if trainer.args.token_rule == "none":  # no token level: nothing to save
        return False
    blocker = kept_token_head_blocker(trainer)
    if blocker:
        logger.warning("kept-token log-probs are off, the LM head runs at every position: %s", blocker)
    return blocker is None


def head_model(model: PreTrainedModel) -> PreTrainedModel:
    """The causal LM whose backbone and LM head the kept-token head uses (under a PEFT wrapper too)."""
    return model.get_base_model() if is_peft_model(model) else model


@contextmanager
def last_hidden_state(backbone: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the backbone's last hidden state while a forward pass runs through the model's wrapper (DDP,
    DeepSpeed), which must see the call; the hook is removed afterwards."""
    captured: list[torch.Tensor] = []
    handle = backbone.register_forward_hook(
        lambda module, args, output: captured.append(output.last_hidden_state)
    )
    try:
        yield captured
    finally:
        handle.remove()


def kept_token_logps(
    model: torch.nn.Module,
    policy: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    token_mask: torch.Tensor,
    temperature: float,
    cast_lm_head_to_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the completion tokens, the log-probs with gradient only where ``token_mask``
    is true: the backbone runs once (through ``model``, the wrapped policy), the LM head scores every valid
    token without gradient, then the kept ones with. ``policy`` is the unwrapped causal LM."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100  # only the completion is scored, as in TRL
    with last_hidden_state(policy.base_model) as captured:
        # TRL's fused head with no label to score: the backbone's pass, without the full-vocabulary logits
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=torch.full_like(labels, -100),
            fused_lm_head=True,
        )
    lm_head = policy.get_output_embeddings()
    hidden = captured[-1][:, :-1].to(lm_head.weight.device)
    labels = labels[:, 1:].to(lm_head.weight.device)
    valid = labels != -100
    keep = torch.zeros_like(valid)
    keep[:, -logits_to_keep:] = token_mask.bool()
    keep &= valid
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
        kept_logps, *_ = head(keep, ())
    # masked_scatter keeps the output connected to the graph even when nothing is kept
    entropy = scored_entropy.new_zeros(valid.shape).masked_scatter(valid, scored_entropy)
    log_probs = scored_logps.new_zeros(valid.shape).masked_scatter(valid, scored_logps)
    log_probs = log_probs.masked_scatter(keep, kept_logps)
    return log_probs[:, -logits_to_keep:], entropy[:, -logits_to_keep:]
