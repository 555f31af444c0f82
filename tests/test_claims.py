"""The claims table's statistics: verdicts from intervals, paired t, Holm, minimum detectable effects, the
seed bootstrap of speedups and the ordering agreement with the paper."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from d3s.analysis import claims
from d3s.analysis.claims import (
    CLAIMS,
    claims_table,
    eval_noise_split,
    holm,
    min_detectable_effect,
    ordering_row,
    paired_t,
    seeds_for_effect,
)


@pytest.mark.parametrize(
    ("low", "high", "direction", "null", "expected"),
    [
        (0.5, 2.0, +1, 0.0, "supported"),
        (-2.0, -0.5, +1, 0.0, "refuted"),
        (-0.5, 2.0, +1, 0.0, "inconclusive"),
        (0.2, 0.9, -1, 1.0, "supported"),
        (1.1, 1.5, -1, 1.0, "refuted"),
        (math.nan, math.nan, +1, 0.0, "inconclusive"),
    ],
)
def test_verdict_is_decided_by_the_interval_alone(low, high, direction, null, expected):
    assert claims.verdict(low, high, direction, null) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=2, max_size=12))
def test_paired_t_matches_scipy(differences):
    result = paired_t(differences)
    d = np.asarray(differences)
    assert result["estimate"] == pytest.approx(d.mean(), abs=1e-9)
    if d.std(ddof=1) > 1e-6:
        reference = stats.ttest_1samp(d, 0.0)
        assert result["p_value"] == pytest.approx(reference.pvalue, rel=1e-6, abs=1e-12)
        interval = reference.confidence_interval(0.95)
        assert (result["ci_low"], result["ci_high"]) == pytest.approx(
            (interval.low, interval.high), rel=1e-6, abs=1e-9
        )


def test_paired_t_with_one_seed_has_no_interval():
    result = paired_t([3.0])
    assert result["estimate"] == 3.0 and math.isnan(result["ci_low"]) and result["n"] == 1


@pytest.mark.parametrize("seeds", [2, 3, 5, 10, 30])
def test_min_detectable_effect_has_80_percent_power(seeds):
    sd = 2.0
    effect = min_detectable_effect(sd, seeds)
    df, critical = seeds - 1, stats.t.ppf(0.975, seeds - 1)
    shift = effect / (sd / math.sqrt(seeds))
    power = stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift)
    assert power == pytest.approx(0.80, abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 6.0), st.floats(0.3, 5.0))
def test_seeds_for_an_effect_are_the_fewest_that_detect_it(sd, effect):
    """Brute force as the oracle: the first n from 2 whose detectable effect at ``sd`` is at most
    ``effect``."""
    needed = seeds_for_effect(sd, effect, limit=150)
    brute = next((n for n in range(2, 151) if min_detectable_effect(sd, n) <= effect), None)
    assert needed == brute


def test_seeds_for_an_effect_at_the_edges():
    assert seeds_for_effect(0.0, 1.5) == 2  # no spread: any two seeds decide
    assert seeds_for_effect(math.nan, 1.5) is None  # unknown spread (one seed)
    assert seeds_for_effect(50.0, 0.5, limit=100) is None  # beyond the limit
    assert min_detectable_effect(2.51, seeds_for_effect(2.51, 1.5)) <= 1.5 < min_detectable_effect(2.51, 23)


def test_the_noise_split_recovers_both_parts_of_a_known_spread():
    """Paired differences = a training effect per seed + an evaluation draw per (seed, draw): with many seeds
    the split finds both standard deviations; the parts' variances add up to the total's."""
    rng = np.random.default_rng(0)
    seeds = 20000
    train = rng.normal(0.5, 2.0, seeds)
    first, second = train + rng.normal(0, 1.5, seeds), train + rng.normal(0, 1.5, seeds)
    split = eval_noise_split(first, second)
    assert split["train_sd"] == pytest.approx(2.0, rel=0.03)
    assert split["eval_sd"] == pytest.approx(1.5, rel=0.03)
    assert split["total_sd"] ** 2 == pytest.approx(split["train_sd"] ** 2 + split["eval_sd"] ** 2)


def test_the_noise_split_by_hand():
    first, second = [1.0, 3.0, 2.0], [2.0, 3.0, 0.0]
    split = eval_noise_split(first, second)
    assert split["eval_sd"] == pytest.approx(math.sqrt((1 + 0 + 4) / 3 / 2))
    total = (np.var(first, ddof=1) + np.var(second, ddof=1)) / 2
    assert split["total_sd"] == pytest.approx(math.sqrt(total))
    assert split["train_sd"] == pytest.approx(math.sqrt(max(total - (5 / 6), 0)))
    same = eval_noise_split([0.0, 1.0, 2.0], [2.0, 1.0, 0.0])  # more evaluation noise than spread: 0 left
    assert same["train_sd"] == 0.0 and same["n"] == 3
    assert math.isnan(eval_noise_split([1.0], [2.0])["eval_sd"])


def _holm_brute_force(p, alpha=0.05):
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return [a <= alpha for a in adjusted]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from([0.001, 0.004, 0.01, 0.0125, 0.02, 0.03, 0.049, 0.2, 0.9]), min_size=1, max_size=8
    )
)
def test_holm_matches_adjusted_p_values(p_values):
    assert holm(p_values) == _holm_brute_force(p_values)


def _curves(per_method: dict[str, list[list[float]]], seconds_per_step: dict[str, float]) -> pd.DataFrame:
    """Pass@1 curves at steps 0..S (step 0 = base model) per method and seed."""
    rows = []
    for method, seeds in per_method.items():
        for seed, values in enumerate(seeds):
            for step, value in enumerate(values):
                rows.append(
                    {
                        "method": method,
                        "seed": seed,
                        "step": step,
                        "value": value,
                        "wall_clock": step * seconds_per_step[method],
                    }
                )
    return pd.DataFrame(rows)


def test_speedup_in_steps_and_wall_clock_with_a_bootstrap_interval():
    ref = [[0.4, 0.5, 0.6, 0.7, 0.8]] * 4  # best 0.8 at step 4
    fast = [[0.4, 0.6, 0.8, 0.8, 0.8]] * 4  # reaches 0.792 at step 2
    curves = _curves({"grpo": ref, "d3s": fast}, {"grpo": 2.0, "d3s": 1.0})
    steps = claims.speedup_row(CLAIMS["speedup_steps"], curves, "d3s", "grpo", "step", resamples=200)
    wall = claims.speedup_row(
        CLAIMS["speedup_wall_clock"], curves, "d3s", "grpo", "wall_clock", resamples=200
    )
    assert steps["estimate"] == pytest.approx(2.0) and steps["ci_low"] == steps["ci_high"] == pytest.approx(
        2.0
    )
    assert wall["estimate"] == pytest.approx(4.0) and wall["verdict"] == "supported"


def test_speedup_never_reached_counts_as_zero_and_is_refuted():
    ref = [[0.4, 0.5, 0.6, 0.7, 0.8]] * 3
    slow = [[0.4, 0.45, 0.5, 0.55, 0.6]] * 3
    row = claims.speedup_row(
        CLAIMS["speedup_steps"],
        _curves({"grpo": ref, "pods": slow}, {"grpo": 1, "pods": 1}),
        "pods",
        "grpo",
        "step",
        resamples=100,
    )
    assert row["estimate"] == 0.0 and row["verdict"] == "refuted" and "never reached" in row["note"]


def test_speedup_bootstrap_is_deterministic_and_holds_the_estimate():
    rng = np.random.default_rng(1)
    ref = [list(np.clip(np.linspace(0.4, 0.8, 6) + rng.normal(0, 0.03, 6), 0, 1)) for _ in range(5)]
    other = [list(np.clip(np.linspace(0.4, 0.85, 6) + rng.normal(0, 0.03, 6), 0, 1)) for _ in range(5)]
    curves = _curves({"grpo": ref, "d3s": other}, {"grpo": 1, "d3s": 1})
    first = claims.speedup_row(CLAIMS["speedup_steps"], curves, "d3s", "grpo", "step", resamples=300)
    again = claims.speedup_row(CLAIMS["speedup_steps"], curves, "d3s", "grpo", "step", resamples=300)
    assert first == again
    assert first["ci_low"] <= first["estimate"] <= first["ci_high"]


def _table(effect_points: float, seeds: int = 6, noise: float = 0.01) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    per_method = {"grpo": [], "d3s": []}
    for _ in range(seeds):
        seed_level = rng.normal(0, 0.05)  # shared by both methods of a seed: pairing removes it
        for method, shift in (("grpo", 0.0), ("d3s", effect_points / 100)):
            end = 0.7 + seed_level + shift + rng.normal(0, noise)
            per_method[method].append(list(np.linspace(0.4 + seed_level, end, 5)))
    curves = _curves(per_method, {"grpo": 2.0, "d3s": 1.0})
    metrics = pd.DataFrame(
        [
            {"method": m, "seed": s, "step": step,
             "grad_norm": 1.0 + (m == "d3s") * 0.5 + rng.normal(0, 0.01), "entropy": 0.5,
             "selection/update_tokens": 100.0 if m == "grpo" else 25.0,
             "step_time": 2.0 if m == "grpo" else 1.0}
            for m in ("grpo", "d3s") for s in range(seeds) for step in range(1, 5)
        ]
    )  # fmt: skip
    # load_evals' shape: the final models (Pass@1, and Pass@4 a little higher) and the base model at step 0
    ends = curves[curves["step"].isin([0, 4])]
    evals = pd.concat(
        [ends.assign(k=1), ends.assign(k=4, value=lambda d: (d["value"] + 0.1).clip(upper=1))]
    ).assign(final=lambda d: d["step"] == 4, benchmark="synthetic")
    evals = evals.assign(ci_low=evals["value"] - 0.0392, ci_high=evals["value"] + 0.0392)  # se 0.02 each
    paper = {"D3S Table 1": {"grpo": 40.0, "d3s": 45.0}}
    return claims_table(evals, curves, metrics, ["grpo", "d3s"], "grpo", paper=paper)


def test_claims_table_decides_a_clear_gain_and_a_clear_cost_saving():
    table = _table(effect_points=10).set_index(["claim", "method"])
    assert list(_table(10).columns) == claims.COLUMNS
    assert table.loc[("pass_at_1", "d3s"), "verdict"] == "supported"
    assert table.loc[("pass_at_1", "d3s"), "estimate"] == pytest.approx(10, abs=2)
    assert table.loc[("gain_over_base", "grpo"), "verdict"] == "supported"
    assert table.loc[("gain_over_base", "grpo"), "reference"] == "base"
    assert table.loc[("grad_norm", "d3s"), "verdict"] == "supported"
    assert table.loc[("update_tokens", "d3s"), "estimate"] == pytest.approx(0.25)
    assert table.loc[("update_tokens", "d3s"), "verdict"] == "supported"
    assert table.loc[("pass_at_k", "d3s"), "verdict"] == "supported"
    assert table.loc[("step_time", "d3s"), "estimate"] == pytest.approx(0.5)
    pass1 = table.loc[("pass_at_1", "d3s")]
    assert pass1["eval_se"] == pytest.approx(100 * 0.02 * math.sqrt(2))  # two independent evaluations
    assert pass1["seed_sd"] > 0 and math.isnan(table.loc[("grad_norm", "d3s"), "eval_se"])
    ordering = table.loc[("ordering_agrees_with_paper", "grpo,d3s")]
    assert ordering["estimate"] == 1.0 and ordering["verdict"] == "supported" and ordering["null"] == 0.5
    assert (
        table.loc[("entropy", "d3s"), "verdict"] == "inconclusive"
    )  # identical: no interval width, no effect


def test_claims_table_refutes_a_loss_and_leaves_no_effect_inconclusive():
    worse = _table(effect_points=-10).set_index(["claim", "method"])
    assert worse.loc[("pass_at_1", "d3s"), "verdict"] == "refuted"
    same = _table(effect_points=0, noise=0.02).set_index(["claim", "method"])
    row = same.loc[("pass_at_1", "d3s")]
    assert row["verdict"] == "inconclusive" and row["ci_low"] < 0 < row["ci_high"]
    assert row["min_detectable_effect"] > 0
    assert same.loc[("gain_over_base", "d3s"), "verdict"] == "supported"


def test_ordering_agreement_with_the_paper():
    final = pd.DataFrame(
        [
            {"method": m, "seed": s, "value": v + 0.001 * s}
            for s in range(4)
            for m, v in (("grpo", 0.5), ("pods", 0.6), ("d3s", 0.7))
        ]
    )
    agree = ordering_row(final, {"grpo": 40.0, "pods": 41.0, "d3s": 45.0}, "D3S Table 1", resamples=100)
    assert agree["estimate"] == 1.0 and agree["verdict"] == "supported" and agree["method"] == "grpo,pods,d3s"
    reverse = ordering_row(final, {"grpo": 45.0, "pods": 41.0, "d3s": 40.0}, "D3S Table 1", resamples=100)
    assert reverse["estimate"] == 0.0 and reverse["verdict"] == "refuted"
    half = ordering_row(final, {"grpo": 40.0, "pods": 46.0, "d3s": 45.0}, "D3S Table 1", resamples=100)
    assert half["estimate"] == pytest.approx(2 / 3)  # grpo < pods and grpo < d3s agree; pods > d3s does not
    one_seed = ordering_row(final[final["seed"] == 0], {"grpo": 40.0, "d3s": 45.0}, "D3S Table 1")
    assert one_seed["verdict"] == "inconclusive" and math.isnan(one_seed["ci_low"])


def test_a_method_is_compared_with_its_own_baseline_where_it_ran():
    """GSPO+D3S against GSPO (the paper's Table 3), every other method against the default reference."""
    curves = _curves(
        {"grpo": [[0.4, 0.5, 0.6]] * 3, "gspo": [[0.4, 0.45, 0.5]] * 3, "gspo_d3s": [[0.4, 0.5, 0.55]] * 3},
        {"grpo": 1, "gspo": 1, "gspo_d3s": 1},
    )
    ends = curves[curves["step"].isin([0, 2])]
    evals = ends.assign(k=1, final=lambda d: d["step"] == 2, benchmark="synthetic")
    metrics = pd.DataFrame(columns=["method", "seed", "step"])
    methods = ["grpo", "gspo", "gspo_d3s"]
    table = claims_table(evals, curves, metrics, methods, "grpo", references={"gspo_d3s": "gspo"})
    pass1 = table[table["claim"] == "pass_at_1"].set_index("method")
    assert pass1.loc["gspo_d3s", "reference"] == "gspo" and pass1.loc["gspo", "reference"] == "grpo"
    assert pass1.loc["gspo_d3s", "estimate"] == pytest.approx(5.0)
    without_gspo = claims_table(evals[evals["method"] != "gspo"], curves, metrics, ["grpo", "gspo_d3s"],
                                "grpo", references={"gspo_d3s": "gspo"})  # fmt: skip
    assert set(without_gspo.loc[without_gspo["claim"] == "pass_at_1", "reference"]) == {"grpo"}


def test_every_pods_row_names_its_protocol():
    from d3s.analysis.claims import pods_protocol

    d3s_protocol = pods_protocol("pods", "grpo", {"grpo": 32, "pods": 32})
    assert d3s_protocol.startswith("D3S's GRPO+PODS") and "trains 8" in d3s_protocol
    own = pods_protocol("pods", "grpo", {"grpo": 16, "pods": 64})
    assert own.startswith("PODS's own") and "n = 64" in own and "m = 16" in own
    assert pods_protocol("pods_random", "grpo", {"grpo": 8, "pods_random": 32}).startswith("PODS's own")
    assert pods_protocol("d3s", "grpo", {"grpo": 32, "d3s": 32}) == ""  # not a PODS comparison
    assert pods_protocol("pods", "base", {"pods": 32}).startswith("D3S's")


@pytest.mark.parametrize("differences", [[1.0, 2.5, 0.5], [-3.0, 4.0, 1.0, 2.0, 0.0], [0.1, 0.2]])
def test_paired_t_equals_the_hand_formula(differences):
    d = np.asarray(differences)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    statistic = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    result = paired_t(differences)
    assert (result["ci_low"], result["ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert result["p_value"] == pytest.approx(2 * stats.t.sf(abs(statistic), len(d) - 1))


def test_paired_t_of_a_constant_difference_is_certain():
    assert paired_t([2.0, 2.0, 2.0]) | {"n": 3} == {
        "estimate": 2.0, "ci_low": 2.0, "ci_high": 2.0, "p_value": 0.0, "mde": 0.0, "n": 3
    }  # fmt: skip
    assert paired_t([0.0, 0.0])["p_value"] == 1.0


def test_seed_bootstrap_is_the_percentile_interval_of_its_draws():
    values = np.array([0.3, 1.2, 0.7, 2.0, 1.1])
    (low, high), draws = claims.seed_bootstrap(lambda draw: float(values[draw].mean()), 5, 500, seed=3)
    assert len(draws) == 500 and set(np.round(draws, 12)) <= {
        round(float(values[list(c)].mean()), 12) for c in itertools.combinations_with_replacement(range(5), 5)
    }
    assert (low, high) == pytest.approx(tuple(np.quantile(draws, [0.025, 0.975])))
    again = claims.seed_bootstrap(lambda draw: float(values[draw].mean()), 5, 500, seed=3)
    assert again[0] == (low, high) and np.array_equal(again[1], draws)
    assert claims.bootstrap_p_value(np.array([0.5, 1.5, 2.0, 3.0]), 1.0) == 0.5
