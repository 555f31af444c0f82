"""Evaluation throughput: math-verify grading (answers/s) and transformers-backend generation (tokens/s).

    .venv/bin/python perf/eval_throughput.py            # ~1-2 min on a 2-core machine
    .venv/bin/python perf/eval_throughput.py --quick    # small sizes, a smoke run

Grading: cold then warm passes, 1 and 2 workers and in-process; generation: the tiny model, sampled and
greedy (perf/README.md).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    TINY_TASK,
    base_parser,
    fmt_seconds,
    markdown_table,
    parse_args,
    prepare_tiny_model,
    timed,
    timed_once,
    write_results,
)

from d3s.grading.pool import Grader

NAME = "eval_throughput"


def synthetic_answers(count: int) -> tuple[list[str], list[str]]:
    """Held-out completions of the tiny task with their gold; every other answer is made wrong."""
    from d3s.data.synthetic import arithmetic_problems

    completions, golds = [], []
    for i, problem in enumerate(arithmetic_problems(count, split="test", **TINY_TASK)):
        text = problem.completion
        if i % 2:
            text = text.replace(f"\\boxed{{{problem.answer}}}", f"\\boxed{{{int(problem.answer) + 1}}}")
        completions.append(text)
        golds.append(problem.answer)
    return completions, golds


def math500_answers(data_dir: Path, count: int) -> tuple[list[str], list[tuple[str, ...]]] | None:
    """MATH500 reference solutions and gold answers, or None when the local copy is absent."""
    from d3s.data.benchmarks import load_benchmark

    if not (data_dir / "math500" / "test.jsonl").is_file():
        return None
    problems = load_benchmark("math500", data_dir, limit=count, allow_hub=False)
    return [p.reference_solution or "" for p in problems], [p.gold for p in problems]


def grading_rows(answer_sets: dict[str, tuple[list[str], list[Any]]]) -> list[dict]:
    """Per answer set and grader: a cold pass (fresh workers) over the first fifth of the answers, then a warm
    pass over the rest (other problems, so the gold cache does not help)."""
    rows = []
    for label, (completions, golds) in answer_sets.items():
        split = len(completions) // 5
        passes = {"cold": (completions[:split], golds[:split]), "warm": (completions[split:], golds[split:])}
        for mode, workers in (("subprocess", 1), ("subprocess", 2), ("in-process", 1)):
            with Grader(num_workers=workers, time_limit=None if mode == "in-process" else 10.0) as grader:
                grader.grade_many(["\\boxed{1}"] * workers, ["1"] * workers)  # start the workers
                for phase, (texts, answers) in passes.items():
                    graded = timed_once(functools.partial(grader.grade_many, texts, answers))
                    results, seconds = graded["result"], graded["median_s"]
                    if mode == "in-process" and phase == "cold":
                        continue  # this process has graded before: its parser caches are never cold again
                    rows.append(
                        {
                            "kind": "grading",
                            "answers": label,
                            "mode": mode,
                            "workers": workers,
                            "phase": phase,
                            "count": len(texts),
                            "seconds": seconds,
                            "answers_per_s": len(texts) / seconds,
                            "correct": sum(r.correct for r in results),
                            "timeouts": sum(r.timed_out for r in results),
                            "mean_chars": sum(map(len, texts)) / len(texts),
                        }
                    )
                    rate = rows[-1]["answers_per_s"]
                    print(f"grading {label} {mode} x{workers} {phase}: {rate:.0f} answers/s", flush=True)
    return rows


def generation_rows(model_dir: Path, problems: int, repeats: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s.data.benchmarks import load_benchmark
    from d3s.evaluation.backends import GenerationSettings, TransformersBackend

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    benchmark = load_benchmark("synthetic", synthetic={"count": problems, **TINY_TASK})
    prompts = [problem.question for problem in benchmark]
    seeds = list(range(len(prompts)))
    sampled = GenerationSettings(samples=8, temperature=0.6, top_p=0.95, max_new_tokens=32)
    configs = [
        ("sampled, 8 per problem", 8, sampled),
        ("sampled, 8 per problem", 32, sampled),
        ("greedy, 1 per problem", 64, GenerationSettings(samples=1, temperature=0.0, max_new_tokens=32)),
    ]
    rows = []
    for label, batch, settings in configs:
        backend = TransformersBackend(str(model_dir), model=model, tokenizer=tokenizer, batch_size=batch)
        generate = functools.partial(backend.generate, prompts, settings, seeds, add_special_tokens=False)
        timing = timed(generate, repeats=repeats)
        samples = [s for per_problem in timing["result"] for s in per_problem]
        tokens = sum(s.num_tokens for s in samples)
        seconds = timing["median_s"]
        rows.append(
            {
                "kind": "generation",
                "decoding": label,
                "prompts_per_call": min(batch, len(prompts)),
                "rows_per_call": min(batch, len(prompts)) * settings.samples,
                "problems": len(prompts),
                "samples": len(samples),
                "generated_tokens": tokens,
                "mean_tokens": tokens / len(samples),
                "seconds": seconds,
                "cpu_seconds": timing["cpu_median_s"],
                "tokens_per_s": tokens / seconds,
                "tokens_per_cpu_s": tokens / timing["cpu_median_s"],
                "problems_per_s": len(prompts) / seconds,
                "samples_per_s": len(samples) / seconds,
                "repeats": timing["repeats"],
            }
        )
        print(f"generation {label} batch {batch}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    return rows


GRADING_COLUMNS = {
    "answer set": "{answers}",
    "mean length (chars)": "{mean_chars:.0f}",
    "grader": lambda r: (
        f"{r['workers']} worker subprocess{'es' if r['workers'] > 1 else ''}"
        if r["mode"] == "subprocess"
        else "in-process, no time limit"
    ),
    "pass": lambda r: "cold (fresh workers)" if r["phase"] == "cold" else "warm",
    "answers": "{count}",
    "time": lambda r: fmt_seconds(r["seconds"]),
    "answers/s": "{answers_per_s:.0f}",
    "vs 1 warm worker": "{vs_1_warm_worker:.2f}x",
    "correct": "{correct}",
    "timeouts": "{timeouts}",
}
GENERATION_COLUMNS = {
    "decoding": "{decoding}",
    "prompts per generate call": "{prompts_per_call}",
    "rows per call": "{rows_per_call}",
    "samples": "{samples}",
    "mean tokens": "{mean_tokens:.1f}",
    "time": lambda r: fmt_seconds(r["seconds"]),
    "CPU time": lambda r: fmt_seconds(r["cpu_seconds"]),
    "tokens/s": "{tokens_per_s:.0f}",
    "tokens per CPU s": "{tokens_per_cpu_s:.0f}",
    "problems/s": "{problems_per_s:.1f}",
    "samples/s": "{samples_per_s:.0f}",
}


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--data-dir", type=Path, default=REPO_ROOT.parent / "shared" / "data")
    parser.add_argument("--synthetic-answers", type=int, default=2500, help="the first 500 are the cold pass")
    parser.add_argument("--math500-answers", type=int, default=500, help="the first 100 are the cold pass")
    parser.add_argument("--problems", type=int, default=128, help="synthetic problems to generate for")
    parser.add_argument("--repeats", type=int, default=3)
    quick = dict(synthetic_answers=40, math500_answers=15, problems=16, repeats=1, sft_steps=0)
    args = parse_args(parser, **quick)
    notes: list[str] = []

    answer_sets: dict[str, tuple[list, list]] = {"synthetic": synthetic_answers(args.synthetic_answers)}
    math500 = math500_answers(args.data_dir, args.math500_answers)
    if math500 is None:
        notes.append(f"MATH500 skipped: no {args.data_dir / 'math500' / 'test.jsonl'}.")
        args.math500_answers = 0  # recorded: none graded
    else:
        answer_sets["math500 reference solutions"] = math500
    grading = grading_rows(answer_sets)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare_tiny_model(Path(tmp) / "model", sft_steps=args.sft_steps)
        generation = generation_rows(model_dir, args.problems, args.repeats)

    warm_single = {
        r["answers"]: r for r in grading if (r["mode"], r["workers"], r["phase"]) == ("subprocess", 1, "warm")
    }
    for r in grading:  # against one warm worker on the same answers
        r["vs_1_warm_worker"] = r["answers_per_s"] / warm_single[r["answers"]]["answers_per_s"]
    grading_table = markdown_table(grading, GRADING_COLUMNS)
    generation_table = markdown_table(generation, GENERATION_COLUMNS)
    notes += [
        "Grading: per answer set, a cold pass (the first fifth of the answers, on freshly started workers) "
        "then a warm pass (the rest: other problems, so every gold is parsed for the first time; the grader "
        "caches parsed gold, so repeated samples of one problem grade faster still). A fresh worker is slow "
        "until math-verify's parser caches warm up; a worker replaced after a timeout starts cold again.",
        "In-process grading has only a warm pass: once a process has graded, its parser caches stay warm.",
        "Generation: transformers generate on the tiny model (fp32, 1 torch thread), median of the repeats; "
        "tokens include the EOS; max 32 new tokens.",
        "Shared 2-core machine: two grading workers compete with each other and with other jobs; compare "
        "ratios within this run.",
    ]
    sections = {"Grading (math-verify)": grading_table, "Generation (transformers backend)": generation_table}
    markdown = "\n\n".join(f"## {title}\n\n{table}" for title, table in sections.items())
    write_results(NAME, args, grading + generation, markdown, notes, title="Evaluation throughput")


if __name__ == "__main__":
    main()
