"""Tables of the reproduction: Pass@k with intervals across seeds, efficiency and speedups; each written with
a ``<name>.provenance.json`` sidecar (:func:`write_table`)."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd

from d3s.analysis.claims import curve_arrays, shared_seeds, speedup, t_interval
from d3s.provenance.manifest import atomic_write_text
from d3s.provenance.settings_check import Provenance

KEYS = ["method", "seed", "step"]
SPEEDUPS = {"step": "steps", "update_tokens_cumulative": "tokens", "wall_clock": "time"}  # x: column suffix


def mean_ci(values) -> tuple[float, float, int]:
    """Mean and half-width of the 95 % t-interval across seeds (half-width NaN for one seed)."""
    result = t_interval(values)
    return result["estimate"], (result["ci_high"] - result["ci_low"]) / 2, result["n"]


def write_table(
    table: pd.DataFrame, path: str | os.PathLike[str], provenance: Provenance, index: bool = False
) -> None:
    """Write ``table`` as CSV (atomically) and the sidecar ``<name>.provenance.json`` of ``provenance``, the
    check of what it was made from."""
    atomic_write_text(path, table.to_csv(index=index))
    provenance.write_sidecar(path)


def pass_at_k_across_seeds(evals: pd.DataFrame, methods=None) -> pd.DataFrame:
    """The final models' Pass@k as a long table: method, benchmark, k, mean across seeds (percent), 95 % CI
    half-width across seeds, seeds; methods in the order given (default: sorted)."""
    final = evals[evals["final"].astype(bool)]
    methods = list(methods) if methods is not None else sorted(final["method"].unique())
    groups = final[final["method"].isin(methods)].groupby(["method", "benchmark", "k"])["value"]
    rows = [(method, bench, int(k), *mean_ci(values * 100)) for (method, bench, k), values in groups]
    if not rows:
        return pd.DataFrame()
    rows.sort(key=lambda row: methods.index(row[0]))  # stable: benchmark and k stay in groupby's order
    return pd.DataFrame(rows, columns=["method", "benchmark", "k", "mean", "ci95", "seeds"])


def cell(mean: float, half: float = math.nan, digits: int = 1) -> str:
    """``mean ± half`` to ``digits`` decimals (no ± without a half-width; "n/a" without a mean)."""
    if pd.isna(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + ("" if pd.isna(half) else f" ± {half:.{digits}f}")


def paper_layout(table: pd.DataFrame, ks=(1, 8)) -> pd.DataFrame:
    """The paper's layout: one row per method, one column per benchmark, cells "P@1 ± ci / P@k ± ci"."""
    if table.empty:
        return table
    cells = {}
    for (method, bench), group in table.groupby(["method", "benchmark"], sort=False):
        at = group.drop_duplicates("k").set_index("k")
        parts = [cell(at.at[k, "mean"], at.at[k, "ci95"]) if k in at.index else "n/a" for k in ks]
        cells.setdefault(method, {})[bench] = " / ".join(parts)
    out = pd.DataFrame.from_dict(cells, orient="index").loc[list(dict.fromkeys(table["method"]))]
    out.index.name = "method"
    return out


def summarise_dynamics(metrics: pd.DataFrame, columns) -> pd.DataFrame:
    """Per method: mean over steps of each metric, then mean and CI across seeds."""
    rows = []
    for method, group in metrics.groupby("method"):
        row = {"method": method}
        for col in (c for c in columns if c in group):
            mean, half, n = mean_ci(group.groupby("seed")[col].mean())
            row |= {col: mean, f"{col}_ci95": half, "seeds": n}
        rows.append(row)
    return pd.DataFrame(rows)


def learning_curves(evals: pd.DataFrame, metrics: pd.DataFrame, k: int = 1) -> pd.DataFrame:
    """Pass@k (mean over benchmarks) per method, seed, step, with the update tokens and training wall-clock
    reached at that step (from metrics.jsonl; 0 at step 0)."""
    ev = evals[(evals["k"] == k) & (evals["benchmark"] != "average")]
    curve = ev.groupby(KEYS, as_index=False)["value"].mean()
    extra = ["update_tokens_cumulative", "wall_clock"]
    if have := [c for c in extra if c in metrics]:
        curve = curve.merge(metrics[[*KEYS, *have]], on=KEYS, how="left")
    for col in extra:
        curve[col] = curve.get(col, np.nan)
        curve.loc[curve["step"] == 0, col] = 0.0
    return curve.sort_values(["method", "seed", "step"]).reset_index(drop=True)


def speedups(
    curves: pd.DataFrame, reference: str = "grpo", fraction: float = 0.99, x: str = "step"
) -> pd.Series:
    """PODS speedup of every method: the reference's time (``x``) to ``fraction`` of its best seed-mean Pass@1
    over the method's, on the seeds both have (NaN: never reached). Point estimates; the intervals and
    verdicts are the claims table's (d3s.analysis.claims)."""
    out = {}
    for method in sorted(curves["method"].unique()):
        seeds = shared_seeds(curves, method, reference)
        arrays = (curve_arrays(curves, m, seeds, x) for m in (method, reference))
        value = speedup(*arrays, np.arange(len(seeds)), fraction) if seeds else math.nan
        out[method] = value if value > 0 else math.nan
    return pd.Series(out, dtype=float)


def efficiency_table(
    curves: pd.DataFrame,
    metrics: pd.DataFrame,
    reference: str = "grpo",
    fraction: float = 0.99,
    finals: pd.DataFrame | None = None,
):
    """The paper's Table 3 layout plus our costs: final Pass@1 (seed mean), its gain over the reference,
    update tokens and seconds per step, and the speedups to ``fraction`` of the reference's best Pass@1 in
    steps, update tokens and wall-clock. ``finals`` (d3s.analysis.claims.per_seed_pass_at_k at k = 1): the
    final Pass@1 from the final models' own evaluation, where the curves' last points are on the checkpoints'
    problems (d3s.analysis.io.load_curve_evals); without it, the curves' last points."""
    final = finals if finals is not None else curves.loc[curves.groupby(["method", "seed"])["step"].idxmax()]
    per_method = final.groupby("method")["value"].agg(["mean", "count"])
    ref_final = per_method.loc[reference, "mean"] if reference in per_method.index else float("nan")
    speed = {label: speedups(curves, reference, fraction, x) for x, label in SPEEDUPS.items()}
    # selection/update_tokens: each step's total over its micro-batches and ranks (d3s/trainer_metrics.py)
    costs = {"update_tokens_per_step": "selection/update_tokens", "seconds_per_step": "step_time"}
    rows = []
    for method, summary in per_method.iterrows():
        m = metrics[metrics["method"] == method]
        gain = 100 * (summary["mean"] / ref_final - 1) if ref_final else float("nan")
        rows.append(
            {
                "method": method,
                "final_pass1": 100 * summary["mean"],
                "final_pass1_ci95": 100 * mean_ci(final[final["method"] == method]["value"])[1],
                "gain_vs_reference_pct": gain,
            }
            | {name: m[column].mean() if column in m else np.nan for name, column in costs.items()}
            | {"seeds": int(summary["count"])}
            | {f"speedup_{label}": values.get(method, np.nan) for label, values in speed.items()}
        )
    return pd.DataFrame(rows)
