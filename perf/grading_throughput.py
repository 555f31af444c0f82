"""Grading throughput on a realistic synthetic mix and on real completions (PODS's released evaluation
outputs, when ../shared/data/completions is there), and the training reward's grading time per step.

    .venv/bin/python perf/grading_throughput.py            # a few minutes on a 2-core machine
    .venv/bin/python perf/grading_throughput.py --quick    # small sizes, a smoke run

The mix (long chains of thought, looping completions with hundreds of boxes, short answers) is written here,
seeded; perf/README.md describes its rows.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, base_parser, fmt_seconds, markdown_table, parse_args, timed_once, write_results

from d3s.grading.policies import ANSWER_POLICIES
from d3s.grading.pool import Grader
from d3s.rewards import make_accuracy_reward

NAME = "grading_throughput"
PODS_COMPLETIONS = REPO_ROOT / ".." / "shared" / "data" / "completions" / "pods"
CHARS_PER_TOKEN = 3.7  # Qwen2.5 on English math reasoning with LaTeX
STEP_TOKENS = 3000
LOOPING_SHARE = 0.05  # 45 of 912 Qwen2.5-Math-7B greedy completions looped (issue 20)
SHORT_SHARE = 0.25

_SENTENCES = (
    r"Let $x$ be the number of apples, so $3x + 5 = {a}$ and therefore $x = \frac{{{a} - 5}}{{3}}$. ",
    r"We expand $(a + b)^2 = a^2 + 2ab + b^2$ and substitute $a = {a}$, $b = {b}$. ",
    r"The sum of the first $n$ integers is $\frac{{n(n+1)}}{{2}}$; with $n = {b}$ this is {c}. ",
    r"Since $\sqrt{{{a}}} \approx {d}$, the inequality $y^2 < {a}$ holds for $|y| < {d}$. ",
    r"Checking: $ {a} \times {b} = {e} $, which matches the condition. ",
    "Now consider the remaining cases one by one, keeping track of the constraint from before. ",
)


def _sentence(rng: random.Random) -> str:
    a, b = rng.randint(6, 999), rng.randint(2, 60)
    values = {"a": a, "b": b, "c": b * (b + 1) // 2, "d": f"{a**0.5:.2f}", "e": a * b}
    return rng.choice(_SENTENCES).format(**values)


def _reasoning(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) < chars:
        parts.append(_sentence(rng))
    return "".join(parts)


def long_chain_of_thought(rng: random.Random, gold: int, tokens: int) -> str:
    body = _reasoning(rng, int(tokens * CHARS_PER_TOKEN) - 60)
    if rng.random() < 0.25:
        return f"{body}\nThe answer is {gold}."
    answer = rng.choice([str(gold), f"\\frac{{{2 * gold}}}{{2}}", str(gold + 1)])  # some wrong
    return f"{body}\nTherefore, the final answer is $\\boxed{{{answer}}}$."


def looping_completion(rng: random.Random, gold: int) -> str:
    """Hundreds of boxes, mostly the same one: as lines ("The final answer is $\\boxed{..}$.") or run
    together (``\\boxed{..} \\boxed{..}``, which math-verify reads as one growing set answer)."""
    prefix = _reasoning(rng, rng.randint(500, 2000))
    boxes = rng.randint(600, 1400)
    distinct = [f"\\frac{{{2 * gold}}}{{2}}", f"\\frac{{{gold + 1}}}{{3}}", f"\\sqrt{{{gold}}}", str(gold)]
    contents = [distinct[0] if i % 40 else distinct[(i // 40) % len(distinct)] for i in range(boxes)]
    if rng.random() < 0.5:
        body = "".join(f"The final answer is $\\boxed{{{content}}}$.\n" for content in contents)
    else:
        body = " ".join(f"\\boxed{{{content}}}" for content in contents)
    return prefix + body


def short_answer(rng: random.Random, gold: int) -> str:
    return rng.choice([f"\\boxed{{{gold}}}", f"<answer>{gold}</answer>", f"{gold}", f"\\boxed{{{gold + 1}}}"])


def synthetic_mix(count: int, tokens: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """``count`` completions, their gold answers and their kinds (``long``, ``looping``, ``short``)."""
    rng = random.Random(seed)
    completions, golds, kinds = [], [], []
    for index in range(count):
        gold = rng.randint(1, 999)
        share = (index % 100) / 100  # the same proportions in every hundred
        if share < LOOPING_SHARE:
            kind, text = "looping", looping_completion(rng, gold)
        elif share < LOOPING_SHARE + SHORT_SHARE:
            kind, text = "short", short_answer(rng, gold)
        else:
            kind, text = "long", long_chain_of_thought(rng, gold, rng.randint(tokens // 3, tokens))
        completions.append(text)
        golds.append(str(gold))
        kinds.append(kind)
    return completions, golds, kinds


def pods_sample(count: int, folder: Path = PODS_COMPLETIONS) -> tuple[list[str], list[str]]:
    """``count`` of PODS's 22,885 released completions, evenly spaced over the files, with their golds."""
    pairs = []
    for path in sorted(folder.glob("*.json.gz")):
        data = json.loads(gzip.decompress(path.read_bytes()))
        checkpoints = {"": data} if path.name.startswith("base-") else data
        for benchmarks in checkpoints.values():
            for evaluation in benchmarks.values():
                pairs += [(example["completion"], example["answer"]) for example in evaluation["examples"]]
    chosen = pairs[:: max(1, len(pairs) // count)][:count]
    return [c for c, _ in chosen], [g for _, g in chosen]


def measure_mix(
    completions: list[str], golds: list[str], kinds: list[str], workers: int, kind: str = "mix"
) -> list[dict]:
    rows = []
    with Grader(num_workers=workers) as grader:
        grader.grade_many([r"\boxed{1}"] * workers, ["1"] * workers)  # start the workers
        for policy in ANSWER_POLICIES:
            graded = timed_once(lambda policy=policy: grader.grade_many(completions, golds, policy))
            results, seconds = graded["result"], graded["median_s"]
            by_kind = {
                kind: max(r.seconds for r, k in zip(results, kinds, strict=True) if k == kind)
                for kind in sorted(set(kinds))
            }
            rows.append(
                {
                    "kind": kind,
                    "policy": policy,
                    "workers": workers,
                    "completions": len(completions),
                    "seconds": seconds,
                    "completions_per_s": len(completions) / seconds,
                    "slowest_s": max(by_kind.values()),
                    "slowest_by_kind_s": by_kind,
                    "timeouts": sum(r.timed_out for r in results),
                    "math_verify_bounded": sum(r.bounded for r in results),  # past the work budget
                    "correct": sum(r.correct for r in results),
                }
            )
    return rows


def measure_step(prompts: int, generations: int, tokens: int) -> dict[str, Any]:
    completions, golds, _ = synthetic_mix(prompts * generations, tokens, seed=1)
    reward = make_accuracy_reward()  # the process's default grader, as training uses it
    reward([r"\boxed{1}"], ["1"])  # start its worker
    graded = timed_once(lambda: reward(completions, golds))
    values, seconds = graded["result"], graded["median_s"]
    return {
        "kind": "step",
        "policy": "math_verify",
        "workers": 1,
        "completions": len(completions),
        "geometry": f"{prompts} x {generations} x <= {tokens} tokens",
        "seconds": seconds,
        "completions_per_s": len(completions) / seconds,
        "reward_mean": sum(v or 0.0 for v in values) / len(values),
    }


def main() -> None:
    parser = base_parser(__doc__, tiny_model=False)
    parser.add_argument("--mix", type=int, default=200, help="completions in the throughput mix")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per training step")
    parser.add_argument("--generations", type=int, default=32, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=STEP_TOKENS, help="completion length cap (tokens)")
    parser.add_argument("--pods", type=int, default=2000, help="PODS completions graded (1 worker; 0: none)")
    args = parse_args(parser, mix=40, workers=[1, 2], prompts=4, generations=8, pods=40)
    completions, golds, kinds = synthetic_mix(args.mix, args.tokens)
    rows: list[dict[str, Any]] = []
    for workers in args.workers:
        rows += measure_mix(completions, golds, kinds, workers)
    if args.pods and PODS_COMPLETIONS.is_dir():
        pods_completions, pods_golds = pods_sample(args.pods)
        rows += measure_mix(pods_completions, pods_golds, ["pods"] * len(pods_completions), 1, kind="pods")
    rows.append(measure_step(args.prompts, args.generations, args.tokens))
    mix_table = markdown_table(
        [r for r in rows if r["kind"] in ("mix", "pods")],
        {
            "completions": "{kind}",
            "policy": "{policy}",
            "workers": "{workers}",
            "graded": "{completions}",
            "wall": lambda r: fmt_seconds(r["seconds"]),
            "completions/s": "{completions_per_s:.1f}",
            "slowest answer": lambda r: fmt_seconds(r["slowest_s"]),
            "slowest looping": lambda r: fmt_seconds(r["slowest_by_kind_s"].get("looping")),
            "math-verify past budget": "{math_verify_bounded}",
            "timeouts": "{timeouts}",
        },
    )
    step_table = markdown_table(
        [r for r in rows if r["kind"] == "step"],
        {
            "geometry": "{geometry}",
            "policy": "{policy}",
            "workers": "{workers}",
            "grading s/step": lambda r: fmt_seconds(r["seconds"]),
            "completions/s": "{completions_per_s:.1f}",
        },
    )
    kinds_text = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
    notes = [
        f"Mix: {kinds_text}; step mix: the same proportions (seed 1). pods: PODS's released completions "
        "(../shared/data/completions/pods), evenly spaced; math-verify past budget: answers math_verify "
        "graded by the bounded reading because math-verify's reading needed more than its work budget (a "
        "count of candidates, not a clock)."
    ]
    write_results(NAME, args, rows, f"{mix_table}\n\n{step_table}", notes=notes, title="Grading throughput")


if __name__ == "__main__":
    main()
