"""Constants and helpers shared by the test files, imported one way: ``from helpers import ...``.

pytest puts tests/ first on ``sys.path`` (rootdir-less test folder, the default "prepend" import mode), so
this module is found whether pytest runs as ``pytest`` or ``python -m pytest``. Fixtures (the benchmark
copies, the tiny SFT model) live in conftest.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
# The workflow's files, passed to the package as the workflow passes them (workflow/rules/common.smk)
SCHEMA = REPO_ROOT / "config" / "schema.yaml"
ACCELERATE_DIR = REPO_ROOT / "workflow" / "accelerate"
SHARED_DATA = (REPO_ROOT / ".." / "shared" / "data").resolve()
# How long a test waits for a running workflow to reach the point where it kills it: a guard against a hang,
# not a speed check. 300 s failed when two suites shared the 2 cores (the job was healthy, only slow).
HANG_GUARD_S = 900

# Row counts of the real copies in ../shared/data (see its README); math_level3to5 loses 2 rows with
# an empty answer.
REAL_COUNTS = {
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "math500": 500,
    "gsm8k": 1319,
    "minerva_math": 272,
    "olympiadbench": 675,
    "math_level3to5": 8521,
    "gsm8k_train": 7473,
}


# ---- the tiny trainer --------------------------------------------------------------------------------------

# D3SConfig fields of the trainer tests: 2 prompts x 8 rollouts per step on the CPU, no checkpoints.
TINY_TRAINER_ARGS: dict[str, Any] = dict(
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=24,
    learning_rate=1e-3,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    bf16=False,
    gradient_checkpointing=False,
    beta=0.0,
    seed=0,
    logging_steps=1,  # D3SConfig keeps TRL's 10; the tests read every step's record
)


def train_rows(count: int = 200) -> Any:
    """A ``datasets.Dataset`` of one-step sums of digits (the task the tiny model is warm-started on)."""
    from datasets import Dataset

    from d3s.data.synthetic import arithmetic_problems

    return Dataset.from_list(
        [
            {"prompt": p.prompt, "answer": p.answer}
            for p in arithmetic_problems(count, max_ops=1, max_operand=9)
        ]
    )


def make_trainer(
    model_path: Path, args: Any, reward_funcs: list | None = None, trainer_cls: type | None = None
) -> Any:
    """A D3STrainer (or ``trainer_cls``) on the saved tiny model, 2 torch threads, math-verify rewards by
    default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s.rewards import accuracy_reward
    from d3s.trainer import D3STrainer

    torch.set_num_threads(2)
    return (trainer_cls or D3STrainer)(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=args,
        reward_funcs=reward_funcs or [accuracy_reward],
        train_dataset=train_rows(),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


# ---- the workflow ------------------------------------------------------------------------------------------

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# The session's smoke run (conftest.py's smoke_workflow): the README's smoke command's arguments, which
# tests/test_readme_commands.py checks, and the run's wall seconds, kept in the pytest config's stash.
SMOKE_ARGS = ["--cores", "2", "--configfile", "config/smoke.yaml"]
SMOKE_SECONDS = pytest.StashKey[float]()
# Rules of the analysis stage (no GPU, run on the login/driver node)
ANALYSIS_RULES = {"training_dynamics", "pass_at_k", "efficiency", "selection_anatomy", "report"}


def copy_workflow(dest: Path) -> Path:
    """A copy of what the workflow needs to run (no results but the paper's numbers) under ``dest``."""
    for name in ("Snakefile", "workflow", "config", "notebooks", "environment.yml"):
        src = REPO_ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
    shutil.copytree(REPO_ROOT / "results" / "paper", dest / "results" / "paper")
    return dest


def run_snakemake(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(SNAKEMAKE + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


FAILED_JOB_LOG = re.compile(r"log: (\S+) \(check log file")


def failed_job_logs(output: str, cwd: Path, tail: int = 3000) -> str:
    """The ends of the log files of the jobs a Snakemake ``output`` reports as failed (read from ``cwd``), for
    an assertion's message: the output's own end often holds only Snakemake's summary, not the cause."""
    parts = []
    for name in dict.fromkeys(FAILED_JOB_LOG.findall(output)):
        log = cwd / name
        text = log.read_text(errors="replace")[-tail:] if log.is_file() else "(no such file)"
        parts.append(f"\n---- {name} ----\n{text}")
    return "".join(parts)


def dry_run_jobs(output: str) -> list[dict]:
    """Jobs in the output of `snakemake -n`: rule, wildcards and resources of each."""
    jobs: list[dict] = []
    for line in output.splitlines():
        if match := re.fullmatch(r"(?:local)?rule (\w+):", line.strip()):
            jobs.append({"rule": match.group(1), "wildcards": {}, "resources": {}})
        elif jobs and line.startswith("    ") and ": " in line:
            key, value = line.strip().split(": ", 1)
            if key in ("wildcards", "resources"):
                jobs[-1][key] = dict(item.split("=", 1) for item in value.split(", "))
    return jobs


def write_run_config(tmp_path: Path, **overrides: Any) -> Path:
    """A `d3s train` config of a 2-step d3s run on the tiny model, written to tmp_path/run.yaml."""
    config = {
        "method": "d3s",
        "model": "tiny",
        "threads": 2,
        "output_dir": str(tmp_path / "run"),
        "tiny": {"sft_steps": 20},
        "dataset": {"name": "synthetic", "count": 100, "max_ops": 1, "max_operand": 9},
        "trainer": {
            "max_steps": 2,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 16,
        },
    } | overrides
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def save_tiny(path: str | Path, seed: int = 0, **model_kwargs) -> Path:
    """Build the tokenizer and a randomly initialised tiny model and save both to ``path``."""
    from d3s.tiny_model import build_model, build_tokenizer

    path = Path(path)
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=seed, **model_kwargs).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def serve_as_vllm(
    trainer: Any, engine_logprobs: Callable[[int, list[int], list[int], Any], list[float]]
) -> None:
    """Make TRL train as if vLLM had generated: transformers generates (``use_vllm`` off for that call), and
    TRL receives ``engine_logprobs(position, prompt_ids, completion_ids, model)`` (no gradient) as the
    engine's per-token log-probs of each completion, so its importance-sampling correction sees the
    mismatch a test forces. The correction's settings stay the caller's."""
    import torch

    generate = trainer._generate

    def fake_generate(prompts):
        trainer.use_vllm = False
        try:
            out = list(generate(prompts))
        finally:
            trainer.use_vllm = True
        model = trainer.accelerator.unwrap_model(trainer.model)
        with torch.no_grad():
            rows = enumerate(zip(out[0], out[1], strict=True))
            out[4] = [
                engine_logprobs(position, prompt, completion, model)
                for position, (prompt, completion) in rows
            ]
        return tuple(out)

    trainer.use_vllm = trainer.args.use_vllm = True  # the config too: D3SConfig.excludes_zeroed reads it
    trainer._generate = fake_generate
