"""The benchmark scripts run (``--quick``) and write the JSON and Markdown they promise.

The scripts run in this process (``runpy``, as ``python benchmarks/<name>.py`` would run them), so the
~5 s import of torch/transformers/TRL is paid once, not once per script.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMON_KEYS = {"name", "created", "machine", "versions", "git", "settings", "rows", "notes"}

# script -> keys every row of its kind must have
SCRIPTS = {
    "selection_overhead": {"scope", "implementation", "seconds", "percent_of_tiny_step"},
    "end_to_end_step": {
        "method",
        "setting",
        "step_s",
        "generation_phase_s",
        "update_phase_s",
        "forward_tokens_total",
        "backprop_tokens",
        "step_vs_grpo",
    },
    "eval_throughput": {"kind", "seconds"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_quick_run_writes_results(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = REPO_ROOT / "benchmarks" / f"{name}.py"
    monkeypatch.syspath_prepend(str(script.parent))  # what `python benchmarks/<name>.py` does
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--out", str(tmp_path)])
    threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:  # the scripts pin 1 thread and silence progress bars
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(record) >= COMMON_KEYS and record["name"] == name
    assert record["settings"]["quick"] is True
    assert {"cpu", "cpu_count", "gpus", "torch_threads"} <= set(record["machine"])
    assert record["versions"]["torch"] and record["rows"]
    markdown = (tmp_path / f"{name}.md").read_text()
    assert "|---|" in markdown and "Machine:" in markdown
    if name == "eval_throughput":
        kinds = {row["kind"] for row in record["rows"]}
        assert kinds == {"grading", "generation"}
        assert all(row["answers_per_s"] > 0 for row in record["rows"] if row["kind"] == "grading")
        assert all(row["tokens_per_s"] > 0 for row in record["rows"] if row["kind"] == "generation")
        return
    rows = [row for row in record["rows"] if "seconds" in row or "step_s" in row]
    main = [row for row in rows if SCRIPTS[name] <= set(row)]
    assert main, f"no row has {sorted(SCRIPTS[name])}: {rows[0]}"
    if name == "end_to_end_step":
        assert {row["method"] for row in main} == {"grpo", "d3s"}
        for row in main:  # the phases split the step; the counters saw the passes
            assert 0 < row["generation_phase_s"] < row["step_s"]
            assert row["generation_tokens"] > 0 and row["loss_pass_tokens"] > 0
            assert 0 < row["backprop_tokens"] <= row["completion_tokens_in_update"]
    else:
        assert all(row.get("max_var_diff", 0.0) < 1e-6 for row in record["rows"])
