"""Three readers of the same completions side by side: our ``math_verify`` policy, TRL 1.16's
``accuracy_reward`` (the ``trl`` policy) and math-verify's default ``parse`` + ``verify``; how many verdicts
differ from the policy's, and, where the completions carry a reference verdict, the errors against it, with
and without the guard against answers copied from the question (``reward_copied_answers: false``).

Run on the shared real completions (README there), to regenerate docs/evaluation/readers.md's table:
``python -m d3s.evaluation.reader_comparison ../shared/data/completions``."""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d3s.grading.copied import copied_from_prompt
from d3s.grading.pool import DEFAULT_TIME_LIMIT_S, Grader
from d3s.markdown import markdown_table


@dataclass(frozen=True)
class LabelledCompletion:
    """One real completion: an id, the prompt it answered, the gold answer, and its authors' verdict."""

    key: str
    prompt: str
    completion: str
    gold: str
    label: bool | None  # the authors' own grader's verdict; None where there is none


def pods_completions(directory: Path) -> list[LabelledCompletion]:
    """PODS's released evaluation outputs (``<dir>/pods/*.json.gz``), labelled by PODS's own grader."""
    items = []
    for path in sorted((directory / "pods").glob("*.json.gz")):
        data = json.loads(gzip.decompress(path.read_bytes()))
        checkpoints = {"": data} if path.name.startswith("base-") else data
        for checkpoint, benchmarks in checkpoints.items():
            for benchmark, evaluation in benchmarks.items():
                for index, example in enumerate(evaluation["examples"]):
                    key = f"{path.name}:{checkpoint}:{benchmark}:{index}"
                    label = str(example["correct"]) == "True"
                    texts = (example["prompt"], example["completion"], example["answer"])
                    items.append(LabelledCompletion(key, *texts, label))
    return items


def gsm8k_gold(reference: str) -> str:
    """The number a GSM8K reference solution ends with: after its last ``A:`` (these files) or ``####``
    (the dataset's own format), thousands separators removed."""
    return re.split(r"####|(?:^|\n)A:", reference)[-1].strip().replace(",", "")


GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def gsm8k_solutions(directory: Path) -> list[LabelledCompletion]:
    """OpenAI's GSM8K example solutions (``<dir>/gsm8k/example_model_solutions.jsonl``), four models per
    question, labelled by their ``is_correct``."""
    items = []
    lines = (directory / "gsm8k" / "example_model_solutions.jsonl").read_text(encoding="utf-8").splitlines()
    for row_index, line in enumerate(lines):
        row = json.loads(line)
        gold = gsm8k_gold(row["ground_truth"])
        for model in GSM8K_MODELS:
            solution = row[model]
            items.append(
                LabelledCompletion(
                    f"gsm8k:{row_index}:{model}",
                    row["question"],
                    solution["solution"],
                    gold,
                    bool(solution["is_correct"]),
                )
            )
    return items


def shared_corpora(directory: Path) -> dict[str, list[LabelledCompletion]]:
    """The shared real completions by corpus name; a clear error when ``directory`` does not hold them."""
    if not (directory / "pods").is_dir() or not (directory / "gsm8k").is_dir():
        raise FileNotFoundError(f"{directory} holds no pods/ and gsm8k/: pass the shared completions folder")
    return {"pods": pods_completions(directory), "gsm8k": gsm8k_solutions(directory)}


def _default_parse_verdict(item: tuple[str, str]) -> bool:
    """math-verify's default call: ``verify(parse(gold), parse(completion))`` with its own time limits."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    completion, gold = item
    try:
        return bool(verify(parse(gold), parse(completion)))
    except Exception:  # its timeouts raise past its own handlers in some versions: wrong, as TRL counts it
        return False


@dataclass(frozen=True)
class ReaderVerdicts:
    """Each reader's verdict on every completion of one corpus, and the policy's copied flags."""

    policy: list[bool]
    trl: list[bool]
    default_parse: list[bool]
    copied: list[bool]  # the policy's answer is copied unevaluated from the prompt
    labels: list[bool | None]


def read_corpus(items: Sequence[LabelledCompletion], workers: int = 2) -> ReaderVerdicts:
    """The three readers' verdicts on ``items`` (``workers`` grading processes each)."""
    completions, golds = [i.completion for i in items], [i.gold for i in items]
    with Grader(num_workers=workers, time_limit=DEFAULT_TIME_LIMIT_S) as grader:
        grades = grader.grade_many_by_policy(completions, golds, ("math_verify", "trl"))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        default = pool.map(_default_parse_verdict, list(zip(completions, golds, strict=True)), chunksize=64)
    pairs = zip(grades["math_verify"], items, strict=True)
    copied = [copied_from_prompt(grade.extracted, item.prompt) for grade, item in pairs]
    return ReaderVerdicts(
        policy=[g.correct for g in grades["math_verify"]],
        trl=[g.correct for g in grades["trl"]],
        default_parse=default,
        copied=copied,
        labels=[i.label for i in items],
    )


COLUMNS = ("corpus", "reader", "differs from the policy", "credited", "errors against the labels")


def comparison_rows(corpus: str, verdicts: ReaderVerdicts) -> list[dict[str, Any]]:
    """One row per reader: verdicts that differ from the policy's, credited answers, errors against the
    labels; and the policy with the guard (copied answers get 0)."""
    guarded = [v and not c for v, c in zip(verdicts.policy, verdicts.copied, strict=True)]
    labelled = [label is not None for label in verdicts.labels]

    def errors(values: list[bool]) -> int | str:
        if not any(labelled):
            return "n/a"
        return sum(v != label for v, label in zip(values, verdicts.labels, strict=True) if label is not None)

    readers = {
        "our `math_verify` policy": verdicts.policy,
        "our `math_verify` policy, copied answers 0 (`reward_copied_answers: false`)": guarded,
        "TRL 1.16 `accuracy_reward` (policy `trl`)": verdicts.trl,
        "math-verify default `parse` + `verify`": verdicts.default_parse,
    }
    return [
        {
            "corpus": f"{corpus} ({len(verdicts.policy)})",
            "reader": name,
            "differs from the policy": sum(a != b for a, b in zip(values, verdicts.policy, strict=True)),
            "credited": sum(values),
            "errors against the labels": errors(values),
        }
        for name, values in readers.items()
    ] + [
        {
            "corpus": f"{corpus} ({len(verdicts.policy)})",
            "reader": "(answers copied from the question, policy)",
            "differs from the policy": "",
            "credited": sum(verdicts.copied),
            "errors against the labels": "",
        }
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("completions", type=Path, help="the shared completions folder (pods/, gsm8k/)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--corpora", nargs="+", choices=("pods", "gsm8k"), default=("pods", "gsm8k"))
    args = parser.parse_args(argv)
    rows = []
    for corpus, items in shared_corpora(args.completions).items():
        if corpus not in args.corpora:
            continue
        rows += comparison_rows(corpus, read_corpus(items, args.workers))
    print(markdown_table(rows, {name: f"{{{name}}}" for name in COLUMNS}))


if __name__ == "__main__":
    main()
