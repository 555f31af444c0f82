"""The tiny offline model: a character-level tokenizer and a small Qwen2-architecture causal LM.

Nothing here downloads anything. The tokenizer covers printable ASCII one character per token (digits
are single tokens, as in Qwen's tokenizer) plus a few multi-character tokens for the synthetic task's
format (``\\boxed{``, ``Q:``, ``A:``), so ``tok(prompt) + tok(completion) == tok(prompt + completion)``
holds for the task's prompt/completion boundary (a BPE merge across that boundary would make SFT and
GRPO see different token ids; see docs/cpu-testbed-notes.md).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
MULTI_CHAR_TOKENS = ["\\boxed{", "Q:", "A:"]


def _vocabulary() -> dict[str, int]:
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    tokens = [PAD, EOS, UNK, *MULTI_CHAR_TOKENS, *chars]
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A deterministic character-level tokenizer (~100 tokens), left padding, EOS doubling as BOS."""
    vocab = _vocabulary()
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    multi = "|".join(Regex_escape(t) for t in MULTI_CHAR_TOKENS)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{multi}|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )
    return tok


def Regex_escape(text: str) -> str:  # noqa: N802 - mirrors re.escape for the tokenizers regex flavour
    return "".join("\\" + c if c in r"\{}()[].*+?^$|" else c for c in text)


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 256,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 model sized for CPU tests (defaults: ~0.1 M parameters)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny(path: str | Path, seed: int = 0, **model_kwargs) -> Path:
    """Build the tokenizer and a randomly initialised tiny model and save both to ``path``."""
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sft_warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[str, str]],
    steps: int = 300,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    warmup_steps: int = 30,
    seed: int = 0,
) -> list[float]:
    """Supervised warm start on (prompt, completion) pairs; loss on completion tokens only.

    Prompt and completion are tokenised separately (as GRPO does) and EOS is appended, so the model
    learns to stop. Returns the loss per step.
    """
    generator = torch.Generator().manual_seed(seed)
    encoded = []
    for prompt, completion in pairs:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps))
    )
    model.train()
    losses = []
    for _ in range(steps):
        batch = [encoded[i] for i in torch.randint(len(encoded), (batch_size,), generator=generator).tolist()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for row, (ids, loss_on) in enumerate(batch):  # right padding for training
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(torch.tensor(loss_on) == 1, torch.tensor(ids), -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses
