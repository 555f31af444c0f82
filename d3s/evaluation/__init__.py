"""Evaluation: backends, grading, Pass@k, runner, audit; only the light pieces are imported here."""

from d3s.evaluation.metrics import average_over_benchmarks, bootstrap_ci, pass_at_k, pass_at_k_table

__all__ = ["average_over_benchmarks", "bootstrap_ci", "pass_at_k", "pass_at_k_table"]
