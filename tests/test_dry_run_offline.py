"""Parsing the workflow is cheap and offline: `snakemake -n` of every configuration works with the Hub
switched off and no data anywhere; data, models and the full trainer settings are checked once per run,
before any job starts (workflow/rules/checks.smk), with one line per missing input naming the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, SNAKEMAKE

# Every configuration, including any added later (config/schema.yaml is the schema, not a configuration).
CONFIGS = sorted(
    p
    for p in [*REPO_ROOT.glob("config/*.yaml"), *REPO_ROOT.glob("config/paper/*.yaml")]
    + [*REPO_ROOT.glob("config/studies/*.yaml")]
    if p.name != "schema.yaml"
)


def _run(args: list[str], work: Path, env: dict[str, str], timeout: int = 300):
    return subprocess.run(
        SNAKEMAKE + args, cwd=work, env=env, capture_output=True, text=True, timeout=timeout
    )


def _write(work: Path, cfg: dict, name: str = "test.yaml") -> str:
    (work / "config" / name).write_text(yaml.safe_dump(cfg))
    return f"config/{name}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(REPO_ROOT / "config")))
def test_dry_run_offline_without_data(config, dry_run):
    jobs = " ".join(dry_run(config).split())  # the dry run's job table, one line
    cfg = yaml.safe_load(config.read_text())
    if "study" in cfg:  # a study (docs/studies.md): its runs, laid over the config it extends
        from d3s.variants import extended_config

        cfg = extended_config(cfg, REPO_ROOT)
        calibration = cfg["study"].get("calibration") or {"runs": [], "seeds": []}
        runs = len(cfg["study"]["runs"]) * len(cfg["seeds"]) + len(calibration["runs"]) * len(
            calibration["seeds"]
        )
        assert f"train {runs}" in jobs and "study_report 1" in jobs
        return
    assert f"train {len(cfg['methods']) * len(cfg['seeds'])}" in jobs
    per_run = (cfg["eval"].get("jobs") or "model") == "run"  # eval.jobs (config/schema.yaml's default)
    assert ("evaluate_run" if per_run else "evaluate_final") in jobs and "report" in jobs


def test_batch_geometry_fails_at_parse_time_offline(offline_work):
    """The prompts_per_step batch geometry is decided by the config's text: `snakemake -n` refuses it."""
    work, env = offline_work
    cfg = yaml.safe_load((REPO_ROOT / "config" / "paper" / "qwen2.5-math-1.5b.yaml").read_text())
    cfg["train"]["prompts_per_step"] = 33  # 33 x 32 rollouts over 8 GPUs x 32 per micro-batch: not whole
    result = _run(["-n", "--configfile", _write(work, cfg, "bad_geometry.yaml")], work, env)
    assert result.returncode != 0
    assert "train.prompts_per_step" in result.stdout + result.stderr


@pytest.mark.slow
def test_missing_inputs_stop_the_run_before_any_job(offline_work):
    """A benchmark with no local copy, offline: the check before the jobs stops the run, with one line
    naming the fix, before any job (not even the base model) starts."""
    work, env = offline_work
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    cfg["experiment"] = "offline-check"
    cfg["eval"]["benchmarks"] = ["synthetic", "math500"]
    result = _run(["--cores", "1", "--configfile", _write(work, cfg)], work, env, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("config ")]
    assert len(lines) == 1 and lines[0].startswith("config eval.benchmarks math500:"), out[-3000:]
    assert "offline mode is set" in lines[0] and "Put a copy at <data-dir>/math500/test.jsonl" in lines[0]
    results = work / "results" / "offline-check"
    assert sorted(p.name for p in results.iterdir()) == ["logs"]  # no job ran
    assert (results / "logs" / "check_inputs.log").read_text() == lines[0] + "\n"


def test_check_records_where_inputs_were_found(offline_work, tmp_path):
    """With a local copy in place the check passes and records where each input was found."""
    work, env = offline_work
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    cfg["eval"]["benchmarks"] = ["synthetic", "math500"]
    data = tmp_path / "data"
    (data / "math500").mkdir(parents=True)
    row = {"problem": "What is $1+1$?", "answer": "2", "unique_id": "a"}
    (data / "math500" / "test.jsonl").write_text(json.dumps(row) + "\n")
    request = {
        "config": cfg,
        "task": cfg["task"],
        "checks": ["base_model", "eval_benchmarks", "train_dataset"],
    }
    script = [sys.executable, str(work / "workflow" / "scripts" / "check_inputs.py")]
    out, log = tmp_path / "inputs.json", tmp_path / "check.log"
    done = subprocess.run(
        [*script, str(out), str(log)],
        input=json.dumps(request),
        env=env | {"D3S_DATA_DIR": str(data)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["eval_benchmarks"]["math500"] == {
        "found": str(data / "math500" / "test.jsonl"),
        "problems_read": 1,
    }
    assert found["train_dataset"]["name"] == "synthetic" and found["base_model"]["kind"] == "tiny"
    assert log.read_text() == "all inputs found\n"


@pytest.mark.slow
def test_paper_config_inputs_checked_before_any_job_offline(offline_work):
    """A paper configuration offline with no data and a selection geometry the trainer refuses: the check
    names each problem on one line with its fix: the trainer setting, the base model, the training data
    and every benchmark."""
    work, env = offline_work
    cfg = yaml.safe_load((REPO_ROOT / "config" / "paper" / "qwen2.5-math-1.5b.yaml").read_text())
    cfg["train"]["trainer"]["per_device_train_batch_size"] = 16  # N = 9 of 32 would leave half rows
    result = _run(
        ["--cores", "1", "--configfile", _write(work, cfg, "bad_paper.yaml")], work, env, timeout=600
    )
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("config ")]
    trainer = [line for line in lines if line.startswith("config train.trainer (method d3s):")]
    assert len(trainer) == 1 and "per_device_train_batch_size" in trainer[0]
    base = [line for line in lines if line.startswith("config base_model.path Qwen/Qwen2.5-Math-1.5B:")]
    assert len(base) == 1 and "hf download Qwen/Qwen2.5-Math-1.5B" in base[0]
    assert sum(line.startswith("config train.dataset math_level3to5:") for line in lines) == 1
    for name in cfg["eval"]["benchmarks"]:
        assert sum(line.startswith(f"config eval.benchmarks {name}:") for line in lines) == 1
    assert len(lines) == 3 + len(cfg["eval"]["benchmarks"])
    assert not (work / "results" / cfg["experiment"] / "runs").exists()


def test_parse_time_check_does_not_import_torch():
    """The workflow's parse-time check (common.smk, run by every `snakemake -n` and every cluster job) imports
    only the registry, the launch settings and the benchmark names: no torch (about 2 s of each parse)."""
    code = (
        "import sys; import d3s.methods, d3s.orchestration.run_config, d3s.data.benchmarks; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'datasets') if m in sys.modules); "
        "print(heavy); sys.exit(bool(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
