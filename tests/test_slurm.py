"""The workflow on a real Slurm cluster: Debian's Slurm 22.05 on one node (scripts/slurm_cluster.sh: munged,
MariaDB, slurmdbd, slurmctld, slurmd, on loopback), started for this module and stopped after it. Snakemake
submits every job through snakemake-executor-plugin-slurm with workflow/profiles/slurm, exactly as on a
cluster; the node's two GPUs are declared (type "fake", /dev/null as their device files) and the jobs asking
for them train on the CPU, as the workflow's GPU path does on a machine without one (test_launch.py).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, SNAKEMAKE, copy_workflow, dry_run_jobs, failed_job_logs

CLUSTER = REPO_ROOT / "scripts" / "slurm_cluster.sh"
SMOKE = Path("results/smoke")
# Status checks every second, not every 40 s (the plugin's default, right for a real cluster's slurmdbd).
FAST_STATUS = ["--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1"]


def _cluster(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    """The environment of a client of the test cluster: SLURM_CONF and the profile's variables."""
    missing = _cluster("missing").stdout.strip()
    if missing and os.geteuid() != 0:  # only root can install the packages and run the daemons
        pytest.skip(missing)
    if missing:
        install = _cluster("install", timeout=900)
        assert install.returncode == 0, f"{missing}; apt-get failed: {install.stderr[-2000:]}"
    # not under pytest's 0700 temporary root: munged runs as the munge user and must reach its socket
    folder = Path(tempfile.mkdtemp(prefix="d3s-slurm-"))
    start = _cluster("start", str(folder), str(os.getpid()))
    try:
        logs = "".join(f"\n{log}: {log.read_text()[-1500:]}" for log in sorted(folder.glob("*.log")))
        assert start.returncode == 0, start.stderr[-2000:] + logs
        yield {
            "SLURM_CONF": str(folder / "etc" / "slurm.conf"),
            "D3S_SLURM_PARTITION": "d3s-gpu",
            "D3S_SLURM_CPU_PARTITION": "d3s-cpu",
            "D3S_SLURM_ACCOUNT": "d3s-test",
        }
    finally:
        _cluster("stop", str(folder), timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def test_profile_names_the_workflows_gpu_rules(dry_run):
    """set-resources of the Slurm profile names the rules that run models, as they are named: a renamed rule
    silently loses its GPU partition and --nodes=1 (as evaluate did, split into evaluate_checkpoint and
    evaluate_final, then joined in evaluate_run)."""
    profile = (REPO_ROOT / "workflow" / "profiles" / "slurm" / "profile.v9+.yaml").read_text()
    line = next(line for line in profile.splitlines() if "?for rule in" in line)
    named = set(yaml.safe_load(line.split(" in ", 1)[1].rstrip(":")))
    # both shapes of eval.jobs: smoke.yaml's `model`, the default's `run`
    configs = [REPO_ROOT / "config" / name for name in ("smoke.yaml", "config.yaml")]
    rules = {job["rule"] for config in configs for job in dry_run_jobs(dry_run(config))}
    model_rules = {rule for rule in rules if rule == "train" or rule.startswith("evaluate")}
    evaluations = {"evaluate_base", "evaluate_checkpoint", "evaluate_final", "evaluate_run"}
    assert named == model_rules == {"train"} | evaluations


# Holds each training process once its checkpoint-2 is complete, while the file D3S_TEST_HOLD_FILE exists:
# the test cancels or orphans the jobs there, whatever the machine's speed. Found through PYTHONPATH.
HOLD = textwrap.dedent(
    """
    import os, sys, time

    _argv = list(getattr(sys, "orig_argv", sys.argv))
    if os.environ.get("D3S_TEST_HOLD_FILE") and "d3s.cli" in _argv and "train" in _argv:
        import d3s.callbacks.checkpoints as checkpoints

        _on_save = checkpoints.D3SCheckpointState.on_save

        def on_save(self, args, state, control, **kwargs):
            result = _on_save(self, args, state, control, **kwargs)
            while state.global_step == 2 and os.path.exists(os.environ["D3S_TEST_HOLD_FILE"]):
                time.sleep(0.5)
            return result

        checkpoints.D3SCheckpointState.on_save = on_save
    """
)

# Values that record when or how fast something ran, not what it computed: they differ between any two runs;
# and what a resumed run records of its resume (its origin; HF's train_loss averages this attempt's steps).
TIMING_KEYS = {
    "resumed_from", "train_loss",
    "checked", "created_at", "mtime_ns", "elapsed_s_this_run", "finished", "seconds", "started", "step_time",
    "train_runtime", "train_samples_per_second", "train_seconds", "train_steps_per_second", "written",
    # the code's version: the same in both runs, unless a developer commits or edits while the suite runs
    "commit", "dirty", "git_commit", "git_dirty",
}  # fmt: skip
TIMING_COLUMNS = {"seconds", "seconds_per_step", "speedup_time", "speedup (time)", "wall_clock"}
TIMING_CLAIMS = {"step_time", "speedup_wall_clock"}
# Files that are records of a run rather than its results: logs, executed notebooks, figures (PDFs carry
# their creation time; the wall-clock plot its times), TRL's model card (its tags are a set), the report (its
# provenance table and timing claims; its other numbers come from the tables compared here).
# training_args.bin pickles the launch's process settings (accelerate's single-GPU path vs in-process);
# provenance.md renders provenance.json (compared) with its times.
NOT_COMPARED = (
    "logs/",
    "notebooks/",
    "figures/",
    "report.md",
    "provenance.md",
    "README.md",
    "training_args.bin",
)

# A checkpoint's completion mark and a final model's record of its files (d3s.provenance.integrity).
FILE_RECORDS = {"d3s_state.json", "d3s_files.json"}
PARSED = {".json", ".jsonl", ".csv"}  # compared by their values, timings aside (_comparable)


def _without_timings(value: object, *, manifest: bool) -> object:
    if isinstance(value, dict):
        dropped = TIMING_KEYS | ({"sha256"} if manifest else set())  # manifests hash the files above
        return {k: _without_timings(v, manifest=manifest) for k, v in value.items() if k not in dropped}
    if isinstance(value, list):
        return [_without_timings(v, manifest=manifest) for v in value]
    return value


def _comparable(path: Path) -> object:
    """What of an output must be the same in any two runs of the same configuration."""
    text = path.read_bytes()
    if path.name in FILE_RECORDS:
        # each file's size and checksum: those of the files compared as bytes; of the others, their names
        record = _without_timings(json.loads(text), manifest=False)
        record["files"] = {
            f: None if Path(f).suffix in PARSED else v
            for f, v in record["files"].items()
            if Path(f).name not in NOT_COMPARED
        }
        return record
    if path.suffix == ".json":
        return _without_timings(json.loads(text), manifest=path.name == "manifest.json")
    if path.suffix == ".jsonl":
        return [_without_timings(json.loads(line), manifest=False) for line in text.splitlines()]
    if path.suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(text.decode())))
        return [
            {k: v for k, v in row.items() if k not in TIMING_COLUMNS}
            for row in rows
            if row.get("claim") not in TIMING_CLAIMS
        ]
    return text


def _assert_same_outputs(local: Path, slurm: Path) -> None:
    files = {p.relative_to(local) for p in local.rglob("*") if p.is_file()}
    assert files == {p.relative_to(slurm) for p in slurm.rglob("*") if p.is_file()}
    compared = [
        f for f in sorted(files) if not str(f).startswith(NOT_COMPARED) and f.name not in NOT_COMPARED
    ]
    assert len(compared) > 100  # weights, samples, metrics, summaries, tables
    differ = [str(f) for f in compared if _comparable(local / f) != _comparable(slurm / f)]
    assert not differ, f"outputs through Slurm differ from the local run's: {differ}"


# The plugin's line for each submission, naming the rule in its log's path (plugin 2.6.0 prints no
# "rule <name>:" header for a submitted job).
SUBMITTED_RULE = re.compile(r"submitted with SLURM jobid \d+ \(log: \S*/slurm_logs/rule_([A-Za-z0-9_]+)/")


def _squeue(env: dict) -> list[dict[str, str]]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i|%k|%T"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return [dict(zip(("id", "comment", "state"), line.split("|"), strict=True)) for line in out.splitlines()]


def _scontrol_job(job_id: str, env: dict) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, check=True
    ).stdout
    return dict(token.split("=", 1) for token in out.split() if "=" in token)


def _wait(condition, seconds: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {seconds} s\n" + log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_smoke_workflow_through_slurm_survives_scancel_and_a_killed_snakemake(
    tmp_path, slurm, smoke_workflow
):
    """The smoke configuration through the real cluster, its training jobs on the GPU path (gpu: 1 each):

    1. each training job's submission asks for what the config says (scontrol show job: the GPUs of the
       profile's model, CPUs per GPU, memory, time, one node, the GPU partition and the account);
    2. d3s's training job is cancelled with scancel after checkpoint-2; Snakemake records the failure;
    3. Snakemake is SIGKILLed while grpo's training job and evaluate_base are still in Slurm's queue; they
       run on, orphaned, to their end;
    4. the same command again (after --unlock): d3s resumes from checkpoint-2, the jobs that finished are not
       run again, and every output equals the local run's (test_workflow.py's smoke run), timings aside.
    """
    work = copy_workflow(tmp_path)
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    # the GPU type from the config, not D3S_SLURM_GPU_MODEL: the profile would give it to the evaluation jobs
    # too, which have no gpu here (they run on the CPU) and plugin 2.6.0 refuses a type without a count
    train_resources = {"gpu": 1, "gpu_model": "fake", "cpus_per_gpu": 1, "mem_mb": 4000, "runtime": 20}
    cfg["train"]["resources"] = train_resources
    (work / "config" / "slurm.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))  # as smoke.yaml
    (work / "hold_code").mkdir()
    (work / "hold_code" / "sitecustomize.py").write_text(HOLD)
    hold = work / "hold"
    hold.touch()
    env = (
        os.environ
        | slurm
        | {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(work / "hold_code"), os.environ.get("PYTHONPATH")])
            ),
            "D3S_TEST_HOLD_FILE": str(hold),
        }
    )
    profile = ["--workflow-profile", "workflow/profiles/slurm"]
    command = SNAKEMAKE + profile + ["--configfile", "config/slurm.yaml", *FAST_STATUS]
    first_log = tmp_path / "first.log"
    with open(first_log, "w") as out:
        first = subprocess.Popen(
            command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        runs = {m: work / SMOKE / "runs" / m / "seed0" for m in ("grpo", "d3s")}
        _wait(
            lambda: all((run / "checkpoint-2" / "d3s_state.json").is_file() for run in runs.values()),
            900,
            "both training jobs at checkpoint-2",
            first_log,
        )
        train_jobs = {}
        for job in _squeue(env):
            for method in runs:
                if job["comment"].startswith(f"rule_train_wildcards_{method}_"):  # the plugin's comment
                    train_jobs[method] = job["id"]
        assert set(train_jobs) == set(runs), _squeue(env)
        for job_id in train_jobs.values():
            record = _scontrol_job(job_id, env)
            assert record["JobState"] == "RUNNING"
            assert record["TresPerJob"] == "gres:gpu:fake:1" and record["CpusPerTres"] == "gres:gpu:1"
            assert record["MinMemoryNode"] == "4000M" and record["TimeLimit"] == "00:20:00"
            assert record["NumNodes"] == "1" and record["NumCPUs"] == "1"
            assert record["Partition"] == "d3s-gpu" and record["Account"] == "d3s-test"

        subprocess.run(["scancel", train_jobs["d3s"]], env=env, check=True)
        _wait(lambda: "Error in rule train" in first_log.read_text(), 400, "the cancel noticed", first_log)
        assert first.poll() is None  # keep-going: the other jobs go on
        queued = _squeue(env)
        assert train_jobs["grpo"] in {job["id"] for job in queued}
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        hold.unlink()  # the orphans run on to their end
    _wait(lambda: not _squeue(env), 900, "the orphaned jobs' end", first_log)
    assert not (runs["d3s"] / "train_summary.json").exists()
    assert (runs["grpo"] / "train_summary.json").is_file()  # finished, orphaned

    unlock = subprocess.run(command + ["--unlock"], cwd=work, env=env, capture_output=True, text=True)
    assert unlock.returncode == 0, unlock.stderr[-2000:]
    again = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-5000:] + failed_job_logs(out, work)
    rerun_jobs = SUBMITTED_RULE.findall(out)
    assert rerun_jobs.count("train") == 1 and "base_model" not in rerun_jobs, rerun_jobs
    d3s_log = (work / SMOKE / "logs" / "train" / "d3s_seed0.log").read_text()
    assert "resuming from results/smoke/runs/d3s/seed0/checkpoint-2 (step 2)" in d3s_log
    assert "(step 0)" not in d3s_log and "starting over" not in d3s_log
    for run in runs.values():
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4]  # each step logged once
    _assert_same_outputs(smoke_workflow / SMOKE, work / SMOKE)

    accounted = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "Comment,Partition,Account,State"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    partitions = {line.split("|")[0].split("_wildcards")[0]: line.split("|")[1] for line in accounted}
    assert partitions["rule_report"] == "d3s-cpu" and partitions["rule_evaluate_final"] == "d3s-gpu"
    assert {line.split("|")[2] for line in accounted} == {"d3s-test"}
