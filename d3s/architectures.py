"""The backbones the memory plan knows: their published config.json values and those values' names in a
transformers config. Data only, shared by the plan (d3s.memory_plan) and its traces (d3s.memory_trace)."""

from __future__ import annotations

from typing import Any

# Published config.json values of the paper's backbones (written here: nothing is downloaded).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-math-1.5b": dict(
        family="qwen2", hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936,
        tied=True, max_positions=4096, rms_norm_eps=1e-6,
    ),
    "qwen2.5-math-7b": dict(
        family="qwen2", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064,
        tied=False, max_positions=4096, rms_norm_eps=1e-6,
    ),
    "qwen2.5-3b": dict(  # PODS's own runs (Qwen2.5-3B-Instruct)
        family="qwen2", hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, vocab=151936,
        tied=True, max_positions=32768, rms_norm_eps=1e-6,
    ),
    "llama-3.1-8b": dict(
        family="llama", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
        tied=False, max_positions=131072, rms_norm_eps=1e-5,
    ),
}  # fmt: skip
# The names of those values in a transformers config.
CONFIG_KEYS = {
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "tied": "tie_word_embeddings",
    "max_positions": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
}
MODEL_ARCHITECTURES = {
    "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
    "Qwen/Qwen2.5-Math-1.5B-Instruct": "qwen2.5-math-1.5b",
    "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
    "Qwen/Qwen2.5-Math-7B-Instruct": "qwen2.5-math-7b",
    "Qwen/Qwen2.5-3B-Instruct": "qwen2.5-3b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "nvidia/OpenMath2-Llama3.1-8B": "llama-3.1-8b",
}
