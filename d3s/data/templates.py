r"""Prompt templates.

* ``qwen_math_cot``: the Qwen2.5-Math chain-of-thought prompt used by the D3S paper's evaluation: the
  system message "Please reason step by step, and put your final answer within \boxed{}." and the
  question as the user message, rendered through the tokenizer's chat template (models without a
  system role get the instruction appended to the user message instead).
* ``plain``: the same instruction in plain text for base models without a chat template.
* ``raw``: the question as is (the synthetic task's prompts are already in the model's format).
* ``auto``: the benchmark's own default if it has one (``raw`` for synthetic), else ``qwen_math_cot``
  when the tokenizer has a chat template and ``plain`` otherwise.
"""

from __future__ import annotations

from typing import Any

TEMPLATES: tuple[str, ...] = ("auto", "qwen_math_cot", "plain", "raw")

QWEN_MATH_COT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PLAIN_TEMPLATE = "Question: {question}\n" + QWEN_MATH_COT_INSTRUCTION + "\nAnswer:"


def resolve_template(name: str, tokenizer: Any = None, benchmark_default: str | None = None) -> str:
    """The concrete template ``auto`` stands for (other names are returned unchanged)."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown template {name!r}; valid: {', '.join(TEMPLATES)}")
    if name != "auto":
        return name
    if benchmark_default is not None:
        return benchmark_default
    return "qwen_math_cot" if getattr(tokenizer, "chat_template", None) else "plain"


def chat_messages(question: str, system_role: bool = True) -> list[dict[str, str]]:
    """The Qwen2.5-Math CoT conversation (TRL's conversational prompt format)."""
    if system_role:
        return [
            {"role": "system", "content": QWEN_MATH_COT_INSTRUCTION},
            {"role": "user", "content": question},
        ]
    return [{"role": "user", "content": f"{question}\n{QWEN_MATH_COT_INSTRUCTION}"}]


def build_prompt(
    question: str, template: str, tokenizer: Any = None, benchmark_default: str | None = None
) -> str:
    """The text fed to the model for ``question`` under ``template`` (resolving ``auto``)."""
    concrete = resolve_template(template, tokenizer, benchmark_default)
    if concrete == "raw":
        return question
    if concrete == "plain":
        return PLAIN_TEMPLATE.replace("{question}", question)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "template 'qwen_math_cot' needs a tokenizer with a chat template; this model has none: "
            "use --template plain (or auto)"
        )
    try:
        return tokenizer.apply_chat_template(
            chat_messages(question), tokenize=False, add_generation_prompt=True
        )
    except Exception:  # e.g. templates that reject a system role (Gemma, Mistral)
        return tokenizer.apply_chat_template(
            chat_messages(question, system_role=False), tokenize=False, add_generation_prompt=True
        )
