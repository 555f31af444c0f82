"""Evaluation: CLI validation, backends (transformers real, vLLM faked), end-to-end runs of the tiny
model on every benchmark, resume after interruption, and the grader audit."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT, save_tiny

from d3s.data.benchmarks import EVAL_BENCHMARKS, load_benchmark
from d3s.evaluation import backends, pass_at_k
from d3s.evaluation.audit import samples_disagreement
from d3s.evaluation.backends import (
    GenerationSettings,
    Sample,
    TransformersBackend,
    VLLMBackend,
    choose_backend,
)
from d3s.evaluation.cli import add_eval_arguments, run_eval
from d3s.evaluation.runner import (
    BenchmarkRun,
    ResumeMismatchError,
    ScoringOptions,
    evaluate_benchmark,
    load_completed_samples,
    write_overall_summary,
)
from d3s.grading.policies import ANSWER_POLICIES
from d3s.grading.pool import Grader

TINY_SETTINGS = GenerationSettings(samples=4, temperature=0.6, top_p=0.95, max_new_tokens=16, seed=0)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_backend(tiny_model: Path) -> TransformersBackend:
    return TransformersBackend(str(tiny_model), batch_size=2)


@pytest.fixture(scope="module")
def grader() -> Iterator[Grader]:
    with Grader(num_workers=1, time_limit=5.0) as shared:
        yield shared


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------- CLI validation


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "m", "--out", "o", "--benchmarks", "aime24,aime2024"], "valid names: aime24"),
        (["--model", "m", "--out", "o", "--samples", "4", "--k", "1,8"], "raise --samples to 8"),
        (["--out", "o"], "--model is required"),
        (["--model", "m"], "--out is required"),
        (["--model", "/no/such/model", "--out", "o"], "no model found there"),
        (["--model", "m", "--out", "o", "--backend", "vllm"], "vllm is not installed"),
        (["--model", "m", "--out", "o", "--top-p", "0"], "top_p"),
        (["--model", "m", "--out", "o", "--grading-time-limit", "0"], "--grading-time-limit"),
        (["--model", "m", "--out", "o", "--audit-samples", "o"], "add --audit"),
        (["--audit", "--audit-samples", "/no/such/eval"], "no samples.jsonl there"),
    ],
)
def test_cli_rejects_bad_arguments_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    monkeypatch.setattr(
        backends, "_load_tokenizer", lambda path: pytest.fail("model loaded before validation")
    )
    assert run_eval(parse(argv)) == 2
    assert message in capsys.readouterr().err


def test_cli_reports_missing_data(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub is out of reach here: no network timeouts
    argv = ["--model", str(tiny_model), "--out", str(tmp_path / "o"), "--benchmarks", "gsm8k"]
    assert run_eval(parse([*argv, "--data-dir", str(tmp_path / "empty")])) == 2
    assert "gsm8k/test.jsonl" in capsys.readouterr().err


def test_argparse_type_errors() -> None:
    for argv in (
        ["--k", "1,x"],
        ["--samples", "0"],
        ["--k", "0"],
        ["--backend", "tgi"],
        ["--template", "chat"],
        ["--answer-policy", "first_boxed"],
    ):
        with pytest.raises(SystemExit):
            parse(argv)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    assert choose_backend("auto") == "vllm"
    monkeypatch.setattr(backends, "gpu_available", lambda: False)
    assert choose_backend("auto") == "transformers"
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    assert choose_backend("auto") == "transformers"
    assert choose_backend("transformers") == "transformers"
    with pytest.raises(ValueError, match="valid: auto, vllm, transformers"):
        choose_backend("tgi")


# ----------------------------------------------------------------------------------------- backends


def test_transformers_backend_is_seeded_and_left_padded(tiny_backend: TransformersBackend) -> None:
    assert tiny_backend.tokenizer.padding_side == "left"
    prompts = ["Q: 1+1=\nA:", "Q: 12+34-5=\nA:"]  # different lengths: left padding matters
    first = tiny_backend.generate(prompts, TINY_SETTINGS, [7, 8], True)
    again = tiny_backend.generate(prompts, TINY_SETTINGS, [7, 8], True)
    other = tiny_backend.generate(prompts, TINY_SETTINGS, [9, 8], True)
    assert [len(s) for s in first] == [4, 4]
    assert first == again and first != other
    for samples in first:
        for sample in samples:
            assert sample.finish_reason in ("stop", "length") and 0 <= sample.num_tokens <= 16
    # A prompt alone gives the same completions as inside a padded batch with the same seed.
    alone = tiny_backend.generate(
        prompts[1:], GenerationSettings(samples=2, temperature=0.0, max_new_tokens=8), [1], True
    )
    batched = tiny_backend.generate(
        prompts, GenerationSettings(samples=2, temperature=0.0, max_new_tokens=8), [1, 1], True
    )
    assert alone[0] == batched[1]
    assert alone[0][0] == alone[0][1]  # greedy: samples are identical


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[list[Any], list[FakeSamplingParams], dict[str, Any]]] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts: list[Any], params: list[FakeSamplingParams], **kwargs: Any) -> list[Any]:
        self.calls.append((prompts, params, kwargs))
        outputs = []
        for prompt, param in zip(prompts, params, strict=True):
            choices = [
                types.SimpleNamespace(
                    text=f" \\boxed{{{len(prompt['prompt_token_ids'])}}}",
                    token_ids=[1, 2, 3][: i + 1],
                    finish_reason="length" if i == 0 else "stop",
                )
                for i in range(param.kwargs["n"])
            ]
            outputs.append(types.SimpleNamespace(outputs=choices))
        return outputs


def test_vllm_backend_with_fake_module(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    fake = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    backend = VLLMBackend(str(tiny_model), seed=3, tensor_parallel_size=2, max_model_len=1024)
    llm = FakeLLM.instances[-1]
    assert llm.kwargs == {
        "model": str(tiny_model),
        "seed": 3,
        "dtype": "auto",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.9,
        "max_model_len": 1024,
    }
    settings = GenerationSettings(samples=3, temperature=0.6, top_p=0.95, max_new_tokens=20)
    results = backend.generate(["Q: 1+1=\nA:", "Q: 2=\nA:"], settings, [11, 12], True)
    prompts, params, kwargs = llm.calls[-1]
    assert [p.kwargs for p in params] == [
        {"n": 3, "temperature": 0.6, "top_p": 0.95, "max_tokens": 20, "seed": 11},
        {"n": 3, "temperature": 0.6, "top_p": 0.95, "max_tokens": 20, "seed": 12},
    ]
    assert prompts[0]["prompt_token_ids"] == backend.tokenizer("Q: 1+1=\nA:")["input_ids"]
    assert kwargs == {"use_tqdm": False}
    assert [len(r) for r in results] == [3, 3]
    assert results[0][0].finish_reason == "length" and results[0][1].finish_reason == "stop"
    assert results[0][2].num_tokens == 3


def test_vllm_backend_on_the_cpu_with_fake_module(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """Without CUDA: the head dimension checked first, eager mode, fp32 for auto, the engine in this process
    and a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (1 unless set)."""
    monkeypatch.setitem(
        sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams)
    )
    monkeypatch.setattr(backends, "gpu_available", lambda: False)
    checked = []
    monkeypatch.setattr(backends, "check_vllm_cpu_model", checked.append)
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(key, "recorded")  # so that the undo also removes what the backend sets
        monkeypatch.delenv(key)
    VLLMBackend(str(tiny_model), seed=3)
    assert checked == [str(tiny_model)]
    assert FakeLLM.instances[-1].kwargs | {"model": None} == {
        "model": None,
        "seed": 3,
        "dtype": "float32",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "max_model_len": None,
        "enforce_eager": True,
    }
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the user's size is kept
    VLLMBackend(str(tiny_model), dtype="bfloat16")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3" and FakeLLM.instances[-1].kwargs["dtype"] == "bfloat16"


def test_imports_are_lazy() -> None:
    """Importing the evaluation code never imports vLLM; math-verify loads only when grading in-process;
    pandas only for the grader audit (about 1 s of every evaluation job's start otherwise)."""
    import subprocess

    code = (
        "import sys, d3s.rewards, d3s.evaluation\n"
        "assert 'math_verify' not in sys.modules, 'math_verify imported'\n"
        "import d3s.evaluation.cli, d3s.evaluation.runner, d3s.evaluation.backends\n"
        "assert 'pandas' not in sys.modules, 'pandas imported'\n"
        "import d3s.evaluation.audit\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_end_to_end_every_benchmark(tiny_model: Path, tmp_path: Path, shared_data_dir: Path) -> None:
    data_dir = shared_data_dir
    names = [*EVAL_BENCHMARKS, "synthetic"]
    out = tmp_path / "eval"
    argv = ["--model", str(tiny_model), "--benchmarks", ",".join(names), "--samples", "4", "--k", "1,2"]
    argv += ["--max-tokens", "16", "--limit", "2", "--out", str(out), "--data-dir", str(data_dir)]
    argv += ["--backend", "transformers", "--grading-workers", "1", "--no-progress", "--seed", "1"]
    assert run_eval(parse(argv)) == 0
    overall = json.loads((out / "summary.json").read_text())
    assert set(overall["benchmarks"]) == set(names) and set(overall["average"]) == {"1", "2"}
    for name in names:
        expected_ids = [p.problem_id for p in load_benchmark(name, data_dir, limit=2)]
        records = read_jsonl(out / name / "samples.jsonl")
        assert len(records) == 2 * 4
        assert [r["problem_id"] for r in records] == [i for i in expected_ids for _ in range(4)]
        assert [r["sample_index"] for r in records] == [0, 1, 2, 3] * 2
        for record in records:
            assert {"completion", "extracted", "correct", "timed_out"} <= set(record)
        summary = json.loads((out / name / "summary.json").read_text())
        assert (
            summary["n_problems"] == 2 and summary["samples_per_problem"] == 4 and summary["n_samples"] == 8
        )
        assert summary["generation"] == {
            "samples": 4,
            "temperature": 0.6,
            "top_p": 0.95,
            "max_new_tokens": 16,
            "seed": 1,
        }
        assert summary["model_path"] == str(tiny_model) and summary["backend"] == "transformers"
        assert summary["unparsable_gold"] == 0 and summary["timeouts"] == 0
        # provenance: versions, commit, hardware and the checksum of the benchmark file that was read
        assert summary["versions"]["trl"] == "1.16.0" and set(summary["git"]) == {"commit", "dirty"}
        assert summary["hardware"]["cpu_count"] >= 1
        if name != "synthetic":
            assert len(summary["data_sha256"]) == 64
        counts = {}
        for record in records:
            counts[record["problem_id"]] = counts.get(record["problem_id"], 0) + record["correct"]
        for k in (1, 2):
            expected = sum(pass_at_k(4, c, k) for c in counts.values()) / 2
            assert summary["pass_at_k"][str(k)] == pytest.approx(expected)
            low, high = summary["ci"][str(k)]
            assert low <= summary["pass_at_k"][str(k)] <= high
        assert summary["template"] == ("raw" if name == "synthetic" else "plain")
        # both answer policies, per sample and in the summary (math_verify is the primary by default)
        assert summary["answer_policy"] == "math_verify"
        assert summary["by_policy"]["math_verify"]["pass_at_k"] == summary["pass_at_k"]
        assert set(summary["by_policy"]) == set(ANSWER_POLICIES)
        for record in records:
            assert set(record["by_policy"]) == set(ANSWER_POLICIES)
            assert record["correct"] == record["by_policy"]["math_verify"]["correct"]
        disagreeing = sum(
            r["by_policy"]["math_verify"]["correct"] != r["by_policy"]["last_boxed"]["correct"]
            for r in records
        )
        assert summary["policy_disagreement"]["disagree"] == disagreeing
        assert (
            overall["benchmarks"][name]["by_policy"]["last_boxed"]["pass_at_k"]
            == (summary["by_policy"]["last_boxed"]["pass_at_k"])
        )
    # Running again finds everything done and changes nothing.
    before = {n: (out / n / "samples.jsonl").read_bytes() for n in names}
    assert run_eval(parse(argv)) == 0
    assert before == {n: (out / n / "samples.jsonl").read_bytes() for n in names}


class Interrupt(Exception):
    pass


def make_run(out_dir: Path, problems: list[Any], **overrides: Any) -> BenchmarkRun:
    fields = {
        "benchmark": "synthetic",
        "problems": problems,
        "out_dir": out_dir,
        "settings": TINY_SETTINGS,
        "model_path": "tiny",
        "scoring": ScoringOptions(ks=(1, 2), bootstrap_resamples=100),
    }
    fields.update(overrides)
    return BenchmarkRun(**fields)


@pytest.mark.slow
def test_resume_after_interruption(tiny_backend: TransformersBackend, grader: Grader, tmp_path: Path) -> None:
    problems = load_benchmark("synthetic", synthetic={"count": 5})
    ids = [p.problem_id for p in problems]

    # Reference: one uninterrupted run.
    reference = evaluate_benchmark(
        tiny_backend, grader, make_run(tmp_path / "ref", problems), batch_size=1, progress=False
    )
    reference_lines = (tmp_path / "ref" / "samples.jsonl").read_text().splitlines()

    # Interrupted after the second problem.
    done: list[str] = []

    def stop_after_two(problem: Any) -> None:
        done.append(problem.problem_id)
        if len(done) == 2:
            raise Interrupt

    run = make_run(tmp_path / "resumed", problems)
    with pytest.raises(Interrupt):
        evaluate_benchmark(
            tiny_backend, grader, run, batch_size=1, on_problem_done=stop_after_two, progress=False
        )
    samples_path = tmp_path / "resumed" / "samples.jsonl"
    assert [r["problem_id"] for r in read_jsonl(samples_path)] == [ids[0]] * 4 + [ids[1]] * 4
    assert not (tmp_path / "resumed" / "summary.json").exists()

    # A crash in the middle of writing the third problem: two whole lines and half of a third.
    partial = reference_lines[8:10] + [reference_lines[10][: len(reference_lines[10]) // 2]]
    with samples_path.open("a") as handle:
        handle.write("\n".join(partial))

    with pytest.warns(UserWarning, match="discarded 3 incomplete"):
        summary = evaluate_benchmark(tiny_backend, grader, run, batch_size=1, progress=False)
    records = read_jsonl(samples_path)
    pairs = [(r["problem_id"], r["sample_index"]) for r in records]
    assert len(pairs) == len(set(pairs)) == 5 * 4  # no duplicates, no gaps
    assert {r["problem_id"] for r in records} == set(ids)
    # Per-problem seeds (and one problem per generate call): the resumed run sampled exactly what the
    # uninterrupted run sampled.
    assert sorted(records, key=lambda r: (ids.index(r["problem_id"]), r["sample_index"])) == [
        json.loads(line) for line in reference_lines
    ]
    assert summary["pass_at_k"] == reference["pass_at_k"]

    # Resuming with other settings is refused, with a message saying what differs.
    other = make_run(
        tmp_path / "resumed",
        problems,
        settings=GenerationSettings(samples=4, temperature=1.0, max_new_tokens=16),
    )
    with pytest.raises(ResumeMismatchError, match="temperature"):
        evaluate_benchmark(tiny_backend, grader, other, progress=False)


def test_load_completed_samples_repairs_the_file(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    lines = [
        json.dumps({"problem_id": p, "sample_index": i})
        for p, n in (("a", 2), ("b", 2), ("c", 1))
        for i in range(n)
    ]
    lines.insert(2, "not json")
    path.write_text("\n".join(lines) + "\n" + '{"problem_id": "d", "sam')
    with pytest.warns(UserWarning, match="discarded 3"):
        completed = load_completed_samples(path, samples=2)
    assert set(completed) == {"a", "b"}
    assert [json.loads(line)["problem_id"] for line in path.read_text().splitlines()] == ["a", "a", "b", "b"]
    assert load_completed_samples(tmp_path / "absent.jsonl", 2) == {}


def test_cli_refuses_resume_with_other_settings(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model), "--benchmarks", "synthetic", "--samples", "2", "--k", "1"]
    argv += [
        "--max-tokens",
        "4",
        "--limit",
        "1",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--backend",
        "transformers",
    ]
    assert run_eval(parse(argv)) == 0
    assert run_eval(parse([*argv, "--temperature", "1.0"])) == 2
    assert "other settings" in capsys.readouterr().err
    assert run_eval(parse([*argv, "--temperature", "1.0", "--overwrite"])) == 0


# ------------------------------------------------------------------------------------------- audit


@pytest.mark.slow
def test_audit_on_real_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shared_data_dir: Path
) -> None:
    data_dir = shared_data_dir
    argv = ["--audit", "--data-dir", str(data_dir), "--out", str(tmp_path)]
    argv += ["--benchmarks", "aime24,aime25,amc23,minerva_math,olympiadbench", "--grading-workers", "2"]
    assert run_eval(parse(argv)) == 0
    printed = capsys.readouterr().out
    assert "| aime24 | 30 | 30 | 0 |" in printed
    rows = {
        line.split(",")[0]: line.split(",")
        for line in (tmp_path / "grader_audit.csv").read_text().splitlines()
    }
    header = rows.pop("benchmark")
    row = {name: dict(zip(header, values, strict=True)) for name, values in rows.items()}
    assert row["aime24"]["reference_answer_found"] == "29"  # one AIME24 solution has no \boxed{}
    assert int(row["aime24"]["reference_verified"]) >= 27
    assert row["minerva_math"]["reference_verified"] == "272"
    assert (
        row["olympiadbench"]["with_reference"] == "675"
        and row["olympiadbench"]["reference_answer_found"] == "0"
    )
    assert all(r["gold_unparsable"] == "0" for r in row.values())
    assert (tmp_path / "grader_audit.md").read_text().startswith("| benchmark |")
    # answer policies on the reference solutions (AIME24's hold several boxes each) and on given samples
    policy_rows = {
        (r["source"], r["benchmark"]): r
        for r in csv.DictReader(io.StringIO((tmp_path / "policy_disagreement.csv").read_text()))
    }
    aime = policy_rows[("reference solutions", "aime24")]
    assert (aime["completions"], aime["with_box"]) == ("30", "29") and int(aime["with_2plus_boxes"]) >= 20
    assert policy_rows[("reference solutions", "minerva_math")]["with_2plus_boxes"] == "0"
    assert ("reference solutions", "aime25") not in policy_rows  # no reference solutions
    assert "answer policies" in printed


# --------------------------------------------------------------------------------- answer policies


class ScriptedBackend:
    """Generation replaced by fixed completions (what is tested is the grading and the files): per problem,
    a late correction, a plain right answer, a right answer taken back, and no answer."""

    name = "scripted"
    tokenizer = None

    def __init__(self, gold_of: dict[str, str]) -> None:
        self.gold_of = gold_of
        self.calls = 0

    def generate(
        self, prompts: list[str], settings: GenerationSettings, seeds: list[int], add_special_tokens: bool
    ) -> list[list[Sample]]:
        self.calls += 1
        out = []
        for prompt in prompts:
            gold = int(self.gold_of[prompt])
            texts = [
                rf"\boxed{{{gold + 1}}} ... wait, actually \boxed{{{gold}}}",  # last_boxed only
                rf"so \boxed{{{gold}}}",  # both
                rf"\boxed{{{gold}}}, no: \boxed{{{gold + 1}}}",  # neither
                "no idea",  # neither
            ]
            out.append([Sample(t, 8, "stop") for t in texts[: settings.samples]])
        return out


class NoGeneration(ScriptedBackend):
    def generate(self, *args: Any, **kwargs: Any) -> list[list[Sample]]:
        raise AssertionError("a resumed evaluation generated again")


def test_both_policies_reported_and_switching_the_primary_does_not_regenerate(
    grader: Grader, tmp_path: Path
) -> None:
    problems = load_benchmark("synthetic", synthetic={"count": 3})
    backend = ScriptedBackend({p.question: p.gold[0] for p in problems})
    run = make_run(tmp_path, problems, template="raw")
    summary = evaluate_benchmark(backend, grader, run, batch_size=2, progress=False)
    samples_path = tmp_path / "samples.jsonl"
    records = read_jsonl(samples_path)
    assert [r["by_policy"]["math_verify"]["correct"] for r in records] == [False, True, False, False] * 3
    assert [r["by_policy"]["last_boxed"]["correct"] for r in records] == [True, True, False, False] * 3
    assert [r["num_boxes"] for r in records] == [2, 1, 2, 0] * 3
    assert all(r["answer_policy"] == "math_verify" for r in records)
    assert [r["correct"] for r in records] == [r["by_policy"]["math_verify"]["correct"] for r in records]
    assert summary["answer_policy"] == "math_verify"
    assert summary["pass_at_k"]["1"] == pytest.approx(0.25)
    assert summary["by_policy"]["math_verify"]["pass_at_k"]["1"] == pytest.approx(0.25)
    assert summary["by_policy"]["last_boxed"]["pass_at_k"]["1"] == pytest.approx(0.5)
    assert summary["by_policy"]["last_boxed"]["pass_at_k"]["2"] == pytest.approx(1 - 1 / 6)  # 2 of 4 right
    assert summary["policy_disagreement"] == {
        "samples": 12,
        "disagree": 3,
        "rate": 0.25,
        "math_verify_only_correct": 0,
        "last_boxed_only_correct": 3,
        "samples_with_2plus_boxes": 6,
    }
    assert json.loads((tmp_path / "manifest.json").read_text())["config"]["answer_policy"] == "math_verify"

    # Another primary policy on the same directory: nothing is generated, the samples are relabelled.
    relabelled_run = make_run(
        tmp_path, problems, template="raw", scoring=ScoringOptions(ks=(1, 2), answer_policy="last_boxed")
    )
    resumed = evaluate_benchmark(NoGeneration({}), grader, relabelled_run, progress=False)
    relabelled = read_jsonl(samples_path)
    assert [r["correct"] for r in relabelled] == [True, True, False, False] * 3
    assert [r["by_policy"] for r in relabelled] == [r["by_policy"] for r in records]
    assert resumed["answer_policy"] == "last_boxed"
    assert resumed["pass_at_k"] == summary["by_policy"]["last_boxed"]["pass_at_k"]
    assert resumed["by_policy"] == summary["by_policy"]

    # Samples written before both policies were recorded are graded again, not generated again.
    for record in relabelled:
        for key in ("by_policy", "answer_policy", "num_boxes"):
            del record[key]
    samples_path.write_text("".join(json.dumps(r) + "\n" for r in relabelled))
    regraded = evaluate_benchmark(NoGeneration({}), grader, run, progress=False)
    assert regraded["by_policy"] == summary["by_policy"]
    assert [r["by_policy"] for r in read_jsonl(samples_path)] == [r["by_policy"] for r in records]

    # The audit reads the same file and finds the same disagreement.
    (row,) = samples_disagreement([tmp_path / "samples.jsonl"], grader)
    assert (row.completions, row.with_box, row.with_2plus_boxes, row.disagree) == (12, 9, 6, 3)
    assert (row.math_verify_only_correct, row.last_boxed_only_correct) == (0, 3)
    assert row.benchmark == tmp_path.name and len(row.examples) == 3


def test_scoring_options_reject_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="math_verify, last_boxed"):
        ScoringOptions(answer_policy="first_boxed")  # type: ignore[arg-type]


def test_workflow_config_takes_an_answer_policy() -> None:
    """eval.answer_policy in the workflow config: default math_verify, the two policies, nothing else."""
    import copy

    import yaml
    from snakemake.utils import validate

    config = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    schema = str(REPO_ROOT / "config" / "schema.yaml")
    default = copy.deepcopy(config)
    validate(default, schema)
    assert default["eval"]["answer_policy"] == "math_verify"
    chosen = copy.deepcopy(config)
    chosen["eval"]["answer_policy"] = "last_boxed"
    validate(chosen, schema)
    assert chosen["eval"]["answer_policy"] == "last_boxed"
    bad = copy.deepcopy(config)
    bad["eval"]["answer_policy"] = "first_boxed"
    with pytest.raises(Exception, match="first_boxed"):
        validate(bad, schema)


class CopyingBackend(ScriptedBackend):
    """Per problem: the question's expression copied into a box, the value, a wrong value, no answer."""

    def generate(
        self, prompts: list[str], settings: GenerationSettings, seeds: list[int], add_special_tokens: bool
    ) -> list[list[Sample]]:
        out = []
        for prompt in prompts:
            expression, gold = prompt.split("Q:")[1].split("=")[0].strip(), int(self.gold_of[prompt])
            texts = [rf"\boxed{{{expression}}}", rf"\boxed{{{gold}}}", rf"\boxed{{{gold + 1}}}", "no idea"]
            out.append([Sample(t, 8, "stop") for t in texts[: settings.samples]])
        return out


def test_copied_fraction_per_policy_in_every_summary(grader: Grader, tmp_path: Path) -> None:
    problems = load_benchmark("synthetic", synthetic={"count": 3})
    run = make_run(tmp_path / "synthetic", problems, template="raw")
    summary = evaluate_benchmark(
        CopyingBackend({p.question: p.gold[0] for p in problems}), grader, run, batch_size=2, progress=False
    )
    records = read_jsonl(run.out_dir / "samples.jsonl")
    assert [r["copied"] for r in records] == [True, False, False, False] * 3  # the primary's flag on top
    assert [r["correct"] for r in records] == [True, True, False, False] * 3  # math-verify credits the copy
    for policy in ANSWER_POLICIES:
        assert [r["by_policy"][policy]["copied"] for r in records] == [True, False, False, False] * 3
        assert summary["by_policy"][policy]["copied_fraction"] == pytest.approx(0.25)
    assert summary["copied_fraction"] == pytest.approx(0.25)
    overall = write_overall_summary(tmp_path, "tiny", {"synthetic": summary})
    assert overall["benchmarks"]["synthetic"]["copied_fraction"] == pytest.approx(0.25)
    assert overall["benchmarks"]["synthetic"]["by_policy"]["trl"]["copied_fraction"] == pytest.approx(0.25)

    # Samples graded before the flag existed get it from their extracted answers, without grading again.
    for record in records:
        for verdict in [record, *record["by_policy"].values()]:
            del verdict["copied"]
    (run.out_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    in_process = Grader(time_limit=None)
    resumed = evaluate_benchmark(NoGeneration({}), in_process, run, progress=False)
    assert in_process._inline is None  # nothing was graded
    assert resumed["by_policy"] == summary["by_policy"]
    assert [r["copied"] for r in read_jsonl(run.out_dir / "samples.jsonl")] == [True, False, False, False] * 3

    # An overall summary of benchmark summaries written before the flag still reads (n/a: None).
    old = json.loads(json.dumps(summary))
    del old["copied_fraction"]
    for values in old["by_policy"].values():
        del values["copied_fraction"]
    overall = write_overall_summary(tmp_path, "tiny", {"synthetic": old})
    assert overall["benchmarks"]["synthetic"]["copied_fraction"] is None
