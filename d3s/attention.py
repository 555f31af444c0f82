"""Grouped-query attention without copying the keys and values, on the CPU: an attention implementation
registered with transformers (its ``AttentionInterface``, the library's own extension point).

transformers' SDPA path expands the key/value heads to the query heads (``repeat_kv``: a copy of the whole KV
cache at every decoding step) whenever an attention mask is passed, since CUDA's fused kernels refuse a mask
together with ``enable_gqa``. The CPU's flash kernel takes both and reads each query head's key/value head
in place: the same products in the same order, so the same bits (tests/test_attention.py). On the tiny default
the copy was a third of generation's time (docs/measurements.md, "Where a step goes").

Only passes without a gradient take it (generation, the no-grad log-prob passes, evaluation): the kernel's
backward sums a key/value head's gradient over its query heads in another order than ``repeat_kv``'s backward
(differences at 1e-7), and a training step stays bitwise what transformers' path computes. Everything else (a
GPU, no mask, no grouping, a position bias) is transformers' SDPA itself.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_cpu_gqa"
MAX_HEAD_DIM = 256  # transformers' bound for enable_gqa (larger head dims fall back to the math kernel)


def sdpa_cpu_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, but a masked grouped-query call without a gradient on the CPU
    broadcasts the key/value heads inside the kernel instead of copying them."""
    in_kernel = (
        attention_mask is not None
        and query.shape[1] != key.shape[1]
        and query.device.type == "cpu"
        and not torch.is_grad_enabled()
        and kwargs.get("position_bias") is None
        and key.shape[-1] == value.shape[-1] <= MAX_HEAD_DIM
    )
    if not in_kernel:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # with a mask transformers passes is_causal=False too: the mask carries causality and padding
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_cpu_gqa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA gets, built as for "sdpa"


def use_cpu_gqa(model: Any) -> Any:
    """``model`` with its SDPA attention replaced by this module's on a machine without CUDA (other
    implementations are left as chosen); returns it. With CUDA the model trains or generates there, where
    this would be transformers' SDPA anyway, and TRL's paged generation looks attention up by transformers'
    names."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa" and not torch.cuda.is_available():
        model.set_attn_implementation(NAME)
    return model
