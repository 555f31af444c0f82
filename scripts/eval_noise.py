"""How much of a comparison's spread across seeds is the evaluation's sampling (docs/studies/power.md).

`python scripts/eval_noise.py results/tiny results/studies/noise-2026-12-07 --methods grpo,pods,d3s` evaluates
every final model of RESULTS once more with another sampling seed (`d3s eval --seed`; the same problems,
samples and settings as its workflow evaluation, read from that evaluation's manifest; the problems' checksum
is checked), into RESULTS/eval_resampled/seed<sampling seed>/<method>/seed<seed>/. Then, for each method
against the reference, it splits the spread of the paired Pass@1 differences into the evaluation's sampling
and the training's variation (claims.eval_noise_split), and sizes the cheapest way to detect 1.5 points:
paired seeds at 1, 2 and 4 times the samples per problem (the sampling variance falls with the samples), each
with its CPU cost from the runs' training time and these evaluations' time. Writes OUT/draws.csv,
OUT/noise.csv, OUT/noise_times.json and OUT/README.md (small, for results/). An evaluation already there is
kept (the script resumes)"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from d3s.analysis.claims import eval_noise_split, seeds_for_effect
from d3s.analysis.studies import TARGET_EFFECT
from d3s.markdown import markdown_table
from d3s.provenance.manifest import atomic_write_text

SAMPLE_MULTIPLIERS = (1, 2, 4)
FINAL = "eval/{method}/seed{seed}/final"  # the workflow's evaluation of a run's final model


def eval_command(manifest: dict, model: Path, out: Path, seed: int, task: str = "") -> list[str]:
    """`d3s eval` of ``model`` with the settings of a workflow evaluation's manifest (one synthetic
    benchmark) and sampling seed ``seed``; ``task``: the synthetic task's keys where they are not the
    run's training task's (``min_ops=8,max_ops=8``), which the manifest does not hold (its checksum does)."""
    config = manifest["config"]
    if config["benchmark_names"] != ["synthetic"]:
        raise SystemExit(f"{model}: only the synthetic benchmark's evaluations are read here")
    bench = config["benchmarks"]["synthetic"]
    generation, scoring = bench["generation"], bench["scoring"]
    synthetic = ",".join([f"count={bench['n_problems']}", *filter(None, [task])])
    return [
        sys.executable, "-m", "d3s.cli", "eval", "--model", str(model), "--out", str(out),
        "--benchmarks", "synthetic", "--synthetic", synthetic,
        "--samples", str(generation["samples"]), "--k", ",".join(str(k) for k in scoring["ks"]),
        "--max-tokens", str(generation["max_new_tokens"]), "--temperature", str(generation["temperature"]),
        "--top-p", str(generation["top_p"]), "--template", bench["template"], "--backend", bench["backend"],
        "--batch-size", str(bench["batch_size"]), "--seed", str(seed), "--no-progress",
    ]  # fmt: skip


def pass_at_1(evaluation: Path) -> float:
    summary = json.loads((evaluation / "summary.json").read_text(encoding="utf-8"))
    return 100 * float(summary["benchmarks"]["synthetic"]["pass_at_k"]["1"])


def problems_checksum(evaluation: Path) -> str:
    manifest = json.loads((evaluation / "manifest.json").read_text(encoding="utf-8"))
    return manifest["config"]["benchmarks"]["synthetic"]["problems_sha256"]


def evaluate_again(
    results: Path, methods: list[str], seed: int, evaluations: str = FINAL, task: str = ""
) -> pd.DataFrame:
    """Both draws of every final model's Pass@1 (method, seed, first, second) and each new evaluation's
    wall seconds (NaN for one kept from an earlier call). ``evaluations``: where the workflow wrote the
    first draw, a path under ``results`` with {method} and {seed}."""
    rows = []
    for method in methods:
        for run in sorted((results / "runs" / method).glob("seed*")):
            where = Path(evaluations.format(method=method, seed=run.name[4:]))
            first = results / where
            second = results / "eval_resampled" / f"seed{seed}" / where
            seconds = math.nan
            if not (second / "summary.json").is_file():
                manifest = json.loads((first / "manifest.json").read_text(encoding="utf-8"))
                if manifest.get("seed", seed) == seed:
                    raise SystemExit(f"{first}: already sampled with seed {seed}; pass another --seed")
                print(f"evaluating {method} {run.name} again (seed {seed})", flush=True)
                start = time.perf_counter()
                subprocess.run(eval_command(manifest, run / "final", second, seed, task), check=True)
                seconds = time.perf_counter() - start
            if problems_checksum(second) != problems_checksum(first):
                raise SystemExit(f"{second}: other problems than {first}; the draws are not comparable")
            rows.append(
                {"method": method, "seed": int(run.name[4:]), "first": pass_at_1(first)}
                | {"second": pass_at_1(second), "eval_seconds": seconds}
            )
    return pd.DataFrame(rows)


def noise_table(
    draws: pd.DataFrame, reference: str, train_seconds: float, eval_seconds: float, effect: float
) -> pd.DataFrame:
    """Per method against ``reference``: the split of its paired differences' spread, then for each samples
    multiplier the paired seeds that detect ``effect`` and what one comparison's runs cost in CPU minutes."""
    wide = draws.pivot(index="seed", columns="method", values=["first", "second"])
    rows = []
    for method in [m for m in dict.fromkeys(draws["method"]) if m != reference]:
        split = eval_noise_split(
            wide["first"][method] - wide["first"][reference],
            wide["second"][method] - wide["second"][reference],
        )
        row = {"method": method, "reference": reference} | split
        for multiplier in SAMPLE_MULTIPLIERS:
            sd = math.sqrt(split["train_sd"] ** 2 + split["eval_sd"] ** 2 / multiplier)
            seeds = seeds_for_effect(sd, effect)
            minutes = seeds * 2 * (train_seconds + multiplier * eval_seconds) / 60 if seeds else math.nan
            row |= {f"seeds_x{multiplier}": seeds, f"cpu_minutes_x{multiplier}": minutes}
        rows.append(row)
    return pd.DataFrame(rows)


def noise_markdown(table: pd.DataFrame, effect: float) -> str:
    columns = {
        "comparison": lambda r: f"{r['method']} vs {r['reference']}",
        "seeds": lambda r: f"{r['n']:.0f}",
        "spread (SD)": lambda r: f"{r['total_sd']:.2f}",
        "evaluation's": lambda r: f"{r['eval_sd']:.2f}",
        "training's": lambda r: f"{r['train_sd']:.2f}",
    } | {
        f"to detect {effect:g}, {m * 8} samples": (
            lambda r, m=m: (
                f"{r[f'seeds_x{m}']:.0f} seeds, {r[f'cpu_minutes_x{m}']:.0f} CPU min"
                if r[f"seeds_x{m}"] and not pd.isna(r[f"seeds_x{m}"])
                else "over 1,000 seeds"
            )
        )
        for m in SAMPLE_MULTIPLIERS
    }
    return markdown_table((row for _, row in table.iterrows()), columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a workflow's results folder (results/<experiment>)")
    parser.add_argument("out", type=Path, help="where the second evaluations and the table go")
    parser.add_argument("--methods", default="grpo,pods,d3s")
    parser.add_argument("--reference", default="grpo")
    parser.add_argument("--seed", type=int, default=1, help="the second draw's sampling seed (1)")
    parser.add_argument("--effect", type=float, default=TARGET_EFFECT)
    parser.add_argument(
        "--evaluations", default=FINAL, help=f"the first draws, under RESULTS ({FINAL}; a study's held-out "
        "problems: eval_ood/<name>/{method}/seed{seed})",
    )  # fmt: skip
    parser.add_argument("--task", default="", help="the synthetic task's keys that differ from training's")
    args = parser.parse_args()
    methods = args.methods.split(",")
    draws = evaluate_again(args.results, methods, args.seed, args.evaluations, args.task)
    summaries = [args.results / "runs" / m / f"seed{s}" / "train_summary.json" for m, s in
                 zip(draws["method"], draws["seed"], strict=True)]  # fmt: skip
    train_seconds = float(pd.Series([json.loads(p.read_text())["train_seconds"] for p in summaries]).mean())
    eval_seconds = float(draws["eval_seconds"].mean())
    if math.isnan(eval_seconds):
        eval_seconds = float(json.loads((args.out / "noise_times.json").read_text())["eval_seconds"])
    table = noise_table(draws, args.reference, train_seconds, eval_seconds, args.effect)
    args.out.mkdir(parents=True, exist_ok=True)
    draws.to_csv(args.out / "draws.csv", index=False)
    table.to_csv(args.out / "noise.csv", index=False)
    times = {"train_seconds": train_seconds, "eval_seconds": eval_seconds}
    atomic_write_text(args.out / "noise_times.json", json.dumps(times, indent=2) + "\n")
    text = (
        f"# The evaluation's share of the spread ({args.results}, sampling seeds 0 and {args.seed})\n\n"
        f"Written by `python scripts/eval_noise.py {args.results} {args.out} --methods {args.methods} "
        f"--reference {args.reference} --seed {args.seed}"
        + (f" --evaluations {args.evaluations}" if args.evaluations != FINAL else "")
        + (f" --task {args.task}" if args.task else "")
        + "`. Cost of one comparison: both runs of each seed, "
        f"training {train_seconds:.0f} s and a final evaluation {eval_seconds:.0f} s at 8 samples (one core)."
        "\n\n" + noise_markdown(table, args.effect) + "\n"
    )
    atomic_write_text(args.out / "README.md", text)
    print(text)


if __name__ == "__main__":
    main()
