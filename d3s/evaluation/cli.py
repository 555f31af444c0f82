"""``d3s eval``: evaluate a model on math benchmarks, or audit the grader (``--audit``).

Arguments are validated (benchmark names, k <= samples, data present, backend available) before any
model is loaded, so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from d3s.data.benchmarks import (
    BENCHMARKS,
    DATA_DIR_ENV,
    EVAL_BENCHMARKS,
    BenchmarkError,
    Problem,
    load_benchmark,
    parse_benchmark_list,
    resolve_data_dir,
)
from d3s.data.templates import TEMPLATES
from d3s.evaluation.backends import BACKENDS, GenerationSettings, choose_backend
from d3s.rewards import ANSWER_POLICIES, DEFAULT_ANSWER_POLICY, DEFAULT_TIME_LIMIT_S
from d3s.runs.config import check_model_dir, one_line

DEFAULT_BENCHMARKS = ",".join(EVAL_BENCHMARKS)
EVAL_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 0.6, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _seed(text: str) -> int:
    if not text.strip().isdigit() or int(text) >= 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32 - 1], got {text!r}")
    return int(text)


def _k_list(text: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--k takes comma-separated integers such as 1,8; got {text!r}"
        ) from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"--k values must be positive integers, got {text!r}")
    return ks


def _synthetic_options(text: str) -> dict[str, int]:
    options = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"--synthetic takes KEY=INTEGER pairs such as max_ops=1; got {part!r}"
            )
        options[key.strip()] = int(value)
    minimums = {"count": 1, "seed": 0, "min_ops": 1, "max_ops": 1, "max_operand": 1}
    for key, value in options.items():
        if key not in minimums:
            raise argparse.ArgumentTypeError(
                f"unknown --synthetic option {key!r}; valid: {', '.join(minimums)}"
            )
        if value < minimums[key]:
            raise argparse.ArgumentTypeError(f"--synthetic {key} must be >= {minimums[key]}, got {value}")
    if options.get("min_ops", 1) > options.get("max_ops", 3):
        raise argparse.ArgumentTypeError("--synthetic min_ops must be <= max_ops")
    return options


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``d3s eval`` options to ``parser``."""
    parser.add_argument("--model", help="model directory or Hugging Face id (required unless --audit)")
    parser.add_argument(
        "--benchmarks",
        default=DEFAULT_BENCHMARKS,
        help=f"comma-separated benchmark names (default: {DEFAULT_BENCHMARKS}); valid: {', '.join(BENCHMARKS)}",
    )
    parser.add_argument("--samples", type=_positive_int, default=32, help="samples per problem (default 32)")
    parser.add_argument(
        "--k", type=_k_list, default=[1, 8], help="Pass@k values to report, e.g. 1,8 (default)"
    )
    parser.add_argument("--out", type=Path, help="output directory (required unless --audit)")
    parser.add_argument(
        "--temperature", type=_number, default=0.6, help="sampling temperature, 0 = greedy (0.6)"
    )
    parser.add_argument("--top-p", type=_number, default=0.95, help="nucleus sampling top-p (0.95)")
    parser.add_argument(
        "--max-tokens", type=_positive_int, default=4096, help="max new tokens per completion (4096)"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"benchmark root <dir>/<benchmark>/test.jsonl (default ${DATA_DIR_ENV})",
    )
    parser.add_argument(
        "--limit", type=_positive_int, default=None, help="only the first N problems per benchmark"
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="generation backend (auto: vLLM if GPU)"
    )
    parser.add_argument("--template", choices=TEMPLATES, default="auto", help="prompt template (auto)")
    parser.add_argument("--seed", type=_seed, default=0, help="sampling and bootstrap seed (0)")
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="problems per generate call (transformers 8, vLLM 64)",
    )
    parser.add_argument(
        "--answer-extraction",
        choices=("boxed_first", "boxed_only"),
        default="boxed_first",
        help="boxed_first: prefer \\boxed{}, else fall back to the last answer-like expression (default)",
    )
    parser.add_argument(
        "--answer-policy",
        choices=ANSWER_POLICIES,
        default=DEFAULT_ANSWER_POLICY,
        help="which boxed answer counts for the primary accuracy: math_verify reads every \\boxed{} as one set "
        "answer (default), last_boxed only the last one (Qwen2.5-Math toolkit); both are always reported",
    )
    parser.add_argument(
        "--audit-samples",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="with --audit: also measure how often the answer policies disagree on the completions of this "
        "samples.jsonl or evaluation directory (repeatable)",
    )
    parser.add_argument(
        "--grading-workers",
        type=_positive_int,
        default=max(1, min(4, (os.cpu_count() or 2) // 2)),
        help="grading subprocesses",
    )
    parser.add_argument(
        "--grading-time-limit",
        type=_number,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"seconds per answer before it counts as wrong and timed out ({DEFAULT_TIME_LIMIT_S:g})",
    )
    parser.add_argument(
        "--bootstrap", type=_positive_int, default=1000, help="bootstrap resamples for the CI (1000)"
    )
    parser.add_argument("--dtype", default="auto", help="model dtype: auto, bfloat16, float16, float32")
    parser.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=1, help="vLLM tensor parallel size"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=_number, default=0.9, help="vLLM GPU memory fraction"
    )
    parser.add_argument("--max-model-len", type=_positive_int, default=None, help="vLLM max model length")
    parser.add_argument(
        "--synthetic",
        type=_synthetic_options,
        default={},
        metavar="KEY=VALUE,...",
        help="options of the synthetic task (count, seed, min_ops, max_ops, max_operand), e.g. max_ops=1,max_operand=9",
    )
    parser.add_argument("--overwrite", action="store_true", help="discard existing samples in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument(
        "--audit",
        action="store_true",
        help="audit the grader on the benchmarks' gold answers and reference solutions instead of evaluating",
    )


def validate_eval_args(args: argparse.Namespace) -> tuple[list[str], GenerationSettings, str]:
    """Check everything that can be checked without the model; raise ValueError saying what to change."""
    names = parse_benchmark_list(args.benchmarks)
    audit_samples = getattr(args, "audit_samples", [])
    if audit_samples and not args.audit:
        raise ValueError("--audit-samples is read by the grader audit only: add --audit, or drop it")
    for path in audit_samples:
        if not (path.is_file() or (path / "samples.jsonl").is_file() or any(path.glob("*/samples.jsonl"))):
            raise ValueError(
                f"--audit-samples {path}: no samples.jsonl there (give the file, or an evaluation directory)"
            )
        files = [path] if path.is_file() else [path / "samples.jsonl", *path.glob("*/samples.jsonl")]
        for file in files:
            if file.is_file() and not file.read_text(encoding="utf-8").strip():
                raise ValueError(
                    f"--audit-samples {file} is empty; give an evaluation's samples.jsonl, or drop it"
                )
    if args.audit:
        return names, GenerationSettings(), ""
    if not args.model:
        raise ValueError("--model is required (a model directory or Hugging Face id); or use --audit")
    if args.out is None:
        raise ValueError("--out is required: the directory for samples.jsonl and summary.json")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; give a directory for samples.jsonl and summary.json")
    if args.dtype not in EVAL_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(EVAL_DTYPES)}; got {args.dtype!r}")
    bad_k = [k for k in args.k if k > args.samples]
    if bad_k:
        raise ValueError(
            f"--k {','.join(map(str, bad_k))} exceeds --samples {args.samples}: Pass@k needs at least k samples "
            f"per problem; raise --samples to {max(bad_k)} or more, or lower --k"
        )
    if args.grading_time_limit <= 0:
        raise ValueError(f"--grading-time-limit must be positive seconds, got {args.grading_time_limit}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    settings = GenerationSettings(
        samples=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_tokens,
        seed=args.seed,
    )
    try:
        settings.validate()
    except ValueError as exc:
        raise ValueError(f"{exc} (--samples/--temperature/--top-p/--max-tokens)") from None
    if settings.temperature == 0 and settings.samples > 1:
        print("note: --temperature 0 is greedy; all samples of a problem will be identical", file=sys.stderr)
    check_model_dir(args.model, "--model")  # a local path needs a readable config.json
    backend = choose_backend(args.backend)
    return names, settings, backend


def _data_source(name: str, data_dir: Path | None) -> str:
    """The file a benchmark was read from (its checksum goes into the summary), or where else it came from."""
    if name == "synthetic":
        return "d3s.data.synthetic (generated)"
    if data_dir is not None and (data_dir / BENCHMARKS[name].local_path).is_file():
        return str(data_dir / BENCHMARKS[name].local_path)
    return "huggingface hub"


def _load_all(
    names: list[str], data_dir: Path | None, limit: int | None, synthetic: dict[str, int] | None = None
) -> dict[str, list[Problem]]:
    """Load every benchmark up front: missing or malformed data fails before the model loads."""
    return {name: load_benchmark(name, data_dir, limit=limit, synthetic=synthetic) for name in names}


def _run_audit(args: argparse.Namespace, names: list[str] | None) -> int:
    from d3s.evaluation import audit
    from d3s.rewards import Grader

    data_dir = resolve_data_dir(args.data_dir)
    with Grader(num_workers=args.grading_workers, time_limit=args.grading_time_limit) as grader:
        rows = audit.run_audit(data_dir, names, grader)
        policy_rows = audit.reference_disagreement(data_dir, [row.benchmark for row in rows], grader)
        policy_rows += audit.samples_disagreement(args.audit_samples, grader)
    print(audit.audit_markdown(rows))
    details = audit.audit_details(rows)
    if details:
        print("\n" + details)
    print("\nanswer policies (math_verify: every box as one set answer; last_boxed: the last box only):\n")
    print(audit.disagreement_markdown(policy_rows))
    details = audit.disagreement_details(policy_rows)
    if details:
        print("\n" + details)
    if args.out is not None:
        for path in audit.write_audit(rows, args.out) + audit.write_disagreement(policy_rows, args.out):
            print(f"wrote {path}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Run ``d3s eval`` with parsed ``args``; returns the process exit code (2 = bad arguments or data)."""
    try:
        names, settings, backend_name = validate_eval_args(args)
        if args.audit:
            explicit = args.benchmarks != DEFAULT_BENCHMARKS
            return _run_audit(args, names if explicit else None)
        data_dir = resolve_data_dir(args.data_dir)
        problems = _load_all(names, data_dir, args.limit, getattr(args, "synthetic", None))
    except (ValueError, BenchmarkError) as exc:
        print(f"d3s eval: error: {one_line(exc)}", file=sys.stderr)
        return 2
    return _evaluate(args, names, settings, backend_name, problems, data_dir)


def _evaluate(
    args: argparse.Namespace,
    names: list[str],
    settings: GenerationSettings,
    backend_name: str,
    problems: dict[str, list[Problem]],
    data_dir: Path | None,
) -> int:
    import shutil

    from d3s.data.benchmarks import get_benchmark
    from d3s.data.templates import resolve_template
    from d3s.evaluation.backends import TransformersBackend, VLLMBackend, _load_tokenizer
    from d3s.evaluation.runner import (
        BenchmarkRun,
        ResumeMismatchError,
        ScoringOptions,
        evaluate_benchmark,
        format_results_table,
        write_overall_summary,
    )
    from d3s.rewards import Grader

    out: Path = args.out
    tokenizer = _load_tokenizer(args.model)
    for name in names:  # a chat-template prompt needs a chat template: check before loading weights
        if resolve_template(
            args.template, tokenizer, get_benchmark(name).default_template
        ) == "qwen_math_cot" and (not getattr(tokenizer, "chat_template", None)):
            print(
                f"d3s eval: error: --template qwen_math_cot needs a chat template, and {args.model} has none; "
                "use --template plain or auto",
                file=sys.stderr,
            )
            return 2
    if args.overwrite:
        for name in names:
            shutil.rmtree(out / name, ignore_errors=True)
    if backend_name == "vllm":
        batch_size = args.batch_size or 64
        backend = VLLMBackend(
            args.model,
            seed=args.seed,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            batch_size=batch_size,
            tokenizer=tokenizer,
        )
    else:
        batch_size = args.batch_size or 8
        backend = TransformersBackend(
            args.model, dtype=args.dtype, batch_size=batch_size, tokenizer=tokenizer
        )
    scoring = ScoringOptions(
        ks=tuple(args.k),
        bootstrap_resamples=args.bootstrap,
        bootstrap_seed=args.seed,
        answer_policy=args.answer_policy,
    )
    summaries = {}
    with Grader(
        num_workers=args.grading_workers,
        time_limit=args.grading_time_limit,
        answer_extraction=args.answer_extraction,
    ) as grader:
        for name in names:
            run = BenchmarkRun(
                benchmark=name,
                problems=problems[name],
                out_dir=out / name,
                settings=settings,
                template=args.template,
                model_path=args.model,
                scoring=scoring,
                data_source=_data_source(name, data_dir),
                extra_provenance={"limit": args.limit, "batch_size": batch_size},
            )
            try:
                summaries[name] = evaluate_benchmark(
                    backend, grader, run, batch_size=batch_size, progress=not args.no_progress
                )
            except ResumeMismatchError as exc:
                print(f"d3s eval: error: {exc}", file=sys.stderr)
                return 2
    write_overall_summary(out, args.model, summaries)
    print(format_results_table(summaries, args.k))
    print(f"results in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from d3s.cli import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="d3s eval", description=__doc__.splitlines()[0])
    add_eval_arguments(parser)
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
