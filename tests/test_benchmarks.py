"""Benchmark registry, local and (mocked) hub loaders, malformed rows, prompt templates."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from helpers import REAL_COUNTS

from d3s.data import benchmarks as bm
from d3s.data import templates
from d3s.data.benchmarks import (
    BENCHMARKS,
    BenchmarkError,
    MalformedRowsWarning,
    get_benchmark,
    gsm8k_final_answer,
    load_benchmark,
    parse_benchmark_list,
)
from d3s.data.synthetic import arithmetic_problems, demonstrations
from d3s.tiny_model import build_tokenizer

SEVEN = ["aime24", "aime25", "amc23", "math500", "gsm8k", "minerva_math", "olympiadbench"]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


# ---------------------------------------------------------------------------------------- registry


def test_registry_has_every_benchmark() -> None:
    assert set(SEVEN) | {"math_level3to5", "gsm8k_train", "synthetic"} == set(BENCHMARKS)
    assert list(bm.EVAL_BENCHMARKS) == SEVEN
    assert get_benchmark("math_level3to5").role == get_benchmark("gsm8k_train").role == "train"
    for name in SEVEN + ["math_level3to5"]:
        assert get_benchmark(name).hub is not None, name


def test_unknown_benchmark_lists_valid_names() -> None:
    with pytest.raises(BenchmarkError) as info:
        get_benchmark("aime2024")
    message = str(info.value)
    assert "aime2024" in message and all(name in message for name in SEVEN)
    with pytest.raises(BenchmarkError):
        parse_benchmark_list("aime24,mat500")
    assert parse_benchmark_list(" aime24, math500 ,aime24") == ["aime24", "math500"]


# ----------------------------------------------------------------------------------- real copies


@pytest.mark.parametrize("name", sorted(REAL_COUNTS))
def test_real_copies_load(name: str, shared_data_dir: Path) -> None:
    data_dir = shared_data_dir
    if name == "math_level3to5":
        with pytest.warns(MalformedRowsWarning, match=r"line 5055.*\n.*line 5159"):
            problems = load_benchmark(name, data_dir)
    else:
        problems = load_benchmark(name, data_dir)
    assert len(problems) == REAL_COUNTS[name]
    assert len({p.problem_id for p in problems}) == len(problems)
    assert all(p.question.strip() and p.gold and all(g for g in p.gold) for p in problems)


def test_real_gold_answer_formats(shared_data_dir: Path) -> None:
    data_dir = shared_data_dir
    aime24 = load_benchmark("aime24", data_dir)
    assert any(p.gold == ("025",) for p in aime24)  # zero-padded strings kept as they are
    assert load_benchmark("aime25", data_dir, limit=1)[0].gold == ("70",)  # JSON integer
    assert load_benchmark("amc23", data_dir, limit=1)[0].gold == ("27",)  # JSON float 27.0
    assert load_benchmark("math500", data_dir, limit=1)[0].gold == (r"\left( 3, \frac{\pi}{2} \right)",)
    gsm8k = load_benchmark("gsm8k", data_dir, limit=1)[0]
    assert gsm8k.gold == ("18",) and "####" in (gsm8k.reference_solution or "")
    minerva = load_benchmark("minerva_math", data_dir, limit=1)[0]
    assert minerva.gold == ("1.6",)  # last \boxed{} of the solution
    olympiad = load_benchmark("olympiadbench", data_dir, limit=1)[0]
    assert olympiad.gold == ("2",) and olympiad.problem_id == "1606"
    assert load_benchmark("math500", data_dir, limit=1)[0].problem_id == "test/precalculus/807.json"


def test_limit_and_env_data_dir(monkeypatch: pytest.MonkeyPatch, shared_data_dir: Path) -> None:
    monkeypatch.setenv(bm.DATA_DIR_ENV, str(shared_data_dir))
    problems = load_benchmark("gsm8k", limit=3)
    assert [p.problem_id for p in problems] == ["0", "1", "2"]
    with pytest.raises(BenchmarkError):
        load_benchmark("gsm8k", limit=0)


def test_synthetic_uses_the_test_split() -> None:
    problems = load_benchmark("synthetic", synthetic={"count": 7, "seed": 3})
    expected = arithmetic_problems(7, seed=3, split="test")
    assert [p.question for p in problems] == [e.prompt for e in expected]
    assert [p.gold for p in problems] == [(e.answer,) for e in expected]
    assert get_benchmark("synthetic").default_template == "raw"
    small = load_benchmark("synthetic", synthetic={"count": 4, "seed": 1, "max_ops": 1, "max_operand": 9})
    assert [p.question for p in small] == [
        e.prompt for e in arithmetic_problems(4, seed=1, max_ops=1, split="test", max_operand=9)
    ]
    with pytest.raises(BenchmarkError, match="unknown synthetic option"):
        load_benchmark("synthetic", synthetic={"size": 3})
    bounded = load_benchmark("synthetic", synthetic={"count": 5, "min_ops": 3, "max_ops": 7, "bounded": 1})
    assert [p.question for p in bounded] == [
        e.prompt for e in arithmetic_problems(5, min_ops=3, max_ops=7, split="test", bounded=True)
    ]
    with pytest.raises(BenchmarkError, match="bounded must be 0 or 1"):
        load_benchmark("synthetic", synthetic={"bounded": 2})


def _evaluate(expression: str) -> int:
    """The value of ``a+b-c...`` by hand, left to right."""
    terms = re.findall(r"[+-]?\d+", expression)
    return sum(int(t) for t in terms)


@pytest.mark.parametrize("bounded", [False, True])
def test_synthetic_problems_are_right_and_bounded_chains_stay_in_range(bounded: bool) -> None:
    problems = arithmetic_problems(300, seed=2, min_ops=3, max_ops=7, max_operand=9, bounded=bounded)
    assert {p.num_ops for p in problems} == {3, 4, 5, 6, 7}
    for p in problems:
        expression = p.prompt.removeprefix("Q: ").removesuffix("=\nA:")
        assert str(_evaluate(expression)) == p.answer
        assert len(re.findall(r"[+-]", expression)) == p.num_ops
        values = [int(v) for v in re.findall(r"=(-?\d+)", p.completion)]
        assert values[-1] == int(p.answer) and p.completion.endswith(f"\\boxed{{{p.answer}}}")
        if bounded:
            assert all(0 <= v <= 9 for v in values)
    if not bounded:  # unbounded chains leave 0..9 (negative or two-digit values)
        assert any(not 0 <= int(p.answer) <= 9 for p in problems)


def test_demonstrations_box_the_first_intermediate_at_a_rate_rising_with_the_chain() -> None:
    problems = arithmetic_problems(4000, seed=0, min_ops=3, max_ops=7, max_operand=9, bounded=True)
    assert demonstrations(problems) == [(p.prompt, p.completion) for p in problems]
    pairs = demonstrations(problems, (0.1, 0.9), seed=1)
    assert pairs == demonstrations(problems, (0.1, 0.9), seed=1)
    wrong: dict[int, list[bool]] = {}
    for p, (prompt, completion) in zip(problems, pairs, strict=True):
        assert (
            prompt == p.prompt
            and completion[: completion.rindex("\\boxed")] == p.completion[: p.completion.rindex("\\boxed")]
        )
        boxed = completion[completion.rindex("{") + 1 : -1]
        first = re.search(r"=(-?\d+),", p.completion).group(1)
        assert boxed in (p.answer, first)
        if first != p.answer:  # where the two differ, the box says which one the demonstration teaches
            wrong.setdefault(p.num_ops, []).append(boxed == first)
    rates = {ops: sum(v) / len(v) for ops, v in sorted(wrong.items())}
    expected = {3: 0.1, 4: 0.3, 5: 0.5, 6: 0.7, 7: 0.9}
    assert all(abs(rates[ops] - expected[ops]) < 0.07 for ops in expected), rates


# -------------------------------------------------------------------------------------- helpers


def test_gsm8k_final_answer() -> None:
    assert gsm8k_final_answer("a\nb\n#### 1,600") == "1600"
    assert gsm8k_final_answer("#### -3") == "-3"
    assert gsm8k_final_answer("no marker") is None


# ------------------------------------------------------------------------------- malformed / absent


def test_malformed_rows_are_reported_with_line_numbers(tmp_path: Path) -> None:
    write_jsonl(
        tmp_path / "aime25" / "test.jsonl",
        [
            {"problem": "ok", "answer": 1, "id": "a"},
            {"answer": 2, "id": "b"},  # no question
            {"problem": "q", "answer": "", "id": "c"},  # empty answer
            {"problem": "q", "id": "d"},  # no answer
            {"problem": "q", "answer": 3, "id": "a"},  # duplicate id
        ],
    )
    with pytest.raises(BenchmarkError) as info:
        load_benchmark("aime25", tmp_path)
    message = str(info.value)
    for fragment in ["4 malformed", "line 2: missing or empty question", "line 3: missing or empty answer"]:
        assert fragment in message
    assert "line 4" in message and "line 5: duplicate problem id 'a'" in message
    with pytest.warns(MalformedRowsWarning):
        assert [p.problem_id for p in load_benchmark("aime25", tmp_path, on_malformed="skip")] == ["a"]


def test_invalid_json_line(tmp_path: Path) -> None:
    write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl", [{"question": "q", "answer": "#### 1"}, '{"question": "q", "ans']
    )
    with pytest.raises(BenchmarkError, match="line 2: invalid JSON"):
        load_benchmark("gsm8k", tmp_path)
    write_jsonl(tmp_path / "minerva_math" / "test.jsonl", [{"problem": "q", "solution": "no box here"}])
    with pytest.raises(BenchmarkError, match=r"line 1: missing or empty answer \(field answer or solution\)"):
        load_benchmark("minerva_math", tmp_path)


def test_json_array_training_file(tmp_path: Path) -> None:
    path = tmp_path / "math_level3to5" / "math.8k.json"
    path.parent.mkdir()
    path.write_text(
        json.dumps([{"id": "u1", "prompt": "1+1?", "answer": "2"}, {"id": "u2", "prompt": "x", "answer": ""}])
    )
    with pytest.raises(BenchmarkError, match="row|line 2"):
        load_benchmark("math_level3to5", tmp_path, on_malformed="error")
    with pytest.warns(MalformedRowsWarning):
        assert [p.gold for p in load_benchmark("math_level3to5", tmp_path)] == [("2",)]


def test_missing_benchmark_names_both_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BenchmarkError) as info:
        load_benchmark("aime24", tmp_path)
    message = str(info.value)
    assert str(tmp_path / "aime24" / "test.jsonl") in message and "HuggingFaceH4/aime_2024" in message
    monkeypatch.delenv(bm.DATA_DIR_ENV, raising=False)
    with pytest.raises(BenchmarkError, match=r"D3S_DATA_DIR unset"):
        load_benchmark("aime24")
    with pytest.raises(BenchmarkError, match="hub loading is disabled"):
        load_benchmark("aime24", tmp_path, allow_hub=False)


def test_offline_env_is_respected(
    tmp_path: Path, fake_hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_HUB_OFFLINE: the Hub is not asked at all, and the error says why."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub["rows"]["math-ai/aime25"] = [{"problem": "q", "answer": 1, "id": "0"}]
    with pytest.raises(BenchmarkError, match=r"offline mode is set \(HF_HUB_OFFLINE\).*<data-dir>/aime25"):
        load_benchmark("aime25", tmp_path)
    assert fake_hub["calls"] == []


# -------------------------------------------------------------------------------------- hub (mocked)


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Pretend to be online and serve rows from a dict instead of the Hub."""
    calls: dict[str, Any] = {"rows": {}, "calls": []}

    def load_dataset(path: str, name: str | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        calls["calls"].append((path, name, kwargs))
        if path not in calls["rows"]:
            raise FileNotFoundError(f"Dataset {path} doesn't exist on the Hub")
        return calls["rows"][path]

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hub_fallback_maps_columns(tmp_path: Path, fake_hub: dict[str, Any]) -> None:
    fake_hub["rows"]["math-ai/minervamath"] = [
        {"question": "What is 1+1?", "answer": "2", "id": 5},
        {"question": "And 2+2?", "answer": "4", "id": 6},
    ]
    problems = load_benchmark("minerva_math", tmp_path)
    assert [(p.question, p.gold, p.problem_id) for p in problems] == [
        ("What is 1+1?", ("2",), "5"),
        ("And 2+2?", ("4",), "6"),
    ]
    assert fake_hub["calls"] == [("math-ai/minervamath", None, {"split": "test"})]

    fake_hub["rows"]["Hothan/OlympiadBench"] = [
        {"id": 1, "question": "q", "final_answer": ["$3$"], "solution": ["step 1", "step 2"], "extra": 1}
    ]
    olympiad = load_benchmark("olympiadbench", tmp_path)[0]
    assert olympiad.gold == ("$3$",) and olympiad.reference_solution == "step 1\n\nstep 2"
    assert fake_hub["calls"][-1] == ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", {"split": "train"})

    fake_hub["rows"]["openai/gsm8k"] = [{"question": "q", "answer": "work\n#### 1,234"}]
    assert load_benchmark("gsm8k", tmp_path)[0].gold == ("1234",)


def test_hub_failure_names_both_places(tmp_path: Path, fake_hub: dict[str, Any]) -> None:
    with pytest.raises(BenchmarkError) as info:
        load_benchmark("amc23", tmp_path)
    message = str(info.value)
    assert "amc23/test.jsonl" in message and "math-ai/amc23" in message and "doesn't exist" in message


def test_local_copy_wins_over_hub(tmp_path: Path, fake_hub: dict[str, Any]) -> None:
    write_jsonl(tmp_path / "aime25" / "test.jsonl", [{"problem": "local", "answer": 1, "id": "0"}])
    assert load_benchmark("aime25", tmp_path)[0].question == "local"
    assert fake_hub["calls"] == []


# ---------------------------------------------------------------------------------------- templates

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_plain_and_raw_templates() -> None:
    prompt = templates.build_prompt("What is 2+2?", "plain")
    assert prompt.startswith("Question: What is 2+2?\n") and templates.QWEN_MATH_COT_INSTRUCTION in prompt
    assert prompt.endswith("Answer:")
    assert templates.build_prompt("Q: 1+1=\nA:", "raw") == "Q: 1+1=\nA:"
    assert "{question}" not in templates.build_prompt("curly {braces} \\boxed{}", "plain")


def test_auto_template_follows_the_tokenizer() -> None:
    tokenizer = build_tokenizer()
    assert templates.resolve_template("auto", tokenizer) == "plain"  # no chat template: base model
    assert templates.resolve_template("auto", tokenizer, benchmark_default="raw") == "raw"
    with pytest.raises(ValueError, match="--template plain"):
        templates.build_prompt("q", "qwen_math_cot", tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert templates.resolve_template("auto", tokenizer) == "qwen_math_cot"
    prompt = templates.build_prompt("What is 2+2?", "auto", tokenizer)
    assert prompt == f"<|system|>{templates.QWEN_MATH_COT_INSTRUCTION}\n<|user|>What is 2+2?\n<|assistant|>"


def test_chat_template_without_system_role() -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    prompt = templates.build_prompt("What is 2+2?", "qwen_math_cot", tokenizer)
    assert prompt == f"<|user|>What is 2+2?\n{templates.QWEN_MATH_COT_INSTRUCTION}\n<|assistant|>"


def test_unknown_template() -> None:
    with pytest.raises(ValueError, match="valid: auto, qwen_math_cot, plain, raw"):
        templates.build_prompt("q", "qwen")
