"""Shared fixtures: the benchmark copies in ../shared/data, a warm-started tiny model, and an offline copy of
the workflow with the dry run of each configuration."""

from __future__ import annotations

import functools
import os
import resource
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO_ROOT,
    SHARED_DATA,
    SMOKE_ARGS,
    SMOKE_SECONDS,
    SNAKEMAKE,
    copy_workflow,
    failed_job_logs,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2): the processes
# most tests start (Snakemake, its jobs, trainers, imports of torch and TRL) keep one core busy at a time.
# These tests set the suite's length (pytest --durations, quiet 2-core machine, 2026-11-26): they start
# first, longest first, and the short ones fill the gaps.
LONGEST_FIRST = (
    # with the Slurm and eval-resume tests (WITH_THE_SMOKE_RUN) the longest unit, about 1,100 s
    "tests/test_workflow.py::test_smoke_workflow_end_to_end",
    "tests/test_studies.py",  # every study's smoke (six snakemake runs) and the studies notebook
    "tests/test_resume_workflow.py::test_killed_deepspeed_jobs_resume_under_snakemake[zero3]",
    "tests/test_resume_workflow.py::test_killed_server_mode_job_resumes_with_new_ports",
    "tests/test_vllm_workflow.py",
    "tests/test_regime.py",
    "tests/test_workflow_eval_resume.py",
    "tests/test_vllm_colocate.py",
    "tests/test_faults.py",
    "tests/test_resume.py",
    "tests/test_vllm_eval.py",
    "tests/test_evaluation.py",
)
# Files whose tests may run on different workers: they share no module fixture. Every other file is one unit
# of work, so its module fixtures (a trained run, a grading pool) are built once. (xdist's own loadgroup
# cannot do this under pytest 9: it renames item._nodeid, which pytest 9's nodeid no longer reads.)
SPLIT_ACROSS_WORKERS = {"test_resume_workflow.py"}
# Files that use the session's smoke run (the smoke_workflow fixture) go with test_workflow.py, so that the
# run is made once (a session fixture is made once per worker).
WITH_THE_SMOKE_RUN = {"test_slurm.py", "test_workflow_eval_resume.py", "test_readme_commands.py"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``-n N`` with the default ``--dist load``: one test file per unit of work, but the files in
    SPLIT_ACROSS_WORKERS, whose tests go to either worker, and those WITH_THE_SMOKE_RUN, in
    test_workflow.py's unit; units in collection order (longest first)."""
    if config.getvalue("dist") != "load":
        return None  # another --dist the user asked for: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if Path(path).name in WITH_THE_SMOKE_RUN:
                return str(Path(path).with_name("test_workflow.py"))
            return nodeid if Path(path).name in SPLIT_ACROSS_WORKERS else path

    return FileScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next(
            (i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
            len(LONGEST_FIRST),
        )

    items.sort(key=rank)  # stable: the rest keep their order


def _cpu_seconds() -> float:
    """CPU time of this process and of the processes it has waited for (Snakemake, its jobs, trainers);
    not of daemons it did not wait for (the Slurm test's jobs run under slurmd)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Each phase's CPU seconds on its report (xdist sends them to the controller): the suite is CPU-bound
    on 2 cores, so CPU, not wall time under two workers, says what a test costs."""
    outcome = yield
    started = item.stash.get(_PHASE_CPU_START, None)
    if started is not None:
        outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - started))


_PHASE_CPU_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    item.stash[_PHASE_CPU_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    item.stash[_PHASE_CPU_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> object:
    item.stash[_PHASE_CPU_START] = _cpu_seconds()
    yield


def pytest_terminal_summary(terminalreporter: object) -> None:
    """The tests that cost the most CPU (setup, call and teardown together) and the suite's total."""
    cost: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, value in getattr(report, "user_properties", ()):
                if name == "cpu_s":
                    cost[report.nodeid] = cost.get(report.nodeid, 0.0) + value
    _readme_commands_table(terminalreporter)
    if not cost:
        return
    terminalreporter.write_sep("=", f"most CPU (s; all tests: {sum(cost.values()):.0f} s)")
    for nodeid, seconds in sorted(cost.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")


def _readme_commands_table(terminalreporter: object) -> None:
    """tests/test_readme_commands.py's cases: each README/docs command, whether it ran, its wall seconds."""
    rows = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, value in getattr(report, "user_properties", ()):
                if name == "readme_command":
                    rows[value[0]] = value
    if not rows:
        return
    terminalreporter.write_sep("=", "README commands (tests/test_readme_commands.py)")
    for text, where, outcome, seconds in rows.values():
        wall = "" if seconds is None else f"{seconds:7.1f} s"
        terminalreporter.write_line(f"{wall:>9}  {outcome[:60]:<60}  {text}  [{where}]")


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """``<repo root>/../shared/data``; tests that use it are skipped when the benchmark copies are absent."""
    if not (SHARED_DATA / "aime24" / "test.jsonl").is_file():
        pytest.skip(
            f"benchmark copies not found at {SHARED_DATA} (expected ../shared/data beside the checkout)"
        )
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_sft_model(tmp_path_factory) -> Path:
    """The tiny model after a short SFT on one-step sums of digits: ~20-40 % sampled accuracy, so GRPO
    groups have mixed rewards. Built once per session (~15 s) and saved; tests load it from disk."""
    from d3s.data.synthetic import arithmetic_problems
    from d3s.tiny_model import build_model, build_tokenizer, sft_warm_start

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=0)
        problems = arithmetic_problems(2000, max_ops=1, max_operand=9)
        sft_warm_start(model, tokenizer, [(p.prompt, p.completion) for p in problems], steps=150, seed=0)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("tiny_sft")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smoke_workflow(tmp_path_factory, request) -> Path:
    """A copy of the workflow after `snakemake --cores 2` of the smoke configuration (test_workflow.py checks
    it; test_slurm.py compares the same run through Slurm with it; it is the README's smoke command, which
    test_readme_commands.py checks). Run once per session; its wall seconds in the stash (SMOKE_SECONDS)."""
    work = copy_workflow(tmp_path_factory.mktemp("smoke"))
    started = time.monotonic()
    done = subprocess.run(
        SNAKEMAKE + SMOKE_ARGS,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:] + failed_job_logs(out, work)
    request.config.stash[SMOKE_SECONDS] = time.monotonic() - started
    return work


@pytest.fixture(scope="session")
def offline_work(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of the workflow with no ../shared/data beside it, and an environment with the Hub off and
    an empty data directory."""
    root = tmp_path_factory.mktemp("offline")
    (root / "work").mkdir()
    (root / "empty_data").mkdir()
    work = copy_workflow(root / "work")
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "D3S_DATA_DIR": str(root / "empty_data"),
        "OMP_NUM_THREADS": "1",
    }
    return work, env


@pytest.fixture(scope="session")
def dry_run(offline_work) -> Callable[[Path], str]:
    """The output of `snakemake -n --forceall` of a shipped configuration, offline with no data (in
    ``offline_work``): run once per configuration per session, as several test files check the same jobs."""
    work, env = offline_work

    @functools.cache
    def run(config: Path) -> str:
        assert not (work.parent / "shared").exists() and not any(Path(env["D3S_DATA_DIR"]).iterdir())
        args = ["-n", "--forceall", "--configfile", str(config.relative_to(REPO_ROOT))]
        done = subprocess.run(
            SNAKEMAKE + args, cwd=work, env=env, capture_output=True, text=True, timeout=300
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-3000:]
        return out

    return run
