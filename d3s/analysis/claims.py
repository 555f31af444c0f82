"""The papers' claims as verdicts with intervals (``tables/claims.csv``; docs/workflow/provenance.md, "The
claims table")."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import optimize, stats

LEVEL = 0.95
POWER = 0.80
BOOTSTRAP_RESAMPLES = 2000
COLUMNS = (
    ["claim", "method", "reference", "estimate", "ci_low", "ci_high", "seeds", "verdict"]
    + ["min_detectable_effect", "unit", "null", "p_value", "verdict_holm", "seed_sd", "eval_se", "statement"]
    + ["note", "protocol"]
)
ENTROPY = "lower policy entropy than the reference (run mean; the paper's Qwen runs, Llama rises)"
REACH = "reaches 99 % of the reference's best Pass@1 in"
Curve = tuple[np.ndarray, np.ndarray]  # (seeds, steps) arrays of Pass@1 and of the time axis
NO_INTERVAL = {"ci_low": math.nan, "ci_high": math.nan, "p_value": math.nan, "mde": math.nan}


@dataclass(frozen=True)
class Claim:
    """One claim of the papers: the direction it asserts for a method against the reference."""

    name: str
    statement: str
    unit: str
    direction: int  # +1: the paper claims the estimate above the null; -1: below
    kind: str  # "difference" (null 0), "ratio" (null 1, paired t on logs), "speedup" (null 1, bootstrap),
    # "ordering" (null 0.5, bootstrap)

    @property
    def null(self) -> float:
        return {"difference": 0.0, "ordering": 0.5}.get(self.kind, 1.0)


CLAIMS = {
    name: Claim(name, statement, unit, direction, kind)
    for name, statement, unit, direction, kind in [
        ("gain_over_base", "training lifts held-out Pass@1 above the base model", "points", +1, "difference"),
        ("pass_at_1", "higher held-out Pass@1 than the reference", "points", +1, "difference"),
        ("pass_at_k", "higher held-out Pass@k than the reference", "points", +1, "difference"),
        ("grad_norm", "larger policy-gradient norm than the reference (run mean)", "norm", +1, "difference"),
        ("entropy", ENTROPY, "nats", -1, "difference"),
        ("update_tokens", "fewer tokens in the update per step", "ratio", -1, "ratio"),
        ("step_time", "less wall-clock per training step", "ratio", -1, "ratio"),
        ("speedup_steps", f"{REACH} fewer steps", "x", +1, "speedup"),
        ("speedup_wall_clock", f"{REACH} less wall-clock", "x", +1, "speedup"),
    ]
}


def verdict(low: float, high: float, direction: int, null: float) -> str:
    """``supported`` / ``refuted`` / ``inconclusive`` from the interval alone."""
    if math.isnan(low) or math.isnan(high) or low <= null <= high:
        return "inconclusive"
    return "supported" if (low > null) == (direction > 0) else "refuted"


def detectable_shift(df: float, level: float = LEVEL, power: float = POWER) -> float:
    """The true effect, in standard errors, that a two-sided t-test with ``df`` degrees of freedom at
    ``level`` detects with ``power`` (exact, from the noncentral t distribution of the test statistic)."""
    critical = stats.t.ppf(1 - (1 - level) / 2, df)

    def shortfall(shift: float) -> float:
        lower_tail = np.nan_to_num(stats.nct.cdf(-critical, df, shift))  # NaN where it underflows to 0
        return stats.nct.sf(critical, df, shift) + lower_tail - power

    return float(optimize.brentq(shortfall, 0.0, 100.0))


def min_detectable_effect(sd: float, n: int, level: float = LEVEL, power: float = POWER) -> float:
    """Smallest true mean difference that a paired two-sided t-test at ``level`` detects with ``power``
    (exact, from the noncentral t distribution of the test statistic)."""
    if n < 2 or math.isnan(sd):
        return float("nan")
    return detectable_shift(n - 1, level, power) * sd / math.sqrt(n)


def seeds_for_effect(sd: float, effect: float, level: float = LEVEL, power: float = POWER, limit: int = 1000):
    """The fewest paired seeds whose :func:`min_detectable_effect` at ``sd`` is at most ``effect`` (None when
    ``limit`` seeds are not enough or ``sd`` is unknown): the power calculation of a claim whose paired
    differences vary by ``sd`` across seeds."""
    if math.isnan(sd) or sd < 0 or effect <= 0:
        return None
    if sd == 0:
        return 2
    low, high = 2, limit  # min_detectable_effect falls with n: bisect for the first n that reaches effect
    if min_detectable_effect(sd, high, level, power) > effect:
        return None
    while low < high:
        middle = (low + high) // 2
        if min_detectable_effect(sd, middle, level, power) <= effect:
            high = middle
        else:
            low = middle + 1
    return low


def eval_noise_split(first: Iterable[float], second: Iterable[float]) -> dict[str, float]:
    """Split the spread of a paired comparison across training seeds into the evaluation's sampling and the
    training's seed-to-seed variation. ``first`` and ``second``: the same comparison's paired differences
    per training seed, with the evaluations sampled twice (two sampling seeds, the same problems). Two draws
    of one training seed differ by evaluation noise alone, so mean((a - b)^2) / 2 estimates its variance;
    the total (pooled over both draws) less that is the training's. Standard deviations, in the inputs'
    unit; ``train_sd`` 0 where the estimate falls below 0."""
    a, b = np.asarray(list(first), dtype=float), np.asarray(list(second), dtype=float)
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    if len(a) < 2:
        return {"total_sd": math.nan, "eval_sd": math.nan, "train_sd": math.nan, "n": len(a)}
    total = (a.var(ddof=1) + b.var(ddof=1)) / 2
    evaluation = float(np.mean((a - b) ** 2) / 2)
    return {
        "total_sd": math.sqrt(total),
        "eval_sd": math.sqrt(evaluation),
        "train_sd": math.sqrt(max(total - evaluation, 0.0)),
        "n": len(a),
    }


def t_interval(values: Iterable[float], level: float = LEVEL) -> dict[str, float]:
    """Mean of ``values`` (NaN and None dropped), its t-interval and two-sided p-value against 0."""
    d = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    result = {"estimate": float(d.mean()) if len(d) else math.nan, "n": len(d)}
    if len(d) < 2:
        return result | {"ci_low": math.nan, "ci_high": math.nan, "p_value": math.nan}
    if (d == d[0]).all():  # scipy gives no p-value; a constant difference is certain
        return result | {"ci_low": d[0], "ci_high": d[0], "p_value": float(d[0] == 0)}
    with warnings.catch_warnings():  # nearly constant values: scipy warns, the numbers are still right
        warnings.simplefilter("ignore", RuntimeWarning)
        test = stats.ttest_1samp(d, 0.0)
        interval = test.confidence_interval(level)
    return result | {"ci_low": interval.low, "ci_high": interval.high, "p_value": test.pvalue}


def paired_t(differences: Iterable[float], level: float = LEVEL) -> dict[str, float]:
    """Mean of paired differences, its t-interval, p-value (null 0) and minimum detectable effect."""
    d = np.asarray(list(differences), dtype=float)
    d = d[~np.isnan(d)]
    result = {key: float(value) for key, value in t_interval(d, level).items()} | {"n": len(d)}
    sd = float(d.std(ddof=1)) if len(d) > 1 else math.nan
    return result | {"mde": min_detectable_effect(sd, len(d), level)}


def holm(p_values: Iterable[float], alpha: float = 1 - LEVEL) -> list[bool]:
    """Holm's step-down rejections (NaN p-values are never rejected and do not count in the family)."""
    p = list(p_values)
    order = sorted((v, i) for i, v in enumerate(p) if not math.isnan(v))
    rejected = [False] * len(p)
    for rank, (value, index) in enumerate(order):
        if value > alpha / (len(order) - rank):
            break
        rejected[index] = True
    return rejected


def pods_protocol(method: str, reference: str, generations: Mapping[str, int] | None) -> str:
    """The PODS comparison (docs/fidelity/open-questions.md, "PODS: two protocols") of a row of a PODS-family
    method (one that re-normalises after down-sampling); empty for other methods."""
    from d3s.methods import METHODS

    entry = METHODS.get(method)  # None for "base" and the ordering rows
    if entry is None or not entry.renormalize or not generations or method not in generations:
        return ""
    n, reference_n = int(generations[method]), int(generations.get(reference, generations[method]))
    m = entry.keep_per_prompt(n)[0]
    if n == reference_n:
        return f"D3S's GRPO+PODS: both generate G = {n}, PODS trains {m}"
    if m == reference_n:
        return f"PODS's own: PODS generates n = {n} and trains m = {m}; {reference} generates and trains {m}"
    return f"PODS at (n, m) = ({n}, {m}) against {reference} at G = {reference_n}"


def _paired(per_seed: pd.DataFrame, method: str, reference: str, values: str = "value") -> pd.DataFrame:
    """Rows of seeds where both ``method`` and ``reference`` have a value: columns method, reference."""
    wide = per_seed.pivot_table(index="seed", columns="method", values=values, aggfunc="mean")
    if method not in wide or reference not in wide:
        return pd.DataFrame(columns=[method, reference])
    return wide[[method, reference]].dropna()


def _row(claim: Claim, method: str, reference: str, result: Mapping[str, float], note: str = "") -> dict:
    """A row of the claims table from ``result``: estimate, ci_low, ci_high, p_value, n and mde."""
    low, high = result["ci_low"], result["ci_high"]
    return {key: result[key] for key in ("estimate", "ci_low", "ci_high", "p_value")} | {
        "claim": claim.name,
        "method": method,
        "reference": reference,
        "seeds": int(result["n"]),
        "verdict": verdict(low, high, claim.direction, claim.null),
        "min_detectable_effect": result["mde"],
        "unit": claim.unit,
        "null": claim.null,
        "statement": claim.statement,
        "note": note,
    }


def difference_row(
    claim: Claim, per_seed: pd.DataFrame, method: str, reference: str, scale: float = 1.0
) -> dict:
    """A paired-difference claim from one value per (method, seed), times ``scale``; an ``se`` column adds
    ``seed_sd`` and ``eval_se`` (docs/workflow/provenance.md, "Noise, both kinds")."""
    pairs = _paired(per_seed, method, reference)
    differences = scale * (pairs[method] - pairs[reference])
    row = _row(claim, method, reference, paired_t(differences))
    row["seed_sd"] = float(differences.std(ddof=1)) if len(differences) > 1 else math.nan
    if "se" in per_seed:
        se = _paired(per_seed, method, reference, "se").reindex(pairs.index)
        row["eval_se"] = float(scale * np.sqrt((se[method] ** 2 + se[reference] ** 2).mean()))
    return row


def ratio_row(claim: Claim, per_seed: pd.DataFrame, method: str, reference: str) -> dict:
    """A paired-ratio claim: the t-interval of the log ratios, reported as ratios (geometric mean)."""
    pairs = _paired(per_seed, method, reference)
    pairs = pairs[(pairs[method] > 0) & (pairs[reference] > 0)]
    logs = paired_t(np.log(pairs[method] / pairs[reference]))
    result = logs | {k: math.exp(logs[k]) for k in ("estimate", "ci_low", "ci_high")}
    result["mde"] = 1 - math.exp(-logs["mde"])  # the detectable ratio below 1 (NaN stays NaN)
    return _row(claim, method, reference, result, "geometric mean of the per-seed ratios")


def shared_seeds(curves: pd.DataFrame, method: str, reference: str) -> list:
    """The seeds on which both ``method`` and ``reference`` have a curve, sorted."""
    seeds = (set(curves.loc[curves["method"] == m, "seed"]) for m in (method, reference))
    return sorted(set.intersection(*seeds))


def curve_arrays(curves: pd.DataFrame, method: str, seeds: list, x: str) -> Curve:
    """(seeds, steps) arrays of Pass@1 and of ``x`` for ``method``'s trained checkpoints (step > 0)."""
    rows = curves[(curves["method"] == method) & (curves["step"] > 0)]  # step 0 is the base model
    value = rows.pivot_table(index="seed", columns="step", values="value").reindex(seeds)
    if x == "step":
        return value.to_numpy(), np.broadcast_to(value.columns.to_numpy(float), value.shape)
    at = rows.pivot_table(index="seed", columns="step", values=x).reindex(seeds)
    return value.to_numpy(), at.to_numpy(float)


def _first_reach(value: np.ndarray, at: np.ndarray, target: float) -> float:
    hit = np.flatnonzero(value >= target - 1e-12)
    return float(at[hit[0]]) if hit.size else math.inf


def speedup(method: Curve, reference: Curve, draw: np.ndarray, fraction: float) -> float:
    """Reference time / method time to ``fraction`` of the reference's best seed-mean Pass@1, for the seeds
    ``draw`` (indices, repeats allowed); 0 when the method never reaches it."""
    ref_value, ref_at = (a[draw].mean(axis=0) for a in reference)
    target = fraction * np.nanmax(ref_value)
    t_method = _first_reach(*(a[draw].mean(axis=0) for a in method), target)
    return 0.0 if math.isinf(t_method) else _first_reach(ref_value, ref_at, target) / t_method


def seed_bootstrap(
    statistic: Callable[[np.ndarray], float], seeds: int, resamples: int, seed: int
) -> tuple[tuple[float, float], np.ndarray]:
    """Percentile interval and draws of ``statistic(seed indices)`` over resamples of whole seeds (paired: one
    draw of seeds serves every method the statistic compares)."""
    result = stats.bootstrap(
        (np.arange(seeds),),
        statistic,
        n_resamples=resamples,
        vectorized=False,
        confidence_level=LEVEL,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    interval = result.confidence_interval
    return (float(interval.low), float(interval.high)), result.bootstrap_distribution


def bootstrap_p_value(draws: np.ndarray, null: float) -> float:
    """Two-sided bootstrap p-value: twice the smaller share of draws on either side of ``null``."""
    return min(1.0, 2 * min(float((draws <= null).mean()), float((draws >= null).mean())))


def speedup_row(
    claim: Claim,
    curves: pd.DataFrame,
    method: str,
    reference: str,
    x: str,
    fraction: float = 0.99,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict:
    """Speedup to ``fraction`` of the reference's best (``x``: "step" or "wall_clock"), with a percentile
    bootstrap over whole seeds, the same draw for both methods."""
    seeds = shared_seeds(curves, method, reference)
    if not seeds:
        return _row(claim, method, reference, NO_INTERVAL | {"estimate": math.nan, "n": 0})
    arrays = curve_arrays(curves, method, seeds, x), curve_arrays(curves, reference, seeds, x)
    estimate = speedup(*arrays, np.arange(len(seeds)), fraction)
    result = NO_INTERVAL | {"estimate": estimate, "n": len(seeds)}
    notes = ["never reached the target (speedup 0)"] if estimate == 0 else []
    if len(seeds) > 1:
        interval, draws = seed_bootstrap(
            lambda draw: speedup(*arrays, draw, fraction), len(seeds), resamples, seed
        )
        result["ci_low"], result["ci_high"], result["p_value"] = *interval, bootstrap_p_value(draws, 1.0)
        if (draws > 0).all():  # detectable speedup from the bootstrap spread of log speedups
            z = stats.norm.ppf(1 - (1 - LEVEL) / 2) + stats.norm.ppf(POWER)
            result["mde"] = math.exp(z * float(np.log(draws).std(ddof=1))) - 1
        if never := float((draws == 0).mean()):
            notes.append(f"never reached in {never:.0%} of bootstrap resamples (counted as 0)")
    return _row(claim, method, reference, result, "; ".join(notes))


def per_seed_pass_at_k(evals: pd.DataFrame, k: int, step0: bool = False) -> pd.DataFrame:
    """method, seed, value, se: Pass@k averaged over benchmarks of the final models (of the base model, filed
    under every method and seed at step 0, with ``step0``) and its evaluation standard error (from each
    benchmark's 95 % problem-bootstrap interval, where there is one)."""
    rows = evals[(evals["k"] == k) & (evals["benchmark"] != "average")]
    rows = rows[rows["step"] == 0] if step0 else rows[rows["final"].astype(bool)]
    width = rows.get("ci_high", np.nan) - rows.get("ci_low", np.nan)
    rows = rows.assign(variance=(width / (2 * 1.96)) ** 2)
    out = rows.groupby(["method", "seed"], as_index=False).agg(
        value=("value", "mean"), variance=("variance", "mean"), n=("value", "size")
    )
    return out.assign(se=np.sqrt(out["variance"] / out["n"]))[["method", "seed", "value", "se"]]


def claims_table(
    evals: pd.DataFrame,
    curves: pd.DataFrame,
    metrics: pd.DataFrame,
    methods: list[str],
    reference: str = "grpo",
    fraction: float = 0.99,
    paper: Mapping[str, Mapping[str, float]] | None = None,
    references: Mapping[str, str] | None = None,
    generations: Mapping[str, int] | None = None,
) -> pd.DataFrame:
    """Every claim for every method against ``reference`` (or its own baseline in ``references``, where that
    ran), each method's gain over the base model, and our ordering's agreement with each ``paper`` table
    (name -> method -> Pass@1); ``generations`` (method -> num_generations) names the PODS protocols."""
    final = per_seed_pass_at_k(evals, 1)
    base = per_seed_pass_at_k(evals, 1, step0=True)
    final_k = per_seed_pass_at_k(evals, int(evals.loc[evals["final"].astype(bool), "k"].max()))
    rows = []
    for m in methods:
        pairs = pd.concat([final[final["method"] == m], base[base["method"] == m].assign(method="base")])
        rows.append(difference_row(CLAIMS["gain_over_base"], pairs, m, "base", 100))
    run_means = metrics.groupby(["method", "seed"], as_index=False).mean(numeric_only=True)

    def per_seed(column: str) -> pd.DataFrame:
        if column not in run_means:
            return pd.DataFrame(columns=["method", "seed", "value"])
        return run_means[["method", "seed", column]].rename(columns={column: "value"})

    for method in (m for m in methods if m != reference):
        baseline = (references or {}).get(method, reference)
        baseline = baseline if baseline in methods else reference
        rows += [
            difference_row(CLAIMS["pass_at_1"], final, method, baseline, 100),
            difference_row(CLAIMS["pass_at_k"], final_k, method, baseline, 100),
            difference_row(CLAIMS["grad_norm"], per_seed("grad_norm"), method, baseline),
            difference_row(CLAIMS["entropy"], per_seed("entropy"), method, baseline),
            ratio_row(CLAIMS["update_tokens"], per_seed("selection/update_tokens"), method, baseline),
            ratio_row(CLAIMS["step_time"], per_seed("step_time"), method, baseline),
            speedup_row(CLAIMS["speedup_steps"], curves, method, baseline, "step", fraction),
            speedup_row(CLAIMS["speedup_wall_clock"], curves, method, baseline, "wall_clock", fraction),
        ]
    rows += [ordering_row(final, scores, source) for source, scores in (paper or {}).items()]
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    pairs = zip(table["method"], table["reference"], strict=True)
    table["protocol"] = [pods_protocol(m, r, generations) for m, r in pairs]
    verdicts = zip(table["verdict"], holm(table["p_value"]), strict=True)
    table["verdict_holm"] = [v if rejected else "inconclusive" for v, rejected in verdicts]
    return table


def ordering_row(
    final: pd.DataFrame,
    paper: Mapping[str, float],
    source: str,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict:
    """The fraction of method pairs that our seed-mean Pass@1 (``final``: method, seed, value) orders as the
    ``paper``'s Pass@1 (method -> Pass@1 in its table ``source``) does (0.5: chance), seed-bootstrapped."""
    wide = final.pivot_table(index="seed", columns="method", values="value")
    methods = [m for m in paper if m in wide]
    wide = wide[methods].dropna()
    pairs = [(a, b) for i, a in enumerate(methods) for b in methods[i + 1 :] if paper[a] != paper[b]]
    result = NO_INTERVAL | {"estimate": math.nan, "n": len(wide)}
    if pairs and len(wide) > 1:  # one seed: no interval, so no verdict
        first, second = ([methods.index(m) for m in side] for side in zip(*pairs, strict=True))
        claimed = np.sign([paper[a] - paper[b] for a, b in pairs])
        values = wide.to_numpy()

        def agreement(draw: np.ndarray) -> float:
            mean = values[draw].mean(axis=0)
            return float((np.sign(mean[first] - mean[second]) == claimed).mean())

        (low, high), draws = seed_bootstrap(agreement, len(wide), resamples, seed)
        result |= {"estimate": agreement(np.arange(len(wide))), "ci_low": low, "ci_high": high}
        result["p_value"] = bootstrap_p_value(draws, 0.5)
    statement = f"orders the methods as {source} does (pairs agreeing)"
    claim = Claim("ordering_agrees_with_paper", statement, "fraction of pairs", +1, "ordering")
    return _row(claim, ",".join(methods), source, result, f"{len(pairs)} method pairs; 0.5 = chance")
