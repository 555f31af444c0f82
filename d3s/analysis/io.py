"""Readers of the workflow's logged files (docs/workflow/stages.md); each checks the manifests of what it
reads and refuses mixed settings (MixedSettingsError) unless ``allow_mixed=True``; rows name their
``manifest``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from d3s.evaluation.kl import KL_FILE
from d3s.evaluation.metrics import pass_at_k
from d3s.evaluation.runner import SAMPLES_FILE
from d3s.provenance import layout
from d3s.provenance.settings_check import MixedSettingsError, load_provenance

# What load_kl reads of each kl.json (d3s.evaluation.kl)
KL_COLUMNS = ["k1", "k3", "k1_per_sequence", "tokens", "sequences", "mean_completion_tokens"]
KL_COLUMNS += ["truncated_fraction", "seconds"]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_metrics(results: str | Path, allow_mixed: bool = False) -> pd.DataFrame:
    """Every training step of every run: method, seed, step, the trainer's logged metrics, ``wall_clock``
    (cumulative ``step_time``, seconds of training) and ``update_tokens_cumulative``."""
    results = Path(results)
    load_provenance(results, allow_mixed, groups=("training",))
    frames = []
    for method, seed, run in layout.runs(results):
        path = run / "metrics.jsonl"
        rows = [r for r in read_jsonl(path) if "loss" in r or "reward" in r] if path.is_file() else []
        if not rows:
            continue
        df = pd.DataFrame(rows)
        df = df.sort_values("step").drop_duplicates("step", keep="last")
        df.insert(0, "seed", seed)
        df.insert(0, "method", method)
        df["manifest"] = _rel(run / layout.MANIFEST, results)
        if "step_time" in df:
            df["wall_clock"] = df["step_time"].fillna(0).cumsum()
        if "selection/update_tokens_cumulative" in df:
            df["update_tokens_cumulative"] = df["selection/update_tokens_cumulative"]
        elif "selection/update_tokens" in df:
            df["update_tokens_cumulative"] = df["selection/update_tokens"].fillna(0).cumsum()
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=["method", "seed", "step"])
    return pd.concat(frames, ignore_index=True)


def _summary_rows(evaluation: Path, results: Path, **labels) -> list[dict]:
    """One row per benchmark and k of the evaluation in folder ``evaluation`` (and the average, over several
    benchmarks): ``labels``, then its manifest, benchmark, k, value and interval."""
    summary = json.loads((evaluation / "summary.json").read_text())
    labels["manifest"] = _rel(evaluation / layout.MANIFEST, results)
    rows = []
    for bench, info in summary.get("benchmarks", {}).items():
        for k, value in (info.get("pass_at_k") or {}).items():
            ci = (info.get("ci") or {}).get(k) or [None, None]
            at = {"benchmark": bench, "k": int(k), "value": value, "ci_low": ci[0], "ci_high": ci[1]}
            rows.append(labels | at | {"n_problems": info.get("n_problems")})
    if len(summary.get("benchmarks", {})) > 1:
        rows += [
            labels | {"benchmark": "average", "k": int(k), "value": value}
            for k, value in (summary.get("average") or {}).items()
        ]
    return rows


def _run_points(results: Path, file: str = "summary.json") -> Iterator[tuple[layout.EvalPoint, dict]]:
    """Every evaluation of a run holding ``file``, with its labels: method, seed, step and final (the final
    model's step is the run's step count, from train_summary.json)."""
    steps_of = {
        (method, seed): int(json.loads((run / "train_summary.json").read_text()).get("steps", 0))
        for method, seed, run in layout.runs(results)
        if (run / "train_summary.json").is_file()
    }
    for point in layout.eval_points(results, file=file):
        if point.method != "base":
            final = point.name == "final"
            step = steps_of.get((point.method, point.seed)) if final else point.step
            yield point, {"method": point.method, "seed": point.seed, "step": step, "final": final}


def load_evals(results: str | Path, allow_mixed: bool = False) -> pd.DataFrame:
    """Every evaluation: method, seed, step, final flag, benchmark, k, value (Pass@k on [0, 1]); the base
    model is copied under every method and seed at step 0 so learning curves start from it."""
    results = Path(results)
    load_provenance(results, allow_mixed, groups=("final", "checkpoints"))
    rows = [
        row
        for point, labels in _run_points(results)
        for row in _summary_rows(point.directory, results, **labels)
    ]
    base = results / "eval" / "base"
    if (base / "summary.json").is_file():
        for method, seed in sorted({(r["method"], r["seed"]) for r in rows}) or [("base", 0)]:
            rows += _summary_rows(base, results, method=method, seed=seed, step=0, final=False)
    if not rows:
        return pd.DataFrame(columns=["method", "seed", "step", "final", "benchmark", "k", "value"])
    return pd.DataFrame(rows).sort_values(["method", "seed", "benchmark", "k", "step"]).reset_index(drop=True)


def load_curve_evals(results: str | Path, allow_mixed: bool = False) -> pd.DataFrame:
    """``load_evals`` with every point of a run's learning curve on one problem set: the final model's and
    the base model's Pass@k rescored from their samples on the problems the run's checkpoints were evaluated
    on (``eval.checkpoint_limit``, the first of each benchmark), at the checkpoints' k. Without it a curve
    would end on more problems than its checkpoints saw, and a speedup's "best" could come from an easier
    subset. Runs without checkpoint evaluations keep their rows as they are. No "average" rows: learning
    curves average the benchmarks themselves (d3s.analysis.tables.learning_curves)."""
    evals = load_evals(results, allow_mixed)
    if evals.empty:
        return evals
    results = Path(results)
    checkpoints = evals[(evals["step"] > 0) & ~evals["final"] & (evals["benchmark"] != "average")]
    ks = checkpoints.groupby(["method", "seed"])["k"].agg(lambda k: sorted(set(k)))
    read: dict[Path, list[dict]] = {}  # samples files, each read once (the base model's serves every run)

    def samples(path: Path) -> list[dict]:
        if path not in read:
            read[path] = read_jsonl(path)
        return read[path]

    def checkpoint_problems(method: str, seed: int, benchmark: str) -> frozenset[str]:
        rows = checkpoints[
            (checkpoints["method"] == method)
            & (checkpoints["seed"] == seed)
            & (checkpoints["benchmark"] == benchmark)
        ]
        sets = {
            frozenset(
                str(r["problem_id"])
                for r in samples(results / Path(manifest).parent / benchmark / SAMPLES_FILE)
            )
            for manifest in set(rows["manifest"])
        }
        if len(sets) != 1:
            raise ValueError(
                f"the checkpoints of {method} seed {seed} were evaluated on different {benchmark} problems "
                f"({len(sets)} sets): evaluate them with one eval.checkpoint_limit"
            )
        return sets.pop()

    rescored, drop = [], []
    for (method, seed), run_ks in ks.items():
        ends = evals[
            (evals["method"] == method)
            & (evals["seed"] == seed)
            & (evals["final"] | (evals["step"] == 0))
            & (evals["benchmark"] != "average")
        ]
        drop += list(ends.index)
        for (manifest, benchmark), rows in ends.groupby(["manifest", "benchmark"]):
            first = rows.iloc[0].to_dict()
            path = results / Path(manifest).parent / benchmark / SAMPLES_FILE
            problems = checkpoint_problems(method, seed, benchmark)
            values = _pass_at_k_on(samples(path), problems, run_ks, path)
            for k, value in values.items():
                keep = {key: first[key] for key in ("method", "seed", "step", "final", "manifest")}
                rescored.append(keep | {"benchmark": benchmark, "k": k, "value": value})
                rescored[-1] |= {"ci_low": math.nan, "ci_high": math.nan, "n_problems": len(problems)}
    kept = evals.drop(index=drop)
    kept = kept[kept["benchmark"] != "average"]
    out = pd.concat([kept, pd.DataFrame(rescored)], ignore_index=True)
    return out.sort_values(["method", "seed", "benchmark", "k", "step"]).reset_index(drop=True)


def _pass_at_k_on(
    records: list[dict], problems: frozenset[str], ks: list[int], path: Path
) -> dict[int, float]:
    """Mean Pass@k over ``problems`` of one evaluation's sample records, graded as its summary was (the
    records' own ``correct``; problems with unparsable gold left out)."""
    by_problem: dict[str, list[dict]] = {}
    for record in records:
        if str(record["problem_id"]) in problems:
            by_problem.setdefault(str(record["problem_id"]), []).append(record)
    if missing := problems - set(by_problem):
        raise ValueError(
            f"{path} lacks {len(missing)} of the checkpoints' problems (e.g. {sorted(missing)[0]}): the "
            "final evaluation must cover them (eval.checkpoint_limit <= eval.limit)"
        )
    counts = [
        (len(rs), sum(bool(r["correct"]) for r in rs))
        for rs in by_problem.values()
        if all(r.get("gold_parsed", True) for r in rs)
    ]
    return {k: sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) for k in ks if counts}


def load_kl(results: str | Path, allow_mixed: bool = False) -> pd.DataFrame:
    """KL to the initial policy (``kl.json`` of d3s.evaluation.kl): one row per (method, seed, step) with
    KL_COLUMNS, the probe's settings and hash and the file read. Refuses different probe settings, or one
    run's checkpoints measured on different probe prompts, unless ``allow_mixed``."""
    results = Path(results)
    rows = []
    for point, labels in _run_points(results, KL_FILE):
        record = json.loads((point.directory / KL_FILE).read_text())
        rows.append(
            labels
            | {key: record.get(key) for key in KL_COLUMNS}
            | {"settings": json.dumps(record.get("settings"), sort_keys=True)}
            | {"probe_sha256": record.get("probe_sha256"), "file": _rel(point.directory / KL_FILE, results)}
        )
    columns = ["method", "seed", "step", "final", *KL_COLUMNS, "settings", "probe_sha256", "file"]
    df = pd.DataFrame(rows, columns=columns)
    if df.empty:
        return df
    problems = []
    if df["settings"].nunique() > 1:
        problems.append(f"probe settings differ: {sorted(df['settings'].unique())}")
    probes = df.groupby(["method", "seed"])["probe_sha256"].nunique()
    if (probes > 1).any():
        runs = [f"{m}/seed{s}" for m, s in probes[probes > 1].index]
        problems.append(f"checkpoints of {runs} were measured on different probe prompts")
    if problems and not allow_mixed:
        raise MixedSettingsError(
            f"KL files of {results}: {'; '.join(problems)}. Re-run their evaluation with one eval.kl "
            "setting, or pass allow_mixed=True (analysis.allow_mixed_settings) to combine them"
        )
    # the final model may also be a checkpoint
    df = df.drop_duplicates(["method", "seed", "step"], keep="last")
    return df.sort_values(["method", "seed", "step"]).reset_index(drop=True)


def _rel(path: Path, results: Path) -> str:
    return str(path.relative_to(results))


def load_base_eval(results: str | Path, allow_mixed: bool = False) -> pd.DataFrame:
    """The base model's evaluation, one row per benchmark and k (checked with the final evaluations); empty
    when the base model was not evaluated."""
    results = Path(results)
    load_provenance(results, allow_mixed, groups=("final",))
    base = results / "eval" / "base"
    if not (base / "summary.json").is_file():
        return pd.DataFrame()
    return pd.DataFrame(_summary_rows(base, results, method="base", seed=0, step=0, final=False))


def load_anatomy(results: str | Path, allow_mixed: bool = False) -> tuple[pd.DataFrame, list[dict]]:
    """(groups, token_records) of ``anatomy.jsonl`` (trainer.anatomy_every > 0): a row per (method, seed,
    step, group) with rewards, advantages, kept, ``n_kept``, ``var_kept``, ``var_all`` and ``var_ratio``
    (Lemma 1; docs/workflow/stages.md, "Notebooks"); the token records (method, seed, step, token_keep_ratio,
    examples)."""
    load_provenance(results, allow_mixed, groups=("training",))
    groups, tokens = [], []
    for method, seed, run in layout.runs(Path(results)):
        path = run / "anatomy.jsonl"
        for record in read_jsonl(path) if path.is_file() else []:
            labels = {"method": method, "seed": seed, "step": record.get("step")}
            if record.get("kind") == "tokens":
                tokens.append(labels | {k: v for k, v in record.items() if k not in ("kind", "step")})
            if record.get("kind") != "samples":
                continue
            for index, group in enumerate(record.get("groups", [])):
                kept = [a for a, keep in zip(group["advantages"], group["kept"], strict=True) if keep]
                var_kept, var_all = _var(kept), _var(group["advantages"])
                groups.append(
                    labels
                    | {key: record.get(key) for key in ("keep_per_prompt", "num_generations")}
                    | {key: group[key] for key in ("rewards", "advantages", "kept")}
                    | {"group": index, "n_kept": len(kept), "var_kept": var_kept, "var_all": var_all}
                    | {"var_ratio": var_kept / var_all if var_all > 0 else float("nan")}
                    | {"reward_std": _var(group["rewards"]) ** 0.5}
                )
    return pd.DataFrame(groups), tokens


def _var(values) -> float:
    """Unbiased variance (ddof 1, NaN below 2 values), the convention of TRL's advantage standardisation."""
    return pd.Series(values, dtype=float).var(ddof=1)
