"""Manifests of real runs and evaluations, and the rule that decides which results may share a table.

One real tiny training run and two real evaluations (its final model and the base model) are made once;
the mixing tests copy their manifests and change one setting at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from d3s.analysis import io, tables
from d3s.methods import METHODS
from d3s.provenance.settings_check import (
    AGREE,
    EVALUATION_RULES,
    FREE,
    TRAINING_RULES,
    WARN,
    MixedSettingsError,
    check_results,
    rule_for,
)

LISTED_FIELDS = {
    "config",
    "seed",
    "torch_threads",
    "versions",
    "git",
    "hardware",
    "inputs",
    "started",
    "finished",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def eval_args(model: Path, out: Path) -> list[str]:
    return [
        "eval", "--model", str(model), "--benchmarks", "synthetic",
        "--synthetic", "count=4,max_ops=1,max_operand=9", "--samples", "2", "--k", "1,2", "--max-tokens", "8",
        "--backend", "transformers", "--template", "raw",
        "--grading-workers", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def real_results(tmp_path_factory, tiny_sft_model) -> Path:
    """results/ in the workflow's layout: grpo seed 0 trained 1 step, its final model and the base
    evaluated."""
    from d3s.cli import main
    from d3s.runs.run import train

    root = tmp_path_factory.mktemp("results")
    train(
        {
            "method": "grpo",
            "model": str(tiny_sft_model),
            "seed": 0,
            "threads": 1,
            "output_dir": str(root / "runs" / "grpo" / "seed0"),
            "dataset": {"name": "synthetic", "count": 64, "max_ops": 1, "max_operand": 9},
            "trainer": {
                "max_steps": 1,
                "per_device_train_batch_size": 8,
                "num_generations": 4,
                "max_completion_length": 8,
                "logging_steps": 1,
            },
        }
    )
    assert (
        main(
            eval_args(root / "runs" / "grpo" / "seed0" / "final", root / "eval" / "grpo" / "seed0" / "final")
        )
        == 0
    )
    assert main(eval_args(tiny_sft_model, root / "eval" / "base")) == 0
    return root


@pytest.fixture()
def results(real_results, tmp_path) -> Path:
    """A private copy of the real results (model weights left out) that a test may change."""
    copy = tmp_path / "results"
    shutil.copytree(real_results, copy, ignore=shutil.ignore_patterns("*.safetensors", "samples.jsonl"))
    return copy


def clone_run(results: Path, method: str, seed: int, edit=None) -> Path:
    """runs/<method>/seed<seed> made from the real grpo run, as that method and seed would record it."""
    dst = results / "runs" / method / f"seed{seed}"
    dst.mkdir(parents=True)
    for name in ("metrics.jsonl", "train_summary.json"):
        shutil.copy(results / "runs" / "grpo" / "seed0" / name, dst / name)
    manifest = read(results / "runs" / "grpo" / "seed0" / "manifest.json")
    config, trainer = manifest["config"], manifest["config"]["resolved_trainer"]
    config["method"] = trainer["method"] = method
    config["method_settings"] = dataclasses.asdict(METHODS[method])
    config["seed"] = trainer["seed"] = manifest["seed"] = seed
    config["output_dir"] = trainer["output_dir"] = str(dst)
    if method != "grpo":  # what D3SConfig resolves for a selecting method
        trainer |= {"sample_rule": "max_variance", "sample_scope": "batch", "keep_per_prompt": 1}
        trainer |= {"token_rule": "adv_entropy", "token_keep_ratio": 0.05, "schedule": "linear"}
    if edit:
        edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def clone_eval(results: Path, method: str, seed: int, edit=None) -> Path:
    dst = results / "eval" / method / f"seed{seed}" / "final"
    shutil.copytree(results / "eval" / "grpo" / "seed0" / "final", dst)
    manifest = read(dst / "manifest.json")
    manifest["config"]["model_path"] = f"runs/{method}/seed{seed}/final"
    if edit:
        edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_hardware_tells_cpu_generations_and_kernel_levels_apart():
    """A model name such as "AMD EPYC" covers several generations, and runs of one config diverged between
    two 2-core machines (docs/workflow/testbed.md): the manifest also records vendor, family, model
    and stepping, and torch's CPU kernel level."""
    import platform
    import re

    import torch

    from d3s.provenance.manifest import hardware

    info = hardware()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if Path("/proc/cpuinfo").is_file() and platform.machine() == "x86_64":
        assert re.fullmatch(r"\w+ family \d+ model \d+ stepping \d+", info["cpu_id"])


@pytest.mark.slow
def test_training_manifest_records_every_listed_field(real_results, tiny_sft_model):
    manifest = read(real_results / "runs" / "grpo" / "seed0" / "manifest.json")
    assert set(manifest) >= LISTED_FIELDS
    assert manifest["config"]["resolved_trainer"]["num_generations"] == 4  # resolved configuration
    assert manifest["config"]["method_settings"] == dataclasses.asdict(METHODS["grpo"])
    assert manifest["versions"]["trl"] and manifest["versions"]["torch"]
    assert len(manifest["git"]["commit"]) == 40 and isinstance(manifest["git"]["dirty"], bool)
    assert manifest["seed"] == 0 and manifest["torch_threads"] == 1
    assert {"cpu", "cpu_id", "cpu_capability", "cpu_count", "gpus", "gpu_count"} <= set(manifest["hardware"])
    assert manifest["finished"] and manifest["started"] <= manifest["finished"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # the base model's files, weights too
        assert manifest["inputs"][f"model/{name}"]["sha256"] == sha256(tiny_sft_model / name)


@pytest.mark.slow
def test_evaluation_manifests_record_every_listed_field(real_results, tiny_sft_model):
    out = real_results / "eval" / "grpo" / "seed0" / "final"
    model = real_results / "runs" / "grpo" / "seed0" / "final"
    train_manifest = read(real_results / "runs" / "grpo" / "seed0" / "manifest.json")
    for path in (out / "manifest.json", out / "synthetic" / "manifest.json"):
        manifest = read(path)
        assert set(manifest) >= LISTED_FIELDS, path
        assert manifest["torch_threads"] >= 1 and manifest["seed"] == 0
        assert len(manifest["git"]["commit"]) == 40 and isinstance(manifest["git"]["dirty"], bool)
        assert {"cpu", "cpu_count", "gpus", "gpu_count"} <= set(manifest["hardware"])
        assert manifest["versions"]["math-verify"] and manifest["versions"]["transformers"]
        assert manifest["finished"] and manifest["started"] <= manifest["finished"]
        # the checkpoint's weights and tokenizer, and the training run the model came from
        inputs = manifest["inputs"]
        assert inputs["model/model.safetensors"]["sha256"] == sha256(model / "model.safetensors")
        assert inputs["model/tokenizer.json"]["sha256"] == sha256(model / "tokenizer.json")
        assert inputs["model_run_manifest"]["sha256"] == sha256(model.parent / "manifest.json")
        assert manifest["model_run"]["method"] == "grpo"
        assert manifest["model_run"]["method_settings"] == train_manifest["config"]["method_settings"]
    settings = read(out / "manifest.json")["config"]["benchmarks"]["synthetic"]
    assert settings["generation"] == {
        "samples": 2,
        "temperature": 0.6,
        "top_p": 0.95,
        "max_new_tokens": 8,
        "seed": 0,
    }
    assert settings["template"] == "raw" and settings["answer_extraction"] == "boxed_first"
    assert settings["n_problems"] == 4 and len(settings["problems_sha256"]) == 64
    assert read(out / "summary.json")["manifest"] == "manifest.json"
    base = read(real_results / "eval" / "base" / "manifest.json")
    assert base["inputs"]["model/model.safetensors"]["sha256"] == sha256(tiny_sft_model / "model.safetensors")
    assert base["model_run"] is None  # the base model is no training run of this tree


@pytest.mark.slow
def test_resumed_evaluation_keeps_its_samples_and_rewrites_the_manifest(
    real_results, tiny_sft_model, tmp_path
):
    from d3s.cli import main

    out = tmp_path / "base"
    shutil.copytree(real_results / "eval" / "base", out)
    samples = (out / "synthetic" / "samples.jsonl").read_text()
    assert main(eval_args(tiny_sft_model, out)) == 0
    assert (out / "synthetic" / "samples.jsonl").read_text() == samples
    part = read(out / "synthetic" / "manifest.json")
    assert (part["problems_resumed"], part["problems_generated"]) == (4, 0)
    assert read(out / "manifest.json")["problems_resumed"] == {"synthetic": 4}


@pytest.mark.slow
def test_real_results_are_consistent_and_methods_and_seeds_may_differ(results):
    clone_run(results, "d3s", 1)
    clone_eval(
        results, "d3s", 1, lambda m: m["inputs"].update({"model/model.safetensors": {"sha256": "0" * 64}})
    )
    provenance = check_results(results)
    assert not provenance.mixed
    assert [c["group"] for c in provenance.checks] == ["training", "final"]
    training = provenance.checks[0]
    assert len({r["settings_hash"] for r in training["manifests"]}) == 1 and training["settings_hash"]
    assert len(provenance.checks[1]["manifests"]) == 3  # both final models and the base model


@pytest.mark.slow
def test_mixed_training_settings_are_refused_naming_keys_values_and_runs(results):
    clone_run(results, "d3s", 1, lambda m: m["config"]["resolved_trainer"].update(learning_rate=0.5))
    with pytest.raises(MixedSettingsError) as error:
        check_results(results)
    message = str(error.value)
    lr = read(results / "runs" / "grpo" / "seed0" / "manifest.json")["config"]["resolved_trainer"][
        "learning_rate"
    ]
    assert message.startswith("Refusing to combine results made with different settings in one table.")
    assert "Training runs differ in settings that must agree:" in message
    assert "  - config.resolved_trainer.learning_rate (trainer setting shared by all methods" in message
    assert f"      {json.dumps(lr)}: grpo seed 0" in message and "      0.5: d3s seed 1" in message
    assert "d3s seed 1 = runs/d3s/seed1/manifest.json" in message
    assert "`analysis.allow_mixed_settings: true`" in message and "allow_mixed=True" in message
    # Only the one key: method, seed, method settings and paths differ too, by design.
    assert message.count("\n  - ") == 1
    with pytest.raises(MixedSettingsError, match="learning_rate"):
        io.load_metrics(results)  # the loaders refuse as well


@pytest.mark.slow
def test_allow_mixed_proceeds_and_states_the_mix(results):
    clone_run(results, "d3s", 1, lambda m: m["config"]["resolved_trainer"].update(learning_rate=0.5))
    provenance = check_results(results, allow_mixed=True)
    assert provenance.mixed
    assert provenance.banner().startswith(
        "> **Warning: mixed settings.** `analysis.allow_mixed_settings` is true"
    )
    assert (
        "`config.resolved_trainer.learning_rate`" in provenance.banner()
        and "0.5 (d3s seed 1)" in provenance.banner()
    )
    assert "**MIXED**: `config.resolved_trainer.learning_rate`" in provenance.markdown()
    metrics = io.load_metrics(results, allow_mixed=True)
    assert set(metrics["method"]) == {"grpo", "d3s"}
    assert set(metrics["manifest"]) == {"runs/grpo/seed0/manifest.json", "runs/d3s/seed1/manifest.json"}
    table = tables.summarise_dynamics(metrics, ["loss"])
    tables.write_table(table, results / "tables" / "dynamics.csv", provenance.select("training"))
    sidecar = read(results / "tables" / "dynamics.provenance.json")
    assert sidecar["table"] == "dynamics.csv" and sidecar["settings"].startswith("MIXED")
    assert sidecar["groups"][0]["mixed"][0]["key"] == "config.resolved_trainer.learning_rate"
    assert {m["path"] for m in sidecar["groups"][0]["manifests"]} == set(metrics["manifest"])


@pytest.mark.slow
def test_mixed_evaluation_settings_are_refused(results):
    def hotter(manifest):
        manifest["config"]["benchmarks"]["synthetic"]["generation"]["temperature"] = 1.0

    clone_run(results, "d3s", 1)
    clone_eval(results, "d3s", 1, hotter)
    with pytest.raises(MixedSettingsError) as error:
        io.load_evals(results)
    message = str(error.value)
    assert "Evaluations of the final models and the base model differ" in message
    assert "config.benchmarks.synthetic.generation.temperature" in message
    assert "0.6: grpo seed 0 final, base model" in message and "1.0: d3s seed 1 final" in message
    evals = io.load_evals(results, allow_mixed=True)
    assert "eval/d3s/seed1/final/manifest.json" in set(evals["manifest"])


@pytest.mark.slow
def test_git_and_hardware_differences_are_stated_not_refused(results):
    def elsewhere(manifest):
        manifest["git"] = {"commit": "f" * 40, "dirty": True}
        manifest["hardware"]["cpu"] = "another CPU"

    clone_run(results, "d3s", 1, elsewhere)
    provenance = check_results(results)
    assert not provenance.mixed
    text = provenance.markdown()
    assert "training runs, may differ, stated: `git.commit`" in text and '"ffffffffff' in text
    assert "`hardware.cpu`" in text and "uncommitted changes" in text and "d3s seed 1" in text


@pytest.mark.slow
def test_a_missing_manifest_is_refused(results):
    (clone_run(results, "d3s", 1) / "manifest.json").unlink()
    with pytest.raises(MixedSettingsError, match=r"manifest.json \(no manifest: the settings are unknown"):
        check_results(results)
    assert check_results(results, allow_mixed=True).mixed


@pytest.mark.parametrize(
    ("rules", "key", "policy"),
    [
        (TRAINING_RULES, "config.resolved_trainer.learning_rate", AGREE),
        (TRAINING_RULES, "config.resolved_trainer.num_generations", AGREE),
        (TRAINING_RULES, "config.resolved_trainer.steps_per_generation", WARN),  # GSPO's mini-batches
        (TRAINING_RULES, "config.resolved_trainer.keep_per_prompt", FREE),
        (TRAINING_RULES, "config.resolved_trainer.epsilon", FREE),  # GSPO's clip range: set by a method
        (TRAINING_RULES, "config.method_settings.schedule", FREE),
        (TRAINING_RULES, "inputs.model_config.sha256", AGREE),
        (TRAINING_RULES, "inputs.model_config.path", FREE),
        (TRAINING_RULES, "versions.trl", AGREE),
        (TRAINING_RULES, "git.commit", WARN),
        (TRAINING_RULES, "hardware.gpus", WARN),
        (TRAINING_RULES, "a_setting_added_later", AGREE),
        (EVALUATION_RULES, "config.benchmarks.math500.generation.top_p", AGREE),
        (EVALUATION_RULES, "config.benchmarks.math500.problems_sha256", AGREE),
        (EVALUATION_RULES, "config.model_path", FREE),
        (EVALUATION_RULES, "inputs.model/model.safetensors.sha256", FREE),
        (EVALUATION_RULES, "inputs.benchmark/math500.sha256", AGREE),
        (EVALUATION_RULES, "versions.math-verify", AGREE),
    ],
)
def test_rule_table(rules, key, policy):
    assert rule_for(key, rules).policy == policy


def test_analysis_reads_provenance_without_the_workflow_glue():
    """d3s.provenance and d3s.analysis import neither d3s.orchestration nor torch (a fresh interpreter)."""
    code = (
        "import sys; import d3s.provenance.settings_check, d3s.analysis.io, d3s.analysis.report, "
        "d3s.analysis.tables; "
        "glue = sorted(m for m in sys.modules if m.startswith('d3s.orchestration') or m == 'torch'); "
        "print(glue); sys.exit(bool(glue))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
