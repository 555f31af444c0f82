"""Trace one training step's memory with the real model code under fake tensors (no GPU, no download).

A model with published dimensions (d3s.architectures.ARCHITECTURES) and TRL's fused LM head runs one
micro-batch (checkpointed forward, GRPO loss, backward, fused AdamW with its state allocated) under
``FakeTensorMode`` and ``MemTracker``; it follows CUDA where the CPU differs (docs/gpu/memory-plan.md,
"CPU vs GPU").
This module imports torch and transformers: the planner imports it only to trace.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

from d3s.architectures import CONFIG_KEYS

TRACKER_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


def build_model(arch: dict[str, Any], layers: int, dtype: torch.dtype) -> torch.nn.Module:
    """The architecture's model with ``layers`` decoder layers and random weights (call under fake mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = {key: arch[name] for name, key in CONFIG_KEYS.items()} | {"num_hidden_layers": layers}
    config = AutoConfig.for_model(arch["family"], **common)  # the family is the model_type: qwen2, llama
    config._attn_implementation = "sdpa"  # transformers' default, as the training jobs load it
    return AutoModelForCausalLM.from_config(config, dtype=dtype)  # in dtype: fake tensors cannot be cast


def trace_step(
    arch: dict[str, Any],
    *,
    layers: int,
    rows: int,
    prompt_tokens: int,
    completion_tokens: int,
    precision: str,
    kl: bool,
) -> dict[str, int]:
    """Peak bytes of one training micro-batch and its optimizer step, by MemTracker category, plus "Total".

    ``precision``: "amp" (fp32 weights under bf16 autocast: plain and DDP training) or "bf16" (bf16 weights,
    no autocast: DeepSpeed's bf16 engine, whose fp32 master weights the planner adds). ``kl``: the loss also
    takes the reference log-probs (beta != 0); the reference model itself is planned from its weights.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from trl.kernels import chunked_logprob
    from trl.trainer.utils import add_fused_lm_head

    dtype = torch.float32 if precision == "amp" else torch.bfloat16
    total = prompt_tokens + completion_tokens
    # CUDA's addmm(out_dtype=float32) accumulates without fp32 copies of the tile and the weight chunk
    as_on_cuda = mock.patch.object(chunked_logprob, "_addmm_fp32", lambda acc, a, b: acc.add_(torch.mm(a, b)))
    with FakeTensorMode(allow_non_fake_inputs=True), as_on_cuda:
        model = build_model(arch, layers, dtype)
        model.train()
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # TRL's
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)  # transformers' default adamw_torch_fused
        for p in params:  # allocate Adam's moments, as every step after the first finds them
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        input_ids = torch.randint(0, arch["vocab"], (rows, total))
        attention_mask = torch.ones(rows, total, dtype=torch.long)
        attention_mask[0, : prompt_tokens // 2] = 0  # left-padded prompts: the 4-D padding mask is built
        attention_mask[1, total - completion_tokens // 2 :] = 0  # a completion that ended early
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :prompt_tokens] = -100
        advantages = torch.randn(rows, 1)
        ref_logps = torch.randn(rows, completion_tokens) if kl else None
        completion_mask = attention_mask[:, prompt_tokens:].float()

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp"):
                out = model(
                    input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True
                )
            logps = out.log_probs[:, -completion_tokens:]
            entropies = out.entropy[:, -completion_tokens:]  # logged, and D3S's |A| x H score
            ratio = torch.exp(logps - logps.detach())
            per_token = -ratio * advantages
            if ref_logps is not None:  # TRL's k3 estimator of the KL to the reference
                delta = ref_logps - logps
                per_token = per_token + 0.001 * (torch.exp(delta) - delta - 1)
            loss = (per_token * completion_mask).sum() / completion_mask.sum() + 0 * entropies.detach().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    result = dict.fromkeys((*TRACKER_CATEGORIES, "Total"), 0)
    for key, value in next(iter(peak.values())).items():  # the one device's _MemRefType members and "Total"
        result[getattr(key, "value", key)] = int(value)
    return result
