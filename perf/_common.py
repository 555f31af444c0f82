"""Shared helpers of the benchmarks: command line, machine, timing, result files, the tiny trainer.

Run the scripts as files (``python perf/<name>.py``): they import this module as ``from _common import ...``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils import benchmark
from transformers import TrainerCallback

from d3s.markdown import markdown_table as markdown_table  # the scripts' tables
from d3s.provenance.manifest import atomic_write_text, git_state, hardware, now, package_versions, write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "results" / "perf"


def base_parser(doc: str | None, tiny_model: bool = True) -> argparse.ArgumentParser:
    """An argument parser with every benchmark's options: --quick, --out, --threads (and --sft-steps)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for <name>.json and <name>.md")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: RL jobs' CPU default)")
    if tiny_model:
        parser.add_argument("--sft-steps", type=int, default=150, help="SFT warm-start steps (tiny model)")
    return parser


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with the table


def parse_args(parser: argparse.ArgumentParser, pin_threads: bool = True, **quick: Any) -> argparse.Namespace:
    """The command line's options, with ``--quick`` the ``quick`` ones; then the torch threads set."""
    args = parser.parse_args()
    if args.quick:
        vars(args).update(quick)
    if pin_threads:
        set_threads(args.threads)
    return args


def machine() -> dict[str, Any]:
    """CPU model, cores, GPUs, torch threads and the load average (a noise indicator on shared machines)."""
    info = hardware()
    info["python"] = platform.python_version()
    info["torch_threads"] = torch.get_num_threads()
    info["torch_interop_threads"] = torch.get_num_interop_threads()
    info["load_average_1min"] = psutil.getloadavg()[0]
    return info


def cpu_clock() -> float:
    """CPU seconds used so far by this process and its live children (the grading workers): unlike wall time,
    it does not grow while other jobs hold the cores (children's time has a 10 ms tick: sum it over steps)."""
    seconds = time.process_time()
    for child in psutil.Process().children(recursive=True):
        with suppress(psutil.Error):  # a child that just exited
            seconds += sum(child.cpu_times()[:2])  # user + system
    return seconds


def timed(fn: Callable[[], Any], repeats: int = 5, min_seconds: float = 0.0) -> dict[str, Any]:
    """Median wall and CPU seconds per call of ``fn`` (torch.utils.benchmark's ``blocked_autorange``) after an
    untimed call (its ``result``), over at least ``repeats`` times that call's length and ``min_seconds``."""
    start = time.perf_counter()
    result = fn()
    first_s = time.perf_counter() - start
    cpu_reads: list[float] = []

    def clock() -> float:  # the wall clock blocked_autorange reads, noting the CPU clock at each read
        cpu_reads.append(time.process_time())
        return time.perf_counter()

    timer = benchmark.Timer("fn()", globals={"fn": fn}, timer=clock, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=max(repeats * first_s, min_seconds))
    blocks, per_block = len(measurement.raw_times), measurement.number_per_run
    reads = cpu_reads[-2 * blocks :]  # two reads per measured block, the last blocks timed
    cpu = [(end - begin) / per_block for begin, end in zip(reads[::2], reads[1::2], strict=True)]
    return {
        "median_s": measurement.median,
        "cpu_median_s": statistics.median(cpu),
        "repeats": blocks * per_block,
        "result": result,
    }


def timed_once(fn: Callable[[], Any]) -> dict[str, Any]:
    """Wall and CPU seconds of one call of ``fn`` (the slow loops, timed once), in ``timed``'s shape."""
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"median_s": wall, "cpu_median_s": cpu, "repeats": 1, "result": result}


def fmt_seconds(seconds: float | None) -> str:
    """Seconds with a unit that keeps three significant digits (ns to s)."""
    if seconds is None:
        return "n/a"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def write_results(
    name: str,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    markdown: str,
    notes: Sequence[str] = (),
    title: str | None = None,
    **settings: Any,
) -> tuple[Path, Path]:
    """Print ``markdown`` and ``notes``; write ``<args.out>/name.json`` and ``.md`` atomically, with machine,
    versions, git state and settings (the options but ``--out``, then ``settings``); return both paths."""
    print(markdown, *notes, sep="\n", flush=True)
    settings = {key: value for key, value in vars(args).items() if key != "out"} | settings
    info, versions, git = machine(), package_versions(), git_state()
    record = {"name": name, "created": now(), "machine": info, "versions": versions, "git": git}
    record |= {"settings": settings, "rows": rows, "notes": list(notes)}
    json_path, md_path = args.out / f"{name}.json", args.out / f"{name}.md"
    write_json(json_path, record)
    gpus = ", ".join(info["gpus"]) or "none"
    # the header names Python once, from the machine record
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k not in ("d3s", "python"))
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    setting_text = ", ".join(f"{k}={v}" for k, v in settings.items())
    header = (
        f"Machine: {info['cpu']}, {info['cpu_count']} CPUs, GPU: {gpus}; torch threads "
        f"{info['torch_threads']}; load average {info['load_average_1min']}. Python {info['python']}, "
        f"{version_text}. Commit {commit}, {record['created']}."
    )
    parts = [f"# {title or name}", header, f"Settings: {setting_text}.", markdown.strip()]
    if notes:
        parts.append("\n".join(f"- {note}" for note in notes))
    atomic_write_text(md_path, "\n\n".join(parts) + "\n")
    return json_path, md_path


# --------------------------------------------------------------------------------------------------
# The tiny model and trainer, in the step-time geometry (d3s train's tiny run): 8 prompts x 8
# rollouts per step, completions up to 24 tokens, one-step sums of digits, SFT warm start 150 steps.

TINY_TRAINER: dict[str, Any] = {
    "per_device_train_batch_size": 64,
    "num_generations": 8,
    "max_completion_length": 24,
    "learning_rate": 3e-4,
    "disable_tqdm": True,
    "logging_steps": 1,
}
TINY_TASK: dict[str, Any] = {"max_ops": 1, "max_operand": 9}


def prepare_tiny_model(path: Path, sft_steps: int = 150) -> Path:
    """The tiny model as ``d3s train`` warm-starts it for ``model: tiny``, saved to ``path``."""
    from d3s.runs.resolve import load_run_model

    path.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_run_model({"model": "tiny", "seed": 0, "tiny": {"sft_steps": sft_steps}}, path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_trainer(
    method: str, model_dir: Path | Any, output_dir: Path, max_steps: int, **trainer_overrides: Any
) -> Any:
    """A D3STrainer for ``method`` on the saved tiny model (or a model object, with the tiny tokenizer),
    configured by ``d3s.runs.resolve.resolve_config`` as ``d3s train`` is, with math-verify accuracy
    rewards."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from d3s.data.synthetic import arithmetic_problems
    from d3s.grading.pool import default_grader
    from d3s.rewards import accuracy_reward
    from d3s.runs.resolve import resolve_config
    from d3s.tiny_model import build_tokenizer
    from d3s.trainer import D3STrainer

    in_memory = not isinstance(model_dir, (str, Path))
    args = resolve_config(
        {
            "method": method,
            "model": "tiny" if in_memory else str(model_dir),  # "tiny": no directory to check
            "output_dir": str(output_dir),
            "trainer": {**TINY_TRAINER, "max_steps": max_steps, **trainer_overrides},
        }
    )
    rows = [
        {"prompt": p.prompt, "answer": p.answer}
        for p in arithmetic_problems(2000, split="train", seed=0, **TINY_TASK)
    ]
    default_grader().grade("\\boxed{1}", "1")  # start the grading worker now, not inside step 1
    trainer = D3STrainer(
        model=model_dir if in_memory else AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        reward_funcs=[accuracy_reward],
        train_dataset=Dataset.from_list(rows),
        processing_class=build_tokenizer() if in_memory else AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.remove_callback(PrinterCallback)  # the benchmark prints its own table, not every log dict
    return trainer


class StepRecorder(TrainerCallback):
    """Per-step wall and CPU seconds (``cpu_clock``), on_step_begin -> on_step_end, and the timers and
    counters added during the step (``now``, ``timing``): one dict per optimizer step in ``steps``."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.now: defaultdict[str, float] = defaultdict(float)
        self.phase = "other"  # what the step is doing now (end_to_end_step: what a model forward belongs to)
        self._start = self._cpu_start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.now = defaultdict(float)
        self._start, self._cpu_start = time.perf_counter(), cpu_clock()

    def on_step_end(self, args, state, control, **kwargs):
        self.now["step_s"] = time.perf_counter() - self._start
        self.now["step_cpu_s"] = cpu_clock() - self._cpu_start
        self.steps.append(dict(self.now))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.steps and logs and "step_time" in logs:  # TRL's training_step time, logged after the step
            self.steps[-1]["trl_step_time_s"] = logs["step_time"]

    @contextmanager
    def timing(self, key: str, phase: str | None = None, cpu: bool = False) -> Iterator[None]:
        """Wall seconds under ``key`` (in ``phase``); with ``cpu`` also CPU seconds under ``key_cpu``."""
        previous, self.phase = self.phase, phase or self.phase
        start, cpu_start = time.perf_counter(), cpu_clock() if cpu else 0.0
        try:
            yield
        finally:
            self.now[key] += time.perf_counter() - start
            if cpu:  # cpu_clock reads /proc for the grading worker: not for tiny timers
                self.now[key.replace("_s", "_cpu_s")] += cpu_clock() - cpu_start
            self.phase = previous
