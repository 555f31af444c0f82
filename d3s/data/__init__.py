"""Benchmark registry and loaders, prompt templates, and the synthetic task of the tiny default."""

from d3s.data.benchmarks import BENCHMARKS, EVAL_BENCHMARKS, BenchmarkError, Problem, load_benchmark
from d3s.data.templates import build_prompt

__all__ = ["BENCHMARKS", "EVAL_BENCHMARKS", "BenchmarkError", "Problem", "build_prompt", "load_benchmark"]
