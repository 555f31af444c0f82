"""Evaluation under Snakemake resumes: a checkpoint evaluation killed midway keeps its samples and generates
only the problems it had not finished; a re-run resumes only what the same model made with the same
settings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from helpers import HANG_GUARD_S, REPO_ROOT, SNAKEMAKE, run_snakemake

PROBLEMS = 40  # enough that a kill after the first few problems lands mid-evaluation
CHECKPOINT_SAMPLES = 2
RUN_SUMMARY = "results/smoke/runs/d3s/seed0/train_summary.json"


def _config(problems: int = PROBLEMS, final_limit: int = 8, **eval_changes) -> dict:
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    cfg["methods"] = ["d3s"]
    cfg["analysis"] = {"reference": "d3s", "headline": ["d3s"], "ablation": ["d3s"]}
    cfg["eval"] |= {
        "synthetic": {"count": problems},
        "checkpoint_samples": CHECKPOINT_SAMPLES,
        "checkpoint_limit": problems,
        "limit": final_limit,
        "batch_size": 1,  # one problem per generate call: the samples file grows problem by problem
    } | eval_changes
    return cfg


def _write_config(work: Path, cfg: dict) -> str:
    # smoke.yaml's key order: Snakemake compares the jobs' params in order (the smoke run's stand)
    (work / "config" / "resume.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return "config/resume.yaml"


def _complete_lines(data: bytes, samples: int) -> bytes:
    """The lines of the problems with all their samples (what a resumed run keeps), in file order."""
    lines = [line for line in data.split(b"\n")[:-1] if line.strip()]
    counts = Counter(json.loads(line)["problem_id"] for line in lines)
    return b"".join(line + b"\n" for line in lines if counts[json.loads(line)["problem_id"]] == samples)


def _kill_after_three_problems(
    target: list[str], work: Path, samples: Path, per_problem: int, log: Path
) -> None:
    """Run Snakemake on ``target`` and SIGKILL its process group once ``samples`` holds 3 problems'
    samples: midway through that evaluation."""
    with open(log, "w") as out:
        job = subprocess.Popen(
            SNAKEMAKE + target, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + HANG_GUARD_S
        while not (samples.is_file() and samples.read_bytes().count(b"\n") >= 3 * per_problem):
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no 3 problems evaluated within {HANG_GUARD_S} s"
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


@pytest.fixture(scope="module")
def trained(smoke_workflow, tmp_path_factory) -> Path:
    """The workflow with the base model built and the d3s run trained (4 steps, checkpoint-2): the session's
    smoke run (conftest.py; _config changes no training setting), copied with Snakemake's records, its
    evaluations removed."""
    work = Path(shutil.copytree(smoke_workflow, tmp_path_factory.mktemp("trained") / "work", symlinks=True))
    for made_by_evaluation in ("eval", "logs/eval"):
        shutil.rmtree(work / "results" / "smoke" / made_by_evaluation)
    dry = run_snakemake([RUN_SUMMARY, "-n", "--configfile", _write_config(work, _config())], work)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]
    return work


@pytest.fixture
def work(trained, tmp_path) -> Path:
    """A copy of the trained workflow (files and Snakemake's records, times kept) for one test."""
    return Path(shutil.copytree(trained, tmp_path / "work", symlinks=True))


@pytest.mark.slow
def test_killed_checkpoint_evaluation_resumes_under_snakemake(work, tmp_path):
    """SIGKILL Snakemake and its checkpoint evaluation midway; after --unlock, --rerun-incomplete keeps every
    finished problem byte for byte and generates only the rest: each problem once, none lost."""
    configfile = _write_config(work, _config())
    out = work / "results" / "smoke" / "eval" / "d3s" / "seed0" / "step2"
    samples = out / "synthetic" / "samples.jsonl"
    target = [str((out / "summary.json").relative_to(work)), "--cores", "1", "--configfile", configfile]

    _kill_after_three_problems(target, work, samples, CHECKPOINT_SAMPLES, tmp_path / "first.log")
    assert not (out / "summary.json").exists(), "the kill missed the evaluation: raise PROBLEMS"
    kept = _complete_lines(samples.read_bytes(), CHECKPOINT_SAMPLES)
    finished = len({json.loads(line)["problem_id"] for line in kept.splitlines()})
    assert 3 <= finished < PROBLEMS

    unlock = run_snakemake([*target, "--unlock"], work)
    assert unlock.returncode == 0, unlock.stderr[-2000:]
    again = run_snakemake([*target, "--rerun-incomplete"], work, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    data = samples.read_bytes()
    assert data.startswith(kept)  # the samples made before the kill, unchanged
    records = [json.loads(line) for line in data.splitlines()]
    per_problem = Counter(r["problem_id"] for r in records)
    assert len(per_problem) == PROBLEMS and set(per_problem.values()) == {CHECKPOINT_SAMPLES}
    assert Counter((r["problem_id"], r["sample_index"]) for r in records).most_common(1)[0][1] == 1
    manifest = json.loads((out / "synthetic" / "manifest.json").read_text())
    assert manifest["problems_resumed"] == finished
    assert manifest["problems_generated"] == PROBLEMS - finished
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["synthetic"]["n_problems"] == PROBLEMS
    log = (work / "results" / "smoke" / "logs" / "eval" / "d3s_seed0_step2.log").read_text()
    assert f"resuming the evaluation in {out.relative_to(work)}" in log


@pytest.mark.slow
def test_evaluation_resumes_only_the_same_model_and_sample_settings(work):
    """Re-running an evaluation after a reporting-only change (Pass@k values) generates nothing; after a
    change of what makes the samples (max tokens) the old evaluation is moved aside, not deleted, and a
    fresh one starts."""
    out = work / "results" / "smoke" / "eval" / "d3s" / "seed0" / "final"
    target = str((out / "summary.json").relative_to(work))
    manifest = out / "synthetic" / "manifest.json"

    def run(cfg: dict) -> dict:
        configfile = _write_config(work, cfg)
        done = run_snakemake([target, "--cores", "1", "--configfile", configfile], work, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(manifest.read_text())

    first = run(_config(problems=8))
    assert (first["problems_resumed"], first["problems_generated"]) == (0, 8)
    trained = (work / RUN_SUMMARY).stat().st_mtime_ns
    samples = (out / "synthetic" / "samples.jsonl").read_bytes()

    kl = (out / "kl.json").read_bytes()  # eval.kl of smoke.yaml: 4 probe prompts x 2 completions
    assert json.loads(kl)["sequences"] == 8

    reported = run(_config(problems=8, k=[1, 2]))  # Pass@k values only: the samples stand
    assert (reported["problems_resumed"], reported["problems_generated"]) == (8, 0)
    assert (out / "synthetic" / "samples.jsonl").read_bytes() == samples
    assert set(json.loads((out / "synthetic" / "summary.json").read_text())["pass_at_k"]) == {"1", "2"}
    assert (out / "kl.json").read_bytes() == kl  # the same model and probe: the KL is kept

    probe = run(_config(problems=8, k=[1, 2], kl={"prompts": 4, "samples": 3}))  # the probe only
    assert (probe["problems_resumed"], probe["problems_generated"]) == (8, 0)
    assert json.loads((out / "kl.json").read_text())["sequences"] == 12

    changed = run(_config(problems=8, max_tokens=16))  # other samples: start over, keep the old ones aside
    assert (changed["problems_resumed"], changed["problems_generated"]) == (0, 8)
    aside = sorted(out.parent.glob("final.superseded-*"))
    assert len(aside) == 1 and (aside[0] / "synthetic" / "samples.jsonl").read_bytes() == samples
    log = (work / "results" / "smoke" / "logs" / "eval" / "d3s_seed0_final.log").read_text()
    assert "--max-tokens 24 -> 16" in log
    # the config changes re-ran rule check_inputs, which must not re-run training (its output is ancient())
    assert (
        work / "results" / "smoke" / "runs" / "d3s" / "seed0" / "train_summary.json"
    ).stat().st_mtime_ns == trained


@pytest.mark.slow
def test_killed_run_evaluation_resumes_every_model(work, tmp_path):
    """eval.jobs run: one job evaluates the run's checkpoint, then its final model. SIGKILL it midway through
    the final model; the re-run keeps the finished checkpoint's samples (nothing generated again) and resumes
    the final model's, and each model keeps its own summary, manifest and resume key."""
    problems, final_samples = 8, 4  # smoke.yaml's eval.samples
    configfile = _write_config(work, _config(problems=problems, final_limit=problems, jobs="run"))
    evals = work / "results" / "smoke" / "eval" / "d3s" / "seed0"
    samples = evals / "final" / "synthetic" / "samples.jsonl"
    target = [str((evals / "final" / "summary.json").relative_to(work)), "--cores", "1"]
    target += ["--configfile", configfile]

    _kill_after_three_problems(target, work, samples, final_samples, tmp_path / "first.log")
    assert (evals / "step2" / "synthetic" / "summary.json").is_file()  # the checkpoint was done
    assert not (evals / "final" / "summary.json").exists(), "the kill missed the evaluation"
    checkpoint_samples = (evals / "step2" / "synthetic" / "samples.jsonl").read_bytes()
    kept = _complete_lines(samples.read_bytes(), final_samples)
    finished = len({json.loads(line)["problem_id"] for line in kept.splitlines()})
    assert 3 <= finished < problems

    assert run_snakemake([*target, "--unlock"], work).returncode == 0
    again = run_snakemake([*target, "--rerun-incomplete"], work, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    step2 = json.loads((evals / "step2" / "synthetic" / "manifest.json").read_text())
    assert (step2["problems_resumed"], step2["problems_generated"]) == (problems, 0)
    assert (evals / "step2" / "synthetic" / "samples.jsonl").read_bytes() == checkpoint_samples
    final = json.loads((evals / "final" / "synthetic" / "manifest.json").read_text())
    assert (final["problems_resumed"], final["problems_generated"]) == (finished, problems - finished)
    assert samples.read_bytes().startswith(kept)
    for point in ("step2", "final"):
        summary = json.loads((evals / point / "summary.json").read_text())
        assert summary["benchmarks"]["synthetic"]["n_problems"] == problems
        key = json.loads((evals / point / "resume_key.json").read_text())
        model = "checkpoint-2" if point == "step2" else "final"
        assert key["settings"]["--model"].endswith(f"runs/d3s/seed0/{model}")
    log = (work / "results" / "smoke" / "logs" / "eval" / "d3s_seed0.log").read_text()
    assert "=== model 2 of 2: final" in log and "resuming the evaluation in" in log
