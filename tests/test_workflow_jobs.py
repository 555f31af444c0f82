"""The workflow's job functions that carry logic beyond a call (d3s.orchestration.evaluation_job,
input_checks): the evaluation's resume key and its typed `d3s eval` call, eval.kl's sampling from the run's
record, the run-model checks (a corrupt final model moved aside, never deleted), the input checks' exit
codes. Without a model or Snakemake: fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from d3s.evaluation.cli import EvalOptions, run_eval
from d3s.orchestration.evaluation_job import (
    EvalJob,
    EvalPoint,
    TrainedRun,
    check_run_models,
    eval_options,
    generate_and_grade,
    kl_sampling,
    measure_kl,
    resume_settings,
    steps,
)
from d3s.orchestration.input_checks import run_input_checks

TASK = {"min_ops": 3, "max_ops": 7, "max_operand": 9, "bounded": True}
# config/config.yaml's eval section as the schema completes it (the settings of results/tiny)
EV = {
    "benchmarks": ["synthetic"],
    "max_tokens": 64,
    "temperature": 0.6,
    "top_p": 0.95,
    "template": "raw",
    "backend": "transformers",
    "synthetic": {"count": 200},
    "max_model_len": None,
    "batch_size": 8,
    "answer_policy": "math_verify",
    "kl": {"prompts": 2, "samples": 2},
}


def _job(
    tmp_path: Path, ev: dict = EV, *, limit: int | None = None, gpu_ids: tuple[str, ...] = ()
) -> EvalJob:
    point = EvalPoint("results/tiny/runs/token_k50/seed4/final", tmp_path / "final", 8, (1, 8), limit)
    return EvalJob(point, ev, TASK, gpu_ids, TrainedRun(tmp_path / "run", "token_k50", 4))


def test_resume_settings_match_the_keys_of_existing_evaluations(tmp_path):
    """The settings of results/tiny/eval/token_k50/seed4/final/resume_key.json, written by the script that
    built a `d3s eval` argv: the same config gives the same key, so existing evaluations resume."""
    written_by_the_argv_script = {
        "--model": "results/tiny/runs/token_k50/seed4/final",
        "--samples": "8",
        "--max-tokens": "64",
        "--temperature": "0.6",
        "--top-p": "0.95",
        "--template": "raw",
        "--backend": "transformers",
        "--synthetic": "min_ops=3,max_ops=7,max_operand=9,bounded=1,count=200",
    }
    assert resume_settings(_job(tmp_path)) == written_by_the_argv_script
    # per-attempt settings stay out of the key; a limit and a dtype are in it, as they always were
    on_gpus = _job(
        tmp_path, EV | {"dtype": "bfloat16", "gpu_memory_utilization": 0.8}, limit=5, gpu_ids=("0",)
    )
    assert resume_settings(on_gpus) == written_by_the_argv_script | {"--limit": "5", "--dtype": "bfloat16"}


def test_eval_options_are_typed(tmp_path):
    options = eval_options(
        _job(tmp_path, EV | {"data_dir": "data", "tensor_parallel_size": 2}, gpu_ids=("0",))
    )
    assert options.benchmarks == "synthetic" and options.k == [1, 8] and options.samples == 8
    assert options.synthetic == {"min_ops": 3, "max_ops": 7, "max_operand": 9, "bounded": 1, "count": 200}
    assert options.out == tmp_path / "final" and options.data_dir == Path("data")
    assert options.grading_workers == 1 and options.tensor_parallel_size == 2 and options.no_progress
    assert (
        options.batch_size == 8 and options.answer_policy == "math_verify" and options.max_model_len is None
    )
    assert eval_options(_job(tmp_path, EV)).tensor_parallel_size == 1  # on the CPU: the default
    few = EvalJob(EvalPoint("m", tmp_path, 2, (1, 8), None), EV, TASK, (), None)
    assert eval_options(few).k == [1]  # Pass@8 needs 8 samples


def test_generate_and_grade_fails_in_one_line_naming_the_log(tmp_path, capsys):
    """A bad setting reaches `d3s eval`'s own checks (exit code 2), not argparse."""
    with pytest.raises(SystemExit, match=r"^d3s eval failed with exit code 2: see job\.log$"):
        generate_and_grade(_job(tmp_path, EV | {"backend": "nope"}), "job.log")
    assert "--backend 'nope' is not one of: " in capsys.readouterr().err


def test_run_eval_checks_typed_options_as_the_command_line_does(tmp_path, capsys):
    common = {"model": "m", "out": tmp_path / "out"}
    for bad, message in (
        ({"dtype": "fp8"}, "--dtype 'fp8' is not one of: auto, bfloat16"),
        ({"k": [0, 1]}, "--k values must be positive integers"),
        ({"synthetic": {"colour": 1}}, "--synthetic"),
    ):
        assert run_eval(EvalOptions(**common, **bad)) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith("d3s eval: error: ") and message in error


def test_kl_samples_as_the_run_trained(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(
        SystemExit, match="resolved_config.yaml is missing: eval.kl samples as the run trained"
    ):
        kl_sampling(run)
    run.mkdir()
    trainer = {"max_completion_length": 24, "temperature": 0.9, "learning_rate": 1e-3}
    (run / "resolved_config.yaml").write_text(yaml.safe_dump({"seed": 4, "resolved_trainer": trainer}))
    assert kl_sampling(run) == {"max_new_tokens": 24, "temperature": 0.9}
    (run / "resolved_config.yaml").write_text(yaml.safe_dump({"resolved_trainer": {"temperature": 1.0}}))
    with pytest.raises(SystemExit, match="resolved_trainer has no max_completion_length"):
        kl_sampling(run)


def test_kl_is_kept_when_measured_with_the_same_settings(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    trainer = {"max_completion_length": 24, "temperature": 0.9}
    (run / "resolved_config.yaml").write_text(yaml.safe_dump({"resolved_trainer": trainer}))
    job = EvalJob(
        EvalPoint("m", tmp_path / "final", 8, (1,), None),
        EV,
        TASK,
        (),
        TrainedRun(run, "d3s", 0, reference="base", train_config=run / "train.yaml"),
    )
    settings = {"prompts": 2, "samples": 2, "max_new_tokens": 24, "temperature": 0.9, "top_p": 1.0}
    settings |= {"seed": 0, "batch_size": 16, "dtype": "auto"}
    job.out.mkdir()
    (job.out / "kl.json").write_text(json.dumps({"settings": settings}))
    measure_kl(job, "job.log")  # no model loaded: kept
    assert "KL to the initial policy: kept" in capsys.readouterr().out


def test_kl_runs_first_and_on_a_run_only(tmp_path):
    run = TrainedRun(tmp_path, "d3s", 0, "base", tmp_path / "train.yaml")
    assert [name for name, _ in steps(EV, run)][0] == "KL to the initial policy (eval.kl)"
    assert [name for name, _ in steps(EV, None)] == ["generate and grade (d3s eval)"]
    assert len(steps({key: value for key, value in EV.items() if key != "kl"}, run)) == 1


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    save_file({"weight": torch.zeros(1000)}, folder / "model.safetensors")
    return folder / "model.safetensors"


def test_a_missing_checkpoint_stops_the_job(tmp_path):
    run = tmp_path / "d3s" / "seed0"
    _model(run / "checkpoint-2")
    points = [
        EvalPoint(str(run / name), tmp_path / name, 1, (1,), None) for name in ("checkpoint-2", "final")
    ]
    with pytest.raises(SystemExit, match=rf"^checkpoint {run / 'final'} is missing: re-run training"):
        check_run_models(TrainedRun(run, "d3s", 0), points)


def test_a_corrupt_final_model_is_moved_aside_and_the_job_says_to_run_again(tmp_path):
    run = tmp_path / "d3s" / "seed0"
    weights = _model(run / "final")
    (run / "train_summary.json").write_text("{}")
    points = [EvalPoint(str(run / "final"), tmp_path / "final", 1, (1,), None)]
    check_run_models(TrainedRun(run, "d3s", 0), points)  # sound: nothing moved
    assert weights.is_file() and (run / "train_summary.json").is_file()
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    with pytest.raises(SystemExit) as refused:
        check_run_models(TrainedRun(run, "d3s", 0), points)
    (moved,) = run.glob("superseded-*-corrupt-final")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"the final model of {run} does not load: {weights} is ")
    assert f"moved it and train_summary.json to {moved}: run the same command again" in line
    assert (moved / "final" / "model.safetensors").is_file() and (moved / "train_summary.json").is_file()
    assert not (run / "final").exists() and not (run / "train_summary.json").exists()
    assert "Run the workflow again" in (moved / "README.txt").read_text()


def test_input_checks_write_where_inputs_were_found_or_one_line_per_problem(tmp_path, capsys):
    config = {"base_model": {"kind": "tiny"}, "eval": {"benchmarks": ["synthetic"]}}
    request = {
        "config": config,
        "task": TASK,
        "accelerate_dir": "",
        "checks": ["base_model", "eval_benchmarks"],
    }
    out, log = tmp_path / "inputs.json", tmp_path / "check.log"
    assert run_input_checks(request, out, log) == 0
    found = json.loads(out.read_text())
    assert (
        found["base_model"]["kind"] == "tiny" and found["eval_benchmarks"]["synthetic"]["problems_read"] > 0
    )
    assert log.read_text() == "all inputs found\n"
    missing = {"kind": "path", "path": str(tmp_path / "no-model")}
    bad = request | {"config": config | {"base_model": missing}, "checks": ["base_model"]}
    assert run_input_checks(bad, tmp_path / "again.json", log) == 1
    (line,) = log.read_text().splitlines()
    assert line.startswith(f"config base_model.path {tmp_path / 'no-model'}: no model found there")
    assert capsys.readouterr().err == line + "\n" and not (tmp_path / "again.json").exists()
    with pytest.raises(ValueError, match=r"unknown checks \['typo'\]"):
        run_input_checks(request | {"checks": ["typo"]}, out, log)
