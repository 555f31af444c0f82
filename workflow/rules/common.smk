# Shared settings and helpers of the workflow (no rules).
import json
import subprocess
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# All jobs run in the project's environment (environment.yml: the pinned set and this package).
ENV = "../../environment.yml"


def _validate_config():
    """config/schema.yaml, the one structural check (it also fills the defaults in); a violation ends in one
    line naming the key and the fix, not Snakemake's dump of the schema."""
    try:
        validate(config, f"{workflow.basedir}/config/schema.yaml")
    except WorkflowError as exc:
        error = exc.__context__  # the jsonschema ValidationError that validate wraps
        if not hasattr(error, "absolute_path"):
            raise
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        schema = error.schema if isinstance(error.schema, dict) else {}
        if error.validator == "enum" and "title" in schema:
            valid = ", ".join(map(str, schema["enum"]))
            message = f"unknown {schema['title']} {error.instance!r}; valid {schema['title']}s: {valid}"
        elif error.validator == "additionalProperties":
            unknown = sorted(set(error.instance) - set(schema.get("properties", {})))
            message = f"unknown key(s) {unknown}; valid: {', '.join(schema.get('properties', {}))}"
        elif error.validator == "not" and "description" in schema:
            message = schema["description"]
        elif error.validator == "anyOf" and "description" in schema:
            message = f"{error.instance!r}: expected {schema['description']}"
        else:
            message = error.message
        raise ValueError(f"config {key or '(top level)'}: {message}".replace("\n", " ")) from None


_validate_config()
RESULTS = f"results/{config['experiment']}"
ACCELERATE_DIR = f"{workflow.basedir}/workflow/accelerate"  # accelerate configs of GPU training jobs
METHODS = config["methods"]
SEEDS = config["seeds"]
TRAINER = config["train"]["trainer"]
MAX_STEPS = TRAINER["max_steps"]
SAVE_STEPS = TRAINER.get("save_steps", MAX_STEPS) if TRAINER.get("save_strategy") == "steps" else MAX_STEPS
# Intermediate checkpoints evaluated for the learning curves (the last one is the final model).
CKPT_STEPS = [s for s in range(SAVE_STEPS, MAX_STEPS, SAVE_STEPS)]
# The schema filled in the defaults; this key order keeps the jobs' params (a new order would re-run them).
TASK = {key: config["task"][key] for key in ("min_ops", "max_ops", "max_operand", "bounded")}
ANALYSIS = config["analysis"]
# What the input check before the jobs found, and where (checks.smk): a record, not a job's output.
INPUT_CHECKS = f"{RESULTS}/checks/inputs.json"


def _check_config():
    """What the schema cannot express, at every parse (pure and fast: no data, network, model or TRL
    import, so `snakemake -n` stays offline). Data, models and trainer settings: checks.smk."""
    from d3s.orchestration.run_config import check_workflow_config
    from d3s.memory_plan import check_fit

    # A cross-key relation: the claims' reference must be one of the methods run.
    if ANALYSIS["reference"] not in METHODS:
        reference = ANALYSIS["reference"]
        raise ValueError(f"config analysis.reference {reference!r} is not one of the methods {METHODS}")
    # Cross-key relations of launch and batch (GPUs, vLLM server, prompts_per_step) and the accelerate file.
    try:
        check_workflow_config(config, ACCELERATE_DIR)
    except ValueError as exc:
        raise ValueError(f"config {exc}") from None
    # The memory plan (model x batch x GPUs) from the cached traces in d3s/memory_plan_cache.json.
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
