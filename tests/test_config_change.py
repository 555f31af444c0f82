"""One "did the configuration change" rule (d3s.provenance.config_change) serves training resume, evaluation
resume and the provenance check: a per-attempt value resumes (or is free) in all three, a real change is
detected by all three."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from d3s.evaluation.runner import RUN_IDENTITY, ResumeMismatchError, _check_resume
from d3s.provenance.config_change import (
    EVALUATION_PER_ATTEMPT,
    TRAINING_PER_ATTEMPT,
    config_changes,
    flatten,
    keep_or_move_aside,
)
from d3s.provenance.settings_check import AGREE, FREE, TRAINING_RULES, compare, rule_for
from d3s.runs.resume import config_differences

RUN = {"method": "d3s", "seed": 0, "threads": 1, "output_dir": "runs/a", "resume": "auto"}
TRAINER = {"learning_rate": 1e-6, "num_generations": 8, "output_dir": "runs/a", "vllm_server_port": 8000}
SAMPLES = {"--model": "m", "--samples": "4", "--temperature": "0.6", "--batch-size": "8", "--out": "a"}


def _training(tmp_path: Path, config: dict) -> dict:
    (tmp_path / "resolved_config.yaml").write_text(yaml.safe_dump(config))
    return config


def _manifest(config: dict) -> dict:
    trainer = config["trainer"]
    return {"config": {k: v for k, v in config.items() if k != "trainer"} | {"resolved_trainer": trainer}}


def _evaluation(tmp_path: Path, options: dict) -> Path:
    out = tmp_path / "eval"
    out.mkdir(exist_ok=True)
    (out / "samples.jsonl").write_text("{}\n")
    settings = {k: v for k, v in options.items() if k not in EVALUATION_PER_ATTEMPT}
    (out / "resume_key.json").write_text(json.dumps({"model_files": {}, "settings": settings}))
    return out


def _resumes(out: Path, options: dict) -> bool:
    settings = {k: v for k, v in options.items() if k not in EVALUATION_PER_ATTEMPT}
    outcome = keep_or_move_aside(out, {"model_files": {}, "settings": settings}, "resume_key.json")
    return outcome is not None and outcome.startswith("resuming")


# Another attempt's value of every per-attempt key (another node, other ports, another run folder).
ANOTHER_ATTEMPT = {
    "resume": "never",
    "output_dir": "runs/b",
    "trainer.output_dir": "runs/b",
    "trainer.vllm_server_host": "10.0.0.2",
    "trainer.vllm_server_port": 8001,
    "trainer.vllm_group_port": 51217,
}


def test_every_per_attempt_key_is_exercised():
    assert set(ANOTHER_ATTEMPT) == TRAINING_PER_ATTEMPT


@pytest.mark.parametrize("key", sorted(TRAINING_PER_ATTEMPT))
def test_a_per_attempt_training_value_resumes_and_is_free_in_provenance(tmp_path, key):
    old = _training(tmp_path, RUN | {"trainer": TRAINER})
    new = {**flatten(old), key: ANOTHER_ATTEMPT[key]}
    nested = {k: v for k, v in new.items() if not k.startswith("trainer.")}
    nested["trainer"] = {k.removeprefix("trainer."): v for k, v in new.items() if k.startswith("trainer.")}
    assert config_differences(tmp_path, nested) == {}  # training resumes
    records = [("a", "a", _manifest(old)), ("b", "b", _manifest(nested))]
    assert compare("training", records)["consistent"]  # the provenance check accepts the two runs


def test_a_real_change_is_detected_by_training_evaluation_and_provenance(tmp_path):
    old = _training(tmp_path, RUN | {"trainer": TRAINER})
    new = RUN | {"trainer": TRAINER | {"learning_rate": 1e-5}}
    assert config_differences(tmp_path, new) == {"trainer.learning_rate": (1e-6, 1e-5)}
    mixed = compare("training", [("a", "a", _manifest(old)), ("b", "b", _manifest(new))])["mixed"]
    assert [d["key"] for d in mixed] == ["config.resolved_trainer.learning_rate"]
    assert rule_for("config.resolved_trainer.learning_rate", TRAINING_RULES).policy == AGREE

    out = _evaluation(tmp_path, SAMPLES)
    assert _resumes(out, SAMPLES | {"--batch-size": "64", "--out": "b"})  # per attempt: resumes
    outcome = keep_or_move_aside(
        out,
        {"model_files": {}, "settings": {k: v for k, v in (SAMPLES | {"--temperature": "1.0"}).items()
                                         if k not in EVALUATION_PER_ATTEMPT}},
        "resume_key.json",
    )  # fmt: skip
    assert "settings.--temperature 0.6 -> 1.0" in outcome and not out.exists()  # moved aside, not deleted
    assert (next(tmp_path.glob("eval.superseded-*")) / "samples.jsonl").is_file()

    (tmp_path / "bench").mkdir()
    identity = {key: "x" for key in RUN_IDENTITY} | {"generation": {"temperature": 0.6}}
    _check_resume(tmp_path / "bench", identity)
    _check_resume(tmp_path / "bench", identity)  # the same settings resume
    with pytest.raises(ResumeMismatchError, match=r"generation.temperature 0.6 -> 1.0"):
        _check_resume(tmp_path / "bench", identity | {"generation": {"temperature": 1.0}})


def test_the_rule_flattens_and_ignores_per_attempt_keys():
    old = {"trainer": {"output_dir": "a", "beta": 0.0}, "dataset": {"count": 10}}
    new = {"trainer": {"output_dir": "b", "beta": 0.0}, "dataset": {"count": 20}, "extra": {}}
    assert config_changes(old, new, TRAINING_PER_ATTEMPT) == {"dataset.count": (10, 20)}
    assert all(rule_for(f"config.{k}", TRAINING_RULES).policy == FREE for k in ("resume", "output_dir"))
