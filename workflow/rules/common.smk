# Shared settings and helpers of the workflow (no rules).
import json
import os
import subprocess
import sys
from pathlib import Path

from snakemake.utils import update_config

from d3s.orchestration.workflow_config import check_workflow_config, typed_config_overrides
from d3s.variants import TASK_KEYS, Variant, base_model_settings, extended_config, run_variants, sft_task
from d3s.studies import parse_study

# All jobs run in the project's environment (environment.yml: the pinned set and this package).
ENV = "../../environment.yml"
# The accelerate configs of GPU training jobs: defined here only, passed to the package and the scripts
ACCELERATE_DIR = f"{workflow.basedir}/workflow/accelerate"
# --config lists and mappings with their YAML types (Snakemake reads their values as strings: seeds=[0,1])
update_config(config, typed_config_overrides(workflow.config_settings.config_args))
# A config that extends another (config/studies/*.yaml extend config/config.yaml) is laid over it, in place.
if "extends" in config:
    _extended = extended_config(config, workflow.basedir)
    config.clear()
    config.update(_extended)
# The schema (filling the defaults in) and what it cannot express; a bad config ends in one line, no job.
check_workflow_config(config, ACCELERATE_DIR, f"{workflow.basedir}/config/schema.yaml")
RESULTS = f"results/{config['experiment']}"
METHODS = config["methods"]
# Every run name: the registry's methods and a study's named variants of them (d3s.variants).
VARIANTS = run_variants(config)
STUDY = parse_study(config, VARIANTS)  # None unless the config declares a study (docs/studies.md)
SEEDS = config["seeds"]
TRAINER = config["train"]["trainer"]
MAX_STEPS = TRAINER["max_steps"]
SAVE_STEPS = TRAINER.get("save_steps", MAX_STEPS) if TRAINER.get("save_strategy") == "steps" else MAX_STEPS
# Intermediate checkpoints evaluated for the learning curves (the last one is the final model).
CKPT_STEPS = list(range(SAVE_STEPS, MAX_STEPS, SAVE_STEPS))
# The schema filled in the defaults; this key order keeps the jobs' params (a new order would re-run them).
TASK = {key: config["task"][key] for key in TASK_KEYS}
ANALYSIS = config["analysis"]


# The model every run starts from: built by rule base_model (kind tiny) or a given path / hub id.
TINY_BASE = config["base_model"]["kind"] == "tiny"
BASE_MODEL = f"{RESULTS}/base_model" if TINY_BASE else config["base_model"]["path"]
BASE_MODEL_INPUT = [f"{BASE_MODEL}/config.json"] if TINY_BASE else []  # rule base_model's output


def variant_of(name):
    """The run ``name``: a declared method or variant, else the registry method of that name."""
    return VARIANTS.get(name) or Variant(name, name)


def base_dir(base):
    """The folder of base model ``base`` (a name under bases; None: the config's own base model)."""
    return BASE_MODEL if base is None else f"{RESULTS}/base_models/{base}"


def sft_params(base):
    """A base model's job parameters: its settings, and the task its SFT draws from (the task with its sft_task
    on top, d3s.variants.sft_task) in place of sft_task, so that a config without one keeps the jobs' params."""
    settings = base_model_settings(config, base)
    settings.pop("sft_task", None)
    return settings, sft_task(config, base)


def run_base_input(wildcards):
    """The base-model file a run waits for: the config's base model, or its variant's."""
    base = variant_of(wildcards.method).base
    return BASE_MODEL_INPUT if base is None else [f"{base_dir(base)}/config.json"]


def run_base_model(wildcards):
    """The base model a run starts from (its KL's initial policy)."""
    return base_dir(variant_of(wildcards.method).base)


def model_param(wildcards, input):
    """The model path as a rule parameter (derived from the input for the built tiny model, as
    `snakemake --lint` asks of a path prefix of an input)."""
    return str(Path(input[0]).parent) if TINY_BASE else BASE_MODEL


# What each kind of pending job needs checked before the run starts (checks.smk; the checks are in
# d3s/orchestration/input_checks.py, run by workflow/scripts/check_inputs.py).
CHECKS_OF_RULE = {
    "train": ("trainer_settings", "base_model", "train_dataset"),
    "evaluate_base": ("base_model", "eval_benchmarks"),
    "evaluate_checkpoint": ("eval_benchmarks",),
    "evaluate_final": ("eval_benchmarks",),
    "evaluate_run": ("eval_benchmarks",),
}


def check_inputs_of_pending_jobs():
    """Run the checks the pending jobs need, in a process of its own (TRL stays out of Snakemake's); stop
    the run if anything is missing (the script prints one line per problem, naming the fix)."""
    pending = {job.rule.name for job in workflow.dag.needrun_jobs()}
    checks = sorted({check for rule in pending for check in CHECKS_OF_RULE.get(rule, ())})
    if not checks:
        return
    request = {"config": config, "task": TASK, "accelerate_dir": ACCELERATE_DIR, "checks": checks}
    script = f"{workflow.basedir}/workflow/scripts/check_inputs.py"
    found = f"{RESULTS}/checks/inputs.json"  # where each input was found: a record, not a job's output
    log = f"{RESULTS}/logs/check_inputs.log"
    done = subprocess.run([sys.executable, script, found, log], input=json.dumps(request), text=True)
    if done.returncode:
        raise SystemExit(done.returncode)
