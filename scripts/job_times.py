"""Where a workflow's time went: job count, job-seconds and the wall-clock span per rule, from Snakemake's
own records (`.snakemake/metadata`, one per output file: its job's rule, start and end time).

    python scripts/job_times.py results/tiny          # run in the workflow's directory, after the run

A job with several outputs is counted once (its log names it). Job-seconds over the span, on a machine with
C cores, says how busy the cores were; a job's start-up (Python, torch, TRL) is inside its job-seconds.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
from pathlib import Path


def job_records(metadata: Path, results: str) -> list[dict]:
    """One record (rule, start, end) per job that wrote a file under ``results``."""
    jobs: dict[tuple, dict] = {}
    prefix = results.rstrip("/") + "/"
    for path in metadata.iterdir():
        try:
            output = base64.b64decode(path.name.replace("@", "/")).decode()
        except ValueError:
            continue
        if not output.startswith(prefix):
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("incomplete") or record.get("starttime") is None:
            continue
        # a job's outputs each have a record, their times a few ms apart; its log names the job
        key = (record["rule"], tuple(record.get("log") or [output]))
        job = jobs.setdefault(key, {"rule": record["rule"], "start": record["starttime"], "end": 0.0})
        job["start"], job["end"] = min(job["start"], record["starttime"]), max(job["end"], record["endtime"])
    return sorted(jobs.values(), key=lambda job: job["start"])


def summary(jobs: list[dict]) -> str:
    """A Markdown table: per rule, jobs, job-seconds and the median job; then the totals."""
    if not jobs:
        return "no finished job found"
    rows = ["| rule | jobs | job-seconds | median job (s) |", "|---|---|---|---|"]
    for rule in dict.fromkeys(job["rule"] for job in jobs):
        times = [job["end"] - job["start"] for job in jobs if job["rule"] == rule]
        rows.append(f"| {rule} | {len(times)} | {sum(times):.0f} | {statistics.median(times):.1f} |")
    total = sum(job["end"] - job["start"] for job in jobs)
    span = max(job["end"] for job in jobs) - min(job["start"] for job in jobs)
    rows.append(
        f"| all | {len(jobs)} | {total:.0f} | {statistics.median(j['end'] - j['start'] for j in jobs):.1f} |"
    )
    return "\n".join(rows) + f"\n\nfirst job start to last job end: {span:.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="the experiment's folder, as the workflow names it (results/tiny)")
    parser.add_argument("--metadata", default=".snakemake/metadata", type=Path)
    args = parser.parse_args(argv)
    if not args.metadata.is_dir():
        print(
            f"{args.metadata} not found: run this in the workflow's directory, after a run", file=sys.stderr
        )
        return 2
    print(summary(job_records(args.metadata, args.results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
