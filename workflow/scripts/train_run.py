"""Snakemake script of rule train: write the run's `d3s train` config (train.yaml) and run it."""

import contextlib
import os
from pathlib import Path

import yaml

smk = snakemake  # noqa: F821 - injected by Snakemake
method, seed = smk.wildcards.method, int(smk.wildcards.seed)
train_cfg, task = smk.params.train, smk.params.task
run_dir = Path(smk.output.config).parent
trainer = dict(train_cfg["trainer"]) | dict((train_cfg.get("method_overrides") or {}).get(method) or {})
dataset = {"name": "synthetic"} | dict(train_cfg.get("dataset") or {})
if dataset["name"] == "synthetic":
    dataset = task | dataset
config = {
    "method": method,
    "model": smk.params.model,
    "seed": seed,
    "threads": int(smk.threads),
    "output_dir": str(run_dir),
    "dataset": dataset,
    "template": train_cfg.get("template", "raw"),
    "trainer": trainer,
}
if smk.params.data_dir:
    config["data_dir"] = smk.params.data_dir
run_dir.mkdir(parents=True, exist_ok=True)
for name in ("metrics.jsonl", "anatomy.jsonl"):  # a rerun starts a fresh log
    with contextlib.suppress(FileNotFoundError):
        (run_dir / name).unlink()
Path(smk.output.config).write_text(yaml.safe_dump(config, sort_keys=False))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from d3s.train import train  # noqa: E402

with open(smk.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    train(config)
