"""Offline stand-ins for the hub ids TRL's tests/test_grpo_trainer.py loads (nothing is downloaded). Written
under ./standins/vocab<N>/trl-internal-testing/<name>; with ./trl-internal-testing a symlink to one of them, a
hub id used as a relative path from this directory resolves to a local folder (transformers and datasets both
load local folders first). Models follow TRL's scripts/generate_tiny_models.py recipe (hidden 8, 4 heads, 2 KV
heads, 2 layers, intermediate 32, bfloat16; reward models hidden 16, num_labels 1) with random weights; the
tokenizers are synthetic byte-level BPE vocabularies whose special tokens sit at Qwen2.5's ids (<|endoftext|>
151643, <|im_start|> 151644, <|im_end|> 151645, vocabulary 151665), so tests that hard-code those ids work.
Run: python build_standins.py
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from torch import nn
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

# TRL saves its tiny models in bfloat16; float32 here: CPU bfloat16 matmuls over the 151,665-token vocabulary
# cost seconds per step on this 2-core machine.
DTYPE = torch.float32
# Vocabulary size of the Qwen-like tokenizer: 151665 (Qwen2.5's, its special ids) or smaller for speed
# (STANDIN_VOCAB); the special tokens then sit at the last 22 ids.
QWEN_VOCAB = int(os.environ.get("STANDIN_VOCAB", "151665"))
# Written to standins/vocab<N>/trl-internal-testing; the symlink ./trl-internal-testing picks the one in use.
ROOT = Path(__file__).parent / "standins" / f"vocab{QWEN_VOCAB}" / "trl-internal-testing"

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]  # ids 151643.. as in Qwen2.5

QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]
LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def qwen_tokenizer() -> Qwen2Tokenizer:
    symbols = list(bytes_to_unicode().values())  # the 256 byte-level symbols
    tokens = list(symbols)
    # Fillers (never produced by encoding: no merges) so the special tokens get Qwen2.5's ids.
    fill = QWEN_VOCAB - len(QWEN_SPECIALS) - len(tokens)
    combos = itertools.chain(
        ("".join(p) for p in itertools.product(symbols, repeat=2)),
        ("".join(p) for p in itertools.product(symbols, repeat=3)),
    )
    tokens += list(itertools.islice(combos, fill))
    tokens += QWEN_SPECIALS
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == QWEN_VOCAB
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=131072,
    )
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def llama_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(symbols + LLAMA_SPECIALS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        padding_side="left",
        model_max_length=131072,
    )
    tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
    tok.chat_template = LLAMA_CHAT_TEMPLATE
    return tok


def init_weights_tiny_model(model: nn.Module) -> None:
    """TRL's recipe: Xavier-uniform linears (zero bias), Normal(0, 0.02) embeddings."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


def save(name: str, model, tokenizer, generation_config=None) -> None:
    out = ROOT / name
    torch.manual_seed(0)
    init_weights_tiny_model(model)
    model = model.to(DTYPE)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    print("saved", out)


def main() -> None:
    qwen = qwen_tokenizer()
    endoftext, im_end = qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    ids = dict(bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext)
    qwen_gen = GenerationConfig(
        bos_token_id=endoftext,
        pad_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )
    small = dict(
        hidden_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=len(qwen),
    )
    save("tiny-Qwen2ForCausalLM-2.5", Qwen2ForCausalLM(Qwen2Config(**small, **ids)), qwen, qwen_gen)
    save("tiny-Qwen3ForCausalLM", Qwen3ForCausalLM(Qwen3Config(**small, **ids)), qwen, qwen_gen)
    save("tiny-Gemma2ForCausalLM", Gemma2ForCausalLM(Gemma2Config(**small, **ids)), qwen, qwen_gen)
    reward = dict(small, hidden_size=16, num_labels=1)
    save(
        "tiny-Qwen2ForSequenceClassification-2.5",
        Qwen2ForSequenceClassification(Qwen2Config(**reward, **ids)),
        qwen,
    )
    save(
        "tiny-Qwen3ForSequenceClassification",
        Qwen3ForSequenceClassification(Qwen3Config(**reward, **ids)),
        qwen,
    )
    llama = llama_tokenizer()
    save(
        "tiny-LlamaForSequenceClassification-3.2",
        LlamaForSequenceClassification(
            LlamaConfig(
                **dict(reward, vocab_size=len(llama)),
                bos_token_id=llama.bos_token_id,
                eos_token_id=llama.eos_token_id,
            )
        ),
        llama,
    )
    zen()


ZEN = [  # (standard prompt, conversational question): the Zen of Python, as TRL's zen dataset
    ("Beautiful is better than", "What is better than ugly?"),
    ("Explicit is", "What is better than implicit?"),
    ("Simple is better", "What is better than complex?"),
    ("Complex", "What is better than complicated?"),
    ("Flat is better than", "What is better than nested?"),
    ("Sparse is better", "What is better than dense?"),
    ("Readability", "What counts?"),
    ("Special cases aren't special", "Are special cases enough to break the rules?"),
    ("Although practicality beats", "What beats purity?"),
    ("Errors should never", "What should never pass silently?"),
    ("Unless explicitly", "When can errors pass silently?"),
    ("In the face of ambiguity, refuse", "What should you do in the face of ambiguity?"),
    ("There should be one-- and preferably", "How many ways should there be to do it?"),
    (
        "Although that way may not be obvious at first unless you're",
        "For whom may the way not be obvious at first?",
    ),
    ("Now is better than", "What is better than never?"),
    ("Although never is often better than", "Is never better than *right* now?"),
    (
        "If the implementation is hard to explain, it's",
        "What does it mean if the implementation is hard to explain?",
    ),
    (
        "If the implementation is easy to explain, it may be",
        "What does it mean if the implementation is easy to explain?",
    ),
    ("Namespaces are one honking great", "Any great ideas?"),
]


def zen() -> None:
    out = ROOT / "zen"
    splits = {"train": ZEN[:17], "test": ZEN[17:]}
    configs = []
    for config in ("standard_prompt_only", "conversational_prompt_only"):
        files = []
        for split, rows in splits.items():
            if config == "standard_prompt_only":
                data = {"prompt": [s for s, _ in rows]}
            else:
                data = {"prompt": [[{"role": "user", "content": q}] for _, q in rows]}
            path = out / config / f"{split}-00000-of-00001.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            Dataset.from_dict(data).to_parquet(str(path))
            files.append({"split": split, "path": f"{config}/{split}-*.parquet"})
        configs.append({"config_name": config, "data_files": files})
    lines = ["---", "configs:"]
    for c in configs:
        lines.append(f"- config_name: {c['config_name']}")
        lines.append("  data_files:")
        for f in c["data_files"]:
            lines += [f"  - split: {f['split']}", f"    path: {f['path']}"]
    lines += ["---", "", "Offline stand-in for trl-internal-testing/zen (see build_standins.py).", ""]
    (out / "README.md").write_text("\n".join(lines))
    print("saved", out, json.dumps([c["config_name"] for c in configs]))


if __name__ == "__main__":
    main()
