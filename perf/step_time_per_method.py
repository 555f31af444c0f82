"""Wall time of one training step per method on the tiny model (CPU), written to results/perf/.

    .venv/bin/python perf/step_time_per_method.py [--steps 20] [--threads 1]

Each method trains the same SFT-warm-started tiny model on the same prompts (8 prompts x 8 rollouts
per step, completions up to 24 tokens). Reported: mean wall seconds per step over all steps after the
first (which starts the grading worker), and the median of TRL's `step_time` (its `training_step`:
generation, scoring, selection and the update, without the optimizer step and logging).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from d3s.methods import METHODS
from d3s.runs.run import train

OUT = Path(__file__).resolve().parents[1] / "results" / "perf"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default=",".join(sorted(METHODS)))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            run_dir = Path(tmp) / method
            start = time.perf_counter()
            train(
                {
                    "method": method,
                    "model": "tiny",
                    "threads": args.threads,
                    "output_dir": str(run_dir),
                    "tiny": {"sft_steps": 150},
                    "dataset": {"name": "synthetic", "count": 2000, "max_ops": 1, "max_operand": 9},
                    "trainer": {
                        "max_steps": args.steps,
                        "per_device_train_batch_size": 64,
                        "num_generations": 8,
                        "max_completion_length": 24,
                        "learning_rate": 3e-4,
                        "disable_tqdm": True,
                    },
                }
            )
            total = time.perf_counter() - start
            logs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [entry for entry in logs if "loss" in entry]
            summary = json.loads((run_dir / "train_summary.json").read_text())
            rows.append(
                {
                    "method": method,
                    "seconds_per_step": summary["train_seconds"] / summary["steps"],
                    "trl_step_time_median": statistics.median(e["step_time"] for e in steps[1:]),
                    "update_tokens_per_step": statistics.mean(e["selection/update_tokens"] for e in steps),
                    "sample_keep_fraction": statistics.mean(
                        e["selection/sample_keep_fraction"] for e in steps
                    ),
                    "job_seconds_incl_sft": total,
                }
            )
            print(rows[-1], flush=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "steps": args.steps,
        "batch": "8 prompts x 8 rollouts, max 24 completion tokens",
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "step_time_per_method.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"Tiny model, CPU, {args.threads} thread(s), {args.steps} steps, {meta['batch']}.",
        "",
        "| method | s/step (whole step) | TRL step_time (median) | update tokens/step | samples kept |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['seconds_per_step']:.3f} | {r['trl_step_time_median']:.3f} | "
            f"{r['update_tokens_per_step']:.0f} | {r['sample_keep_fraction']:.2f} |"
        )
    (OUT / "step_time_per_method.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
