"""The tiny default's task and tokenizer: completion lengths, boundary-safe tokenisation, grading."""

from __future__ import annotations

import yaml
from helpers import REPO_ROOT

from d3s.data.synthetic import arithmetic_problems
from d3s.rewards import accuracy_reward
from d3s.tiny_model import build_tokenizer


def _default_task():
    return yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())["task"]


def test_default_task_completions_are_chains_of_thought_ending_in_boxed():
    """Long enough for token selection to choose (issue 14: 40 tokens or more on average), short enough to fit
    the default's generation budget uncut."""
    tok = build_tokenizer()
    problems = arithmetic_problems(500, **_default_task())
    lengths = [len(tok(p.completion, add_special_tokens=False)["input_ids"]) + 1 for p in problems]
    config = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    assert max(lengths) <= config["train"]["trainer"]["max_completion_length"] == config["eval"]["max_tokens"]
    assert sum(lengths) / len(lengths) >= 40
    assert all(p.completion.rstrip().endswith("\\boxed{" + p.answer + "}") for p in problems)


def test_prompt_completion_boundary_tokenises_like_the_whole():
    tok = build_tokenizer()
    for p in arithmetic_problems(200, **_default_task()):
        ids = (
            tok(p.prompt, add_special_tokens=False)["input_ids"]
            + tok(p.completion, add_special_tokens=False)["input_ids"]
        )
        assert ids == tok(p.prompt + p.completion, add_special_tokens=False)["input_ids"]


def test_held_out_split_is_disjoint_and_graded_by_math_verify():
    task = _default_task()
    train = {p.prompt for p in arithmetic_problems(2000, split="train", **task)}
    test = arithmetic_problems(100, split="test", **task)
    assert not train & {p.prompt for p in test}
    rewards = accuracy_reward([p.completion for p in test[:20]], answer=[p.answer for p in test[:20]])
    assert rewards == [1.0] * 20


def test_saved_tokenizer_reloads_identically_through_auto_tokenizer(tmp_path):
    """transformers rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer; ours must survive that."""
    from helpers import save_tiny
    from transformers import AutoTokenizer

    save_tiny(tmp_path, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    tok, reloaded = build_tokenizer(), AutoTokenizer.from_pretrained(tmp_path)
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    for p in arithmetic_problems(100, max_ops=3, max_operand=99):
        for text in (p.prompt, p.completion, p.prompt + p.completion):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
            assert reloaded.decode(ids) == text
