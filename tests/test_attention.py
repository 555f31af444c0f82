"""The CPU's grouped-query SDPA (d3s/attention.py): the same bits as transformers' SDPA where it takes over,
transformers' own path everywhere else."""

from __future__ import annotations

import json

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers import AutoModelForCausalLM

import d3s.attention as attention
from d3s.evaluation.backends import load_model
from d3s.tiny_model import build_model, build_tokenizer

PROMPTS = ["Q: 3+4=\nA:", "Q: 12*7-5=\nA:", "Q: 1=\nA:", "Q: 40-2*3+8=\nA:"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def models(tokenizer, heads: int = 4, kv_heads: int = 2):
    """Two copies of one tiny model, on transformers' SDPA and on this module's."""
    stock = build_model(tokenizer, num_heads=heads, num_kv_heads=kv_heads, seed=3).eval()
    ours = build_model(tokenizer, num_heads=heads, num_kv_heads=kv_heads, seed=3).eval()
    assert stock.config._attn_implementation == "sdpa"
    attention.use_cpu_gqa(ours)
    assert ours.config._attn_implementation == attention.NAME
    return stock, ours


def batch(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)  # left padding


@pytest.fixture
def calls(monkeypatch):
    """How often this module handed a call to transformers' SDPA, and how often the kernel was called with
    grouping switched on (by either)."""
    counts = {"stock": 0, "grouped_kernel": 0}
    stock_forward, sdpa = attention.sdpa_attention_forward, torch.nn.functional.scaled_dot_product_attention

    def counted_stock(*args, **kwargs):
        counts["stock"] += 1
        return stock_forward(*args, **kwargs)

    def counted_sdpa(*args, **kwargs):
        counts["grouped_kernel"] += bool(kwargs.get("enable_gqa"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted_stock)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    return counts


def test_no_grad_logits_are_bitwise_transformers_and_skip_the_copy(tokenizer, calls, monkeypatch):
    stock, ours = models(tokenizer)
    inputs = batch(tokenizer)
    assert (inputs["attention_mask"] == 0).any()  # padded: transformers passes a mask and copies K/V
    copies = {"repeat_kv": 0}
    repeat_kv = hf_sdpa.repeat_kv

    def counted_repeat(*args, **kwargs):
        copies["repeat_kv"] += 1
        return repeat_kv(*args, **kwargs)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", counted_repeat)
    with torch.no_grad():
        expected = stock(**inputs).logits
        assert copies["repeat_kv"] == 2 * stock.config.num_hidden_layers  # K and V of each layer
        calls.update(stock=0, grouped_kernel=0)
        got = ours(**inputs).logits
    assert torch.equal(got, expected)
    assert calls == {"stock": 0, "grouped_kernel": ours.config.num_hidden_layers}
    assert copies["repeat_kv"] == 2 * stock.config.num_hidden_layers  # none more


def test_sampled_generation_is_token_for_token_transformers(tokenizer):
    stock, ours = models(tokenizer)
    inputs = batch(tokenizer)
    settings = dict(max_new_tokens=24, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
    settings |= dict(output_scores=True, return_dict_in_generate=True)
    outputs = []
    for model in (stock, ours):
        torch.manual_seed(11)
        with torch.no_grad():
            outputs.append(model.generate(**inputs, **settings))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outputs[0].scores, outputs[1].scores, strict=True))


def test_a_pass_with_a_gradient_is_transformers_own(tokenizer, calls):
    stock, ours = models(tokenizer)
    inputs = batch(tokenizer)
    for model in (stock, ours):
        model.train()
        model(**inputs).logits.logsumexp(-1).mean().backward()
    assert calls == {"stock": ours.config.num_hidden_layers, "grouped_kernel": 0}
    for (name, a), b in zip(stock.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("mask", [False, True])
def test_ungrouped_or_unmasked_calls_are_transformers_own(tokenizer, calls, mask):
    stock, ours = models(tokenizer, heads=2, kv_heads=2) if mask else models(tokenizer)
    unpadded = tokenizer(PROMPTS[:1], return_tensors="pt", add_special_tokens=False)
    inputs = batch(tokenizer) if mask else unpadded
    with torch.no_grad():
        expected = stock(**inputs).logits
        calls.update(stock=0, grouped_kernel=0)
        assert torch.equal(ours(**inputs).logits, expected)
    # unmasked, transformers itself groups in the kernel (its own rule); ungrouped, nothing does
    layers = ours.config.num_hidden_layers
    assert calls == {"stock": layers, "grouped_kernel": 0 if mask else layers}


def test_only_sdpa_is_replaced_and_checkpoints_name_no_custom_attention(tokenizer, tmp_path, monkeypatch):
    eager = build_model(tokenizer).eval()
    eager.set_attn_implementation("eager")
    assert attention.use_cpu_gqa(eager).config._attn_implementation == "eager"
    _, ours = models(tokenizer)
    ours.save_pretrained(tmp_path)
    assert "sdpa_cpu_gqa" not in (tmp_path / "config.json").read_text()
    assert "_attn_implementation" not in json.loads((tmp_path / "config.json").read_text())
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
    # what the evaluation loads on the CPU; with CUDA present, transformers' name stays
    assert load_model(tmp_path, "float32", "cpu").config._attn_implementation == attention.NAME
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_model(tmp_path, "float32", "cpu").config._attn_implementation == "sdpa"
