"""The `d3s` command: one entry point, a subcommand per stage."""

from __future__ import annotations

import argparse
import sys

from d3s.methods import METHODS


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML run config (see d3s/train.py); flags below override it")
    parser.add_argument("--method", choices=sorted(METHODS), help="method from the registry (default grpo)")
    parser.add_argument("--model", help="'tiny' (built in code, SFT warm start) or a model path / hub id")
    parser.add_argument("--output-dir", help="run directory (metrics.jsonl, resolved_config.yaml, final/)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, help="torch threads (default 1)")
    parser.add_argument("--max-steps", type=int, help="shortcut for trainer.max_steps")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a trainer (D3SConfig) field, e.g. --set num_generations=8 (YAML-typed values)",
    )


def run_train(args: argparse.Namespace) -> int:
    import yaml

    from d3s.train import load_config, train

    config = load_config(args.config) if args.config else {}
    for key in ("method", "model", "seed", "threads"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if args.output_dir:
        config["output_dir"] = args.output_dir
    trainer = dict(config.get("trainer") or {})
    if args.max_steps is not None:
        trainer["max_steps"] = args.max_steps
    for item in args.set:
        if "=" not in item:
            raise SystemExit(f"--set expects FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        trainer[key.strip()] = yaml.safe_load(value)
    config["trainer"] = trainer
    try:
        run_dir = train(config)
    except ValueError as err:
        print(f"d3s train: {err}", file=sys.stderr)
        return 2
    print(f"run finished: {run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3s", description="D3S / PODS / GRPO reproduction suite")
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser("train", help="train one method (TRL GRPO + D3S selection)")
    _add_train_arguments(train_parser)
    train_parser.set_defaults(handler=run_train)

    from d3s.evaluation.cli import add_eval_arguments, run_eval

    eval_parser = sub.add_parser("eval", help="evaluate a model on math benchmarks, or --audit the grader")
    add_eval_arguments(eval_parser)
    eval_parser.set_defaults(handler=run_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
