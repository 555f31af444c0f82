"""The bad-input list (issue 12): every `d3s` command and flag with wrong types, missing or empty files,
unknown keys and values out of range ends in exit code 2 and one line that names the fix, before any
model is built or loaded."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from d3s.cli import main

FILES = {
    "empty.yaml": "",
    "malformed.yaml": "method: [unclosed\n",
    "list.yaml": "- a\n- b\n",
    "unknown.yaml": "method: d3s\nmodel: tiny\nbogus_key: 1\n",
    "ok.yaml": "method: d3s\nmodel: tiny\n",
    "empty.jsonl": "",
}
TRAIN = "train --config ok.yaml"
EVAL = "eval --model some/hub-id --out out --benchmarks synthetic"

# (command line, what the one line must say)
BAD_INPUT = [
    # d3s train: config files
    ("train --config missing.yaml", "config file missing.yaml not found"),
    ("train --config empty.yaml", "config file empty.yaml is empty"),
    ("train --config malformed.yaml", "malformed.yaml is not valid YAML (line 2"),
    ("train --config list.yaml", "expected a mapping of config keys at the top level, got list"),
    ("train --config unknown.yaml", "unknown config keys ['bogus_key']"),
    # d3s train: --set, one value per field type
    (f"{TRAIN} --set learning_rate=abc", "trainer.learning_rate: expected a number"),
    (f"{TRAIN} --set learning_rate=-1", "trainer.learning_rate must be > 0"),
    (f"{TRAIN} --set num_generations=2.5", "trainer.num_generations: expected an integer"),
    (f"{TRAIN} --set bf16=maybe", "trainer.bf16: expected true or false"),
    (f"{TRAIN} --set sample_rule=bogus", "trainer.sample_rule: expected one of max_variance"),
    (f"{TRAIN} --set reward_weights=notalist", "trainer.reward_weights: expected a list"),
    (f"{TRAIN} --set model_init_kwargs=[1]", "trainer.model_init_kwargs: expected a mapping"),
    (f"{TRAIN} --set no_such_field=1", "unknown trainer option(s) ['no_such_field']"),
    (f"{TRAIN} --set noequals", "--set expects FIELD=VALUE"),
    (f"{TRAIN} --set keep_per_prompt=99", "keep_per_prompt must be an integer between 1 and num_generations"),
    # d3s train: flags
    (f"{TRAIN} --threads x", "threads: expected an integer, got 'x' (from --threads x)"),
    (f"{TRAIN} --threads 0", "threads must be >= 1 (torch threads); got 0 (from --threads 0)"),
    (f"{TRAIN} --seed -1", "seed must be in [0, 2**32 - 1] (numpy's seed range); got -1 (from --seed -1)"),
    (f"{TRAIN} --max-steps 0", "trainer.max_steps must be >= 1, or -1 to train for num_train_epochs; got 0"),
    (f"{TRAIN} --method bogus", "argument --method: invalid choice: 'bogus'"),
    (f"{TRAIN} --model no/such/dir/", "no model found there"),
    # d3s eval: required, files
    ("eval --out out --benchmarks synthetic", "--model is required"),
    ("eval --model some/hub-id --benchmarks synthetic", "--out is required"),
    ("eval --model ./no/such/dir --out out --benchmarks synthetic", "no model found there"),
    ("eval --audit --audit-samples empty.jsonl", "--audit-samples empty.jsonl is empty"),
    ("eval --audit --audit-samples no/such", "no samples.jsonl there"),
    ("eval --model some/hub-id --out out --audit-samples empty.jsonl", "add --audit"),
    # d3s eval: numbers, choices, key=value lists
    (f"{EVAL} --samples 0", "argument --samples: must be a positive integer"),
    (f"{EVAL} --samples x", "argument --samples: expected a positive integer"),
    (f"{EVAL} --k 0", "--k values must be positive integers"),
    (f"{EVAL} --samples 4 --k 8", "--k 8 exceeds --samples 4"),
    (f"{EVAL} --temperature -1", "temperature must be >= 0"),
    (f"{EVAL} --top-p 0", "top_p must be in (0, 1]"),
    (f"{EVAL} --top-p 1.5", "top_p must be in (0, 1]"),
    (f"{EVAL} --max-tokens 0", "argument --max-tokens: must be a positive integer"),
    ("eval --model some/hub-id --out out --benchmarks bogus", "unknown benchmark 'bogus'"),
    (f"{EVAL} --limit 0", "argument --limit: must be a positive integer"),
    (f"{EVAL} --synthetic bad=1", "unknown --synthetic option 'bad'"),
    (f"{EVAL} --synthetic count=x", "--synthetic takes KEY=INTEGER pairs"),
    (f"{EVAL} --grading-workers 0", "argument --grading-workers: must be a positive integer"),
    (f"{EVAL} --grading-time-limit 0", "--grading-time-limit must be positive seconds"),
    (f"{EVAL} --bootstrap -1", "argument --bootstrap: must be a positive integer"),
    (f"{EVAL} --dtype float99", "argument --dtype: invalid choice: 'float99'"),
    (f"{EVAL} --tensor-parallel-size 0", "argument --tensor-parallel-size: must be a positive integer"),
    (f"{EVAL} --gpu-memory-utilization 1.5", "--gpu-memory-utilization must be in (0, 1]"),
    (f"{EVAL} --max-model-len 0", "argument --max-model-len: must be a positive integer"),
    (f"{EVAL} --seed -1", "argument --seed: expected an integer in [0, 2**32 - 1]"),
    (f"{EVAL} --batch-size 0", "argument --batch-size: must be a positive integer"),
    (f"{EVAL} --backend tpu", "argument --backend: invalid choice: 'tpu'"),
    (f"{EVAL} --answer-policy first_boxed", "argument --answer-policy: invalid choice"),
    (f"{EVAL} --template bogus", "argument --template: invalid choice"),
]


@pytest.fixture
def in_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_model_may_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    import d3s.tiny_model

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the bad input was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(d3s.tiny_model, "build_model", refuse)


@pytest.mark.parametrize(("command", "message"), BAD_INPUT, ids=[c for c, _ in BAD_INPUT])
def test_bad_input_ends_in_one_line_before_any_model(
    command: str, message: str, in_work_dir: Path, no_model_may_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(shlex.split(command))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"d3s {command.split()[0]}: error: "), err
    assert message in lines[0], err
    assert not (in_work_dir / "out").exists()  # nothing written either


def test_the_console_script_prints_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it: one line on stderr, exit code 2."""
    done = subprocess.run(
        [sys.executable, "-m", "d3s.cli", "train", "--config", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        f"d3s train: error: config file {tmp_path / 'missing.yaml'} not found; give the path of a YAML run "
        "config such as examples/tiny.yaml"
    ]
