"""Where a training step and an evaluation job of the tiny default go, phase by phase, beside each floor.

    .venv/bin/python perf/step_breakdown.py                 # grpo and d3s as config/config.yaml trains them
    .venv/bin/python perf/step_breakdown.py --model results/tiny/base_model   # its base model (no SFT here)
    .venv/bin/python perf/step_breakdown.py --quick         # a smoke run: small base model, 1 timed step

The trainer is the default's (config/config.yaml through the workflow's own run config and ``d3s train``'s
resolution), instrumented from outside. A phase's floor is its arithmetic at this machine's matrix rate,
measured here on the model's own layer shapes (2 x weights x real tokens, x 3 with the backward), or the same
work in one batched call (the optimizer: one AdamW step over one flat tensor; start-up: importing torch and
transformers alone). The evaluation job is the default's on the trained d3s model (``eval``: 200 problems x 8
samples), in this process.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from _common import REPO_ROOT, base_parser, fmt_seconds, markdown_table, parse_args, write_results
from transformers import TrainerCallback

NAME = "step_breakdown"
PHASES = (
    "generation",
    "reward",
    "no-grad log-prob passes",
    "loss forward",
    "backward",
    "optimizer",
    "logging",
)
HIDE_VLLM = "from d3s.vllm_engine import keep_vllm_out_of_this_process; keep_vllm_out_of_this_process(); "
IMPORTS = {  # process start-up: what a job imports as it runs (vLLM hidden, as CPU jobs do), and the floor
    "training job": HIDE_VLLM + "import d3s.orchestration.training_job, d3s.runs.run, d3s.trainer",
    "evaluation job": HIDE_VLLM + "import d3s.orchestration.evaluation_job, d3s.evaluation.cli, transformers",
    "floor": "import torch, transformers",  # the model's library, which every job needs
}


def matmul_rate(model: torch.nn.Module, rows: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of this model's linear layers (the LM head included) on ``rows`` positions at once."""
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    flops, seconds = 0.0, 0.0
    for out_features, in_features in shapes:
        x, w = torch.randn(rows, in_features), torch.randn(in_features, out_features)
        x @ w
        start = time.perf_counter()
        for _ in range(repeats):
            x @ w
        seconds += time.perf_counter() - start
        flops += 2.0 * rows * in_features * out_features * repeats
    return flops / seconds


def flops_per_token(model: torch.nn.Module) -> float:
    """2 x the weights a token goes through (every linear layer, the tied LM head included)."""
    return 2.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def wrap(self, obj: Any, attribute: str, name: Any, count: Any = None) -> None:
        """``obj.attribute`` timed under ``name`` (a phase, or a function of the call's grad mode)."""
        original = getattr(obj, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            phase = name() if callable(name) else name
            with self.phase(phase):
                result = original(*args, **kwargs)
            if count is not None:
                self.tokens[phase] += count(args, kwargs, result)
            return result

        setattr(obj, attribute, wrapper)


class StepMarks(TrainerCallback):
    """Per optimizer step: the wall time of the step and of its optimizer step."""

    def __init__(self, timer: Timer) -> None:
        self.timer, self.steps, self._start, self._optimizer = timer, [], 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self.before = dict(self.timer.seconds), dict(self.timer.tokens)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timer.seconds["optimizer"] += time.perf_counter() - self._optimizer

    def on_step_end(self, args, state, control, **kwargs):
        seconds, tokens = self.before
        self.steps.append(
            {
                "step_s": time.perf_counter() - self._start,
                **{k: v - seconds.get(k, 0.0) for k, v in self.timer.seconds.items()},
                **{f"{k} tokens": v - tokens.get(k, 0.0) for k, v in self.timer.tokens.items()},
            }
        )


def default_config() -> dict[str, Any]:
    return yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())


def build_base_model(out: Path, sft_steps: int | None) -> Path:
    from d3s.orchestration.base_model_job import build_base

    cfg = default_config()
    base = dict(cfg["base_model"]) | ({"sft_steps": sft_steps} if sft_steps else {})
    build_base(out, base, cfg["task"], threads=1)
    return out


def training_step(method: str, model_dir: Path, out: Path, timed_steps: int) -> tuple[dict[str, float], Any]:
    """The default's ``method`` run for 1 + ``timed_steps`` steps; the timed steps' mean seconds by phase."""
    from datasets import Dataset

    from d3s.orchestration.run_config import build_run_config
    from d3s.rewards import reward_functions
    from d3s.runs.config import coerce_run_config
    from d3s.runs.resolve import load_run_model, model_init_kwargs, resolve_config, training_rows
    from d3s.trainer import D3STrainer

    cfg = default_config()
    train_cfg = dict(cfg["train"])
    train_cfg["trainer"] = dict(train_cfg["trainer"]) | {"max_steps": 1 + timed_steps, "save_strategy": "no"}
    config = coerce_run_config(
        build_run_config(
            method=method,
            seed=0,
            model=str(model_dir),
            train_cfg=train_cfg,
            task=cfg["task"],
            output_dir=out,
            threads=1,
        )
    )
    args = resolve_config(config)
    model, tokenizer = load_run_model(config, out, model_init_kwargs(args))
    trainer = D3STrainer(
        model=model,
        args=args,
        reward_funcs=reward_functions(config.get("reward", "accuracy")),
        train_dataset=Dataset.from_list(training_rows(config, tokenizer)),
        processing_class=tokenizer,
    )
    timer = Timer()
    pass_phase = lambda: "loss forward" if torch.is_grad_enabled() else "no-grad log-prob passes"  # noqa: E731

    def generated(args, kwargs, result):  # prompts' and completions' real tokens
        return float(sum(len(p) for p in args[0]) + sum(len(c) for c in result[0]))

    timer.wrap(trainer, "_generate_single_turn", "generation", generated)
    timer.wrap(trainer, "_calculate_rewards", "reward")
    timer.wrap(trainer, "_logprob_pass", pass_phase, lambda a, k, r: float(a[2].sum()))
    timer.wrap(trainer.accelerator, "backward", "backward")
    timer.wrap(trainer, "log", "logging")
    marks = StepMarks(timer)
    trainer.add_callback(marks)
    trainer.train()
    timed = marks.steps[1:] or marks.steps
    keys = {key for step in timed for key in step}
    return {key: sum(step.get(key, 0.0) for step in timed) / len(timed) for key in keys}, trainer


def evaluation_job(model_dir: Path, out: Path, quick: bool) -> dict[str, float]:
    """The default's final-model evaluation of ``model_dir`` (``d3s eval`` as the workflow calls it)."""
    from d3s.evaluation import backends
    from d3s.evaluation.cli import EvalOptions, run_eval
    from d3s.grading.pool import Grader

    ev = default_config()["eval"]
    timer = Timer()
    timer.wrap(backends.TransformersBackend, "generate", "generation")
    timer.wrap(Grader, "grade_many_by_policy", "grading")
    options = EvalOptions(
        model=str(model_dir),
        benchmarks="synthetic",
        samples=2 if quick else ev["samples"],
        k=[1],
        out=out,
        temperature=ev["temperature"],
        top_p=ev["top_p"],
        max_tokens=ev["max_tokens"],
        backend=ev["backend"],
        template=ev["template"],
        batch_size=ev["batch_size"],
        synthetic={
            key: int(value)
            for key, value in (
                {"count": 20 if quick else ev["synthetic"]["count"]} | default_config()["task"]
            ).items()
        },
        no_progress=True,
    )
    start = time.perf_counter()
    if run_eval(options):
        raise SystemExit("the evaluation failed")
    total = time.perf_counter() - start
    return {"job_s": total, **timer.seconds}


def import_seconds(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, cwd=REPO_ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--model", type=Path, help="a base model folder (default: build the default's here)")
    parser.add_argument("--methods", default="grpo,d3s", help="comma-separated registry methods")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    args = parse_args(parser, steps=1, sft_steps=20, methods="d3s")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        model_dir = args.model or build_base_model(
            scratch_dir / "base", args.sft_steps if args.quick else None
        )
        from transformers import AutoModelForCausalLM

        probe = AutoModelForCausalLM.from_pretrained(model_dir)
        rate, per_token = matmul_rate(probe), flops_per_token(probe)
        floor = lambda tokens, factor=1.0: factor * per_token * tokens / rate  # noqa: E731
        trained = None
        for method in args.methods.split(","):
            phases, trainer = training_step(method, model_dir, scratch_dir / method, args.steps)
            optimizer_floor = adamw_floor(trainer.model)
            floors = {
                "generation": floor(phases.get("generation tokens", 0.0)),
                "no-grad log-prob passes": floor(phases.get("no-grad log-prob passes tokens", 0.0)),
                "loss forward": floor(phases.get("loss forward tokens", 0.0)),
                "backward": floor(phases.get("loss forward tokens", 0.0), 2.0),
                "optimizer": optimizer_floor,
            }
            for phase in PHASES:
                rows.append(
                    {
                        "part": f"{method} step",
                        "phase": phase,
                        "seconds": phases.get(phase, 0.0),
                        "floor_s": floors.get(phase),
                        "step_s": phases["step_s"],
                    }
                )
            accounted = sum(phases.get(phase, 0.0) for phase in PHASES)
            rows.append(
                {
                    "part": f"{method} step",
                    "phase": "other (TRL's scoring, selection, metrics)",
                    "seconds": phases["step_s"] - accounted,
                    "floor_s": None,
                    "step_s": phases["step_s"],
                }
            )
            rows.append(
                {
                    "part": f"{method} step",
                    "phase": "whole step",
                    "seconds": phases["step_s"],
                    "floor_s": sum(v for v in floors.values() if v),
                    "step_s": phases["step_s"],
                }
            )
            if method == "d3s" or trained is None:
                trained = scratch_dir / f"{method}-final"
                trainer.save_model(str(trained))
                trainer.processing_class.save_pretrained(str(trained))
        job = evaluation_job(trained, scratch_dir / "eval", args.quick)
        for phase in ("generation", "grading"):
            rows.append(
                {
                    "part": "evaluation job",
                    "phase": phase,
                    "seconds": job.get(phase, 0.0),
                    "floor_s": None,
                    "step_s": job["job_s"],
                }
            )
        rows.append(
            {
                "part": "evaluation job",
                "phase": "whole job (in process)",
                "seconds": job["job_s"],
                "floor_s": None,
                "step_s": job["job_s"],
            }
        )
    imports = {name: import_seconds(statement) for name, statement in IMPORTS.items()}
    for name in ("training job", "evaluation job"):
        rows.append(
            {
                "part": "start-up",
                "phase": f"imports: {name}",
                "seconds": imports[name],
                "floor_s": imports["floor"],
                "step_s": None,
            }
        )
    table = markdown_table(
        rows,
        {
            "part": "{part}",
            "phase": "{phase}",
            "seconds": lambda r: fmt_seconds(r["seconds"]),
            "share": lambda r: f"{100 * r['seconds'] / r['step_s']:.0f} %" if r["step_s"] else "",
            "floor": lambda r: fmt_seconds(r["floor_s"]) if r["floor_s"] is not None else "",
            "x floor": lambda r: f"{r['seconds'] / r['floor_s']:.1f}x" if r["floor_s"] else "",
        },
    )
    notes = [
        f"Matrix rate of the linear layers at 8,192 positions: {rate / 1e9:.1f} GFLOP/s (one thread); "
        f"{per_token / 1e3:.0f} kFLOP a token forward.",
        "Floors count real tokens only (no padding); the backward's is twice its forward's; generation's "
        "counts each prompt and completion token once (what a KV cache computes).",
    ]
    write_results(
        NAME,
        args,
        rows,
        table,
        notes,
        title="Where a step of the tiny default goes",
        matmul_gflops=rate / 1e9,
    )


def adamw_floor(model: torch.nn.Module, repeats: int = 20) -> float:
    """One AdamW step over all the model's weights as one flat tensor (one batched call)."""
    flat = torch.nn.Parameter(torch.zeros(sum(p.numel() for p in model.parameters())))
    flat.grad = torch.randn_like(flat)
    optimizer = torch.optim.AdamW([flat], lr=1e-4, fused=False, foreach=True)
    optimizer.step()
    start = time.perf_counter()
    for _ in range(repeats):
        optimizer.step()
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    main()
