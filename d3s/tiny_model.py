"""The tiny offline model: a small byte-level BPE tokenizer and a small Qwen2-architecture causal LM.

Nothing here downloads anything. The tokenizer covers printable ASCII one symbol per token (digits single, as
in Qwen's) plus merged tokens for ``\\boxed``, with Qwen2's pre-tokenizer, so no merge crosses the task's
prompt/completion boundary (SFT and GRPO see the same ids); AutoTokenizer reloads a saved copy identically.
"""

from __future__ import annotations

import string

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# (attention heads, KV heads) of the hidden size 64 for each head dim. 16 is the default's; vLLM's CPU
# attention refuses it and runs 32 ("Unsupported CPU attention configuration: head_dim=16"): the tiny model
# for vLLM.
HEADS_BY_HEAD_DIM = {16: (4, 2), 32: (2, 1)}
# Whole words of the task's format, merged into single tokens (``\boxed`` as in Qwen's vocabulary).
MERGED_WORDS = ["\\boxed", "boxed", "Ġ\\"]


def _vocabulary_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    symbols = bytes_to_unicode()  # GPT-2 / Qwen byte-level symbols: space is 'Ġ', newline 'Ċ'
    chars = [symbols[ord(c)] for c in string.printable if c not in "\r\x0b\x0c"]
    tokens = [PAD, EOS, UNK, *chars]
    merges: list[tuple[str, str]] = []
    for word in MERGED_WORDS:
        for i in range(2, len(word) + 1):
            left, right = word[: i - 1], word[i - 1]
            if word[:i] not in tokens:
                tokens.append(word[:i])
                merges.append((left, right))
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}, merges


def build_tokenizer() -> Qwen2Tokenizer:
    """A deterministic byte-level BPE tokenizer of ~110 tokens in Qwen2's format, left padding, EOS as BOS:
    what ``AutoTokenizer`` rebuilds from a saved copy, which tokenises identically."""
    vocab, merges = _vocabulary_and_merges()
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )


def build_model(
    tokenizer: Qwen2Tokenizer,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 256,
    seed: int = 0,
    tie_embeddings: bool = True,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 model sized for CPU tests (defaults: ~0.1 M parameters); its LM head is
    the input embedding (tied, as Qwen2.5-Math-1.5B's) unless ``tie_embeddings`` is False."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)  # its generation config takes pad, eos and bos from ``config``


def sft_warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: Qwen2Tokenizer,
    pairs: list[tuple[str, str]],
    steps: int = 300,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    warmup_steps: int = 30,
    seed: int = 0,
) -> list[float]:
    """Supervised warm start on (prompt, completion) pairs; loss on completion tokens only.

    Prompt and completion are tokenised separately (as GRPO does) and EOS is appended, so the model
    learns to stop. Batches go to the model's device (move the model to CUDA first to train there); the
    batch sampling stays on a CPU generator, so every device sees the same batches. Returns the loss per step.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    encoded = []  # (token ids, labels: -100 on the prompt)
    for prompt, completion in pairs:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((torch.tensor(p_ids + c_ids), torch.tensor([-100] * len(p_ids) + c_ids)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps))
    )
    model.train()
    losses = []
    for _ in range(steps):
        picks = torch.randint(len(encoded), (batch_size,), generator=generator).tolist()
        ids, labels = zip(*(encoded[i] for i in picks), strict=True)
        # right padding for training
        input_ids = pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_token_id)
        attention = pad_sequence([torch.ones_like(row) for row in ids], batch_first=True)
        labels = pad_sequence(labels, batch_first=True, padding_value=-100)
        loss = model(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)
        ).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses
