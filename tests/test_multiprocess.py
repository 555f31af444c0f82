"""Selection across two processes (torchrun, gloo on CPU): same decision on every rank, no row lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3s.selection import select_samples

WORKER = Path(__file__).with_name("multiprocess_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["d3s", "pods"])
def test_two_processes_agree_and_keep_every_row(tmp_path, tiny_sft_model, method):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port on localhost
        "--nproc_per_node",
        "2",
        str(WORKER),
        str(tiny_sft_model),
        method,
        str(tmp_path),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"{method}_rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # every rank decided the same kept rows, from the same gathered batch
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and len(ranks[0]["decisions"]) == 3
    for step, decision in enumerate(ranks[0]["decisions"]):
        # ... and a single process given that gathered batch keeps the same rows
        again = select_samples(
            torch.tensor(decision["advantages"]),
            torch.tensor(decision["rewards"]),
            num_generations=decision["num_generations"],
            keep_per_prompt=decision["keep_per_prompt"],
            rule=decision["rule"],
            scope=decision["scope"],
        )
        assert again.tolist() == decision["kept"]
        local = [r["batches"][step] for r in ranks]
        # no kept row is dropped: the ranks' rows add up to the kept count, in equal shares
        assert local[0]["rows"] == local[1]["rows"] == len(decision["kept"]) // 2
        # the loss normaliser counts the kept tokens of all ranks
        total_tokens = local[0]["local_tokens"] + local[1]["local_tokens"]
        assert local[0]["num_items_in_batch"] == local[1]["num_items_in_batch"] == total_tokens
    assert ranks[0]["losses"] == ranks[1]["losses"]
