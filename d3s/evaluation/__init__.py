"""Evaluation: generation backends (vLLM, transformers), grading, Pass@k, resumable runner, audit.

Only the light pieces are imported here; backends import torch / vLLM when they are used.
"""

from d3s.evaluation.metrics import average_over_benchmarks, bootstrap_ci, pass_at_k, pass_at_k_table

__all__ = ["average_over_benchmarks", "bootstrap_ci", "pass_at_k", "pass_at_k_table"]
