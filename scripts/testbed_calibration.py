"""The tiny testbed's calibration, read from a finished run of the workflow (docs/workflow/testbed.md).

    .venv/bin/python scripts/testbed_calibration.py                       # config/config.yaml's results
    .venv/bin/python scripts/testbed_calibration.py --configfile config/standard.yaml

Prints, as Markdown: held-out Pass@1 by number of operations of the base model and of every method's final
models (mean over seeds), the fraction of prompts whose rollouts all got the same reward over the first steps
(no signal for GRPO; what cross-group selection skips), the mean completion length, and each method's learning
curve (seed-mean Pass@1 by step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import yaml

from d3s.data.benchmarks import load_benchmark
from d3s.evaluation.runner import problems_sha256


def _samples(path: Path, ops_of: dict[str, int]) -> pd.DataFrame:
    frame = pd.read_json(path, lines=True, dtype={"problem_id": str})
    return frame.assign(ops=frame["problem_id"].astype(str).map(ops_of))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # argparse applies ``type`` to a string default too
    parser.add_argument("--configfile", type=Path, default="config/config.yaml", help="the workflow config")
    parser.add_argument("--first-steps", type=int, default=5, help="steps of the all-equal fraction")
    args = parser.parse_args()
    config = yaml.safe_load(args.configfile.read_text())
    args.results = Path("results") / config["experiment"]
    resolved = yaml.safe_load(next((args.results / "runs").glob("*/seed*/resolved_config.yaml")).read_text())
    options = dict(config.get("task") or {}) | dict(config["eval"].get("synthetic") or {})
    problems = load_benchmark("synthetic", synthetic={k: int(v) for k, v in options.items()})
    manifest = json.loads((args.results / "eval" / "base" / "synthetic" / "manifest.json").read_text())
    if manifest["config"]["problems_sha256"] != problems_sha256(problems):
        raise SystemExit(
            f"the held-out problems of {args.configfile} are not those {args.results} was evaluated on"
        )
    ops_of = {p.problem_id: p.question.count("+") + p.question.count("-") for p in problems}
    frames = {"base": [_samples(args.results / "eval" / "base" / "synthetic" / "samples.jsonl", ops_of)]}
    for path in sorted(args.results.glob("eval/*/seed*/final/synthetic/samples.jsonl")):
        frames.setdefault(path.parts[-5], []).append(_samples(path, ops_of))
    by_ops = {}
    for name, parts in frames.items():
        frame = pd.concat(parts)
        by_ops[name] = (100 * frame.groupby("ops")["correct"].mean()).round(1)
        by_ops[name]["all"] = round(100 * frame["correct"].mean(), 1)
    print("## Held-out Pass@1 (%) by number of operations\n")
    print(pd.DataFrame(by_ops).to_markdown())
    equal, lengths = [], []
    for metrics in sorted(args.results.glob("runs/*/seed*/metrics.jsonl")):
        logs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [log for log in logs if "frac_reward_zero_std" in log]
        equal += [log["frac_reward_zero_std"] for log in steps[: args.first_steps]]
        lengths += [log["completions/mean_length"] for log in steps if "completions/mean_length" in log]
    print(
        f"\nPrompts whose {resolved['trainer']['num_generations']} rollouts all got the same reward, "
        f"first {args.first_steps} steps of every run: {100 * sum(equal) / len(equal):.0f} % "
        f"(of {len(equal)} steps)"
    )
    print(f"Mean completion length in training: {sum(lengths) / len(lengths):.1f} tokens")
    curves = args.results / "tables" / "learning_curves.csv"
    if curves.is_file():
        curve = pd.read_csv(curves).groupby(["method", "step"])["value"].mean().unstack("method")
        print("\n## Learning curves: seed-mean held-out Pass@1 (%) by step\n")
        print((100 * curve).round(1).to_markdown())


if __name__ == "__main__":
    main()
