"""Read what the workflow logged (metrics.jsonl, anatomy.jsonl, `d3s eval` summaries) into pandas, and
turn it into the tables, figures and report of the reproduction. Nothing here trains or evaluates.

    from d3s.analysis import load_metrics, load_evals, load_anatomy
    metrics = load_metrics("results/tiny")      # one row per (method, seed, step)
    evals = load_evals("results/tiny")          # one row per (method, seed, step, benchmark, k)
"""

from d3s.analysis.io import load_anatomy, load_evals, load_metrics
from d3s.analysis.tables import efficiency_table, mean_ci, pass_at_k_across_seeds, summarise_dynamics

__all__ = [
    "efficiency_table",
    "load_anatomy",
    "load_evals",
    "load_metrics",
    "mean_ci",
    "pass_at_k_across_seeds",
    "summarise_dynamics",
]
