# Shared settings and helpers of the workflow (no rules).
import json
import subprocess
import sys
from pathlib import Path

# All jobs run in the project's environment (environment.yml: the pinned set and this package).
ENV = "../../environment.yml"

RESULTS = f"results/{config['experiment']}"
ACCELERATE_DIR = f"{workflow.basedir}/workflow/accelerate"  # accelerate configs of GPU training jobs
METHODS = list(config["methods"])
SEEDS = [int(s) for s in config["seeds"]]
TRAINER = dict(config["train"]["trainer"])
MAX_STEPS = int(TRAINER["max_steps"])
SAVE_STEPS = int(TRAINER.get("save_steps", MAX_STEPS)) if TRAINER.get("save_strategy") == "steps" else MAX_STEPS
# Intermediate checkpoints evaluated for the learning curves (the last one is the final model).
CKPT_STEPS = [s for s in range(SAVE_STEPS, MAX_STEPS, SAVE_STEPS)]
TASK = {"min_ops": 1, "max_ops": 2, "max_operand": 9, "bounded": False} | dict(config.get("task") or {})
ANALYSIS = {"reference": "grpo", "target_fraction": 0.99} | dict(config.get("analysis") or {})
# What the input check before the jobs found, and where (checks.smk): a record, not a job's output.
INPUT_CHECKS = f"{RESULTS}/checks/inputs.json"


def _check_config():
    """Fail at parse time, with the name to change, on what the config's text alone decides: unknown methods
    or benchmarks, the analysis reference, launch settings, GPU resources and the batch geometry of
    train.prompts_per_step. Pure and fast (no data, network, model or TRL import): it runs at every parse,
    in every cluster job too, and keeps `snakemake -n` offline. Data, models and every method's full trainer
    settings are checked before any training or evaluation job starts (checks.smk)."""
    from d3s.data.benchmarks import BenchmarkError, parse_benchmark_list
    from d3s.orchestration.run_config import check_workflow_config
    from d3s.methods import get_method

    try:
        for method in METHODS:
            get_method(method)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"config methods: {exc}") from None
    try:
        parse_benchmark_list(config["eval"]["benchmarks"])
    except BenchmarkError as exc:
        raise ValueError(f"config eval.benchmarks: {exc}") from None
    reference = ANALYSIS["reference"]
    if reference not in METHODS:
        raise ValueError(f"config analysis.reference {reference!r} is not one of the methods {METHODS}")
    if config["base_model"]["kind"] == "path" and not config["base_model"].get("path"):
        raise ValueError("config base_model.kind is 'path' but base_model.path is not set")
    try:
        check_workflow_config(config, ACCELERATE_DIR)
    except ValueError as exc:
        raise ValueError(f"config {exc}") from None
    # The memory plan from the traces cached in d3s/memory_plan_cache.json: JSON only, no torch, so `snakemake
    # -n` stays fast; a GPU config it does not cover is planned (traced) by `d3s plan --config`.
    from d3s.memory_plan import check_fit

    problem = check_fit(config)
    if problem:
        raise ValueError(f"config {problem}")


_check_config()


def base_model_path():
    """The model every run starts from: built by rule base_model (kind tiny) or a given path / hub id."""
    if config["base_model"]["kind"] == "tiny":
        return f"{RESULTS}/base_model"
    return config["base_model"]["path"]


def model_param(wildcards, input):
    """The model path as a rule parameter (derived from the input for the built tiny model, as
    `snakemake --lint` asks of a path prefix of an input)."""
    if config["base_model"]["kind"] == "tiny":
        return str(Path(input[0]).parent)
    return config["base_model"]["path"]


def base_model_input():
    return [f"{RESULTS}/base_model/config.json"] if config["base_model"]["kind"] == "tiny" else []


# What each kind of pending job needs checked before the run starts (checks.smk; the checks are in
# workflow/scripts/check_inputs.py).
CHECKS_OF_RULE = {
    "train": ("trainer_settings", "base_model", "train_dataset"),
    "evaluate_base": ("base_model", "eval_benchmarks"),
    "evaluate_checkpoint": ("eval_benchmarks",),
    "evaluate_final": ("eval_benchmarks",),
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
    log = f"{RESULTS}/logs/check_inputs.log"
    done = subprocess.run([sys.executable, script, INPUT_CHECKS, log], input=json.dumps(request), text=True)
    if done.returncode:
        raise SystemExit(done.returncode)
