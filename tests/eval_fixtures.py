"""Helpers shared by the evaluation-side tests (benchmarks, grading, pass@k, evaluation runner)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO_ROOT / ".." / "shared" / "data").resolve()

# Row counts of the real copies in ../shared/data (see its README); math_level3to5 loses 2 rows with
# an empty answer.
REAL_COUNTS = {
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "math500": 500,
    "gsm8k": 1319,
    "minerva_math": 272,
    "olympiadbench": 675,
    "math_level3to5": 8521,
}


def shared_data_dir() -> Path:
    """``<repo root>/../shared/data``, or skip the calling test when it is absent."""
    if not (SHARED_DATA / "aime24" / "test.jsonl").is_file():
        pytest.skip(f"real benchmark copies not found at {SHARED_DATA}")
    return SHARED_DATA
