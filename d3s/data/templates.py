r"""Prompt templates (``qwen_math_cot``, ``plain``, ``pods``, ``raw``, ``auto``;
docs/evaluation/benchmarks.md)."""

from __future__ import annotations

from typing import Any

TEMPLATES: tuple[str, ...] = ("auto", "qwen_math_cot", "plain", "raw", "pods")

QWEN_MATH_COT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PLAIN_TEMPLATE = "Question: {question}\n" + QWEN_MATH_COT_INSTRUCTION + "\nAnswer:"
PODS_INSTRUCTION = (
    "Think about the problem step by step, then give the final answer. Put the reasoning inside <think> "
    "</think> and only the final answer inside <answer> </answer>, in this format:\n"
    "<think>\n...\n</think>\n<answer>\n...\n</answer>"
)
PODS_PLAIN_TEMPLATE = PODS_INSTRUCTION + "\n\nQuestion: {question}\n"


def resolve_template(name: str, tokenizer: Any = None, benchmark_default: str | None = None) -> str:
    """The concrete template ``auto`` stands for (other names are returned unchanged)."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown template {name!r}; valid: {', '.join(TEMPLATES)}")
    if name != "auto":
        return name
    if benchmark_default is not None:
        return benchmark_default
    return "qwen_math_cot" if getattr(tokenizer, "chat_template", None) else "plain"


def build_prompt(
    question: str, template: str, tokenizer: Any = None, benchmark_default: str | None = None
) -> str:
    """The text fed to the model for ``question`` under ``template`` (resolving ``auto``)."""
    concrete = resolve_template(template, tokenizer, benchmark_default)
    if concrete == "raw":
        return question
    if concrete == "plain":
        return PLAIN_TEMPLATE.replace("{question}", question)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if concrete == "pods" and not has_chat:
        return PODS_PLAIN_TEMPLATE.replace("{question}", question)
    instruction = PODS_INSTRUCTION if concrete == "pods" else QWEN_MATH_COT_INSTRUCTION
    if not has_chat:
        raise ValueError(
            "template 'qwen_math_cot' needs a tokenizer with a chat template; this model has none: "
            "use --template plain (or auto)"
        )
    # TRL's conversational prompt format: the instruction as the system message
    messages = [{"role": "system", "content": instruction}, {"role": "user", "content": question}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # e.g. templates that reject a system role (Gemma, Mistral): after the question
        messages = [{"role": "user", "content": f"{question}\n{instruction}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
