"""Benchmark registry and loaders, prompt templates, and the synthetic task of the tiny default."""

from d3s.data.benchmarks import (
    BENCHMARKS,
    DATA_DIR_ENV,
    EVAL_BENCHMARKS,
    BenchmarkError,
    BenchmarkSpec,
    HubSource,
    Problem,
    get_benchmark,
    load_benchmark,
    local_copy,
    parse_benchmark_list,
    resolve_data_dir,
)
from d3s.data.templates import (
    QWEN_MATH_COT_INSTRUCTION,
    TEMPLATES,
    build_prompt,
    chat_messages,
    resolve_template,
)

__all__ = [
    "BENCHMARKS",
    "DATA_DIR_ENV",
    "EVAL_BENCHMARKS",
    "QWEN_MATH_COT_INSTRUCTION",
    "TEMPLATES",
    "BenchmarkError",
    "BenchmarkSpec",
    "HubSource",
    "Problem",
    "build_prompt",
    "chat_messages",
    "get_benchmark",
    "load_benchmark",
    "local_copy",
    "parse_benchmark_list",
    "resolve_data_dir",
    "resolve_template",
]
