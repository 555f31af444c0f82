"""The regime sweep (`d3s regime`, d3s.analysis.regime; docs/workflow/regime-sweep.md): the slope of
the gap against log update tokens and its interval against brute force, the equal-wall-clock interpolation by
hand, the paper-regime estimate, the sweep config and its one-line refusals, and (slow) the real driver end
to end on a tiny sweep."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import ACCELERATE_DIR, REPO_ROOT, SCHEMA, copy_workflow, failed_job_logs

from d3s.analysis.claims import min_detectable_effect
from d3s.analysis.paper_regime import PAPER, token_fraction
from d3s.analysis.regime_gaps import (
    ERROR_RATIO,
    gap_slope,
    log_error_ratio,
    trend_claims,
    value_at,
    wall_clock_gaps,
)
from d3s.cli import main
from d3s.methods import METHODS
from d3s.orchestration.regime import plan_sweep, point_config, snakemake_command
from d3s.orchestration.workflow_config import validate_config

# ---- the slope ----


def test_slope_recovers_a_known_slope_exactly():
    """Gaps on a line (every seed the same at each point): the slope, with a zero-width interval."""
    x = np.log10([221, 450, 900, 1800])
    gaps = [[-9.0 + 4.0 * xi] * 5 for xi in x]
    result = gap_slope(x, gaps)
    assert result["estimate"] == pytest.approx(4.0)
    assert (result["ci_low"], result["ci_high"]) == pytest.approx((4.0, 4.0))
    assert result["n"] == 20


def test_slope_is_ols_over_every_seed_when_the_points_have_equal_seeds():
    """The oracle: numpy's least squares over all (x, per-seed gap) pairs."""
    rng = np.random.default_rng(1)
    x = np.log10([221, 450, 900, 1800, 3600])
    gaps = [rng.normal(2.0 * xi, 3.0, size=5) for xi in x]
    slope = np.polyfit(np.repeat(x, 5), np.concatenate(gaps), 1)[0]
    assert gap_slope(x, gaps)["estimate"] == pytest.approx(slope)


def test_slope_interval_covers_the_true_slope_at_its_level():
    """Brute force: 3,000 simulated sweeps with unequal seed noise per point (as measured: sd 9 at 8 prompts,
    2 at 32) and a true slope of 3 points per decade. The estimate is unbiased, its standard error matches the
    spread of the estimates, and the 95 % interval covers the true slope 95 % of the time."""
    rng = np.random.default_rng(0)
    x = np.log10([221, 450, 900, 1800])
    sd, seeds, truth = np.array([9.0, 5.0, 2.0, 1.5]), 5, 3.0
    estimates, ses, covered = [], [], 0
    for _ in range(3000):
        gaps = [rng.normal(-5 + truth * xi, s, size=seeds) for xi, s in zip(x, sd, strict=True)]
        result = gap_slope(x, gaps, detectable=False)
        estimates.append(result["estimate"])
        ses.append(result["se"])
        covered += result["ci_low"] <= truth <= result["ci_high"]
    w = (x - x.mean()) / ((x - x.mean()) ** 2).sum()
    exact_se = math.sqrt((w**2 * sd**2 / seeds).sum())
    assert np.mean(estimates) == pytest.approx(truth, abs=4 * exact_se / math.sqrt(3000))
    assert np.std(estimates) == pytest.approx(exact_se, rel=0.05)
    assert np.sqrt(np.mean(np.square(ses))) == pytest.approx(exact_se, rel=0.05)
    assert 0.93 <= covered / 3000 <= 0.97


def test_slope_minimum_detectable_effect_matches_the_paired_t_case():
    """Two points with the second's gaps only: the slope's detectable effect is the paired t-test's own
    (claims.min_detectable_effect) up to the Welch degrees of freedom, here equal."""
    x = [0.0, 1.0]
    gaps = [[0.0] * 5, [1.0, 3.0, 2.0, 5.0, 4.0]]
    # a constant first point contributes no variance: df = 4, se = sd / sqrt(5)
    result = gap_slope(x, gaps)
    sd = float(np.std(gaps[1], ddof=1))
    assert result["df"] == pytest.approx(4.0)
    assert result["mde"] == pytest.approx(min_detectable_effect(sd, 5))


@pytest.mark.parametrize(
    ("x", "gaps"),
    [
        ([2.0, 3.0], [[1.0], [2.0]]),  # one seed per point: a slope, no interval
        ([2.0, 2.0], [[1.0, 2.0], [2.0, 3.0]]),  # one update-token value: no slope
        ([2.0], [[1.0, 2.0]]),  # one point
    ],
)
def test_slope_without_the_data_for_an_interval(x, gaps):
    result = gap_slope(x, gaps)
    assert math.isnan(result["ci_low"]) and math.isnan(result["ci_high"])
    assert math.isnan(result["estimate"]) == (len(set(x)) < 2)


def test_trend_claims_have_the_claims_columns_and_verdicts():
    """Two methods, two measures: four rows with the claims table's columns; a clear positive slope is
    supported, a flat one inconclusive."""
    x = np.log10([200.0, 2000.0])
    table = pd.DataFrame(
        {
            "prompts_per_step": [8, 64, 8, 64],
            "method": ["d3s", "d3s", "pods", "pods"],
            "log10_update_tokens": [*x, *x],
        }
    )
    rng = np.random.default_rng(3)
    rows = []
    for method, slope in (("d3s", 5.0), ("pods", 0.0)):
        for p, xi in zip((8, 64), x, strict=True):
            for measure in ("steps", "wall_clock"):
                noise = rng.normal(0, 0.5, 5) if slope else [0.3, -0.3, 0.1, -0.1, 0.0]
                rows += [
                    {
                        "method": method,
                        "seed": s,
                        "measure": measure,
                        "gap": slope * xi + n,
                        "prompts_per_step": p,
                    }
                    for s, n in enumerate(noise)
                ]
    claims = trend_claims(table, pd.DataFrame(rows), "grpo")
    from d3s.analysis.claims import COLUMNS

    assert list(claims.columns) == COLUMNS
    assert list(claims["claim"]) == ["gap_slope", "gap_slope_wall_clock"] * 2  # no error-ratio gaps given
    d3s = claims[claims["method"] == "d3s"]
    assert (d3s["verdict"] == "supported").all()
    assert d3s["estimate"].to_numpy() == pytest.approx([5.0, 5.0], abs=1.0)
    assert (claims[claims["method"] == "pods"]["verdict"] == "inconclusive").all()
    assert (claims["unit"] == "points per decade").all() and (claims["seeds"] == 10).all()


def test_the_error_ratio_measures_the_gap_against_the_ceiling():
    """ln(reference errors / method errors): 0 where both err alike, ln 2 where the method errs half as often,
    the same at 80 % as at 98 % (where a gap in points is ten times smaller), finite for a perfect seed."""
    assert log_error_ratio(0.8, 0.8) == 0.0
    ratios = log_error_ratio([0.9, 0.99], [0.8, 0.98])
    assert ratios == pytest.approx([math.log(2), math.log(2)])
    assert log_error_ratio(0.8, 0.9) == pytest.approx(-math.log(2))
    assert math.isfinite(log_error_ratio(1.0, 0.9)) and log_error_ratio(1.0, 0.9) > math.log(100)


def test_trend_claims_slope_the_error_ratio_where_the_gaps_have_it():
    x = np.log10([200.0, 2000.0, 20000.0])
    table = pd.DataFrame({"prompts_per_step": [8, 64, 512], "method": ["d3s"] * 3, "log10_update_tokens": x})
    rows = [
        {"method": "d3s", "seed": s, "measure": m, "gap": g + 0.01 * s, "prompts_per_step": p}
        for p, g in zip((8, 64, 512), (0.0, 0.5, 1.0), strict=True)
        for m in ("steps", "wall_clock", ERROR_RATIO)
        for s in range(4)
    ]
    claims = trend_claims(table, pd.DataFrame(rows), "grpo")
    assert list(claims["claim"]) == ["gap_slope", "gap_slope_wall_clock", "error_ratio_slope"]
    error = claims.set_index("claim").loc["error_ratio_slope"]
    assert error["estimate"] == pytest.approx(0.5) and error["unit"] == "ln(error ratio) per decade"


# ---- equal wall-clock ----


def test_value_at_interpolates_linearly_and_says_when_it_clamps():
    times, values = [20.0, 0.0, 10.0, 40.0], [0.8, 0.5, 0.6, 0.7]  # unsorted on purpose
    assert value_at(times, values, 30.0) == pytest.approx((0.75, False))  # halfway from 0.8 to 0.7
    assert value_at(times, values, 5.0) == pytest.approx((0.55, False))
    assert value_at(times, values, 45.0) == (pytest.approx(0.7), True)  # beyond the run: its end
    assert math.isnan(value_at(times, values, math.nan)[0])


def test_wall_clock_gap_against_a_hand_computation():
    """grpo's curve seed 0: (0 s, 50 %), (10 s, 60 %), (20 s, 80 %), (40 s, 70 %); d3s trained 30 s and ends
    at 77 %: 77 - 75 = +2 points. Seed 1: d3s trained 50 s, longer than grpo's 40 s: grpo's final 70 % is
    used, and counted as clamped."""
    curves = pd.DataFrame(
        [
            ("grpo", s, step, v, t)
            for s in (0, 1)
            for step, v, t in [(0, 0.5, 0), (10, 0.6, 10), (20, 0.8, 20), (40, 0.7, 40)]
        ]
        + [
            ("d3s", 0, 0, 0.5, 0.0),
            ("d3s", 0, 40, 0.77, 30.0),
            ("d3s", 1, 0, 0.5, 0.0),
            ("d3s", 1, 40, 0.74, 50.0),
        ],
        columns=["method", "seed", "step", "value", "wall_clock"],
    )
    final = pd.Series({0: 0.77, 1: 0.74})
    gaps, clamped = wall_clock_gaps(curves, final, "d3s", "grpo")
    assert gaps == pytest.approx({0: 2.0, 1: 4.0})
    assert clamped == 1


# ---- the paper's regime ----


def test_paper_regime_estimate_from_its_inputs():
    """D3S trains on N(p)/G x K(p) of the tokens, N 1/4 -> 1 and K 5 -> 20 % linear in p: the mean of that
    product is 0.0125 + (0.25 x 0.15 + 0.05 x 0.75) / 2 + 0.75 x 0.15 / 3 = 0.0875; PODS 0.25; GRPO 1."""
    assert token_fraction(METHODS["d3s"]) == pytest.approx(0.0875)
    assert token_fraction(METHODS["pods"]) == pytest.approx(0.25)
    assert token_fraction(METHODS["grpo"]) == 1.0
    # numerically: the mean over a fine grid of p
    p = np.linspace(0, 1, 100001)
    assert np.mean((0.25 + 0.75 * p) * (0.05 + 0.15 * p)) == pytest.approx(0.0875, rel=1e-4)
    low, mid, high = PAPER.update_tokens("d3s")
    assert (low, high) == pytest.approx((32 * 32 * 0.0875 * 500, 32 * 32 * 0.0875 * 1500))
    assert mid == pytest.approx(math.sqrt(low * high))
    assert 1e4 < mid < 1e5 < PAPER.update_tokens("pods")[1]


# ---- the sweep config ----


def test_regime_config_validates_and_plans_its_points():
    config = yaml.safe_load((REPO_ROOT / "config" / "regime.yaml").read_text())
    validate_config(config, SCHEMA)
    sweep = plan_sweep(str(REPO_ROOT / "config" / "regime.yaml"), ACCELERATE_DIR, SCHEMA)
    assert [p.prompts for p in sweep.points] == [8, 16, 32, 64, 256]
    assert [p.experiment for p in sweep.points] == [f"regime/p{p}" for p in (8, 16, 32, 64, 256)]
    # every point trains on each prompt once: 4,000 cover 64 x 40 steps; larger points get P x 40
    counts = [point_config(config, p)["train"]["dataset"]["count"] for p in sweep.points]
    assert counts == [4000, 4000, 4000, 4000, 256 * 40]
    assert "dataset" not in sweep.points[3].overrides["train"]
    assert sweep.base_model == "results/regime/base/base_model"
    point = point_config(yaml.safe_load((REPO_ROOT / "config" / "regime.yaml").read_text()), sweep.points[2])
    assert point["train"]["trainer"]["per_device_train_batch_size"] == 256  # 32 prompts x 8
    assert point["train"]["trainer"]["max_steps"] == config["train"]["trainer"]["max_steps"]  # merged
    assert point["base_model"]["kind"] == "path" and point["experiment"] == "regime/p32"
    command = snakemake_command(sweep, 2, sweep.points[0])
    assert command[command.index("--configfile") + 1].endswith("config/regime.yaml")
    assert 'train={"trainer": {"per_device_train_batch_size": 64}}' in command
    base = snakemake_command(sweep, 2)
    assert "results/regime/base/base_model/config.json" in base and "experiment=regime/base" in base


def test_regime_config_keeps_the_default_testbed():
    """config/regime.yaml is config/config.yaml's testbed: every key equal but the experiment, the sweep, the
    batch, which the sweep sets per point, and the step schedule (the sweep: 40 steps at every point; the
    default: 64 prompts x 20 steps, as many rollouts as 32 x 40). Update it with the default."""
    default = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    regime = yaml.safe_load((REPO_ROOT / "config" / "regime.yaml").read_text())
    assert regime.pop("regime")["prompts_per_step"][0] >= 1
    for config in (default, regime):
        config.pop("experiment")
        for key in ("per_device_train_batch_size", "max_steps", "save_steps", "anatomy_every"):
            config["train"]["trainer"].pop(key)
    assert regime == default


BAD_SWEEPS = [
    ({}, "config regime: {config} has no regime section"),
    (
        {"regime": {"prompts_per_step": [8]}},
        "config regime.prompts_per_step: [8] is one point; a slope needs",
    ),
    (
        {"regime": {"prompts_per_step": [8, 0]}},
        "config regime.prompts_per_step[1]: 0 is less than the minimum",
    ),
    ({"regime": {"prompts": [8, 16]}}, "config regime: unknown key(s) ['prompts']"),
    (
        {"regime": {"prompts_per_step": [8, 16]}, "methods": ["d3s"]},
        "config methods: the sweep compares methods with analysis.reference 'grpo'",
    ),
    (
        {"regime": {"prompts_per_step": [2, 3]}, "train": {"prompts_per_step": 2}},
        "config train.prompts_per_step x num_generations = 3 x 8 = 24 rollouts per step is not a multiple",
    ),
]


@pytest.mark.parametrize(("change", "message"), BAD_SWEEPS, ids=range(len(BAD_SWEEPS)))
def test_a_bad_sweep_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, change, message):
    config = yaml.safe_load((REPO_ROOT / "config" / "regime-smoke.yaml").read_text())
    config.pop("regime")
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] |= value
        else:
            config[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(REPO_ROOT)
    before = set((REPO_ROOT / "results").iterdir())
    assert main(["regime", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("d3s regime: error: " + message.format(config=path)), err
    assert "(regime point P = 3)" in err if "train" in change else True
    assert set((REPO_ROOT / "results").iterdir()) == before  # nothing written


def test_a_missing_config_and_a_folder_without_the_workflow_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    assert main(["regime", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["regime", "--config", str(REPO_ROOT / "config" / "regime.yaml")]) == 2
    assert "run d3s regime from the repository root" in capsys.readouterr().err


# ---- the sweep, end to end ----


@pytest.mark.slow
def test_regime_sweep_smoke_end_to_end(tmp_path):
    """`d3s regime --config config/regime-smoke.yaml`: the shared base model, two complete points (2 and 4
    prompts per step, grpo and d3s, 1 seed, 2 steps), then the sweep's table, figure, trend claims and
    report."""
    work = copy_workflow(tmp_path)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "d3s.cli", "regime", "--config", "config/regime-smoke.yaml", "--cores", "2"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:] + failed_job_logs(out, work)
    print(f"sweep smoke: {time.perf_counter() - start:.0f} s")
    root = work / "results" / "regime-smoke"
    assert "[3/3] P = 4 (32 rollouts per step)" in done.stdout and "sweep finished" in done.stdout
    for point in ("p2", "p4"):  # complete experiments, each with its own claims and report
        assert (root / point / "tables" / "claims.csv").is_file() and (root / point / "report.md").is_file()
        train = yaml.safe_load((root / point / "runs" / "d3s" / "seed0" / "train.yaml").read_text())
        assert train["model"] == "results/regime-smoke/base/base_model"
        assert train["trainer"]["per_device_train_batch_size"] == 8 * int(point[1:])
        assert train["dataset"]["count"] == {"p2": 6, "p4": 8}[point]  # grown to P x steps: one pass
    assert not (root / "p2" / "base_model").exists()  # the base model is built once, shared
    gap = pd.read_csv(root / "tables" / "regime_gap.csv")
    assert sorted(zip(gap["prompts_per_step"], gap["method"], strict=True)) == [(2, "d3s"), (4, "d3s")]
    assert (gap["seeds"] == 1).all() and gap["pass_at_1_ci_low"].isna().all()  # one seed: no interval
    by = gap.set_index(["method", "prompts_per_step"])
    # more prompts, more update tokens; fewer than grpo's
    assert by.at[("d3s", 4), "update_tokens_per_step"] > by.at[("d3s", 2), "update_tokens_per_step"]
    assert (gap["update_tokens_per_step"] < gap["reference_update_tokens_per_step"]).all()
    # one seed: the gap is the difference of the two final Pass@1 columns
    assert (gap["pass_at_1_gap"] - (gap["method_pass_at_1"] - gap["reference_pass_at_1"])).abs().max() < 1e-9
    assert gap["pass_at_1_gap"].between(-100, 100).all() and gap["wall_clock_gap"].between(-100, 100).all()
    assert (gap["step_time_ratio"] > 0).all() and (gap["k"] == 4).all()
    claims = pd.read_csv(root / "tables" / "regime_claims.csv")
    assert (
        list(claims["claim"]) == ["gap_slope", "gap_slope_wall_clock", "error_ratio_slope"]
        and (claims["method"] == "d3s").all()
    )
    expected = log_error_ratio(gap["method_pass_at_1"] / 100, gap["reference_pass_at_1"] / 100)
    assert gap["log_error_ratio"].to_numpy() == pytest.approx(expected)  # one seed: the two finals' ratio
    assert claims["estimate"].notna().all() and (claims["verdict"] == "inconclusive").all()
    for suffix in ("png", "pdf"):
        assert (root / "figures" / f"regime_gap.{suffix}").stat().st_size > 10_000
    report = (root / "report.md").read_text()
    assert "figures/regime_gap.png" in report and "P = 2 (" in report and "paper's regime" in report
    assert "agree in every setting but the batch" in report


@pytest.mark.parametrize(
    ("experiment", "valid"),
    [("regime/p8", True), ("tiny", True), ("a.b/c-d_e", True), ("../x", False), ("a/../b", False)]
    + [(".", False), ("a/", False), ("/abs", False)],
)
def test_experiment_names_may_nest_but_not_leave_results(experiment, valid):
    config = yaml.safe_load((REPO_ROOT / "config" / "regime-smoke.yaml").read_text()) | {
        "experiment": experiment
    }
    if valid:
        validate_config(config, SCHEMA)
    else:
        with pytest.raises(ValueError, match=r"^config experiment: .* does not match"):
            validate_config(config, SCHEMA)
