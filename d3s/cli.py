"""The `d3s` command: one entry point, a subcommand per stage.

Bad input (argparse errors, config files, unknown keys, wrong types, values out of range) ends in one line
on stderr that names the setting and the fix, exit status 2, before any model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from d3s.methods import METHODS

# The workflow's files that `d3s plan` and `d3s regime` check a config against, as the workflow does (which
# passes its own: workflow/rules/common.smk): relative to the working directory, the repository root.
WORKFLOW_SCHEMA = "config/schema.yaml"
WORKFLOW_ACCELERATE_DIR = "workflow/accelerate"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error reported on one line (no usage block) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_train_config(args: argparse.Namespace) -> dict:
    """The run config of ``d3s train``: the --config file, then the flags, parsed once (d3s.runs.config);
    ConfigError (a ValueError) names the key, where the value came from and the fix."""
    from d3s.runs.config import ConfigError, coerce_run_config, read_config_file

    config = read_config_file(args.config) if args.config else {}
    sources = {}  # where each flag's value came from, for the error messages
    for key in ("method", "model", "seed", "threads", "output_dir"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
            sources[key] = f"from --{key.replace('_', '-')} {getattr(args, key)}"
    trainer = config.get("trainer") or {}
    flags = (
        [("max_steps", args.max_steps, f"--max-steps {args.max_steps}")] if args.max_steps is not None else []
    )
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects FIELD=VALUE such as --set learning_rate=1e-6, got {item!r}")
        flags.append((key.strip(), text, f"--set {item}"))
    if flags and not isinstance(trainer, dict):
        raise ConfigError(
            f"trainer: expected a mapping such as {{key: value}}, got {trainer!r} (from {args.config})"
        )
    if isinstance(trainer, dict):  # anything else is refused by the parser, naming the file
        for key, value, flag in flags:
            trainer[key] = value
            sources[f"trainer.{key}"] = f"from {flag}"
        config["trainer"] = trainer
    return coerce_run_config(config, source=f"from {args.config}" if args.config else None, sources=sources)


def run_train(args: argparse.Namespace) -> int:
    from d3s.provenance.integrity import DiskFullError
    from d3s.runs.config import one_line

    try:
        config = build_train_config(args)
        if args.own_process and not (config.get("trainer") or {}).get("use_vllm"):
            from d3s.vllm_engine import keep_vllm_out_of_this_process

            keep_vllm_out_of_this_process()
        from d3s.runs.run import train  # torch and TRL: after the cheap checks

        run_dir = train(config)  # which checks the whole config (resolve_config) before it loads a model
    except ValueError as err:
        print(f"d3s train: error: {one_line(err)}", file=sys.stderr)
        return 2
    except DiskFullError as err:  # the path and the space left there; the run resumes once there is room
        print(f"d3s train: error: {one_line(err)}", file=sys.stderr)
        return 1
    print(f"run finished: {run_dir}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Print the per-GPU memory plan of every job of a workflow config (config/paper/*.yaml and the like)."""
    import time

    import yaml

    from d3s.memory_plan import PlanError, format_plan, plan_config, read_cache, write_cache
    from d3s.orchestration.run_config import train_launch
    from d3s.orchestration.workflow_config import check_workflow_files, validate_config
    from d3s.runs.config import one_line

    try:
        with open(args.config) as handle:
            config = yaml.safe_load(handle)
        if not isinstance(config, dict):
            raise PlanError(f"{args.config}: not a workflow config (a mapping; see config/paper/)")
        check_workflow_files(args.schema, args.accelerate_dir)
        validate_config(config, args.schema)  # the workflow's one structural check, the same one-line errors
        launch = train_launch(config["train"], args.accelerate_dir)  # how the workflow would launch training
        start = time.perf_counter()
        cache = read_cache()
        entries = len(cache)
        plan = plan_config(config, launch, cache=cache)
    except (OSError, yaml.YAMLError, PlanError, KeyError, ValueError) as err:
        print(f"d3s plan: error: {one_line(err)}", file=sys.stderr)
        return 2
    if plan is None:
        print(f"{args.config}: no GPU jobs (train.resources.gpu is 0): nothing to plan")
        return 0
    if len(cache) > entries:
        with contextlib.suppress(OSError):  # a read-only install: the next run traces again
            write_cache(cache)
    print(format_plan(plan))
    print(f"\nplanned in {time.perf_counter() - start:.1f} s ({len(cache) - entries} geometries traced)")
    return 1 if plan.too_big() else 0


def _run_regime(args: argparse.Namespace) -> int:
    from d3s.orchestration.regime import run_regime

    return run_regime(args)


def _add_workflow_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schema", default=WORKFLOW_SCHEMA, help=f"the workflow's config schema (default {WORKFLOW_SCHEMA})"
    )
    parser.add_argument(
        "--accelerate-dir",
        default=WORKFLOW_ACCELERATE_DIR,
        help=f"the workflow's accelerate configs (default {WORKFLOW_ACCELERATE_DIR})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="d3s", description="D3S / PODS / GRPO reproduction suite")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one method (TRL GRPO + D3S selection)")
    train.add_argument("--config", help="YAML run config (see d3s/runs/run.py); flags below override it")
    train.add_argument("--method", choices=sorted(METHODS), help="method from the registry (default grpo)")
    train.add_argument("--model", help="'tiny' (built in code, SFT warm start) or a model path / hub id")
    train.add_argument("--output-dir", help="run directory (metrics.jsonl, resolved_config.yaml, final/)")
    train.add_argument("--seed", help="numpy/torch seed, 0 to 2**32 - 1 (default 0)")
    train.add_argument("--threads", help="torch threads (default 1)")
    train.add_argument("--max-steps", help="shortcut for trainer.max_steps")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a trainer (D3SConfig) field, e.g. --set learning_rate=1e-6; the value is converted to "
        "the field's type (lists and mappings in YAML/JSON: --set reward_weights=[1,0.5])",
    )
    train.set_defaults(handler=run_train)

    plan = sub.add_parser(
        "plan",
        help="per-GPU peak memory of a workflow config's training and evaluation jobs (traced, no GPU)",
    )
    plan.add_argument(
        "--config", required=True, help="workflow config, e.g. config/paper/qwen2.5-math-7b.yaml"
    )
    _add_workflow_files(plan)
    plan.set_defaults(handler=run_plan)

    regime = sub.add_parser(
        "regime",
        help="the regime sweep: the workflow at each prompts-per-step of a config's regime section, then the "
        "gaps to the reference against update tokens per step (docs/workflow/regime-sweep.md)",
    )
    regime.add_argument("--config", required=True, help="sweep config, e.g. config/regime.yaml")
    regime.add_argument("--cores", type=int, default=2, help="snakemake --cores of every point (default 2)")
    regime.add_argument(
        "-n", "--dry-run", action="store_true", help="check the config and print the commands; run nothing"
    )
    _add_workflow_files(regime)
    regime.set_defaults(handler=_run_regime)

    from d3s.evaluation.cli import add_eval_arguments, run_eval

    eval_parser = sub.add_parser("eval", help="evaluate a model on math benchmarks, or --audit the grader")
    add_eval_arguments(eval_parser)
    eval_parser.set_defaults(handler=run_eval)
    return parser


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """``own_process``: the command runs in a process of its own (:func:`command`), which may keep out
    imports it will not use; in-process callers (tests, notebooks) get none of that."""
    args = build_parser().parse_args(argv)
    args.own_process = own_process
    return args.handler(args)


def command() -> int:
    """The `d3s` command and `python -m d3s.cli`."""
    return main(own_process=True)


if __name__ == "__main__":
    raise SystemExit(command())
