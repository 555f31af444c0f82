"""A workflow config checked once at parse time (check_workflow_config): the workflow's schema, given by
its caller (validate_config), then what a schema cannot express; and ``snakemake --config`` lists and
mappings with their YAML types (typed_config_overrides)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from d3s.memory_plan import check_fit
from d3s.orchestration.run_config import run_trainer, train_launch
from d3s.startup import skip_iri_format_checks
from d3s.studies import parse_study
from d3s.variants import run_variants, sft_task


def check_workflow_files(schema: str | os.PathLike[str], accelerate_dir: str | os.PathLike[str]) -> None:
    """The workflow's schema file and accelerate configs folder, as a command outside Snakemake was given
    them; ValueError naming the fix when one is missing."""
    fix = "run from the repository root (where the Snakefile is) or give --schema and --accelerate-dir"
    if not Path(schema).is_file():
        raise ValueError(f"the workflow's config schema {schema} is not a file; {fix}")
    if not Path(accelerate_dir).is_dir():
        raise ValueError(f"the workflow's accelerate configs folder {accelerate_dir} is not a folder; {fix}")


def typed_config_overrides(config_args: Sequence[str] | None) -> dict[str, Any]:
    """The lists and mappings of ``snakemake --config key=value ...``, read as YAML: Snakemake reads every
    value inside them as a string (``seeds=[0,1]`` gives ['0', '1'], which the schema refuses), so the
    workflow applies these on top. Top-level scalars stay as Snakemake typed them; text YAML cannot read is
    left as Snakemake read it, for the schema to name."""
    from snakemake.utils import update_config

    typed: dict[str, Any] = {}
    for arg in config_args or ():
        key, _, value = str(arg).partition("=")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            continue
        if isinstance(parsed, (list, dict)):
            update_config(typed, {key: parsed})  # a key given twice merges, as Snakemake merges it
    return typed


def validate_config(config: dict[str, Any], schema: str | os.PathLike[str]) -> None:
    """``config`` against the workflow's ``schema`` (its config/schema.yaml), the one structural check (it
    fills the defaults in); a violation raises ValueError with one line naming the key and the fix, not
    jsonschema's dump of the schema."""
    skip_iri_format_checks()  # the schema has no "iri" format: 3.2 s of every snakemake start (d3s.startup)
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(config, str(schema))
    except WorkflowError as exc:
        error = exc.__context__  # the jsonschema ValidationError that validate wraps
        if not hasattr(error, "absolute_path"):
            raise
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        schema_part = error.schema if isinstance(error.schema, dict) else {}
        title, description = schema_part.get("title"), schema_part.get("description")
        if error.validator == "enum" and title:
            valid = ", ".join(map(str, schema_part["enum"]))
            message = f"unknown {title} {error.instance!r}; valid {title}s: {valid}"
        elif error.validator == "additionalProperties":
            known = schema_part.get("properties", {})
            message = f"unknown key(s) {sorted(set(error.instance) - set(known))}; valid: {', '.join(known)}"
        elif error.validator == "not" and description:
            message = description
        elif error.validator == "anyOf" and description:
            message = f"{error.instance!r}: expected {description}"
        else:
            message = error.message
        raise ValueError(f"config {key or '(top level)'}: {message}".replace("\n", " ")) from None


def check_workflow_config(
    config: dict[str, Any], accelerate_dir: str | os.PathLike[str], schema: str | os.PathLike[str]
) -> None:
    """Everything a workflow config is checked for at parse time, pure and fast (no data, network, model or
    TRL import): the schema, then what it cannot express (relations between keys, the GPUs against the
    batch, the memory plan from cached traces); ValueError with one line starting "config ". The paths of
    the workflow's files come from the caller (``accelerate_dir``: its accelerate configs; ``schema``)."""
    validate_config(config, schema)
    try:
        variants = run_variants(config)
    except ValueError as exc:
        raise ValueError(f"config {exc}") from None
    if config["analysis"]["reference"] not in variants:
        reference = config["analysis"]["reference"]
        raise ValueError(
            f"config analysis.reference {reference!r} is not one of the methods {list(variants)}"
        )
    train_cfg = config["train"]
    try:
        if config.get("bases") and config["base_model"]["kind"] != "tiny":
            raise ValueError(
                "bases: base-model variants rebuild the tiny base model; set base_model.kind tiny"
            )
        for base in (None, *(config.get("bases") or {})):
            sft = sft_task(config, base)
            if sft["min_ops"] > sft["max_ops"]:
                where = "base_model" if base is None else f"bases.{base}"
                raise ValueError(
                    f"{where}.sft_task: the SFT's chains run from min_ops {sft['min_ops']} to max_ops "
                    f"{sft['max_ops']} (task's keys with sft_task's on top); make min_ops <= max_ops"
                )
        parse_study(config, variants)
        launch = train_launch(train_cfg, accelerate_dir)
        for variant in variants.values():
            run_trainer(train_cfg, variant.method, launch.processes, variant.trainer)
    except ValueError as exc:
        raise ValueError(f"config {exc}") from None
    problem = check_fit(config, launch)
    if problem:
        raise ValueError(f"config {problem}")
