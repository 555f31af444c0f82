"""d3s.analysis on a small logged-results tree written by the test (the layout of docs/workflow/stages.md)."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import REPO_ROOT
from scipy import stats

from d3s.analysis import claims, figures, io, tables
from d3s.analysis.report import write_claims, write_report
from d3s.provenance.settings_check import MixedSettingsError, load_provenance, write_provenance

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _summary(path: Path, p1: float, p4: float, correct: list[list[bool]] | None = None) -> None:
    """summary.json (Pass@1 ``p1``, Pass@4 ``p4``) and its samples: ``correct`` per problem and sample, or 50
    problems x 4 samples whose first round(200 p1) are correct (the same Pass@1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if correct is None:
        hits = round(200 * p1)
        correct = [[4 * problem + sample < hits for sample in range(4)] for problem in range(50)]
    bench = {"pass_at_k": {"1": p1, "4": p4},
             "ci": {"1": [p1 - 0.05, p1 + 0.05], "4": [p4 - 0.05, p4 + 0.05]},
             "n_problems": len(correct), "unparsable_gold": 0, "timeouts": 0}  # fmt: skip
    path.write_text(json.dumps({"benchmarks": {"synthetic": bench}, "average": {"1": p1, "4": p4}}))
    records = [
        {"problem_id": str(problem), "sample_index": sample, "correct": hit, "gold_parsed": True}
        for problem, hits in enumerate(correct)
        for sample, hit in enumerate(hits)
    ]
    (path.parent / "synthetic").mkdir(exist_ok=True)
    (path.parent / "synthetic" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _write_manifest(path.with_name("manifest.json"), _eval_manifest(str(path.parent)))


def _shared(seed: int) -> dict:
    """What d3s.provenance.manifest.build_manifest records besides the config (fixed values for the test)."""
    return {"seed": seed, "torch_threads": 1, "versions": {"torch": "2.13.0", "trl": "1.16.0"},
            "git": {"commit": COMMIT, "dirty": False}, "hardware": {"cpu": "test CPU", "gpu_count": 0},
            "started": "2026-01-01T00:00:00+00:00", "finished": "2026-01-01T00:01:00+00:00"}  # fmt: skip


def _train_manifest(method: str, seed: int, learning_rate: float = 3e-4) -> dict:
    trainer = {"method": method, "seed": seed, "learning_rate": learning_rate, "num_generations": 4,
               "max_steps": 4, "sample_rule": "none" if method == "grpo" else "max_variance"}  # fmt: skip
    config = {
        "method": method,
        "seed": seed,
        "resolved_trainer": trainer,
        "method_settings": {"name": method},
    }
    return {
        "config": config,
        "inputs": {"model_config": {"path": "base/config.json", "sha256": "ab" * 32}},
    } | _shared(seed)


def _eval_manifest(model_path: str, temperature: float = 0.6) -> dict:
    generation = {"samples": 4, "temperature": temperature, "top_p": 0.95, "max_new_tokens": 24, "seed": 0}
    config = {"model_path": model_path, "benchmark_names": ["synthetic"],
              "benchmarks": {"synthetic": {"generation": generation, "template": "raw",
                                           "problems_sha256": "cd" * 32}}}  # fmt: skip
    return {"kind": "evaluation", "config": config, "inputs": {}} | _shared(0)


def _write_manifest(path: Path, manifest: dict) -> None:
    path.write_text(json.dumps(manifest))


@pytest.fixture()
def results(tmp_path) -> Path:
    """grpo and d3s, 2 seeds, 4 steps each, checkpoints at step 2, a base evaluation, anatomy records."""
    for m_index, method in enumerate(("grpo", "d3s")):
        for seed in (0, 1):
            run = tmp_path / "runs" / method / f"seed{seed}"
            run.mkdir(parents=True)
            tokens = 800 if method == "grpo" else 80
            with open(run / "metrics.jsonl", "w") as fh:
                for step in range(1, 5):
                    row = {"step": step, "loss": 0.1, "grad_norm": 0.1 + 0.2 * m_index + 0.01 * seed,
                           "reward": 0.1 * step, "entropy": 0.5,
                           "step_time": 0.5 if method == "grpo" else 0.25,
                           "selection/update_tokens": tokens,
                           "selection/update_tokens_cumulative": tokens * step}  # fmt: skip
                    fh.write(json.dumps(row) + "\n")
                fh.write(json.dumps({"step": 4, "train_runtime": 2.0}) + "\n")  # the final summary line
            (run / "train_summary.json").write_text(
                json.dumps({"steps": 4, "train_seconds": 2.0, "threads": 1})
            )
            _write_manifest(run / "manifest.json", _train_manifest(method, seed))
            gain = 0.1 * m_index
            _summary(tmp_path / "eval" / method / f"seed{seed}" / "step2" / "summary.json", 0.2 + gain, 0.4)
            _summary(
                tmp_path / "eval" / method / f"seed{seed}" / "final" / "summary.json",
                0.3 + gain + 0.01 * seed,
                0.5,
            )
            anatomy = [
                {"kind": "samples", "step": 2, "keep_per_prompt": 2, "num_generations": 4,
                 "groups": [{"rewards": [1, 0, 0, 0], "advantages": [1.5, -0.5, -0.5, -0.5],
                             "kept": [True, True, False, False]}]},
                {"kind": "tokens", "step": 2, "token_keep_ratio": 0.5,
                 "examples": [{"tokens": [" 1", "+", "2", "<eos>"], "entropy": [0.1, 0.5, 0.9, 0.0],
                               "score": [0.1, 0.5, 0.9, 0.0], "selected": [False, True, True, False],
                               "advantage": 1.5}]},
            ]  # fmt: skip
            (run / "anatomy.jsonl").write_text("\n".join(json.dumps(r) for r in anatomy) + "\n")
    _summary(tmp_path / "eval" / "base" / "summary.json", 0.1, 0.3)
    return tmp_path


def test_load_metrics_adds_wall_clock_and_skips_summary_lines(results):
    metrics = io.load_metrics(results)
    assert len(metrics) == 2 * 2 * 4
    grpo = metrics[(metrics["method"] == "grpo") & (metrics["seed"] == 0)]
    assert grpo["wall_clock"].tolist() == [0.5, 1.0, 1.5, 2.0]
    assert grpo["update_tokens_cumulative"].iloc[-1] == 3200


def test_load_evals_has_base_at_step_zero_and_final_at_last_step(results):
    evals = io.load_evals(results)
    d3s = evals[(evals["method"] == "d3s") & (evals["seed"] == 0) & (evals["k"] == 1)]
    assert d3s["step"].tolist() == [0, 2, 4]
    assert d3s["final"].tolist() == [False, False, True]
    assert d3s["value"].tolist() == pytest.approx([0.1, 0.3, 0.4])


def test_curve_evals_rescore_the_final_and_base_models_on_the_checkpoints_problems(results):
    """The checkpoint of d3s seed 0 saw the first 2 problems; its final model (4 problems) and the base model
    (50) are rescored on them, at the checkpoints' k, by hand; load_evals keeps what summary.json says."""
    run = results / "eval" / "d3s" / "seed0"
    _summary(run / "step2" / "summary.json", 0.5, 1.0, correct=[[True, False, True, False]] * 2)
    final_correct = [[True, True, True, False]] + [[False] * 4] * 3
    _summary(run / "final" / "summary.json", 0.1875, 0.25, correct=final_correct)
    curve = io.load_curve_evals(results)
    d3s = curve[(curve["method"] == "d3s") & (curve["seed"] == 0)]
    # steps 0, 2, 4: the base model got its first 20 problems right; the final model 3 of 8 samples
    assert d3s[d3s["k"] == 1]["value"].tolist() == pytest.approx([1.0, 0.5, 3 / 8])
    # Pass@4 of 4 samples: a problem counts when any of its samples is correct
    assert d3s[d3s["k"] == 4]["value"].tolist() == pytest.approx([1.0, 1.0, 0.5])
    assert set(d3s["n_problems"]) == {2}
    assert "average" not in set(curve["benchmark"])
    evals = io.load_evals(results)
    final = evals[(evals["method"] == "d3s") & (evals["seed"] == 0) & evals["final"] & (evals["k"] == 1)]
    assert final["value"].tolist() == [0.1875]  # as summary.json says
    # the other runs' checkpoints saw all 50 problems: their curves keep the evaluations' own Pass@1
    other = curve[(curve["method"] == "grpo") & (curve["seed"] == 1) & (curve["k"] == 1)]
    assert other["value"].tolist() == pytest.approx([0.1, 0.2, 0.31])


def test_curve_evals_refuse_a_final_evaluation_without_the_checkpoints_problems(results):
    run = results / "eval" / "d3s" / "seed0"
    _summary(run / "final" / "summary.json", 0.25, 0.5, correct=[[True] * 4] * 10)  # 10 of the 50 problems
    with pytest.raises(ValueError, match="lacks 40 of the checkpoints' problems.*checkpoint_limit"):
        io.load_curve_evals(results)


def test_efficiency_table_takes_the_final_pass_at_1_from_the_final_evaluation(results):
    metrics = io.load_metrics(results)
    run = results / "eval" / "d3s" / "seed0"
    _summary(run / "step2" / "summary.json", 0.5, 0.5, correct=[[True, False, True, False]] * 2)
    curves = tables.learning_curves(io.load_curve_evals(results), metrics)
    finals = claims.per_seed_pass_at_k(io.load_evals(results), 1)
    assert finals.set_index(["method", "seed"]).loc[("d3s", 0), "value"] == pytest.approx(0.4)
    eff = tables.efficiency_table(curves, metrics, finals=finals).set_index("method")
    assert eff.loc["d3s", "final_pass1"] == pytest.approx(100 * (0.4 + 0.41) / 2)
    on_curves = tables.efficiency_table(curves, metrics).set_index("method")  # seed 0's first 2 problems: 1.0
    assert on_curves.loc["d3s", "final_pass1"] == pytest.approx(100 * (1.0 + 0.41) / 2)


def test_mean_ci_matches_t_interval():
    mean, half, n = tables.mean_ci([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(4.302653 * 1.0 / math.sqrt(3))  # t quantile 0.975 at 2 degrees of freedom
    assert math.isnan(tables.mean_ci([5.0])[1])


def test_pass_at_k_across_seeds_and_paper_layout(results):
    long = tables.pass_at_k_across_seeds(io.load_evals(results), ["grpo", "d3s"])
    row = long[(long["method"] == "d3s") & (long["k"] == 1) & (long["benchmark"] == "synthetic")]
    assert row["mean"].iloc[0] == pytest.approx(40.5)
    assert row["seeds"].iloc[0] == 2
    layout = tables.paper_layout(long, ks=(1, 4))
    assert list(layout.index) == ["grpo", "d3s"]
    assert layout.loc["d3s", "synthetic"].startswith("40.5 ± ")


def test_speedup_and_efficiency(results):
    metrics = io.load_metrics(results)
    curves = tables.learning_curves(io.load_evals(results), metrics)
    steps = tables.speedups(curves, "grpo", 0.99, "step")
    # grpo reaches 99 % of its best (0.305) only at step 4; d3s (0.3 at step 2 < 0.302) also at step 4.
    assert steps.to_dict() == {"d3s": pytest.approx(1.0), "grpo": pytest.approx(1.0)}
    eff = tables.efficiency_table(curves, metrics).set_index("method")
    assert eff.loc["d3s", "update_tokens_per_step"] == 80
    assert eff.loc["d3s", "speedup_time"] == pytest.approx(2.0)  # same step, half the seconds per step
    assert eff.loc["d3s", "speedup_tokens"] == pytest.approx(10.0)


def test_anatomy_var_after_selection(results):
    groups, token_records = io.load_anatomy(results)
    assert len(groups) == 4 and len(token_records) == 4
    # unbiased variances (TRL's convention): kept 1.5 and -0.5 give 2.0, the whole group 1.0
    assert groups["var_kept"].iloc[0] == pytest.approx(2.0)
    assert groups["var_all"].iloc[0] == pytest.approx(1.0)
    assert groups["var_ratio"].iloc[0] == pytest.approx(2.0)
    assert groups["n_kept"].iloc[0] == 2


def test_claims_csv_from_the_logged_files(results):
    """tables/claims.csv from the run logs and evaluation summaries (d3s.analysis.claims does the statistics;
    tests/test_claims.py checks them), with its provenance sidecar."""
    table = write_claims(results, REPO_ROOT / "results" / "paper", _report_config())
    written = pd.read_csv(results / "tables" / "claims.csv")
    assert written[["claim", "method", "reference", "verdict"]].equals(
        table[["claim", "method", "reference", "verdict"]]
    )
    assert written["estimate"].tolist() == pytest.approx(table["estimate"].tolist(), nan_ok=True)
    assert (results / "tables" / "claims.provenance.json").is_file()

    def row(claim: str, method: str) -> pd.Series:
        # the one row of a (claim, method): other claims repeat their pair (one row per k), so the index is
        # not unique and pandas 2's .loc would return a frame
        matched = table[(table["claim"] == claim) & (table["method"] == method)]
        assert len(matched) == 1, matched
        return matched.iloc[0]

    assert row("grad_norm", "d3s")["verdict"] == "supported"  # 0.3 + 0.01 seed vs 0.1 + 0.01 seed
    assert row("update_tokens", "d3s")["estimate"] == pytest.approx(0.1)  # 80 vs 800 tokens a step
    gain = row("gain_over_base", "grpo")  # final 0.30, 0.31 vs the base model's 0.10
    assert (gain["reference"], gain["estimate"], gain["seeds"]) == ("base", pytest.approx(20.5), 2)
    assert row("pass_at_1", "d3s")["estimate"] == pytest.approx(10.0)


def test_figures_write_png_and_pdf(results, tmp_path):
    metrics = io.load_metrics(results)
    groups, token_records = io.load_anatomy(results)
    curves = tables.learning_curves(io.load_evals(results), metrics)
    long = tables.pass_at_k_across_seeds(io.load_evals(results))
    made = [
        figures.training_dynamics(metrics, ["grpo", "d3s"], smooth=1),
        figures.learning_curve_figure(curves, ["grpo", "d3s"]),
        figures.pass_at_k_figure(long, ["grpo", "d3s"]),
        figures.var_after_figure(groups, ["grpo", "d3s"]),
        figures.token_selection_figure(figures.informative_token_examples(token_records)),
    ]
    for i, fig in enumerate(made):
        paths = figures.save(fig, tmp_path / "figs" / f"f{i}")
        assert all(p.stat().st_size > 1000 for p in paths)


def _token_record(method: str, step: int, examples: list[tuple[float, list[bool]]]) -> dict:
    return {
        "method": method,
        "seed": 0,
        "step": step,
        "token_keep_ratio": 0.5,
        "examples": [
            {
                "tokens": ["a", "b"],
                "entropy": [0.5, 0.2],
                "score": [abs(a) * 0.5, abs(a) * 0.2],
                "selected": kept,
            }
            | {"advantage": a}
            for a, kept in examples
        ],
    }


def test_the_token_figure_draws_rollouts_that_show_selection():
    """Issue 47: A = 0 scores every token 0 and shows nothing. The latest record with a selected token at both
    A > 0 and A < 0 is drawn, else the latest informative rollout; never an A = 0 rollout."""
    records = [
        _token_record("d3s", 0, [(0.0, [True, False]), (-1.2, [False, True]), (0.8, [True, False])]),
        _token_record("d3s", 5, [(0.9, [True, True]), (0.9, [False, False]), (0.0, [True, False])]),
        _token_record("d3s", 10, [(0.0, [True, False]), (0.0, [False, False])]),  # the latest: all A = 0
        _token_record("grpo", 15, [(1.0, [True, True]), (-1.0, [True, True])]),  # selects no token
    ]
    examples = figures.informative_token_examples(records)
    assert [(e["where"], e["advantage"]) for e in examples] == [
        ("d3s seed 0 step 0", 0.8),
        ("d3s seed 0 step 0", -1.2),
    ]
    assert all(e["advantage"] != 0 and any(e["selected"]) for e in examples)
    fig = figures.token_selection_figure(examples)
    assert len([ax for ax in fig.axes if ax.get_title()]) == 2
    # no record with both signs: the latest informative rollout, alone
    single = figures.informative_token_examples(records[1:3])
    assert [(e["where"], e["advantage"]) for e in single] == [("d3s seed 0 step 5", 0.9)]
    assert figures.informative_token_examples(records[2:]) == []
    with pytest.raises(ValueError, match="no example"):
        figures.token_selection_figure([])


def test_the_anatomy_log_writes_informative_rollouts_first():
    import torch

    from d3s.callbacks.logs import informative_rows

    advantages = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.0, -0.5, 0.3])
    any_kept = torch.tensor([True, True, True, False, True, True, True])
    assert informative_rows(advantages, any_kept, 4) == [1, 2, 6, 5]
    assert informative_rows(advantages, any_kept, 10) == [1, 2, 6, 5, 0, 3, 4]
    assert informative_rows(torch.zeros(3), torch.ones(3, dtype=torch.bool), 2) == [0, 1]


def test_the_update_token_axis_labels_zero_and_decades_apart():
    """The learning curves against update tokens start at the base model's 0 and span three decades, as the
    tiny default's do (d3s 330 tokens by its first checkpoint, grpo 105,000 by its last): the label of 0 and
    those of the decades are drawn side by side, never on top of each other."""
    curves = pd.DataFrame(
        [
            {"method": method, "seed": seed, "step": step, "value": 0.5 + 0.005 * step,
             "update_tokens_cumulative": per_step * step, "wall_clock": 0.3 * step}
            for method, per_step in (("grpo", 2625), ("d3s", 33))
            for seed in (0, 1)
            for step in (0, 10, 20, 30, 40)
        ]
    )  # fmt: skip
    fig = figures.learning_curve_figure(curves, ["grpo", "d3s"])
    ax = fig.axes[1]
    fig.canvas.draw()
    labels = [label for label in ax.get_xticklabels() if label.get_text()]
    assert [label.get_position()[0] for label in labels] == [0, 1e2, 1e3, 1e4, 1e5]
    boxes = [label.get_window_extent() for label in labels]
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:], strict=False)), boxes


def test_paper_numbers_carry_citations():
    paper = REPO_ROOT / "results" / "paper"
    t1 = pd.read_csv(paper / "d3s_table1.csv")
    assert set(t1["source_tag"]) == {"N"}
    row = t1[(t1["method"] == "d3s") & (t1["benchmark"] == "average") & (t1["model"] == "Qwen2.5-Math-7B")]
    assert (row["pass_at_1"].iloc[0], row["pass_at_8"].iloc[0]) == (34.3, 56.8)
    for name in ("d3s_table2", "d3s_table3", "pods_single_gpu", "pods_ablations", "pods_multi_gpu"):
        df = pd.read_csv(paper / f"{name}.csv")
        assert df["citation"].notna().all() and df["source_tag"].notna().all()


def _write_tables(results: Path) -> None:
    """The tables report.md reads, as the notebooks write them."""
    metrics, evals = io.load_metrics(results), io.load_evals(results)
    curves = tables.learning_curves(evals, metrics)
    (results / "tables").mkdir(exist_ok=True)
    tables.pass_at_k_across_seeds(evals).to_csv(results / "tables" / "pass_at_k.csv", index=False)
    tables.efficiency_table(curves, metrics).to_csv(results / "tables" / "efficiency.csv", index=False)
    curves.to_csv(results / "tables" / "learning_curves.csv", index=False)
    write_claims(results, REPO_ROOT / "results" / "paper", _report_config())


def _report_config(**analysis) -> dict:
    return {
        "experiment": "test",
        "base_model": {"kind": "path", "path": "base"},
        "methods": ["grpo", "d3s"],
        "seeds": [0, 1],
        "train": {"trainer": {"max_steps": 4, "per_device_train_batch_size": 8, "num_generations": 4}},
        "eval": {"benchmarks": ["synthetic"], "samples": 4, "temperature": 0.6, "top_p": 0.95},
        "analysis": {"reference": "grpo"} | analysis,
    }


def test_loaders_name_the_manifest_of_every_row(results):
    metrics, evals = io.load_metrics(results), io.load_evals(results)
    assert set(metrics["manifest"]) == {
        f"runs/{m}/seed{s}/manifest.json" for m in ("grpo", "d3s") for s in (0, 1)
    }
    assert (results / metrics["manifest"].iloc[0]).is_file()
    base = evals[evals["step"] == 0]
    assert set(base["manifest"]) == {"eval/base/manifest.json"}
    assert "eval/d3s/seed1/step2/manifest.json" in set(evals["manifest"])


def test_report_names_the_manifests_it_came_from(results):
    _write_tables(results)
    final = results / "eval" / "d3s" / "seed0" / "final" / "summary.json"  # copied fraction: issue 47
    summary = json.loads(final.read_text())
    summary["benchmarks"]["synthetic"]["by_policy"] = {"math_verify": {"copied_fraction": 0.125}}
    final.write_text(json.dumps(summary))
    report = write_report(results, REPO_ROOT / "results" / "paper", _report_config())
    assert "## Provenance" in report and "Warning: mixed settings" not in report
    for method in ("grpo", "d3s"):
        for seed in (0, 1):
            path = f"runs/{method}/seed{seed}/manifest.json"
            assert f"| [{path}]({path}) | {method} seed {seed} | `{COMMIT[:12]}` | no |" in report
            path = f"eval/{method}/seed{seed}/final/manifest.json"
            assert f"[{path}]({path})" in report
    assert "| training runs | 4 | `" in report and "| consistent |" in report
    assert "## Answers copied from the question" in report
    assert "| d3s seed 0 | synthetic | 12.50 | n/a |" in report
    assert "| grpo seed 1 | synthetic | n/a |" in report
    assert "- Sources (manifests checked):\n  - training runs: 4 manifest(s), settings `" in report
    # the regime the verdicts belong to: the batch and each method's update tokens per step (800 and 80)
    regime = "- Regime: 2 prompts x 4 rollouts per step; tokens in the update per step (mean over steps and "
    assert regime + "seeds): grpo 800, d3s 80. The verdicts above belong to this regime" in report


def test_report_refuses_mixed_settings_unless_allowed(results):
    _write_tables(results)
    _write_manifest(results / "runs" / "d3s" / "seed1" / "manifest.json", _train_manifest("d3s", 1, 1e-3))
    with pytest.raises(MixedSettingsError) as error:
        write_report(results, REPO_ROOT / "results" / "paper", _report_config())
    message = str(error.value)
    assert "config.resolved_trainer.learning_rate" in message
    assert "      0.0003: d3s seed 0, grpo seed 0, grpo seed 1\n      0.001: d3s seed 1\n" in message
    assert "analysis.allow_mixed_settings: true" in message
    report = write_report(results, REPO_ROOT / "results" / "paper", _report_config(allow_mixed_settings=True))
    head = report.split("## Main table")[0]
    assert "> **Warning: mixed settings.** `analysis.allow_mixed_settings` is true" in head
    assert "`config.resolved_trainer.learning_rate`: 0.0003 (" in head and "0.001 (d3s seed 1)" in head
    assert "**MIXED**: `config.resolved_trainer.learning_rate`" in report


def test_the_check_runs_once_and_its_provenance_json_is_read_while_up_to_date(results):
    """Rule provenance writes provenance.json; loaders and notebooks read it until a manifest is newer."""
    _write_manifest(results / "runs" / "d3s" / "seed1" / "manifest.json", _train_manifest("d3s", 1, 1e-3))
    with pytest.raises(MixedSettingsError) as refused:
        write_provenance(results, allow_mixed=False)
    assert not (results / "provenance.json").exists()  # nothing written when refused
    write_provenance(results, allow_mixed=True)
    saved = json.loads((results / "provenance.json").read_text())
    assert saved["settings"].startswith("MIXED") and (results / "provenance.md").is_file()
    # the refusal read from the file is the check's own, word for word
    with pytest.raises(MixedSettingsError) as from_file:
        io.load_metrics(results)
    assert str(from_file.value) == str(refused.value)
    saved["notes"] = ["read from provenance.json"]
    (results / "provenance.json").write_text(json.dumps(saved))
    assert load_provenance(results, allow_mixed=True).notes == ["read from provenance.json"]
    assert load_provenance(results, allow_mixed=True, groups=("training",)).notes == []  # notes on evals
    assert [c["group"] for c in load_provenance(results, True, groups=("final",)).checks] == ["final"]
    # a manifest newer than the file, or one it does not list: checked again
    later = (results / "provenance.json").stat().st_mtime + 10
    os.utime(results / "eval" / "base" / "manifest.json", (later, later))
    assert load_provenance(results, allow_mixed=True).notes == []
    os.utime(results / "eval" / "base" / "manifest.json", (later - 20, later - 20))
    assert load_provenance(results, allow_mixed=True).notes == ["read from provenance.json"]
    _summary(results / "eval" / "grpo" / "seed0" / "step3" / "summary.json", 0.2, 0.4)
    os.utime(results / "eval" / "grpo" / "seed0" / "step3" / "manifest.json", (later - 20, later - 20))
    assert load_provenance(results, allow_mixed=True).notes == []


@pytest.mark.parametrize("values", [[0.2, 0.9, 0.4, 0.5], [10.0, 12.0], [3.0, 3.0, 3.0]])
def test_mean_ci_equals_the_hand_formula(values):
    arr = np.asarray(values)
    half = stats.t.ppf(0.975, len(arr) - 1) * arr.std(ddof=1) / math.sqrt(len(arr))
    assert tables.mean_ci(values) == pytest.approx((arr.mean(), half, len(arr)))
    assert tables.mean_ci([])[2] == 0 and math.isnan(tables.mean_ci([math.nan, None])[0])


def _write_kl_files(results: Path) -> None:
    """kl.json at every evaluated checkpoint of the `results` tree, so the training-dynamics notebook draws
    its KL figure too (the fields d3s.evaluation.kl writes and d3s.analysis.io.load_kl reads)."""
    settings = {"prompts": 4, "samples": 2, "max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0, "seed": 0}
    for point in sorted(results.glob("eval/*/seed*/*/summary.json")):
        k1 = 0.01 * len(point.parent.name)
        record = {"k1": k1, "k3": k1 / 2, "k1_per_sequence": [k1] * 8, "tokens": 80, "sequences": 8,
                  "mean_completion_tokens": 10.0, "truncated_fraction": 0.0, "seconds": 0.1,
                  "settings": settings, "probe_sha256": "ef" * 32}  # fmt: skip
        (point.parent / "kl.json").write_text(json.dumps(record))


async def _execute_notebooks(notebooks: list[Path], parameters: dict) -> list:
    """Each notebook with papermill's parameters cell, executed by nbclient (papermill's engine) in a python3
    kernel of its own, as rule <notebook> executes it; the kernels run side by side. A cell's error raises."""
    from nbclient import NotebookClient
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    clients = [
        NotebookClient(
            parameterize_notebook(load_notebook_node(str(path)), parameters),
            kernel_name="python3",
            timeout=600,
        )
        for path in notebooks
    ]
    await asyncio.gather(*(client.async_execute() for client in clients))
    return [client.nb for client in clients]


@pytest.mark.slow
def test_every_notebook_shows_its_figures_in_a_real_kernel(results, monkeypatch):
    """Every notebook executed on the small results tree: no cell errs, and every cell that saves figures
    shows each of them once as image/png (not the text `<Figure size ...>`), even where MPLBACKEND names
    Agg, a headless machine's usual setting."""
    _write_kl_files(results)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernels inherit it; the notebooks still show their figures
    paper = REPO_ROOT / "results" / "paper"
    # what the workflow passes (analyse.smk, NB_PARAMS)
    parameters = {"results_dir": str(results), "out_dir": str(results), "paper_dir": str(paper),
                  "reference": "grpo", "target_fraction": 0.99, "headline": ["grpo", "d3s"],
                  "ablation": ["grpo", "d3s"], "allow_mixed": False}  # fmt: skip
    # the workflow's analysis notebooks (notebooks/studies.ipynb reads study folders: tests/test_studies.py)
    notebooks = sorted(p for p in (REPO_ROOT / "notebooks").glob("*.ipynb") if p.name != "studies.ipynb")
    assert len(notebooks) == 4
    executed = asyncio.run(_execute_notebooks(notebooks, parameters))
    shown = 0
    for notebook, cell in ((n, c) for n, nb in zip(notebooks, executed, strict=True) for c in nb.cells):
        if cell.cell_type != "code":
            continue
        assert not [o for o in cell.outputs if o.output_type == "error"], (notebook.name, cell.source)
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert len(images) == cell.source.count("figures.save("), (notebook.name, cell.source, cell.outputs)
        as_text = [
            o for o in cell.outputs if o not in images and "<Figure" in str(o.get("data", o.get("text")))
        ]
        assert not as_text, (notebook.name, cell.source)
        shown += len(images)
    # one image per figure file written: the seven figures of the four notebooks (docs/workflow/stages.md)
    assert shown == len(list((results / "figures").glob("*.png"))) == 7


def test_without_an_informative_rollout_the_latest_is_drawn_saying_so():
    """A short run may log only A = 0 rollouts (the regime sweep's smallest point): the workflow's figure is
    still made, from the latest rollout of a token-selecting method, and never from another method's."""
    records = [
        _token_record("d3s", 0, [(0.0, [False, False]), (0.0, [True, False])]),
        _token_record("grpo", 5, [(1.0, [True, True])]),
    ]
    assert figures.informative_token_examples(records) == []
    (example,) = figures.latest_token_example(records)
    assert (example["where"], example["selected"]) == ("d3s seed 0 step 0", [True, False])
    assert figures.token_selection_figure([example]).axes
    assert figures.latest_token_example(records[1:]) == []
