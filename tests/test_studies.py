"""The studies (docs/studies.md): the schedule's shapes and the adaptive switch against brute force,
variants and study sections and their one-line refusals, every shipped study config checked as the workflow
checks it, the claims' arithmetic against scipy, and (slow) every study run for real, to its report, on a
tiny testbed."""

from __future__ import annotations

import asyncio
import json
import math
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import ACCELERATE_DIR, REPO_ROOT, SCHEMA, SNAKEMAKE, copy_workflow, failed_job_logs
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from d3s.analysis.claims import min_detectable_effect
from d3s.analysis.studies import (
    calibration_table,
    chosen_threshold,
    claim_rows,
    control_rows,
    index_markdown,
    power_table,
    read_study,
    render_study,
    slope_per_seed,
    study_figure,
    study_folders,
)
from d3s.data.synthetic import arithmetic_problems
from d3s.methods import ADAPTIVE_SWITCH_SIGNAL, ADAPTIVE_SWITCH_THRESHOLD, METHODS
from d3s.orchestration.workflow_config import check_workflow_config
from d3s.selection import (
    SCHEDULES,
    SIGNAL_LOG_KEYS,
    SWITCH_SIGNALS,
    Schedule,
    ScopeSwitch,
    early_reward,
    spike_ratios,
)
from d3s.studies import MEASURES, Study, parse_study
from d3s.trainer import D3SConfig, D3STrainer
from d3s.variants import Variant, base_model_settings, extended_config, run_variants

STUDIES = ("token_level", "sample_level", "schedule", "alignment", "adaptive", "generalization")
STUDY_FILES = sorted((REPO_ROOT / "config" / "studies").glob("*.yaml"))


# ---- the schedule's shapes ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(SCHEDULES),
    keep=st.tuples(st.integers(1, 64), st.integers(1, 64)),
    ratio=st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)),
    progress=st.floats(0.0, 1.0),
)
def test_every_shape_stays_between_its_ends_and_reaches_them(kind, keep, ratio, progress):
    schedule = Schedule(kind, keep[0], keep[1], ratio[0], ratio[1])
    n, k = schedule.keep_per_prompt(progress), schedule.token_keep_ratio(progress)
    final = keep[0] if kind == "constant" else keep[1]
    assert min(keep[0], final) <= n <= max(keep[0], final)
    assert n in schedule.reachable_keep_values()
    low, high = sorted((ratio[0], ratio[0] if kind == "constant" else ratio[1]))
    assert low - 1e-12 <= k <= high + 1e-12
    assert schedule.keep_per_prompt(0.0) == keep[0] and schedule.token_keep_ratio(0.0) == ratio[0]
    if kind != "constant":
        assert schedule.keep_per_prompt(1.0) == keep[1] and schedule.token_keep_ratio(1.0) == ratio[1]


@pytest.mark.parametrize("progress", [0.0, 0.1, 0.25, 0.49, 0.5, 0.75, 0.9, 1.0])
def test_each_shape_is_its_formula(progress):
    """The formulas of docs/studies.md written out: N 2 -> 8, K 5 -> 20 %."""
    weights = {
        "constant": 0.0,
        "linear": progress,
        "two_phase": 0.0 if progress < 0.5 else 1.0,
        "cosine": (1 - math.cos(math.pi * progress)) / 2,
    }
    for kind, weight in weights.items():
        schedule = Schedule(kind, 2, 8, 0.05, 0.20)
        assert schedule.token_keep_ratio(progress) == pytest.approx((1 - weight) * 0.05 + weight * 0.20)
        assert schedule.keep_per_prompt(progress) == math.floor((1 - weight) * 2 + weight * 8 + 0.5 + 1e-9)


def test_cosine_moves_slowly_at_the_ends_and_fast_in_the_middle():
    schedule = Schedule("cosine", 2, 8, 0.05, 0.20)
    ends = schedule.token_keep_ratio(0.1) - schedule.token_keep_ratio(0.0)
    middle = schedule.token_keep_ratio(0.55) - schedule.token_keep_ratio(0.45)
    assert middle > 3 * ends


def test_an_unknown_shape_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="schedule must be one of constant, linear, two_phase, cosine"):
        Schedule("exponential", 2, 8, 0.05, 0.2)


@pytest.mark.parametrize("schedule", ["two_phase", "cosine"])
def test_the_trainer_config_takes_the_new_shapes_and_checks_every_reachable_n(schedule):
    config = D3SConfig.for_method("d3s", schedule=schedule, output_dir="/tmp/unused", **_TINY_BATCH)
    assert config.selection_schedule.kind == schedule
    micro = _TINY_BATCH | {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}  # N x 4 / 8
    if schedule == "cosine":  # passes through N = 3
        with pytest.raises(ValueError, match="keep_per_prompt = 3 .reached by the schedule."):
            D3SConfig.for_method("d3s", schedule=schedule, output_dir="/tmp/unused", **micro)
    else:  # N = 2 for the first half, 8 for the second: 1 and 4 rows
        assert config.selection_schedule.reachable_keep_values() == (2, 8)
        D3SConfig.for_method("d3s", schedule=schedule, output_dir="/tmp/unused", **micro)


_TINY_BATCH = {"per_device_train_batch_size": 16, "num_generations": 8, "use_cpu": True, "report_to": "none"}


# ---- the adaptive switch -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(st.floats(0.01, 100.0), min_size=0, max_size=30), warmup=st.integers(1, 5))
def test_spike_ratios_are_each_step_over_the_median_before_it(norms, warmup):
    expected = [norms[t] / statistics.median(norms[:t]) for t in range(warmup, len(norms))]
    assert spike_ratios(norms, warmup) == pytest.approx(expected)


def test_a_step_without_an_earlier_scale_gives_no_ratio():
    """Steps with no learning signal have norm 0: a median of 0 gives no scale, so no ratio (not infinity)."""
    assert spike_ratios([0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 2.0], warmup=3) == [2.0, 4.0]
    assert ScopeSwitch(3.0).scope([0.0, 0.0, 0.0, 0.5]) == "batch"


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(st.floats(0.01, 100.0), min_size=0, max_size=30), threshold=st.floats(1.01, 10.0))
def test_the_switch_latches_once_a_spike_crosses_the_threshold(norms, threshold):
    switch = ScopeSwitch(threshold)
    scopes = [switch.scope(norms[:t]) for t in range(len(norms) + 1)]
    first = next((t for t, scope in enumerate(scopes) if scope == "group"), None)
    if first is not None:  # once intra-group, intra-group for the rest of the run
        assert all(scope == "group" for scope in scopes[first:])
        assert norms[first - 1] / statistics.median(norms[: first - 1]) > threshold
    assert (first is None) == all(r <= threshold for r in spike_ratios(norms))


def test_the_switch_refuses_a_threshold_that_is_not_a_ratio_above_one():
    with pytest.raises(ValueError, match="threshold must be > 1"):
        ScopeSwitch(0.5)


@settings(max_examples=200, deadline=None)
@given(
    rewards=st.lists(st.one_of(st.floats(0.0, 1.0), st.just(math.nan)), max_size=12),
    warmup=st.integers(1, 5),
    threshold=st.floats(0.01, 1.0),
)
def test_the_early_reward_switch_decides_once_from_the_first_steps_mean_reward(rewards, warmup, threshold):
    """The mean of the first ``warmup`` logged rewards (NaN skipped), brute force; before them the scope stays
    cross-group, after them it is fixed for the rest of the run."""
    logged = [r for r in rewards if not math.isnan(r)]
    expected = sum(logged[:warmup]) / warmup if len(logged) >= warmup else math.nan
    assert early_reward(rewards, warmup) == pytest.approx(expected, nan_ok=True)
    switch = ScopeSwitch(threshold, warmup, "early_reward")
    scopes = [switch.scope(rewards[:t]) for t in range(len(rewards) + 1)]
    for t, scope in enumerate(scopes):
        seen = [r for r in rewards[:t] if not math.isnan(r)]
        fires = len(seen) >= warmup and sum(seen[:warmup]) / warmup < threshold
        assert scope == ("group" if fires else "batch")
    first = next((t for t, scope in enumerate(scopes) if scope == "group"), None)
    if first is not None:  # latched
        assert all(scope == "group" for scope in scopes[first:])


def test_the_switch_reads_the_log_record_of_its_signal():
    history = [{"reward": 0.1, "grad_norm": 1.0}, {"train_runtime": 1.0}, {"reward": 0.1, "grad_norm": 1.0}]
    history += [{"reward": 0.1, "grad_norm": 1.0}, {"reward": 0.9, "grad_norm": 9.0}]
    assert ScopeSwitch(0.2, signal="early_reward").scope_from_log(history) == "group"
    assert ScopeSwitch(0.05, signal="early_reward").scope_from_log(history) == "batch"
    assert ScopeSwitch(0.2, signal="early_reward").scope_from_log(history[:3]) == "batch"  # 2 steps so far
    assert ScopeSwitch(3.0).scope_from_log(history[:4]) == "batch"
    assert ScopeSwitch(3.0).scope_from_log(history) == "group"  # 9 over the median 1
    with pytest.raises(ValueError, match="signal must be one of"):
        ScopeSwitch(0.2, signal="loss")


def test_the_switchs_signals_are_the_schemas():
    """The study file's calibration.signal (config/schema.yaml) names what d3s.selection can read, and every
    signal names the log record it reads."""
    schema = yaml.safe_load(SCHEMA.read_text())
    calibration = schema["properties"]["study"]["properties"]["calibration"]["properties"]
    assert tuple(sorted(calibration["signal"]["enum"])) == tuple(sorted(SWITCH_SIGNALS))
    assert sorted(SIGNAL_LOG_KEYS) == sorted(SWITCH_SIGNALS)


def test_a_config_sets_the_early_reward_switch():
    config = D3SConfig.for_method(
        "d3s_adaptive",
        output_dir="/tmp/unused",
        scope_switch_signal="early_reward",
        scope_switch_threshold=0.25,
        **_TINY_BATCH,
    )
    assert config.scope_switch() == ScopeSwitch(0.25, signal="early_reward")
    history = [{"reward": 0.2, "grad_norm": 1.0, "step": s} for s in range(1, 4)]
    trainer = SimpleNamespace(args=config, state=SimpleNamespace(log_history=history), _metrics={"train": {}})
    trainer._metrics["train"]["selection/cross_group"] = []
    assert D3STrainer._sample_scope(trainer) == "group"  # 0.2 < 0.25 over the first 3 steps
    assert (
        D3STrainer._sample_scope(
            SimpleNamespace(**vars(trainer) | {"state": SimpleNamespace(log_history=history[:2])})
        )
        == "batch"
    )


def test_the_adaptive_method_is_d3s_with_the_switch():
    adaptive, d3s = METHODS["d3s_adaptive"], METHODS["d3s"]
    assert adaptive.scope_switch_threshold == ADAPTIVE_SWITCH_THRESHOLD > 0
    assert adaptive.scope_switch_signal == ADAPTIVE_SWITCH_SIGNAL == "early_reward"
    same = ("sample_rule", "sample_scope", "token_rule", "schedule", "keep_per_prompt_fraction_init")
    assert all(getattr(adaptive, name) == getattr(d3s, name) for name in same)
    config = D3SConfig.for_method("d3s_adaptive", output_dir="/tmp/unused", **_TINY_BATCH)
    assert config.scope_switch() == ScopeSwitch(ADAPTIVE_SWITCH_THRESHOLD, signal="early_reward")
    assert D3SConfig.for_method("d3s", output_dir="/tmp/unused", **_TINY_BATCH).scope_switch() is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sample_scope": "group"}, "needs a sample_rule and sample_scope batch"),
        ({"logging_steps": 2}, "needs logging_steps=1"),
        (
            {"scope_switch_threshold": 0.5, "scope_switch_signal": "grad_norm_spike"},
            "scope_switch_threshold must be 0 .off. or a ratio > 1",
        ),
        ({"scope_switch_threshold": -0.5}, "scope_switch_threshold must be >= 0 .0: off."),
        ({"scope_switch_signal": "loss"}, "scope_switch_signal"),
    ],
)
def test_the_switch_refuses_settings_it_cannot_honour(overrides, message):
    with pytest.raises(ValueError, match=message):
        D3SConfig.for_method("d3s_adaptive", output_dir="/tmp/unused", **_TINY_BATCH | overrides)


def test_the_trainer_reads_the_switch_from_the_logged_gradient_norms():
    """D3STrainer._sample_scope on a stand-in trainer: cross-group (logged 1) while no step spiked,
    intra-group (logged 0) from the step after a spike on."""
    config = D3SConfig.for_method(
        "d3s_adaptive",
        output_dir="/tmp/unused",
        scope_switch_signal="grad_norm_spike",
        scope_switch_threshold=1.5,
        **_TINY_BATCH,
    )
    history = [{"grad_norm": 1.0, "step": s} for s in range(1, 5)]
    trainer = SimpleNamespace(args=config, state=SimpleNamespace(log_history=history), _metrics={"train": {}})
    trainer._metrics["train"]["selection/cross_group"] = []
    assert D3STrainer._sample_scope(trainer) == "batch"
    history.append({"grad_norm": 15.0, "step": 5})
    history.append({"train_runtime": 1.0})  # a record without a gradient norm is skipped
    assert D3STrainer._sample_scope(trainer) == "group"
    assert trainer._metrics["train"]["selection/cross_group"] == [1.0, 0.0]


# ---- variants, extends and the study section ---------------------------------------------------------------


def _study_config(name: str) -> dict:
    """A shipped study config as the workflow resolves it (laid over config/config.yaml, defaults filled)."""
    raw = yaml.safe_load((REPO_ROOT / "config" / "studies" / f"{name}.yaml").read_text())
    config = extended_config(raw, REPO_ROOT)
    check_workflow_config(config, ACCELERATE_DIR, SCHEMA)
    return config


def test_the_six_studies_are_shipped():
    assert sorted(p.stem for p in STUDY_FILES) == sorted(STUDIES)


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_config_checks_and_keeps_the_default_testbed(name):
    """Each study extends config/config.yaml: the default's base model, task, training and evaluation, so the
    runs it shares with the default (and with other studies) are the same jobs. A study may add paired seeds
    for power (the schedule's 24), after the default's own."""
    config = _study_config(name)
    default = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    check_workflow_config(default, ACCELERATE_DIR, SCHEMA)
    # a study in the default's results tree shares its runs, so it keeps its testbed; one in a tree of its
    # own (generalization: another RL task) keeps its training and evaluation
    shared = config["experiment"] == default["experiment"]
    for key in ("experiment", "base_model", "task", "train", "eval") if shared else ("train", "eval"):
        assert config[key] == default[key], key
    assert config["seeds"][: len(default["seeds"])] == default["seeds"]
    assert len(set(config["seeds"])) == len(config["seeds"])
    study = parse_study(config, run_variants(config))
    assert study is not None and study.name == name
    assert all(claim.measure in MEASURES for claim in study.claims)
    assert len(config["seeds"]) >= 5  # 5 paired seeds at least: an interval needs several
    assert any(claim.primary for claim in study.claims), "name the claims the study decides (primary: true)"


def test_generalization_holds_out_values_its_base_model_knows():
    """The generalization study's base model is the default's (its SFT on the default's task, values in
    0..9), its RL task holds the values above 5 out, and its held-out problems have them; the setup's count
    of held-out problems that reach one is right."""
    config = _study_config("generalization")
    default = _study_config("token_level")  # the default's testbed, with the schema's defaults filled in
    assert config["task"] | config["base_model"]["sft_task"] == default["task"]
    assert config["base_model"] | {"sft_task": {}} == default["base_model"]
    assert config["experiment"] != default["experiment"]  # its runs are not the default's
    study = parse_study(config, run_variants(config))
    assert study is not None and study.ood is not None
    held_out = config["task"] | study.ood.task
    assert held_out == default["task"] and config["task"]["max_operand"] < held_out["max_operand"]
    problems = arithmetic_problems(study.ood.count, seed=0, split="test", **held_out)
    numbers = [[int(n) for n in re.findall(r"\d+", p.prompt + p.completion)] for p in problems]
    above = sum(max(values) > config["task"]["max_operand"] for values in numbers)
    assert f"{study.ood.count} held-out chains" in study.setup
    assert f"{above} of them reach a value above" in study.setup


def test_studies_that_share_a_run_name_define_it_alike():
    """A run name is one run in results/<experiment>/runs/: every study of that experiment that names it
    trains it the same, on the same task."""
    seen: dict[str, tuple] = {}
    for name in STUDIES:
        config = _study_config(name)
        for run, variant in run_variants(config).items():
            settings = (variant.method, variant.trainer, base_model_settings(config, variant.base))
            definition = (*settings, config["task"], config["train"])
            assert seen.setdefault((config["experiment"], run), definition) == definition, (name, run)


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"a": {"b": 1, "c": 2}, "seeds": [0, 1, 2], "x": 1}))
    merged = extended_config({"extends": "base.yaml", "a": {"c": 3}, "seeds": [5]}, tmp_path)
    assert merged == {"a": {"b": 1, "c": 3}, "seeds": [5], "x": 1}
    with pytest.raises(ValueError, match="config extends: nope.yaml not found"):
        extended_config({"extends": "nope.yaml"}, tmp_path)


def test_a_variant_is_a_method_with_overrides_on_a_base():
    config = {
        "methods": ["grpo"],
        "bases": {"weak": {"sft_steps": 10}},
        "base_model": {"kind": "tiny", "sft_steps": 400, "seed": 0},
        "variants": {
            "k05": {"method": "d3s", "trainer": {"token_keep_ratio": 0.05}, "base": "weak", "x": 0.05}
        },
    }
    variants = run_variants(config)
    assert variants["grpo"] == Variant("grpo", "grpo")
    assert variants["k05"] == Variant("k05", "d3s", {"token_keep_ratio": 0.05}, "weak", "", 0.05)
    train = {"trainer": {"max_steps": 3}, "method_overrides": {"d3s": {"max_steps": 4, "beta": 0.1}}}
    assert variants["k05"].train_settings(train) == {"max_steps": 4, "beta": 0.1, "token_keep_ratio": 0.05}
    assert base_model_settings(config, "weak") == {"kind": "tiny", "sft_steps": 10, "seed": 0}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"variants": {"d3s": {"method": "d3s", "trainer": {"beta": 0.1}}}},
            "is a registry method, which an entry",
        ),
        ({"variants": {"v": {"method": "d3s", "base": "nope"}}}, "variants.v.base: unknown base 'nope'"),
        ({"variants": {"v": {"method": "d3z"}}}, "unknown method 'd3z'"),
        ({"study": {"runs": ["grpo", "nope"]}}, r"study.runs: unknown run\(s\) \['nope'\]"),
        (
            {
                "study": {
                    "claims": [
                        {
                            "kind": "versus",
                            "measure": "pass_at_2",
                            "runs": ["d3s"],
                            "reference": "grpo",
                            "statement": "s",
                        }
                    ]
                }
            },
            "unknown measure 'pass_at_2'; valid measures: pass_at_1",
        ),
        (
            {
                "study": {
                    "claims": [
                        {
                            "kind": "interaction",
                            "measure": "kl",
                            "runs": ["d3s", "grpo", "d3s"],
                            "statement": "s",
                        }
                    ]
                }
            },
            "an interaction compares four runs",
        ),
        (
            {
                "study": {
                    "claims": [{"kind": "slope", "measure": "kl", "runs": ["d3s", "grpo"], "statement": "s"}]
                }
            },
            "a slope reads each run's x",
        ),
        (
            {"study": {"claims": [{"kind": "versus", "measure": "kl", "runs": ["d3s"], "statement": "s"}]}},
            "a versus claim needs a reference run",
        ),
        ({"study": {"calibration": {"seeds": [0, 99], "runs": ["d3s"]}}}, r"study.calibration.seeds: \[0\]"),
        (
            {"variants": {"v": {"method": "d3s_i", "trainer": {"scope_switch_threshold": 2.0}}}},
            "variant v: variants.v.trainer.*needs a sample_rule and sample_scope batch",
        ),
        (
            {"base_model": {"sft_task": {"min_ops": 8}}},
            r"base_model.sft_task: the SFT.s chains run from min_ops 8 to max_ops 7 .*min_ops <= max_ops",
        ),
    ],
)
def test_a_bad_study_ends_in_one_line_naming_the_key(change, message):
    """Checked at parse time (every `snakemake -n`), before any job."""
    from snakemake.utils import update_config

    config = _study_config("generalization")
    update_config(config, change)
    with pytest.raises(ValueError, match=message) as error:
        check_workflow_config(config, ACCELERATE_DIR, SCHEMA)
        from d3s.orchestration.run_config import resolved_trainer_configs

        resolved_trainer_configs(config, ACCELERATE_DIR, check_inputs=False)
    assert "\n" not in str(error.value)


# ---- the claims' arithmetic --------------------------------------------------------------------------------


def _values(table: dict[str, list[float]], measure: str = "pass_at_1") -> pd.DataFrame:
    rows = [
        {"run": run, "seed": seed, "measure": measure, "value": value}
        for run, values in table.items()
        for seed, value in enumerate(values)
    ]
    return pd.DataFrame(rows)


def _study(claims: list[dict], variants: dict[str, Variant]):
    config = {"seeds": [0, 1, 2, 3, 4], "study": {"name": "t", "title": "t", "question": "q",
                                                    "runs": list(variants), "claims": claims}}  # fmt: skip
    return parse_study(config, variants)


def test_versus_claims_are_paired_t_intervals_and_holm_runs_over_the_study():
    rng = np.random.default_rng(3)
    table = {"a": rng.normal(50, 3, 5), "b": rng.normal(40, 3, 5), "ref": rng.normal(50, 3, 5)}
    variants = {name: Variant(name, "grpo") for name in table}
    claims = [
        {"kind": "versus", "measure": "pass_at_1", "runs": ["a", "b"], "reference": "ref", "statement": "s"}
    ]
    rows = claim_rows(_values(table), _study(claims, variants), variants)
    for _, row in rows.iterrows():
        test = stats.ttest_rel(table[row["method"]], table["ref"])
        interval = test.confidence_interval(0.95)
        assert row["estimate"] == pytest.approx(np.mean(table[row["method"]] - table["ref"]))
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((interval.low, interval.high))
        assert row["p_value"] == pytest.approx(test.pvalue)
    b = rows.set_index("method").loc["b"]
    assert b["verdict"] == "refuted"  # direction +1 asserted, b is 10 points lower
    p = sorted(rows["p_value"])
    holm_rejects = [p[0] <= 0.025, p[0] <= 0.025 and p[1] <= 0.05]
    assert sorted(rows["verdict_holm"] != "inconclusive") == sorted(holm_rejects)


def test_a_slope_is_the_per_seed_least_squares_slope_against_log_x():
    xs = {"n1": 0.125, "n2": 0.25, "n4": 0.5, "n8": 1.0}
    rng = np.random.default_rng(5)
    table = {run: 3.0 * np.log10(x) + rng.normal(0, 0.5, 5) for run, x in xs.items()}
    variants = {run: Variant(run, "grpo", x=x) for run, x in xs.items()}
    slopes = slope_per_seed(
        _values(table).pivot(index="seed", columns="run", values="value"), list(xs), list(xs.values())
    )
    for seed in range(5):
        expected = np.polyfit(np.log10(list(xs.values())), [table[r][seed] for r in xs], 1)[0]
        assert slopes[seed] == pytest.approx(expected)
    claims = [{"kind": "slope", "measure": "pass_at_1", "runs": list(xs), "statement": "s"}]
    row = claim_rows(_values(table), _study(claims, variants), variants).iloc[0]
    assert row["estimate"] == pytest.approx(slopes.mean())
    assert row["ci_low"] < 3.0 < row["ci_high"] and row["verdict"] == "supported"


def test_an_interaction_is_the_per_seed_difference_of_differences():
    rng = np.random.default_rng(7)
    table = {name: rng.normal(40, 5, 5) for name in ("a", "b", "c", "d")}
    variants = {name: Variant(name, "grpo") for name in table}
    claims = [{"kind": "interaction", "measure": "pass_at_1", "runs": ["a", "b", "c", "d"], "statement": "s"}]
    row = claim_rows(_values(table), _study(claims, variants), variants).iloc[0]
    contrast = (table["a"] - table["b"]) - (table["c"] - table["d"])
    assert row["estimate"] == pytest.approx(contrast.mean())
    half = stats.t.ppf(0.975, 4) * contrast.std(ddof=1) / math.sqrt(5)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((contrast.mean() - half, contrast.mean() + half))


def test_the_power_table_holds_the_primary_claims_and_the_seeds_they_need():
    """Only the primary claim's rows; Holm over the whole study as its report; seeds_needed the fewest whose
    detectable effect at the row's spread reaches 1.5 points; a decided row is enough whatever its spread."""
    rng = np.random.default_rng(13)
    ref = rng.normal(50, 3, 5)
    table = {"ref": ref, "far": ref - 10 + rng.normal(0, 1, 5), "near": ref + rng.normal(0.3, 2.5, 5)}
    table |= {"tight": ref + rng.normal(0.2, 0.3, 5), "other": rng.normal(50, 3, 5)}
    variants = {name: Variant(name, "grpo") for name in table}
    versus = {"kind": "versus", "measure": "pass_at_1", "reference": "ref", "statement": "s"}
    claims = [versus | {"runs": ["far", "near", "tight"], "primary": True}, versus | {"runs": ["other"]}]
    study = _study(claims, variants)
    assert [claim.primary for claim in study.claims] == [True, False]
    power = power_table(_values(table), study, variants).set_index("method")
    assert list(power.index) == ["far", "near", "tight"]
    whole = claim_rows(_values(table), study, variants).set_index("method")
    assert (power["verdict_holm"] == whole.loc[power.index, "verdict_holm"]).all()
    assert power.loc["far", "verdict_holm"] == "refuted" and power.loc["far", "enough"]
    near = power.loc["near"]
    assert near["verdict_holm"] == "inconclusive" and not near["enough"]
    assert near["seed_sd"] == pytest.approx(np.std(table["near"] - ref, ddof=1))
    assert min_detectable_effect(near["seed_sd"], near["seeds_needed"]) <= 1.5
    assert min_detectable_effect(near["seed_sd"], near["seeds_needed"] - 1) > 1.5
    assert power.loc["tight", "enough"] and power.loc["tight", "min_detectable_effect"] <= 1.5


def test_the_power_section_of_docs_is_what_the_script_computes_from_the_committed_studies():
    """docs/studies/power.md: the script's output on the committed folder it names, word for word."""
    docs = (REPO_ROOT / "docs" / "studies" / "power.md").read_text()
    folder = re.search(r"`python scripts/study_power.py (results/studies/[\w-]+)`", docs).group(1)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "study_power.py"), folder],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() in docs


def test_the_second_draw_is_the_workflows_evaluation_but_for_the_sampling_seed(tmp_path):
    """scripts/eval_noise.py evaluates a final model again with `d3s eval`: every setting of the workflow
    evaluation's manifest, parsed back by d3s's own parser, with only the seed changed; its table sizes the
    seeds at each samples multiplier from the split."""
    from d3s.cli import build_parser

    script = runpy.run_path(str(REPO_ROOT / "scripts" / "eval_noise.py"))
    generation = {"samples": 8, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 64, "seed": 0}
    bench = {"template": "raw", "generation": generation, "backend": "transformers", "n_problems": 200}
    bench |= {"scoring": {"ks": [1, 4, 8]}, "batch_size": 50}
    manifest = {"config": {"benchmark_names": ["synthetic"], "benchmarks": {"synthetic": bench}}}
    command = script["eval_command"](manifest, tmp_path / "final", tmp_path / "again", 1)
    assert command[1:4] == ["-m", "d3s.cli", "eval"]
    args = build_parser().parse_args(command[3:])
    assert (args.samples, args.temperature, args.top_p, args.max_tokens) == (8, 0.6, 0.95, 64)
    assert (args.template, args.backend, args.batch_size, args.seed) == ("raw", "transformers", 50, 1)
    assert args.k == [1, 4, 8] and args.synthetic == {"count": 200} and args.benchmarks == "synthetic"
    draws = pd.DataFrame(
        [{"method": m, "seed": s, "first": 50 + s + (m == "a"), "second": 50 + s + 3 * (m == "a") * (s % 2)}
         for m in ("ref", "a") for s in range(5)]
    )  # fmt: skip
    table = script["noise_table"](draws, "ref", 60.0, 10.0, 1.5).iloc[0]
    assert table["method"] == "a" and table["seeds_x4"] <= table["seeds_x2"] <= table["seeds_x1"]
    assert table["cpu_minutes_x1"] == pytest.approx(table["seeds_x1"] * 2 * (60 + 10) / 60)


@pytest.mark.parametrize("part", ["default", "generalization-ood"])
def test_the_committed_noise_split_is_what_its_draws_give_and_what_the_docs_show(part):
    """results/studies/noise-2026-12-07/<part>: noise.csv recomputed from draws.csv and the measured times
    (scripts/eval_noise.py's noise_table), and its table in docs/studies/power.md as the README states it."""
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "eval_noise.py"))
    folder = REPO_ROOT / "results" / "studies" / "noise-2026-12-07" / part
    times = json.loads((folder / "noise_times.json").read_text())
    draws = pd.read_csv(folder / "draws.csv")
    table = script["noise_table"](draws, "grpo", times["train_seconds"], times["eval_seconds"], 1.5)
    committed = pd.read_csv(folder / "noise.csv")
    pd.testing.assert_frame_equal(table.reset_index(drop=True), committed, check_dtype=False)
    readme = (folder / "README.md").read_text()
    assert readme[readme.index("| comparison") :].strip() in (REPO_ROOT / "docs/studies/power.md").read_text()


def _calibration_study(tmp_path: Path, key: str, logged: dict, calibration: dict) -> tuple[Study, dict]:
    """A study of d3s on the default and the weak base with ``calibration``, and a results folder whose runs
    (name, seed) logged ``key`` at each step as ``logged`` says."""
    for (name, seed), values in logged.items():
        folder = tmp_path / "runs" / name / f"seed{seed}"
        folder.mkdir(parents=True)
        lines = [f'{{"step": {s + 1}, "loss": 0.0, "{key}": {v}}}' for s, v in enumerate(values)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    variants = {"d3s": Variant("d3s", "d3s"), "weak_d3s": Variant("weak_d3s", "d3s", base="weak")}
    claim = {"kind": "versus", "measure": "kl", "runs": ["weak_d3s"], "reference": "d3s", "statement": "s"}
    study = {"name": "t", "title": "t", "question": "q", "runs": ["d3s", "weak_d3s"], "claims": [claim]}
    calibration = {"runs": ["d3s", "weak_d3s"]} | calibration
    parsed = parse_study({"seeds": [0], "study": study | {"calibration": calibration}}, variants)
    assert parsed is not None
    return parsed, variants


def test_the_calibration_rule_picks_the_smallest_threshold_above_the_aligned_models_spikes(tmp_path):
    runs = {
        ("d3s", 5): [1, 1, 1, 1.5, 1, 2.2],
        ("d3s", 6): [1, 1, 1, 1, 1.4],
        ("weak_d3s", 5): [1, 1, 1, 9, 1],
    }
    calibration = {"seeds": [5, 6], "thresholds": [1.5, 2.0, 3.0, 4.0]}
    study, variants = _calibration_study(tmp_path, "grad_norm", runs, calibration)
    table = calibration_table(tmp_path, study, variants)
    aligned = table[table["base"] == "default"]["max_spike_ratio"]
    assert aligned.max() == pytest.approx(2.2)  # seed 5: 2.2 over the median 1 of the five steps before it
    assert chosen_threshold(table, study.calibration.thresholds) == 3.0
    weak = table[table["run"] == "weak_d3s"].iloc[0]
    assert weak["switches_above_3"] and not table[table["run"] == "d3s"]["switches_above_3"].any()


def test_the_early_reward_calibration_picks_the_candidate_halfway_between_the_bases(tmp_path):
    runs = {
        ("d3s", 100): [0.375, 0.375, 0.375, 0.1],  # early reward 0.375 (the first 3 steps)
        ("d3s", 101): [0.5, 0.5, 0.5],  # 0.5
        ("weak_d3s", 100): [0.125, 0.125, 0.125, 0.9],  # 0.125
        ("weak_d3s", 101): [0.0625, 0.125, 0.1875],  # 0.125
    }
    thresholds = [0.125, 0.2, 0.25, 0.3, 0.375]
    calibration = {"seeds": [100, 101], "thresholds": thresholds, "signal": "early_reward"}
    study, variants = _calibration_study(tmp_path, "reward", runs, calibration)
    table = calibration_table(tmp_path, study, variants)
    assert table["early_reward"].tolist() == [0.375, 0.5, 0.125, 0.125]
    assert chosen_threshold(table, thresholds, "early_reward") == 0.25  # halfway between 0.125 and 0.375
    assert table["switches_below_0.25"].tolist() == [False, False, True, True]
    assert not table["switches_below_0.125"].any()  # 0.125 is not below 0.125
    overlap = table.assign(early_reward=[0.375, 0.5, 0.4, 0.125])
    assert math.isnan(chosen_threshold(overlap, thresholds, "early_reward"))  # no candidate separates them


def test_a_fraction_is_drawn_on_its_whole_range():
    """A run at the bottom of a fraction (the weak base's 3 cross-group steps of 20) is drawn whole, not on
    the axis's edge."""
    variants = {"d3s": Variant("d3s", "d3s"), "weak_d3s": Variant("weak_d3s", "d3s", base="weak")}
    claim = {
        "kind": "versus",
        "measure": "pass_at_1",
        "runs": ["weak_d3s"],
        "reference": "d3s",
        "statement": "s",
    }
    study = {"name": "t", "title": "t", "question": "q", "runs": ["d3s", "weak_d3s"], "claims": [claim]}
    figure = {"measures": ["pass_at_1", "cross_group_fraction"]}
    parsed = parse_study({"seeds": [0, 1], "study": study | {"figure": figure}}, variants)
    rows = [
        {"run": run, "seed": seed, "measure": measure, "value": value}
        for run, fraction in (("d3s", 1.0), ("weak_d3s", 0.15))
        for seed in (0, 1)
        for measure, value in (("pass_at_1", 50.0 + seed), ("cross_group_fraction", fraction))
    ]
    fig = study_figure(pd.DataFrame(rows), parsed, variants)
    points, fraction = fig.axes
    assert fraction.get_ylim() == (-0.05, 1.05)
    assert points.get_ylim()[0] > 40  # other units keep matplotlib's own limits
    fig.clf()


def test_runs_side_by_side_are_drawn_whole_when_only_the_last_has_the_measure():
    """The adaptive study's third panel: only the adaptive runs have the switch's fraction, and the groups are
    drawn side by side around each run's slot; every slot is on the axis, so no group's point is cut."""
    names = ("d3s", "adaptive", "weak_d3s", "weak_adaptive")
    variants = {
        name: Variant(name, "d3s", base="weak" if name.startswith("weak") else None) for name in names
    }
    claim = {
        "kind": "versus",
        "measure": "pass_at_1",
        "runs": ["adaptive"],
        "reference": "d3s",
        "statement": "s",
    }
    figure = {
        "measures": ["cross_group_fraction"],
        "groups": {"default base": ["d3s", "adaptive"], "weak base": ["weak_d3s", "weak_adaptive"]},
    }
    study = {"name": "t", "title": "t", "question": "q", "runs": list(names), "claims": [claim]}
    parsed = parse_study({"seeds": [0, 1], "study": study | {"figure": figure}}, variants)
    rows = [
        {"run": run, "seed": seed, "measure": "cross_group_fraction", "value": fraction}
        for run, fraction in (("adaptive", 1.0), ("weak_adaptive", 0.15))
        for seed in (0, 1)
    ]
    fig = study_figure(pd.DataFrame(rows), parsed, variants)
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    drawn = [x for collection in ax.collections for x, _ in collection.get_offsets()]
    assert (low, high) == (-0.5, 1.5) and drawn and all(low < x < high for x in drawn)
    fig.clf()


# ---- controls (docs/studies.md, "Controls") ----------------------------------------------------------------


_GRPO_CONTROL = {
    "kind": "versus",
    "measure": "ood_pass_at_1",
    "runs": ["grpo"],
    "reference": "base",
    "at_least": 2.0,
    "statement": "s",
}


@pytest.mark.parametrize(
    ("control", "message"),
    [
        (
            _GRPO_CONTROL | {"kind": "ratio"},
            r"study.controls\[0\].kind: 'ratio' is not one of \['versus', 'slope', 'interaction', 'fires'\]",
        ),
        (_GRPO_CONTROL | {"runs": ["nope"]}, r"study.controls\[0\].runs: unknown run\(s\) \['nope'\]"),
        (
            _GRPO_CONTROL | {"measure": "pass_at_2"},
            r"study.controls\[0\].measure: unknown measure 'pass_at_2'",
        ),
        (_GRPO_CONTROL | {"measure": "kl"}, r"study.controls\[0\].measure: a base model has only pass_at_1"),
        (_GRPO_CONTROL | {"reference": "pods", "at_most": 1}, r"study.controls\[0\].at_most: only a fires"),
        (
            _GRPO_CONTROL | {"at_least": -1.0},
            r"study.controls\[0\].at_least: -1.0 is less than the minimum of 0",
        ),
        ({k: v for k, v in _GRPO_CONTROL.items() if k != "reference"}, "a versus control needs a reference"),
        (
            {"kind": "fires", "runs": ["grpo"], "at_least": 1, "statement": "s"},
            r"study.controls\[0\].runs: \['grpo'\] run no adaptive switch",
        ),
        (
            {"kind": "fires", "runs": ["grpo"], "statement": "s"},
            r"study.controls\[0\]: a fires control needs exactly one of at_least",
        ),
    ],
)
def test_a_bad_control_ends_in_one_line_naming_the_key(control, message):
    """The schema refuses a wrong type, parse_study the rest; one line either way."""
    from snakemake.utils import update_config

    config = _study_config("generalization")
    update_config(config, {"study": {"controls": [control]}})
    with pytest.raises(ValueError, match=message) as error:
        check_workflow_config(config, ACCELERATE_DIR, SCHEMA)
        parse_study(config, run_variants(config))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("control", "message"),
    [
        (
            {
                "kind": "versus",
                "measure": "pass_at_1",
                "runs": ["other"],
                "reference": "base",
                "statement": "s",
            },
            r"study.controls\[0\].runs: \['other'\] not among study.runs; add them there",
        ),
        (
            {
                "kind": "versus",
                "measure": "ood_pass_at_1",
                "runs": ["a"],
                "reference": "base",
                "statement": "s",
            },
            "measure ood_pass_at_1 needs a study.ood evaluation",
        ),
        (
            {"kind": "fires", "runs": ["adaptive"], "at_least": 1, "at_most": 0, "statement": "s"},
            "needs exactly one of at_least",
        ),
        (
            {"kind": "fires", "runs": ["adaptive"], "at_least": 0.5, "statement": "s"},
            r"study.controls\[0\].at_least: a count of runs x seeds, 1 or more",
        ),
        (
            {"kind": "fires", "runs": ["adaptive"], "at_most": 0, "direction": -1, "statement": "s"},
            r"study.controls\[0\].direction: a fires control reads cross_group_fraction",
        ),
        (
            {
                "kind": "slope",
                "measure": "pass_at_1",
                "runs": ["a", "adaptive"],
                "reference": "a",
                "statement": "s",
            },
            r"study.controls\[0\].reference: only a versus control has a reference",
        ),
    ],
)
def test_parse_study_refuses_a_control_it_cannot_honour(control, message):
    variants = {name: Variant(name, "grpo") for name in ("a", "other")}
    variants["adaptive"] = Variant("adaptive", "d3s_adaptive")
    claim = {
        "kind": "versus",
        "measure": "pass_at_1",
        "runs": ["a"],
        "reference": "adaptive",
        "statement": "s",
    }
    study = {"name": "t", "title": "t", "question": "q", "runs": ["a", "adaptive"], "claims": [claim]}
    config = {"seeds": [0, 1], "study": study | {"controls": [control]}}
    with pytest.raises(ValueError, match=message):
        parse_study(config, variants)


def test_every_shipped_study_declares_controls_on_its_own_runs():
    for name in STUDIES:
        config = _study_config(name)
        study = parse_study(config, run_variants(config))
        assert study.controls, name
        assert all(set(control.runs) <= set(study.runs) for control in study.controls), name
    adaptive = parse_study(_study_config("adaptive"), run_variants(_study_config("adaptive")))
    assert {(c.kind, c.runs, c.at_least, c.at_most) for c in adaptive.controls} == {
        ("fires", ("weak_d3s_adaptive",), 1, None),
        ("fires", ("d3s_adaptive",), None, 0),
    }


def _control_study(tmp_path: Path, weak_gain: float, fired_weak: list[float], fired_default: list[float]):
    """A synthetic study folder as render_study writes it: a claim that is supported, a GRPO run on the weak
    base that gains ``weak_gain`` over its base model (12 points), and the adaptive runs' cross-group
    fractions."""
    rng = np.random.default_rng(11)
    variants = {
        "a": {"method": "d3s"},
        "b": {"method": "d3s_i"},
        "weak_grpo": {"method": "grpo", "base": "weak"},
        "weak_adaptive": {"method": "d3s_adaptive", "base": "weak"},
        "adaptive": {"method": "d3s_adaptive"},
    }
    study = {
        "name": "synthetic",
        "title": "A synthetic study",
        "question": "q",
        "runs": list(variants),
        "claims": [
            {
                "kind": "versus",
                "measure": "pass_at_1",
                "runs": ["a"],
                "reference": "b",
                "statement": "a beats b",
            }
        ],
        "controls": [
            {
                "kind": "versus",
                "measure": "pass_at_1",
                "runs": ["weak_grpo"],
                "reference": "base",
                "at_least": 5.0,
                "statement": "the weak base learns",
            },  # fmt: skip
            {
                "kind": "fires",
                "runs": ["weak_adaptive"],
                "at_least": 1,
                "statement": "fires on the weak base",
            },
            {"kind": "fires", "runs": ["adaptive"], "at_most": 0, "statement": "never on the default base"},
        ],
    }
    config = _study_config("alignment") | {"methods": [], "variants": variants, "study": study}
    config |= {"analysis": {"reference": "a"}, "seeds": [0, 1, 2, 3, 4]}  # 5 seeds, whatever the study file's
    seeds = [int(s) for s in config["seeds"]]
    table = {
        ("a", "pass_at_1"): 60 + rng.normal(0, 0.3, 5),
        ("b", "pass_at_1"): 50 + rng.normal(0, 0.3, 5),
        ("weak_grpo", "pass_at_1"): 12 + weak_gain + rng.normal(0, 0.3, 5),
        ("weak_adaptive", "cross_group_fraction"): fired_weak,
        ("adaptive", "cross_group_fraction"): fired_default,
        ("base", "pass_at_1"): [50.0] * 5,
        ("base:weak", "pass_at_1"): [12.0] * 5,
    }
    rows = [
        {"run": run, "seed": seed, "measure": measure, "value": float(value)}
        for (run, measure), values in table.items()
        for seed, value in zip(seeds, values, strict=True)
    ]
    out = tmp_path / "studies" / "synthetic"
    render_study(out, config, pd.DataFrame(rows))
    return out


def test_a_failed_control_makes_the_study_uninformative_naming_it(tmp_path):
    folder = _control_study(tmp_path, weak_gain=1.0, fired_weak=[1.0] * 5, fired_default=[1.0] * 5)
    result = read_study(folder)
    assert not result.informative
    assert result.verdicts()["supported"] == 1  # the claim is still computed, and shown
    failed = result.controls[~result.controls["supported"]]
    assert list(failed["statement"]) == ["the weak base learns", "fires on the weak base"]
    weak = failed.iloc[0]
    assert weak["against"] == "base:weak" and weak["estimate"] == pytest.approx(1.0, abs=0.5)
    report = (folder / "report.md").read_text()
    head = report.split("**The question")[0]
    assert "**UNINFORMATIVE.**" in head and "'the weak base learns': weak_grpo against base:weak" in head
    assert f"{weak['estimate']:.2f} [{weak['ci_low']:.2f}, {weak['ci_high']:.2f}] points" in head
    assert "the switch fired on 0 runs x seeds (of 5) of weak_adaptive" in head
    assert "**Verdicts, NOT COUNTING" in report and "After Holm, not counting: 1 supported" in report
    assert "**Verdicts** (" not in report
    index = index_markdown(folder.parent)
    assert "**uninformative**: 'the weak base learns'" in index
    assert "not counted (1 supported, 0 refuted, 0 inconclusive)" in index


def test_when_every_control_is_supported_they_come_first_and_the_verdicts_count(tmp_path):
    folder = _control_study(
        tmp_path, weak_gain=10.0, fired_weak=[1.0, 0.4, 1.0, 1.0, 0.7], fired_default=[1.0] * 5
    )
    result = read_study(folder)
    assert result.informative and result.controls["supported"].all()
    report = (folder / "report.md").read_text()
    assert "UNINFORMATIVE" not in report and "NOT COUNTING" not in report
    assert (
        report.index("**Controls**") < report.index("**Verdicts** (") < report.index("| pass_at_1_versus |")
    )
    assert "**Controls: 4 of 4 supported**" not in report  # three controls, one row each
    assert "**Controls: 3 of 3 supported**, so the verdicts below count." in report
    fires = result.controls[result.controls["kind"] == "fires"].set_index("run")
    assert fires.loc["weak_adaptive", "estimate"] == 2 and fires.loc["adaptive", "estimate"] == 0
    index = index_markdown(folder.parent)
    assert "3 of 3 supported" in index and "| 1 supported, 0 refuted, 0 inconclusive |" in index


def test_a_control_at_its_threshold_or_without_data_is_not_supported(tmp_path):
    """The interval must clear at_least, not the estimate; a run that never ran supports nothing; a switch
    that fired on the default base fails the at_most control."""
    folder = _control_study(
        tmp_path, weak_gain=5.0, fired_weak=[0.5] * 5, fired_default=[1.0, 1.0, 0.9, 1.0, 1.0]
    )
    controls = read_study(folder).controls.set_index("statement")
    assert (
        controls.loc["the weak base learns", "ci_low"] < 5.0 < controls.loc["the weak base learns", "ci_high"]
    )
    assert not controls.loc["the weak base learns", "supported"]
    assert controls.loc["fires on the weak base", "supported"]
    assert not controls.loc["never on the default base", "supported"]
    variants = {name: Variant(name, "d3s_adaptive") for name in ("x", "y")}
    claim = {"kind": "versus", "measure": "pass_at_1", "runs": ["x"], "reference": "y", "statement": "s"}
    control = {"kind": "fires", "runs": ["y"], "at_most": 0, "statement": "s"}
    study = {"name": "t", "title": "t", "question": "q", "runs": ["x", "y"], "claims": [claim]}
    study = parse_study({"seeds": [0, 1, 2, 3, 4], "study": study | {"controls": [control]}}, variants)
    values = _values({"y": [1.0, 1.0, np.nan, 1.0, 1.0]}, "cross_group_fraction")
    row = control_rows(values, study, variants).iloc[0]  # seed 2 has no data: it may have fired
    assert (row["estimate"], row["ci_low"], row["ci_high"]) == (0, 0, 1) and not row["supported"]


def test_a_folder_calibrated_otherwise_is_not_rendered_again(tmp_path):
    """A study folder whose calibration (runs, signal, seeds) is not the study file's was made by other
    runs: the script refuses it instead of reading its calibration.csv under the new rule."""
    rerender = runpy.run_path(str(REPO_ROOT / "scripts" / "rerender_studies.py"))["rerender"]
    folder = tmp_path / "source" / "adaptive"
    shutil.copytree(REPO_ROOT / "results" / "studies" / "2026-12-08-seeds" / "adaptive", folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["study"]["calibration"]["seeds"] = [70, 71]
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(
        SystemExit, match=r"adaptive: the study file's calibration \(study.calibration\) differs"
    ):
        rerender(tmp_path / "source", tmp_path / "dest")


def test_the_committed_studies_are_what_the_script_renders_from_the_runs_before_them(tmp_path):
    """scripts/rerender_studies.py, as each committed folder was made, under the study files as they are now.
    2026-11-28 rendered with the controls of 2026-11-29's study files left alignment (weak_grpo never ran) and
    adaptive (the switch never fired) uninformative; since 2026-12-07 their weak base is another (study file's
    ``bases``), since 2026-12-07-power the schedule has 24 seeds, since 2026-12-07-power30 token level and
    sample level have 30, since 2026-12-08-generalization generalization holds out values (another task and
    results tree) and since 2026-12-08-seeds alignment and adaptive have 16 seeds and generalization 46, so an
    older folder is refused for those studies, naming the change, and a study run again under an older study
    file is refused as fresh. 2026-12-07 is 2026-11-29 with alignment and adaptive run again on the new weak
    base (alignment's control, the weak base learns, supported; adaptive's, the switch fires on the weak
    base, not), 2026-12-07-power is 2026-12-07 with the schedule run again at 24 seeds, 2026-12-07-power30
    is 2026-12-07-power with the three others run again at 30, 2026-12-07-switch is 2026-12-07-power30 with
    adaptive run again on its new switch (early_reward, calibrated on seeds 100-103),
    2026-12-08-generalization is 2026-12-07-switch with generalization run again on its new axis, and
    2026-12-08-seeds is 2026-12-08-generalization with alignment, adaptive and generalization run again with
    more seeds on one machine. Each step renders what the study files as they are now still render: the
    studies they left as they were. What is committed is what the script writes."""
    rerender = runpy.run_path(str(REPO_ROOT / "scripts" / "rerender_studies.py"))["rerender"]
    studies = REPO_ROOT / "results" / "studies"
    more_seeds = ("alignment", "adaptive", "generalization")  # run again in 2026-12-08-seeds

    def without(name: str, *left_out: str) -> Path:  # a committed folder less studies run again since
        copy = tmp_path / "source" / name
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(studies / name, copy, ignore=shutil.ignore_patterns(*left_out))
        return copy

    def only(name: str, study: str) -> Path:  # one study of a committed folder
        copy = tmp_path / "one" / name / study / study
        shutil.copytree(studies / name / study, copy, dirs_exist_ok=True)
        return copy.parent

    for name, study, changed in (
        ("2026-12-07-power", "token_level", ["seeds"]),
        ("2026-11-28", "schedule", ["seeds"]),
        ("2026-11-28", "alignment", ["bases", "seeds"]),
        ("2026-12-08-generalization", "alignment", ["seeds"]),
        ("2026-12-08-generalization", "adaptive", ["seeds"]),
        ("2026-12-07-switch", "generalization", ["experiment", "base_model", "task", "seeds"]),
        ("2026-12-08-generalization", "generalization", ["seeds"]),
    ):
        with pytest.raises(
            SystemExit,
            match=rf"{study}: the study file's testbed differs from the folder's in "
            + re.escape(str(changed)),
        ):
            rerender(only(name, study), tmp_path / "refused" / name / study)
    with pytest.raises(SystemExit, match=r"adaptive: .*2026-12-07-switch.* was not written by the current"):
        fresh = {"adaptive": studies / "2026-12-07-switch" / "adaptive"}
        rerender(only("2026-12-08-generalization", "adaptive"), tmp_path / "refused_fresh", fresh)

    def informative(root: Path) -> dict[str, bool]:
        return {folder.name: read_study(folder).informative for folder in study_folders(root)}

    assert informative(studies / "2026-11-29") == {
        "token_level": True,
        "sample_level": True,
        "schedule": True,
        "alignment": False,
        "adaptive": False,
        "generalization": True,
    }
    assert {name: informative(studies / "2026-12-07")[name] for name in ("alignment", "adaptive")} == {
        "alignment": True,
        "adaptive": False,
    }
    power = {"schedule": studies / "2026-12-07-power" / "schedule"}
    rerender(without("2026-12-07", "token_level", "sample_level", *more_seeds), tmp_path / "power", power)
    assert read_study(tmp_path / "power" / "schedule").informative
    power30 = {name: studies / "2026-12-07-power30" / name for name in ("token_level", "sample_level")}
    rerender(without("2026-12-07-power", *more_seeds), tmp_path / "power30", power30)
    rerender(without("2026-12-07-power30", *more_seeds), tmp_path / "switch")
    rerender(without("2026-12-07-switch", *more_seeds), tmp_path / "values")
    fresh = {name: studies / "2026-12-08-seeds" / name for name in more_seeds}
    notes = rerender(studies / "2026-12-08-generalization", tmp_path / "seeds", fresh)
    for name, folder in fresh.items():
        assert f"{name}: run again ({folder}), not rendered from" in "\n".join(notes)
    assert all(informative(tmp_path / "seeds").values()) and len(study_folders(tmp_path / "seeds")) == 6
    for made, committed_root in (
        (tmp_path / "power", "2026-12-07-power"),
        (tmp_path / "power30", "2026-12-07-power30"),
        (tmp_path / "switch", "2026-12-07-switch"),
        (tmp_path / "values", "2026-12-08-generalization"),
        (tmp_path / "seeds", "2026-12-08-seeds"),
    ):
        for folder in study_folders(made):  # what is committed is what the script writes
            committed = studies / committed_root / folder.name
            # to the last printed digit; the CSV's full floats to 1e-9 (a least-squares slope's last bits
            # differ between CPUs' float kernels)
            pd.testing.assert_frame_equal(
                pd.read_csv(folder / "claims.csv"), pd.read_csv(committed / "claims.csv"), rtol=1e-9
            )
            assert (folder / "report.md").read_text() == (committed / "report.md").read_text(), folder


# ---- every study, for real, on a tiny testbed --------------------------------------------------------------


@pytest.fixture(scope="module")
def study_smokes(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    """Every study run by `snakemake --configfile config/studies/<name>.yaml
    config/studies/smoke/overlay.yaml` in one copy of the workflow (results/studies-smoke/, the runs shared
    between studies built once)."""
    work = copy_workflow(tmp_path_factory.mktemp("studies"))
    times = {}
    for name in STUDIES:
        start = time.perf_counter()
        args = [
            "--cores",
            "2",
            "--configfile",
            f"config/studies/{name}.yaml",
            "config/studies/smoke/overlay.yaml",
        ]
        if name == "adaptive":  # one calibration seed runs the calibration's code
            args += ["--config", "study={calibration: {seeds: [5]}}"]
        done = subprocess.run(SNAKEMAKE + args, cwd=work, capture_output=True, text=True, timeout=900)
        out = done.stdout + done.stderr
        assert done.returncode == 0, (name, out[-3000:] + failed_job_logs(out, work))
        times[name] = time.perf_counter() - start
    return work, times


@pytest.mark.slow
def test_every_study_runs_to_a_report_with_its_claims(study_smokes):
    work, times = study_smokes
    root = work / "results" / "studies-smoke" / "studies"
    assert [p.name for p in study_folders(root)] == list(STUDIES)
    for folder in study_folders(root):
        result = read_study(folder)
        expected = sum(
            len([r for r in c.runs if r != c.reference]) if c.kind == "versus" else 1
            for c in result.study.claims
        )
        assert len(result.claims) == expected, folder.name
        assert set(result.claims["verdict"]) <= {"supported", "refuted", "inconclusive"}
        passes = result.claims[result.claims["claim"].str.startswith("pass_at_1")]
        assert passes["estimate"].notna().all(), (
            folder.name,
            result.claims,
        )  # others may lack data at 1 seed
        report = (folder / "report.md").read_text()
        assert result.study.title in report and "figure.png" in report
        assert (folder / "figure.png").stat().st_size > 1000 and (folder / "figure.pdf").is_file()
    adaptive = read_study(root / "adaptive")
    assert (root / "adaptive" / "calibration.csv").is_file() and "**Calibration**" in (
        root / "adaptive" / "report.md"
    ).read_text()
    switched = adaptive.values[adaptive.values["measure"] == "cross_group_fraction"].dropna()
    assert len(switched) == 2 and switched["value"].between(0, 1).all()
    ood = read_study(root / "generalization").values
    assert ood[ood["measure"] == "ood_pass_at_1"]["value"].notna().all()
    # the weak base model of the alignment study was built once and shared with the adaptive study
    assert len(list((work / "results" / "studies-smoke" / "base_models").glob("*/config.json"))) == 1
    print({name: round(seconds) for name, seconds in times.items()}, round(sum(times.values())), "s")


@pytest.mark.slow
def test_the_studies_notebook_shows_every_figure_and_verdict_in_a_real_kernel(study_smokes, monkeypatch):
    """notebooks/studies.ipynb on the smokes' results (a fresh run) and on the committed ones."""
    from nbclient import NotebookClient
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    async def execute(roots: list[Path]) -> list:
        clients = [
            NotebookClient(
                parameterize_notebook(load_notebook_node(str(notebook)), {"studies_dir": str(root)}),
                kernel_name="python3",
                timeout=600,
            )
            for root in roots
        ]
        await asyncio.gather(*(client.async_execute() for client in clients))
        return [client.nb for client in clients]

    work, _ = study_smokes
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = REPO_ROOT / "notebooks" / "studies.ipynb"
    committed = sorted((REPO_ROOT / "results" / "studies").glob("20*"))
    roots = [work / "results" / "studies-smoke" / "studies", *committed[-1:]]
    executed = asyncio.run(execute(roots))
    for root, nb in zip(roots, executed, strict=True):
        outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
        assert not [o for o in outputs if o.output_type == "error"]
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(images) == len(study_folders(root)) == 6, root
        text = " ".join(str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
        for folder in study_folders(root):  # every study's title and each of its verdict rows
            result = read_study(folder)
            assert result.study.title in text
            assert text.count(f"| {result.claims['claim'].iloc[0]} |") >= 1
