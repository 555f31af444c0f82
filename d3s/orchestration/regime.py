"""The regime sweep (``d3s regime``; docs/workflow/regime-sweep.md): one complete experiment of the
workflow per prompts-per-step P of a config's ``regime`` section, all from one shared base model, then the
sweep's analysis (d3s.analysis.regime).

Every point is an ordinary ``snakemake`` run of the config with three ``--config`` values: its experiment
(``<experiment>/p<P>``), its batch (``per_device_train_batch_size`` = P x num_generations on the CPU, or
``train.prompts_per_step`` = P where the config sets it) and, for a tiny base model, the model built once in
``<experiment>/base`` as ``base_model: {kind: path}``. Snakemake skips what is done, so a re-run resumes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml
from snakemake.utils import update_config

from d3s.orchestration.workflow_config import check_workflow_config, check_workflow_files, validate_config
from d3s.runs.config import SyntheticDataset

PROGRESS = re.compile(r"\d+ of \d+ steps \(\d+%\) done")


@dataclass(frozen=True)
class Point:
    """One regime point: P prompts per step, its experiment and the --config values that make it."""

    prompts: int
    rollouts: int  # per step: P x num_generations
    experiment: str
    overrides: dict[str, Any]  # the --config values (train, base_model), merged into the config

    @property
    def results(self) -> Path:
        return Path("results") / self.experiment


@dataclass(frozen=True)
class Sweep:
    """A checked sweep: the config file, the sweep's experiment, the shared base model and the points."""

    config_path: str
    config: dict[str, Any]  # the sweep config, defaults filled in by the schema
    experiment: str
    base_experiment: str | None  # where the tiny base model is built once; None: base_model.kind path
    base_model: str  # the model every point starts from
    points: tuple[Point, ...]

    @property
    def results(self) -> Path:
        return Path("results") / self.experiment


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ValueError(f"config file {path} not found (e.g. config/regime.yaml)") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a workflow config (a mapping, as config/regime.yaml)")
    return config


def plan_sweep(
    config_path: str, accelerate_dir: str | os.PathLike[str], schema: str | os.PathLike[str]
) -> Sweep:
    """The sweep of ``config_path``, every point's config checked as the workflow checks it at parse time
    (against the workflow's ``schema`` and accelerate configs in ``accelerate_dir``); ValueError with one
    line naming the key and the fix, before anything runs."""
    raw = _read(config_path)
    if "regime" not in raw:
        raise ValueError(
            f"config regime: {config_path} has no regime section; a sweep config sets e.g. "
            "regime: {prompts_per_step: [8, 16, 32, 64]} (config/regime.yaml)"
        )
    prompts = raw["regime"].get("prompts_per_step") if isinstance(raw["regime"], dict) else None
    if isinstance(prompts, list) and len(prompts) < 2:
        raise ValueError(
            f"config regime.prompts_per_step: {prompts} is one point; a slope needs at least 2, e.g. "
            "[8, 16, 32, 64]"
        )
    config = copy.deepcopy(raw)
    validate_config(config, schema)  # the one structural check, defaults filled in; one-line errors
    methods, reference = config["methods"], config["analysis"]["reference"]
    if reference not in methods or len(methods) < 2:
        raise ValueError(
            f"config methods: the sweep compares methods with analysis.reference {reference!r}: list it and "
            f"at least one other method (methods: {methods})"
        )
    experiment = config["experiment"]
    tiny = config["base_model"]["kind"] == "tiny"
    base_experiment = f"{experiment}/base" if tiny else None
    base_model = f"results/{base_experiment}/base_model" if tiny else config["base_model"]["path"]
    train = config["train"]
    generations = int(train["trainer"].get("num_generations", 8))
    points = []
    for prompts in sorted(config["regime"]["prompts_per_step"]):
        if "prompts_per_step" in train:  # GPU configs: the workflow derives the accumulation from P
            batch: dict[str, Any] = {"prompts_per_step": prompts}
        else:
            batch = {"trainer": {"per_device_train_batch_size": prompts * generations}}
        batch |= _one_pass(train, prompts)
        overrides: dict[str, Any] = {"train": batch}
        if tiny:
            overrides["base_model"] = {"kind": "path", "path": base_model}
        point = Point(prompts, prompts * generations, f"{experiment}/p{prompts}", overrides)
        resolved = point_config(raw, point)
        try:
            check_workflow_config(resolved, accelerate_dir, schema)
        except ValueError as exc:
            raise ValueError(f"{exc} (regime point P = {prompts})") from None
        points.append(point)
    return Sweep(config_path, config, experiment, base_experiment, base_model, tuple(points))


def _one_pass(train: dict[str, Any], prompts: int) -> dict[str, Any]:
    """The synthetic training set a point at ``prompts`` per step needs to train on every prompt once, none
    twice: config/regime.yaml's 4,000 prompts cover 64 x 40 steps, so P = 256 gets 10,240. A larger count
    only appends (the task draws its prompts in a fixed order per seed), so the smaller points' prompts are
    the first of a larger point's; the count is then the one setting besides the batch in which points
    differ (d3s.analysis.regime_provenance.POINT_KEYS)."""
    dataset = train.get("dataset") or {}
    steps = train["trainer"].get("max_steps")
    if dataset.get("name", "synthetic") != "synthetic" or not isinstance(steps, int) or steps < 1:
        return {}
    needed = prompts * steps
    return {"dataset": {"count": needed}} if needed > dataset.get("count", SyntheticDataset.count) else {}


def point_config(raw: dict[str, Any], point: Point) -> dict[str, Any]:
    """The config a point's snakemake run resolves: the file's, with the point's --config values on top."""
    config = copy.deepcopy(raw)
    update_config(config, {"experiment": point.experiment} | copy.deepcopy(point.overrides))
    return config


def snakemake_command(sweep: Sweep, cores: int, point: Point | None = None) -> list[str]:
    """The snakemake command of a point, or (``point`` None) the one building the shared base model."""
    command = [sys.executable, "-m", "snakemake"]
    if point is None:  # the target: rule base_model's output
        command.append(f"{sweep.base_model}/config.json")
    command += ["--cores", str(cores), "--rerun-incomplete", "--configfile", sweep.config_path, "--config"]
    if point is None:
        return command + [f"experiment={sweep.base_experiment}"]
    values = [f"{key}={json.dumps(value)}" for key, value in point.overrides.items()]
    return command + [f"experiment={point.experiment}", *values]


def _run(command: Sequence[str], log: Path, out: TextIO) -> int:
    """Run ``command``, its output written to ``log`` and its progress lines echoed to ``out``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"\n$ {shlex.join(command)}\n")
        handle.flush()
        process = subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert process.stdout is not None
        for line in process.stdout:
            handle.write(line)
            if PROGRESS.search(line) or line.startswith(("Error", "config ")):
                print(f"    {line.strip()}", file=out, flush=True)
        return process.wait()


def _tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []
    return "\n".join(f"    | {line}" for line in text[-lines:])


def run_sweep(sweep: Sweep, cores: int, dry_run: bool = False, out: TextIO = sys.stdout) -> int:
    """Build the base model, run every point through to its report, then the sweep's analysis; 0 when all
    of it is written. Logs: ``results/<experiment>/logs/<base|p<P>>.log``."""
    logs = sweep.results / "logs"
    steps: list[tuple[str, list[str], Path]] = []
    if sweep.base_experiment is not None:
        steps.append(("shared base model", snakemake_command(sweep, cores), logs / "base.log"))
    for point in sweep.points:
        label = f"P = {point.prompts} ({point.rollouts} rollouts per step) -> results/{point.experiment}/"
        steps.append((label, snakemake_command(sweep, cores, point), logs / f"p{point.prompts}.log"))
    if dry_run:
        for label, command, _ in steps:
            print(f"# {label}\n{shlex.join(command)}", file=out)
        return 0
    started = time.perf_counter()
    for index, (label, command, log) in enumerate(steps, 1):
        print(f"[{index}/{len(steps)}] {label}", file=out, flush=True)
        begun = time.perf_counter()
        code = _run(command, log, out)
        if code:
            print(f"{label}: snakemake failed (exit {code}); log: {log}\n{_tail(log)}", file=out)
            return code
        print(f"    done in {time.perf_counter() - begun:.0f} s (log: {log})", file=out, flush=True)
    from d3s.analysis.regime import write_regime  # pandas and matplotlib: after the runs

    written = write_regime(sweep.results, sweep.config, [p.prompts for p in sweep.points])
    print(f"sweep analysis: {', '.join(str(p) for p in written)}", file=out)
    print(f"sweep finished in {time.perf_counter() - started:.0f} s", file=out)
    return 0


def run_regime(args: Any) -> int:
    """``d3s regime``: a bad config ends in one line (exit 2) before any job."""
    from d3s.runs.config import one_line

    try:
        if not Path("Snakefile").is_file():
            raise ValueError(f"no Snakefile in {Path.cwd()}: run d3s regime from the repository root")
        if args.cores < 1:
            raise ValueError(f"--cores {args.cores}: give at least 1")
        check_workflow_files(args.schema, args.accelerate_dir)
        sweep = plan_sweep(args.config, args.accelerate_dir, args.schema)
    except ValueError as err:
        print(f"d3s regime: error: {one_line(err)}", file=sys.stderr)
        return 2
    return run_sweep(sweep, args.cores, dry_run=args.dry_run)
