"""Snakemake script of rule base_model: build the tiny model and SFT-warm-start it (see build_base.py)."""

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_base import build_base  # noqa: E402

smk = snakemake  # noqa: F821 - injected by Snakemake
cfg, task = smk.params.cfg, smk.params.task
with open(smk.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    summary = build_base(
        Path(smk.output.config).parent,
        sft_steps=int(cfg.get("sft_steps", 800)),
        sft_problems=int(cfg.get("sft_problems", 4000)),
        min_ops=int(task["min_ops"]),
        max_ops=int(task["max_ops"]),
        max_operand=int(task["max_operand"]),
        seed=int(cfg.get("seed", 0)),
        threads=int(smk.threads),
        model_kwargs=dict(cfg.get("model") or {}),
        learning_rate=float(cfg.get("learning_rate", 3e-3)),
    )
    print(summary)
