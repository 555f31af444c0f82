"""End-to-end training step per method: where the time goes, and how many tokens are forwarded and trained.

    .venv/bin/python perf/end_to_end_step.py            # 10 methods x 2 settings x 2 rounds, ~3 min
    .venv/bin/python perf/end_to_end_step.py --quick    # grpo and d3s, 2 steps: a smoke run
    # wall seconds per step of every method, 20 steps (results/perf/step_time_per_method.md):
    .venv/bin/python perf/end_to_end_step.py --methods all --settings beta0_iter1 --cycles 19 --rounds 1

The trainer is instrumented from outside (wrappers on TRL's hooks, module hooks; d3s is not changed);
perf/README.md lists what is timed and counted.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from _common import (
    TINY_TRAINER,
    StepRecorder,
    base_parser,
    build_tiny_trainer,
    fmt_seconds,
    markdown_table,
    parse_args,
    prepare_tiny_model,
    write_results,
)

import d3s.trainer as d3s_trainer
from d3s.methods import METHODS as ALL_METHODS

NAME = "end_to_end_step"
METHODS = ["grpo", "pods", "d1s", "d1s_cross", "d2s", "d3s", "d3s_i", "entropy_8020", "gspo", "gspo_d3s"]
SAVINGS = {"defer_logprob_passes": True, "kept_token_logprobs": True}  # both opt-in savings on (d3s/savings)
SETTINGS = {
    "beta0_iter1": {"beta": 0.0, "num_iterations": 1} | SAVINGS,
    "beta0.04_iter2": {"beta": 0.04, "num_iterations": 2} | SAVINGS,
}


RATIOS = {  # row key -> its ratio to grpo's in the same setting (token counts: to at least 1)
    "step_s": "step_vs_grpo",
    "update_phase_s": "update_vs_grpo",
    "step_cpu_s": "step_cpu_vs_grpo",
    "update_phase_cpu_s": "update_cpu_vs_grpo",
    "backprop_tokens": "backprop_tokens_vs_grpo",
    "forward_tokens_total": "forward_tokens_vs_grpo",
}


def _share(key: str, digits: int = 0) -> Callable[[dict], str]:
    return lambda r: f"{100 * r[key] / r['step_s']:.{digits}f} %"


TIME_COLUMNS = {
    "method": "{method}",
    "step (wall)": lambda r: fmt_seconds(r["step_s"]),
    "step / grpo (wall / CPU)": "{step_vs_grpo:.2f} / {step_cpu_vs_grpo:.2f}",
    "TRL step_time (median)": lambda r: fmt_seconds(r["trl_step_time_median"]),
    "generation phase": _share("generation_phase_s"),
    "of which generate": _share("generate_s"),
    "rewards": _share("reward_s"),
    "no-grad log-prob passes": _share("scoring_forward_s"),
    "sample selection": _share("select_samples_s", 2),
    "update phase": _share("update_phase_s"),
    "of which loss forward": _share("compute_loss_s"),
    "backward + optimizer": _share("backward_optimizer_s"),
    "update phase (% of step CPU)": lambda r: f"{100 * r['update_phase_cpu_s'] / r['step_cpu_s']:.0f} %",
    "update / grpo (wall / CPU)": "{update_vs_grpo:.2f} / {update_cpu_vs_grpo:.2f}",
}
TOKEN_COLUMNS = {
    "method": "{method}",
    "samples kept": "{sample_keep_fraction:.2f}",
    "generation (prefill + decode)": "{generation_tokens:.0f}",
    "no-grad log-prob passes": "{scoring_pass_tokens:.0f} ({scoring_passes:.1f} passes/step)",
    "gradient pass": "{loss_pass_tokens:.0f}",
    "positions scored by the LM head (gradient pass)": "{loss_pass_scored:.0f}",
    "LM-head positions with gradient": "{lm_head_grad_positions:.0f}",
    "tokens backpropagated (update_tokens)": "{backprop_tokens:.0f}",
    "backprop / grpo": "{backprop_tokens_vs_grpo:.2f}",
    "all forwarded / grpo": "{forward_tokens_vs_grpo:.2f}",
}


def _wrap(recorder: StepRecorder, fn: Callable[..., Any], key: str, phase: str | None = None) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with recorder.timing(key, phase, cpu=key in ("generation_phase_s", "compute_loss_s")):
            return fn(*args, **kwargs)

    return wrapper


def _count_forward(recorder: StepRecorder, model: torch.nn.Module, role: str) -> list[Any]:
    """Forward pre/post hooks that count tokens and time per pass, keyed by phase and model role."""
    starts: list[float] = []

    def pre(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            return None
        new = input_ids.shape[1]  # positions processed by this call (1 per row in cached decoding)
        mask = kwargs.get("attention_mask")
        tokens = mask[:, -new:].sum().item() if mask is not None and mask.dim() == 2 else input_ids.numel()
        grad = torch.is_grad_enabled()
        prefix = f"{recorder.phase}.{role}.{'grad' if grad else 'nograd'}"
        recorder.now[f"{prefix}.passes"] += 1
        recorder.now[f"{prefix}.positions"] += input_ids.numel()
        recorder.now[f"{prefix}.tokens"] += tokens
        labels = kwargs.get("labels")
        if labels is not None:
            scored = (labels != -100).sum().item()
            recorder.now[f"{prefix}.scored"] += scored
            select = kwargs.get("select_tokens")  # the trainer restricts the LM head's gradient to this mask
            if grad:
                recorder.now[f"{prefix}.head_grad"] += scored if select is None else select.sum().item()
        starts.append(time.perf_counter())
        return args, kwargs

    def post(module, args, kwargs, output):
        if starts:
            recorder.now[f"{recorder.phase}.{role}.forward_s"] += time.perf_counter() - starts.pop()

    return [
        model.register_forward_pre_hook(pre, with_kwargs=True),
        model.register_forward_hook(post, with_kwargs=True),
    ]


@contextmanager
def instrument(trainer: Any, recorder: StepRecorder) -> Iterator[None]:
    """Timers on the trainer instance, the model and d3s.trainer's selection functions; undone on exit."""
    trainer.add_callback(recorder)
    restore = ExitStack()
    timers = [  # object, attribute, timer key, phase
        (d3s_trainer, "select_samples", "select_samples_s", None),
        (d3s_trainer, "token_keep_mask", "token_mask_s", None),
        (trainer, "_generate_and_score_completions", "generation_phase_s", "scoring"),
        (trainer, "_calculate_rewards", "reward_s", None),
        (trainer.model, "generate", "generate_s", "generate"),  # TRL calls the unwrapped model's generate
    ]
    for obj, name, key, phase in timers:
        restore.enter_context(mock.patch.object(obj, name, _wrap(recorder, getattr(obj, name), key, phase)))
    compute_loss = _wrap(recorder, trainer.compute_loss, "compute_loss_s", "loss")

    def compute_loss_counting(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        if "completion_mask" in inputs:  # not a micro-batch packing emptied (d3s/packing.py)
            recorder.now["completion_tokens_in_update"] += inputs["completion_mask"].sum().item()
            recorder.now["update_rows"] += inputs["completion_mask"].shape[0]
        return loss

    close_step = trainer._close_step_metrics

    def close_step_counting():  # the trainer counts the tokens that reached the gradient once per step
        tokens_before = trainer.update_tokens_total
        close_step()
        recorder.now["backprop_tokens"] += trainer.update_tokens_total - tokens_before

    restore.enter_context(mock.patch.object(trainer, "compute_loss", compute_loss_counting))
    restore.enter_context(mock.patch.object(trainer, "_close_step_metrics", close_step_counting))
    hooks = _count_forward(recorder, trainer.model, "policy")
    if trainer.ref_model is not None:  # beta > 0
        hooks += _count_forward(recorder, trainer.ref_model, "ref")
    restore.callback(lambda: [hook.remove() for hook in hooks])
    with restore:
        yield


def summarise(method: str, setting: str, steps: list[dict[str, float]]) -> dict[str, Any]:
    """Means per step of every timer and counter, plus the derived update phase."""
    keys = sorted({key for step in steps for key in step})
    raw = {key: sum(step.get(key, 0.0) for step in steps) / len(steps) for key in keys}
    mean, forward = defaultdict(float, raw), defaultdict(float)  # absent timers and counters: 0
    for key, value in raw.items():
        if key.count(".") == 3:  # phase.role.grad.kind
            phase, _, grad, kind = key.split(".")
            forward[f"{phase}_{grad}_{kind}"] += value
    step_s, generation = mean["step_s"], mean["generation_phase_s"]
    step_cpu, generation_cpu = mean["step_cpu_s"], mean["generation_phase_cpu_s"]
    return {
        "method": method,
        "setting": setting,
        "steps_timed": len(steps),
        "step_s": step_s,
        "step_s_median": statistics.median(step["step_s"] for step in steps),
        "generation_phase_s": generation,
        "generate_s": mean["generate_s"],
        "reward_s": mean["reward_s"],
        "scoring_forward_s": sum(
            v for k, v in raw.items() if k.startswith("scoring.") and k.endswith("forward_s")
        ),
        "select_samples_s": mean["select_samples_s"],
        "update_phase_s": step_s - generation,
        "step_cpu_s": step_cpu,
        "generation_phase_cpu_s": generation_cpu,
        "update_phase_cpu_s": step_cpu - generation_cpu,
        "compute_loss_cpu_s": mean["compute_loss_cpu_s"],
        "compute_loss_s": mean["compute_loss_s"],
        "backward_optimizer_s": step_s - generation - mean["compute_loss_s"],
        "token_mask_s": mean["token_mask_s"],
        "generation_tokens": forward["generate_nograd_tokens"],
        "scoring_pass_tokens": forward["scoring_nograd_tokens"],
        "scoring_pass_positions": forward["scoring_nograd_positions"],
        "scoring_passes": forward["scoring_nograd_passes"],
        "loss_pass_tokens": forward["loss_grad_tokens"],
        "loss_pass_positions": forward["loss_grad_positions"],
        "loss_pass_scored": forward["loss_grad_scored"],
        "lm_head_grad_positions": forward["loss_grad_head_grad"],
        "completion_tokens_in_update": mean["completion_tokens_in_update"],
        "update_rows": mean["update_rows"],
        "sample_keep_fraction": mean["update_rows"] / TINY_TRAINER["per_device_train_batch_size"],
        "trl_step_time_median": statistics.median(step.get("trl_step_time_s", 0.0) for step in steps),
        "backprop_tokens": mean["backprop_tokens"],
        "forward_tokens_total": sum(
            forward[f"{p}_tokens"] for p in ("generate_nograd", "scoring_nograd", "loss_grad")
        ),
        "raw_means": raw,
    }


def run_method(method: str, setting: str, model_dir: Path, steps: int, out: Path) -> tuple[list[dict], dict]:
    """Train ``method`` ``steps`` steps: (the steps after the first generation cycle, trainer info)."""
    overrides = SETTINGS[setting]
    trainer = build_tiny_trainer(
        method, model_dir, out / f"{setting}-{method}", max_steps=steps, metrics_log=None, **overrides
    )
    recorder = StepRecorder()
    with instrument(trainer, recorder):
        trainer.train()
    skip = overrides["num_iterations"]  # the first generation cycle carries start-up costs
    options = {name: getattr(trainer.args, name) for name in SAVINGS}
    info = {"trainer_options": options, "kept_token_head": trainer.kept_token_head}
    return recorder.steps[skip:] or recorder.steps, info


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument(
        "--methods", help=f"comma-separated or all (default: {','.join(METHODS)}; --quick: grpo,d3s)"
    )
    parser.add_argument(
        "--settings", help=f"comma-separated (default: all; --quick: the first): {', '.join(SETTINGS)}"
    )
    parser.add_argument("--cycles", type=int, default=5, help="generation cycles timed per method run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per method, order reversed each round")
    args = parse_args(parser, cycles=1, sft_steps=0, rounds=1)
    args.methods = args.methods or ("grpo,d3s" if args.quick else ",".join(METHODS))
    args.settings = args.settings or (next(iter(SETTINGS)) if args.quick else ",".join(SETTINGS))
    methods = sorted(ALL_METHODS) if args.methods == "all" else args.methods.split(",")
    settings = args.settings.split(",")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare_tiny_model(Path(tmp) / "model", sft_steps=args.sft_steps)
        # A discarded run first: the first trainer of a process pays one-off costs (lazy imports, caches).
        warm_up_steps = 2 * SETTINGS[settings[0]]["num_iterations"]
        run_method("grpo", settings[0], model_dir, warm_up_steps, Path(tmp) / "warm-up")
        for setting in settings:
            steps_per_run = SETTINGS[setting]["num_iterations"] * (1 + args.cycles)
            steps: dict[str, list[dict]] = {method: [] for method in methods}
            infos: dict[str, dict] = {}
            # Alternate the method order between rounds so drifts in machine load do not favour one end.
            for round_index in range(args.rounds):
                for method in methods if round_index % 2 == 0 else methods[::-1]:
                    work = Path(tmp) / str(round_index)
                    recorded, infos[method] = run_method(method, setting, model_dir, steps_per_run, work)
                    steps[method] += recorded
                    print(f"{setting} round {round_index} {method}: {len(recorded)} steps", flush=True)
            for method in methods:
                row = summarise(method, setting, steps[method]) | infos[method] | {"rounds": args.rounds}
                rows.append(row)
                print(
                    f"{setting} {method}: step {fmt_seconds(row['step_s'])}, generation "
                    f"{fmt_seconds(row['generation_phase_s'])}, update {fmt_seconds(row['update_phase_s'])}, "
                    f"backprop tokens {row['backprop_tokens']:.0f}",
                    flush=True,
                )
    notes = [
        "Generation phase: TRL's _generate_and_score_completions with the D3S selection (generate, rewards, "
        "no-grad log-prob passes, selection, advantages). Update phase: the rest of the step (the gradient "
        "forward and loss, backward, clipping, optimizer).",
        "Per step means over the steps after the first generation cycle; with num_iterations=2 every other "
        "step reuses the rollouts (no generation), so the mean is per optimizer step.",
        "Tokens backpropagated: the trainer's selection/update_tokens (completion tokens with nonzero loss "
        "weight); 'LM-head positions with gradient' counts the positions the LM head projects with gradient.",
        "CPU time: this process plus the grading worker subprocess (the reward), from process_time and "
        "/proc. Everything runs on 1 thread, so on this shared machine the CPU ratios are the steadier ones; "
        "wall time also counts waiting for the cores.",
        "Tiny model: 1 thread, shared 2-core machine; compare ratios within one setting, not absolute times.",
    ]
    tables = []
    for setting in settings:
        subset = [r for r in rows if r["setting"] == setting]
        by_method = {r["method"]: r for r in subset}
        base = by_method.get("grpo", subset[0])
        for r in subset:
            for key, ratio in RATIOS.items():
                r[ratio] = r[key] / (max(base[key], 1.0) if "tokens" in key else base[key])
        if "gspo" in by_method and "grpo" in by_method:  # gspo trains on grpo's tokens: its ratio is noise
            notes.append(
                "Noise level ({setting}): gspo forwards and backpropagates the same tokens as grpo "
                "({forward_tokens_vs_grpo:.2f}x, {backprop_tokens_vs_grpo:.2f}x), yet measures "
                "{step_vs_grpo:.2f}x (wall) / {step_cpu_vs_grpo:.2f}x (CPU) of its step time: differences of "
                "that size between methods are noise.".format_map(by_method["gspo"])
            )
        overrides = SETTINGS[setting]
        tables += [
            f"## {setting}: beta={overrides['beta']}, num_iterations={overrides['num_iterations']}",
            "",
            "Time per step (mean), split into the generation phase and the update phase, as % of the step's "
            "wall time (and the update phase as % of its CPU time); ratios to grpo by wall and by CPU time:",
            "",
            markdown_table(subset, TIME_COLUMNS),
            "",
            "Tokens per step (mean; non-padding tokens fed to the model):",
            "",
            markdown_table(subset, TOKEN_COLUMNS),
            "",
        ]
    args.methods, args.settings = methods, {s: SETTINGS[s] for s in settings}  # recorded as resolved
    batch = "8 prompts x 8 rollouts, max 24 completion tokens"
    write_results(NAME, args, rows, "\n".join(tables), notes, title="End-to-end step per method", batch=batch)


if __name__ == "__main__":
    main()
