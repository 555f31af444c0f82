"""The studies (docs/studies.md): the schedule's shapes and the adaptive switch against brute force,
variants and study sections and their one-line refusals, every shipped study config checked as the workflow
checks it, the claims' arithmetic against scipy, and (slow) every study run for real, to its report, on a
tiny testbed."""

from __future__ import annotations

import asyncio
import math
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import ACCELERATE_DIR, REPO_ROOT, SCHEMA, SNAKEMAKE, copy_workflow
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from d3s.analysis.studies import (
    calibration_table,
    chosen_threshold,
    claim_rows,
    read_study,
    slope_per_seed,
    study_folders,
)
from d3s.methods import ADAPTIVE_SWITCH_THRESHOLD, METHODS
from d3s.orchestration.workflow_config import check_workflow_config
from d3s.selection import SCHEDULES, Schedule, ScopeSwitch, spike_ratios
from d3s.studies import MEASURES, parse_study
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


def test_the_adaptive_method_is_d3s_with_the_switch():
    adaptive, d3s = METHODS["d3s_adaptive"], METHODS["d3s"]
    assert adaptive.scope_switch_threshold == ADAPTIVE_SWITCH_THRESHOLD > 1
    same = ("sample_rule", "sample_scope", "token_rule", "schedule", "keep_per_prompt_fraction_init")
    assert all(getattr(adaptive, name) == getattr(d3s, name) for name in same)
    config = D3SConfig.for_method("d3s_adaptive", output_dir="/tmp/unused", **_TINY_BATCH)
    assert config.scope_switch() == ScopeSwitch(ADAPTIVE_SWITCH_THRESHOLD)
    assert D3SConfig.for_method("d3s", output_dir="/tmp/unused", **_TINY_BATCH).scope_switch() is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sample_scope": "group"}, "needs a sample_rule and sample_scope batch"),
        ({"logging_steps": 2}, "needs logging_steps=1"),
        ({"scope_switch_threshold": 0.5}, "scope_switch_threshold must be 0 .off. or > 1"),
    ],
)
def test_the_switch_refuses_settings_it_cannot_honour(overrides, message):
    with pytest.raises(ValueError, match=message):
        D3SConfig.for_method("d3s_adaptive", output_dir="/tmp/unused", **_TINY_BATCH | overrides)


def test_the_trainer_reads_the_switch_from_the_logged_gradient_norms():
    """D3STrainer._sample_scope on a stand-in trainer: cross-group (logged 1) while no step spiked,
    intra-group (logged 0) from the step after a spike on."""
    config = D3SConfig.for_method("d3s_adaptive", output_dir="/tmp/unused", **_TINY_BATCH)
    history = [{"grad_norm": 1.0, "step": s} for s in range(1, 5)]
    trainer = SimpleNamespace(args=config, state=SimpleNamespace(log_history=history), _metrics={"train": {}})
    trainer._metrics["train"]["selection/cross_group"] = []
    assert D3STrainer._sample_scope(trainer) == "batch"
    history.append({"grad_norm": 10 * ADAPTIVE_SWITCH_THRESHOLD, "step": 5})
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
    runs it shares with the default (and with other studies) are the same jobs."""
    config = _study_config(name)
    default = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    check_workflow_config(default, ACCELERATE_DIR, SCHEMA)
    for key in ("experiment", "base_model", "task", "seeds", "train", "eval"):
        assert config[key] == default[key], key
    study = parse_study(config, run_variants(config))
    assert study is not None and study.name == name
    assert all(claim.measure in MEASURES for claim in study.claims)
    assert len(config["seeds"]) == 5


def test_studies_that_share_a_run_name_define_it_alike():
    """A run name is one run in results/<experiment>/runs/: every study that names it trains it the same."""
    seen: dict[str, tuple] = {}
    for name in STUDIES:
        config = _study_config(name)
        for run, variant in run_variants(config).items():
            definition = (variant.method, variant.trainer, base_model_settings(config, variant.base))
            assert seen.setdefault(run, definition) == definition, (name, run)


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
        ({"study": {"calibration": {"seeds": [0, 7], "runs": ["d3s"]}}}, r"study.calibration.seeds: \[0\]"),
        (
            {"variants": {"v": {"method": "d3s_i", "trainer": {"scope_switch_threshold": 2.0}}}},
            "variant v: variants.v.trainer.*needs a sample_rule and sample_scope batch",
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


def test_the_calibration_rule_picks_the_smallest_threshold_above_the_aligned_models_spikes(tmp_path):
    runs = {
        ("d3s", 5): [1, 1, 1, 1.5, 1, 2.2],
        ("d3s", 6): [1, 1, 1, 1, 1.4],
        ("weak_d3s", 5): [1, 1, 1, 9, 1],
    }
    for (name, seed), norms in runs.items():
        folder = tmp_path / "runs" / name / f"seed{seed}"
        folder.mkdir(parents=True)
        lines = [f'{{"step": {s + 1}, "loss": 0.0, "grad_norm": {g}}}' for s, g in enumerate(norms)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    variants = {"d3s": Variant("d3s", "d3s"), "weak_d3s": Variant("weak_d3s", "d3s", base="weak")}
    claim = {"kind": "versus", "measure": "kl", "runs": ["weak_d3s"], "reference": "d3s", "statement": "s"}
    calibration = {"seeds": [5, 6], "runs": ["d3s", "weak_d3s"], "thresholds": [1.5, 2.0, 3.0, 4.0]}
    study = {"name": "t", "title": "t", "question": "q", "runs": ["d3s", "weak_d3s"], "claims": [claim]}
    config = {"seeds": [0], "study": study | {"calibration": calibration}}
    study = parse_study(config, variants)
    table = calibration_table(tmp_path, study, variants)
    aligned = table[table["base"] == "default"]["max_spike_ratio"]
    assert aligned.max() == pytest.approx(2.2)  # seed 5: 2.2 over the median 1 of the five steps before it
    assert chosen_threshold(table, study.calibration.thresholds) == 3.0
    weak = table[table["run"] == "weak_d3s"].iloc[0]
    assert weak["switches_above_3"] and not table[table["run"] == "d3s"]["switches_above_3"].any()


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
        assert done.returncode == 0, (name, done.stdout[-3000:] + done.stderr[-3000:])
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
