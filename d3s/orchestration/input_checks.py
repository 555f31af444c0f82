"""The workflow's input check before any job of a `snakemake` run starts (docs/workflow/checks.md, "What is
checked where"), run in a process of its own so that TRL stays out of Snakemake's; the request is
{"config", "task", "accelerate_dir", "checks": names in CHECKS}. Each problem is one line naming the fix;
else the output file records where each input was found."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from d3s.data.benchmarks import BenchmarkError, benchmark_source, load_benchmark, parse_benchmark_list
from d3s.orchestration.run_config import resolved_trainer_configs
from d3s.provenance.manifest import atomic_write_text, now, write_json
from d3s.runs.config import check_model_dir
from d3s.variants import run_variants
from d3s.vllm_engine import keep_vllm_out_of_this_process


def check_trainer_settings(request: Mapping[str, Any]) -> dict[str, Any]:
    config = request["config"]
    variants = run_variants(config)
    if not any(v.train_settings(config["train"]).get("use_vllm") for v in variants.values()):
        keep_vllm_out_of_this_process()  # else TRL imports it to resolve the configs: 7-9 s on the CPU
    resolved_trainer_configs(config, request["accelerate_dir"], request["task"], check_inputs=False)
    return {"methods": list(variants)}


def check_base_model(request: Mapping[str, Any]) -> dict[str, Any]:
    base = request["config"]["base_model"]
    if base["kind"] == "tiny":
        return {"kind": "tiny", "found": "built by rule base_model"}
    path = str(base["path"])
    if check_model_dir(path, "base_model.path"):  # a local directory, checked
        return {"path": path, "found": "local directory"}
    from huggingface_hub import model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return {"path": path, "found": "local Hugging Face cache"}
    try:  # raises at once under HF_HUB_OFFLINE, and when the Hub cannot be reached or has no such model
        model_info(path)
    except Exception as exc:
        raise ValueError(
            f"base_model.path {path}: not a local directory, not in the local Hugging Face cache, and the "
            f"Hub cannot serve it ({' '.join(f'{type(exc).__name__}: {exc}'.split())}); download it where "
            f"the Hub is reachable (hf download {path}) or set base_model.path to a local copy"
        ) from None
    return {"path": path, "found": "Hugging Face Hub"}


def _benchmark(key: str, name: str, data_dir: str | None, **kwargs: Any) -> dict[str, Any]:
    try:
        problems = load_benchmark(name, data_dir, **kwargs)
    except BenchmarkError as exc:
        raise ValueError(f"{key} {name}: {exc}") from None
    return {"found": benchmark_source(name, data_dir), "problems_read": len(problems)}


def check_train_dataset(request: Mapping[str, Any]) -> dict[str, Any]:
    train = request["config"]["train"]
    name = dict(train.get("dataset") or {}).get("name", "synthetic")
    if name == "synthetic":
        return {"name": name, "found": benchmark_source(name)}
    # the first row, as `d3s train` checks it (d3s.runs.resolve): malformed rows are skipped there, warned of
    return {"name": name, **_benchmark("train.dataset", name, train.get("data_dir"), limit=1)}


def check_eval_benchmarks(request: Mapping[str, Any]) -> dict[str, Any]:
    ev = request["config"]["eval"]
    found, problems = {}, []
    for name in parse_benchmark_list(ev["benchmarks"]):
        try:  # every row, as `d3s eval` reads them before loading a model: a malformed row fails here too
            found[name] = _benchmark("eval.benchmarks", name, ev.get("data_dir"))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))
    return found


CHECKS = {
    "trainer_settings": check_trainer_settings,
    "base_model": check_base_model,
    "train_dataset": check_train_dataset,
    "eval_benchmarks": check_eval_benchmarks,
}


def run_input_checks(
    request: Mapping[str, Any], out: str | os.PathLike[str], log: str | os.PathLike[str]
) -> int:
    """Run the checks ``request["checks"]`` names; returns the exit code: 1 with one line per problem on
    stderr and in ``log``, else 0 with where each input was found in ``out``."""
    unknown = set(request["checks"]) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; valid: {sorted(CHECKS)}")
    found, problems = {}, []
    for name, check in CHECKS.items():
        if name in request["checks"]:
            try:
                found[name] = check(request)
            except ValueError as exc:
                problems.extend(f"config {line}" for line in str(exc).splitlines())
    atomic_write_text(log, "".join(line + "\n" for line in problems) or "all inputs found\n")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    write_json(out, {"checked": now(), **found})
    return 0
