"""Snakemake's own overrides: `--config key=value` on top of the default config/config.yaml and on top of a
`--configfile`, which replaces the default rather than being merged into it (README, "Reproduction
workflow"). Dry runs, offline, in the workflow copy of conftest's offline_work."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import SNAKEMAKE, dry_run_jobs

# The workflow itself, then the `d3s train` config of every run, built by the function rule train calls,
# from the parameters rule train passes it (train: config["train"], task: TASK), as each job would write it
# to train.yaml.
RUN_CONFIGS_SNAKEFILE = """
include: "Snakefile"


import json

from d3s.orchestration.run_config import build_run_config

for _method in METHODS:
    for _seed in SEEDS:
        _run = build_run_config(
            method=_method, seed=_seed, model=BASE_MODEL, train_cfg=config["train"], task=TASK,
            output_dir=f"{RESULTS}/runs/{_method}/seed{_seed}", threads=config["train"]["threads"],
        )
        print("run config:", json.dumps(_run))
"""


def _dry_run(offline_work: tuple[Path, dict[str, str]], *args: str) -> tuple[int, str]:
    work, env = offline_work
    probe = work / "Snakefile.run_configs"
    probe.write_text(RUN_CONFIGS_SNAKEFILE)
    command = SNAKEMAKE + ["-n", "--forceall", "--snakefile", probe.name, "all", *args]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def _run_configs(out: str) -> dict[tuple[str, int], dict]:
    runs = [json.loads(line.split(":", 1)[1]) for line in out.splitlines() if line.startswith("run config:")]
    return {(run["method"], run["seed"]): run for run in runs}


def _job_counts(out: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for job in dry_run_jobs(out):
        counts[job["rule"]] = counts.get(job["rule"], 0) + 1
    return counts


def test_config_values_apply_on_top_of_the_default(offline_work):
    """`snakemake --config 'methods=[grpo,d3s]'` runs the default with two methods; nested values keep their
    YAML types (Snakemake alone reads `seeds=[0,1]` as strings, which the schema would refuse)."""
    code, out = _dry_run(
        offline_work, "--config", "methods=[grpo,d3s]", "seeds=[0,1]", "train={trainer: {max_steps: 20}}"
    )
    assert code == 0, out[-3000:]
    assert "Config file config/config.yaml is extended by additional config specified via the command" in out
    runs = _run_configs(out)
    assert sorted(runs) == [("d3s", 0), ("d3s", 1), ("grpo", 0), ("grpo", 1)]
    d3s = runs[("d3s", 1)]
    assert d3s["output_dir"] == "results/tiny/runs/d3s/seed1"
    assert d3s["trainer"]["max_steps"] == 20  # the override, an integer
    # the rest is the default's: its trainer, data and task (config/config.yaml)
    assert (d3s["trainer"]["per_device_train_batch_size"], d3s["trainer"]["save_steps"]) == (512, 5)
    assert d3s["dataset"] == {"min_ops": 3, "max_ops": 7, "max_operand": 9, "bounded": True} | {
        "name": "synthetic",
        "count": 4000,
    }
    jobs = _job_counts(out)
    assert (jobs["train"], jobs["evaluate_run"]) == (4, 4)  # eval.jobs run: one evaluation job per run
    assert "evaluate_checkpoint" not in jobs and "evaluate_final" not in jobs


def test_config_values_apply_on_top_of_a_configfile_that_replaces_the_default(offline_work):
    """A --configfile replaces config/config.yaml (keys it lacks are not taken from the default), and --config
    values apply on top of it."""
    code, out = _dry_run(
        offline_work,
        "--configfile",
        "config/smoke.yaml",
        "--config",
        "methods=[grpo]",
        "train={trainer: {learning_rate: 1.0e-3}}",
    )
    assert code == 0, out[-3000:]
    assert "config/config.yaml" not in out
    runs = _run_configs(out)
    assert list(runs) == [("grpo", 0)]
    grpo = runs[("grpo", 0)]
    assert grpo["output_dir"] == "results/smoke/runs/grpo/seed0"
    assert grpo["trainer"]["learning_rate"] == 1.0e-3  # the override
    # smoke's trainer
    assert (grpo["trainer"]["max_steps"], grpo["trainer"]["per_device_train_batch_size"]) == (4, 16)
    # smoke.yaml sets no task.bounded: the schema's default (false), not config/config.yaml's true
    assert grpo["dataset"]["bounded"] is False and grpo["dataset"]["max_ops"] == 2
    assert _job_counts(out)["train"] == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("methods=[grpo,d3z]", "config methods[1]: unknown method 'd3z'; valid methods: grpo, pods,"),
        ("method=[d3s]", "config (top level): unknown key(s) ['method']; valid: experiment,"),
        ("eval={jobs: checkpoint}", "config eval.jobs: 'checkpoint' is not one of ['model', 'run']"),
    ],
)
def test_a_bad_config_value_is_refused_in_one_line(offline_work, override, message):
    """As a bad value in a config file: one line naming the key and the fix, no traceback, no job."""
    code, out = _dry_run(offline_work, "--config", override)
    assert code != 0
    assert [line for line in out.splitlines() if line.startswith("config ")] == [
        next(line for line in out.splitlines() if line.startswith(message))
    ], out
    assert "Traceback" not in out and "rule " not in out, out
