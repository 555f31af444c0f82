"""scripts/job_times.py: per-rule job counts and job-seconds from Snakemake's per-output records."""

from __future__ import annotations

import base64
import json
import runpy
from pathlib import Path

from helpers import REPO_ROOT

job_times = runpy.run_path(str(REPO_ROOT / "scripts" / "job_times.py"))


def _record(
    metadata: Path, output: str, rule: str, start: float, end: float, log: str | None, **extra
) -> None:
    name = base64.b64encode(output.encode()).decode().replace("/", "@")
    record = {"rule": rule, "starttime": start, "endtime": end, "log": [log] if log else []} | extra
    (metadata / name).write_text(json.dumps(record))


def test_a_job_with_several_outputs_counts_once_and_other_experiments_are_left_out(tmp_path):
    metadata = tmp_path / "metadata"
    metadata.mkdir()
    log = "results/tiny/logs/eval/d3s_seed0.log"
    for point, offset in (("step10", 0.001), ("final", 0.004)):  # one evaluate_run job, two outputs
        _record(
            metadata,
            f"results/tiny/eval/d3s/seed0/{point}/summary.json",
            "evaluate_run",
            10 + offset,
            40,
            log,
        )
    _record(
        metadata, "results/tiny/runs/d3s/seed0/train.yaml", "train", 0, 10, "results/tiny/logs/train/a.log"
    )
    _record(
        metadata, "results/tiny/runs/d3s/seed0/final", "train", 0.002, 10.003, "results/tiny/logs/train/a.log"
    )
    _record(metadata, "results/tiny/report.md", "report", 41, 43, None)
    _record(
        metadata, "results/tiny/x.json", "report", 50, 99, None, incomplete=True
    )  # a killed job: left out
    _record(metadata, "results/smoke/report.md", "report", 0, 500, None)  # another experiment
    jobs = job_times["job_records"](metadata, "results/tiny")
    assert [(job["rule"], round(job["end"] - job["start"], 3)) for job in jobs] == [
        ("train", 10.003),
        ("evaluate_run", 29.999),
        ("report", 2),
    ]
    table = job_times["summary"](jobs)
    assert "| evaluate_run | 1 | 30 | 30.0 |" in table and "| all | 3 | 42 |" in table
    assert table.endswith("first job start to last job end: 43 s")
