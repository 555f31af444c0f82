"""Run-config values coerced to their declared types, and range checks, before anything loads.

YAML reads ``1e-4`` as a string and ``no`` as a boolean; ``--set KEY=VALUE`` gives text. Every trainer option is
coerced to the type annotation of its D3SConfig / GRPOConfig field (float, int, bool, enum, Literal, list, dict,
Optional and unions of these), or refused with a one-line :class:`ConfigError` that names the key, the value, where
it came from and what to write instead. The top-level keys of a ``d3s train`` config get the same treatment.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value that cannot be used; the message is one line naming the key and the fix."""


BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}
NULL_WORDS = ("null", "Null", "NULL", "~")

# String options with a closed set of values that GRPOConfig only checks at train time, or never.
TRAINER_CHOICES: dict[str, tuple[Any, ...]] = {
    "vllm_mode": ("colocate", "server"),
    "vllm_model_impl": ("vllm", "transformers"),
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "include_num_input_tokens_seen": ("no", "all", "non_padding", True, False),
}

# Annotations that understate what TRL accepts (it maps True/False to "group"/"none" itself).
TYPE_OVERRIDES: dict[str, Any] = {"scale_rewards": str | bool}

# dict | str fields whose string form is a path to a JSON file (TrainingArguments reads it).
PATH_OR_MAPPING_FIELDS = ("deepspeed", "fsdp_config", "accelerator_config")

_POSITIVE = (lambda v: v > 0, "> 0")
_AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
_NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
_UNIT = (lambda v: 0 < v <= 1, "in (0, 1]")
_SEED = (lambda v: 0 <= v < 2**32, "in [0, 2**32 - 1] (numpy's seed range)")

# Value ranges of the trainer options that matter here; None always passes (the field's "unset").
TRAINER_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "learning_rate": _POSITIVE,
    "num_generations": (lambda v: v >= 2, ">= 2 (GRPO needs two rollouts per prompt for an advantage)"),
    "num_generations_eval": (lambda v: v >= 2, ">= 2"),
    "max_steps": (lambda v: v >= 1 or v == -1, ">= 1, or -1 to train for num_train_epochs"),
    "num_train_epochs": _POSITIVE,
    "per_device_train_batch_size": _AT_LEAST_1,
    "per_device_eval_batch_size": _AT_LEAST_1,
    "gradient_accumulation_steps": _AT_LEAST_1,
    "steps_per_generation": _AT_LEAST_1,
    "generation_batch_size": _AT_LEAST_1,
    "num_iterations": _AT_LEAST_1,
    "max_completion_length": _AT_LEAST_1,
    "temperature": (lambda v: v > 0, "> 0 (rollouts must be sampled)"),
    "top_p": _UNIT,
    "top_k": _NON_NEGATIVE,
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": _POSITIVE,
    "beta": _NON_NEGATIVE,
    "epsilon": _NON_NEGATIVE,
    "epsilon_high": _NON_NEGATIVE,
    "weight_decay": _NON_NEGATIVE,
    "max_grad_norm": _NON_NEGATIVE,
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_epsilon": _POSITIVE,
    "warmup_steps": _NON_NEGATIVE,
    "logging_steps": _POSITIVE,
    "save_steps": _POSITIVE,
    "eval_steps": _POSITIVE,
    "save_total_limit": _AT_LEAST_1,
    "seed": _SEED,
    "data_seed": _SEED,
    "dataloader_num_workers": _NON_NEGATIVE,
    "keep_per_prompt": _AT_LEAST_1,
    "keep_per_prompt_final": _AT_LEAST_1,
    "token_keep_ratio": _UNIT,
    "token_keep_ratio_final": _UNIT,
    "anatomy_every": _NON_NEGATIVE,
    "anatomy_examples": _NON_NEGATIVE,
}


class _Refused(Exception):
    """Internal: the value does not fit the annotation; ``expected`` says what would."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if _is_text(value) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    raise _Refused("true or false (also yes/no, 1/0)")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Refused("an integer")
    if isinstance(value, int):
        return value
    number = value
    if _is_text(value):
        try:
            return int(value.strip())
        except ValueError:
            try:
                number = float(value.strip())
            except ValueError:
                raise _Refused("an integer") from None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        return int(number)  # 1e3 or 8.0: written as a float, meant as an integer
    raise _Refused("an integer")


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Refused("a number such as 1e-6")
    number = value
    if _is_text(value):
        try:
            number = float(value.strip())
        except ValueError:
            raise _Refused("a number such as 1e-6") from None
    if isinstance(number, (int, float)) and math.isfinite(number):
        return float(number)
    raise _Refused("a finite number such as 1e-6")


def _to_str(value: Any) -> str:
    if _is_text(value):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    hint = "; YAML reads yes/no/on/off as booleans, so quote the word" if isinstance(value, bool) else ""
    raise _Refused("a string" + hint)


def _parse_text(value: str) -> Any:
    """A string that may hold a JSON or YAML list or mapping (``--set reward_weights=[1, 0.5]``).

    JSON first: YAML 1.1 reads the 1e-6 of ``{"min_lr": 1e-6}`` as a string.
    """
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _to_mapping(value: Any, key_hint: Any, value_hint: Any) -> dict:
    if _is_text(value):
        value = _parse_text(value)
    if not isinstance(value, Mapping):
        raise _Refused("a mapping such as {key: value} (YAML or JSON)")
    return {_coerce(key_hint, k): _coerce(value_hint, v) for k, v in value.items()}


def _to_list(value: Any, item_hint: Any) -> list:
    if _is_text(value):
        parsed = _parse_text(value)
        value = parsed if isinstance(parsed, list) else [value]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise _Refused("a list such as [a, b]")
    try:
        return [_coerce(item_hint, item) for item in value]
    except _Refused as refused:
        raise _Refused(f"a list whose items are each {refused.expected}") from None


def _choices_text(choices: tuple[Any, ...]) -> str:
    return "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)


def _coerce(hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` describes, or _Refused."""
    if hint is Any or hint is typing.Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(typing.get_args(hint), value)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value in choices:
            return value
        raise _Refused(_choices_text(choices))
    if hint is type(None):
        if value is None or (_is_text(value) and value in NULL_WORDS):
            return None
        raise _Refused("null")
    if hint is bool:
        return _to_bool(value)
    if hint is int:
        return _to_int(value)
    if hint is float:
        return _to_float(value)
    if hint is str:
        return _to_str(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = tuple(member.value for member in hint)
        if isinstance(value, hint):
            return value
        if value is False and "no" in values:  # YAML 1.1 reads `save_strategy: no` as False
            return "no"
        if _is_text(value) and value in values:
            return value
        raise _Refused(_choices_text(values))
    if hint is dict or origin is dict:
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        return _to_mapping(value, key_hint, value_hint)
    if hint is list or origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        return _to_list(value, item_hint)
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Refused(f"a {hint.__name__} object (set it from Python, not from a config file)")
    return value


def _union_order(member: Any) -> int:
    """Try the strict types first, str last, so '8' becomes 8 for ``int | str``."""
    if member is type(None):
        return 0
    if member is bool:
        return 1
    if member is int:
        return 2
    if member is float:
        return 3
    if member is str:
        return 9
    return 5


def _coerce_union(members: tuple[Any, ...], value: Any) -> Any:
    if (value is None or (_is_text(value) and value in NULL_WORDS)) and type(None) in members:
        return None
    enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
    if enums:  # `IntervalStrategy | str`: the str is the enum's value, and only those values are valid
        return _coerce(enums[0], value)
    expected: list[str] = []
    ordered = sorted(members, key=_union_order)
    if _is_text(value) and str in members:
        # A string stays a string unless it reads as one of the other members' scalars.
        word = value.strip().lower()
        if bool in members and word in BOOL_WORDS:
            return BOOL_WORDS[word]
        if int in members and word.lstrip("-").isdigit():
            return int(word)
        mappings = [m for m in members if m is dict or typing.get_origin(m) is dict]
        if mappings and value.lstrip().startswith("{"):
            return _coerce(mappings[0], value)
        return value
    for member in ordered:
        if member is type(None):
            continue
        try:
            return _coerce(member, value)
        except _Refused as refused:
            expected.append(refused.expected)
    raise _Refused(" or ".join(dict.fromkeys(expected)) + (" or null" if type(None) in members else ""))


@functools.cache
def trainer_field_types() -> dict[str, Any]:
    """Every D3SConfig field (GRPOConfig's and TrainingArguments' included) and its resolved annotation."""
    from d3s.trainer import D3SConfig

    hints = typing.get_type_hints(D3SConfig)
    return {f.name: TYPE_OVERRIDES.get(f.name, hints[f.name]) for f in dataclasses.fields(D3SConfig)}


@functools.cache
def _trainer_choices() -> dict[str, tuple[Any, ...]]:
    from d3s.methods import METHODS
    from d3s.selection import SAMPLE_RULES, SAMPLE_SCOPES, SCHEDULES, TOKEN_RULES, TOKEN_SCOPES
    from d3s.trainer import D3SConfig

    choices = {
        f.name: tuple(f.metadata["choices"])
        for f in dataclasses.fields(D3SConfig)
        if f.metadata.get("choices")
    }
    return (
        choices
        | TRAINER_CHOICES
        | {
            "method": tuple(sorted(METHODS)),
            "sample_rule": tuple(SAMPLE_RULES),
            "sample_scope": tuple(SAMPLE_SCOPES),
            "token_rule": tuple(TOKEN_RULES),
            "token_scope": tuple(TOKEN_SCOPES),
            "schedule": tuple(SCHEDULES),
        }
    )


def _allows_mapping(hint: Any) -> bool:
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(m is dict or typing.get_origin(m) is dict for m in members)


def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _from(source: str | None) -> str:
    return f" ({source})" if source else ""


def coerce_trainer_option(name: str, value: Any, *, source: str | None = None) -> Any:
    """``value`` of trainer option ``name`` as its field's type; ConfigError naming the key and fix otherwise."""
    field_types = trainer_field_types()
    if name not in field_types:
        raise ConfigError(
            f"unknown trainer option(s) [{name!r}]{_did_you_mean(name, list(field_types))}{_from(source)}: every "
            "option must be a field of D3SConfig / GRPOConfig"
        )
    try:
        coerced = _coerce(field_types[name], value)
    except _Refused as refused:
        raise ConfigError(
            f"trainer.{name}: expected {refused.expected}, got {value!r}{_from(source)}"
        ) from None
    if name == "method":
        raise ConfigError(
            f"trainer.method{_from(source)}: set the top-level method (or --method), not trainer.method"
        )
    if isinstance(coerced, str) and _allows_mapping(field_types[name]) and name not in PATH_OR_MAPPING_FIELDS:
        raise ConfigError(
            f"trainer.{name}: expected a mapping such as {{key: value}} (YAML or JSON), got {value!r}{_from(source)}"
        )
    choices = _trainer_choices().get(name)
    if choices and coerced is not None and coerced not in choices:
        raise ConfigError(f"trainer.{name}: expected {_choices_text(choices)}, got {value!r}{_from(source)}")
    if (
        name in PATH_OR_MAPPING_FIELDS
        and isinstance(coerced, str)
        and not Path(coerced).expanduser().is_file()
    ):
        raise ConfigError(
            f"trainer.{name}: file {coerced} not found{_from(source)}; give an existing JSON file or a mapping"
        )
    if name == "report_to":
        _check_report_to(coerced, source)
    check_trainer_range(name, coerced, source=source)
    return coerced


def coerce_trainer_options(options: Any, *, source: str | None = None) -> dict[str, Any]:
    """All trainer options coerced (see :func:`coerce_trainer_option`); unknown names are refused together."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"trainer: expected a mapping of D3SConfig fields such as {{max_steps: 20}}, got {options!r}{_from(source)}"
        )
    field_types = trainer_field_types()
    unknown = sorted(str(key) for key in options if key not in field_types)
    if unknown:
        hints = "".join(_did_you_mean(name, list(field_types)) for name in unknown)
        raise ConfigError(
            f"unknown trainer option(s) {unknown}{hints}{_from(source)}: every option must be a field of "
            "D3SConfig / GRPOConfig"
        )
    return {name: coerce_trainer_option(name, value, source=source) for name, value in options.items()}


def check_trainer_range(name: str, value: Any, *, source: str | None = None) -> None:
    """Refuse a number outside the option's range (TRAINER_RANGES); non-numbers are the type check's business."""
    rule = TRAINER_RANGES.get(name)
    if rule is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    accepts, description = rule
    if not accepts(value):
        raise ConfigError(f"trainer.{name} must be {description}; got {value!r}{_from(source)}")


def check_trainer_ranges(settings: Mapping[str, Any]) -> None:
    for name, value in settings.items():
        check_trainer_range(name, value)


def _check_report_to(value: Any, source: str | None) -> None:
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    names = [value] if isinstance(value, str) else list(value or [])
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise ConfigError(
                f"trainer.report_to: unknown integration {name!r}{_from(source)}; use none, all or one of "
                f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}"
            )
        if name not in get_available_reporting_integrations():
            raise ConfigError(
                f"trainer.report_to: {name} is not installed here{_from(source)}; install it or set report_to: none"
            )


# ---- top-level keys of a `d3s train` config ---------------------------------------------------------------

SYNTHETIC_DATASET_KEYS = {"count": 1, "min_ops": 1, "max_ops": 1, "max_operand": 1}  # key -> minimum
BENCHMARK_DATASET_KEYS = {"limit": 1}
TINY_KEYS = {"sft_steps": 0, "sft_problems": 1, "max_ops": 1, "max_operand": 1}


def _top(name: str, value: Any, hint: Any, source: str | None) -> Any:
    try:
        return _coerce(hint, value)
    except _Refused as refused:
        raise ConfigError(f"{name}: expected {refused.expected}, got {value!r}{_from(source)}") from None


def _int_options(
    section: str, options: Any, minimums: Mapping[str, int], source: str | None
) -> dict[str, int]:
    unknown = sorted(set(options) - set(minimums))
    if unknown:
        hints = "".join(_did_you_mean(str(name), list(minimums)) for name in unknown)
        raise ConfigError(
            f"unknown {section} option(s) {unknown}{hints}{_from(source)}; valid: {', '.join(minimums)}"
        )
    out = {}
    for key, value in options.items():
        number = _top(f"{section}.{key}", value, int, source)
        if number < minimums[key]:
            raise ConfigError(f"{section}.{key} must be >= {minimums[key]}; got {value!r}{_from(source)}")
        out[key] = number
    return out


def coerce_run_config(config: Any, *, source: str | None = None) -> dict[str, Any]:
    """A ``d3s train`` config with every value coerced and range-checked; ConfigError (one line) otherwise.

    Checks the top-level keys' types and values (method, seed, threads, resume, template, dataset, tiny,
    output_dir) and every trainer option. Needs no model and no data: paths are checked by d3s.runs.run.
    """
    from d3s.data.templates import TEMPLATES
    from d3s.methods import METHODS
    from d3s.runs.run import TOP_LEVEL_KEYS

    if not isinstance(config, Mapping):
        raise ConfigError(
            f"expected a mapping of config keys at the top level, got {config!r}{_from(source)}"
        )
    unknown = sorted(str(key) for key in config if key not in TOP_LEVEL_KEYS)
    if unknown:
        hints = "".join(_did_you_mean(name, sorted(TOP_LEVEL_KEYS)) for name in unknown)
        raise ConfigError(
            f"unknown config keys {unknown}{hints}{_from(source)}; valid keys: {sorted(TOP_LEVEL_KEYS)}"
        )
    out = dict(config)
    for key in ("method", "model", "output_dir", "template", "resume", "data_dir"):
        if key in out:
            out[key] = _top(key, out[key], str, source)
            if not out[key]:
                raise ConfigError(f"{key}: expected a non-empty string, got {config[key]!r}{_from(source)}")
    if "method" in out and out["method"] not in METHODS:
        raise ConfigError(
            f"unknown method {out['method']!r}{_from(source)}; valid methods: {', '.join(sorted(METHODS))}"
        )
    for key, choices in (
        ("resume", ("auto", "never")),
        ("template", TEMPLATES),
    ):
        if key in out and out[key] not in choices:
            raise ConfigError(f"{key}: expected {_choices_text(choices)}, got {config[key]!r}{_from(source)}")
    if "seed" in out:
        out["seed"] = _top("seed", out["seed"], int, source)
        if not _SEED[0](out["seed"]):
            raise ConfigError(f"seed must be {_SEED[1]}; got {config['seed']!r}{_from(source)}")
    if "threads" in out:
        out["threads"] = _top("threads", out["threads"], int, source)
        if out["threads"] < 1:
            raise ConfigError(
                f"threads must be a positive number of torch threads; got {config['threads']!r}{_from(source)}"
            )
    for key in ("dataset", "tiny"):
        if out.get(key) is not None and not isinstance(out[key], Mapping):
            raise ConfigError(
                f"{key}: expected a mapping such as {{name: synthetic}}, got {out[key]!r}{_from(source)}"
            )
    if out.get("dataset"):
        dataset = dict(out["dataset"])
        name = _top("dataset.name", dataset.pop("name", "synthetic"), str, source)
        keys = SYNTHETIC_DATASET_KEYS if name == "synthetic" else BENCHMARK_DATASET_KEYS
        numbers = _int_options("dataset", dataset, keys, source)
        # same keys in the same order: the resolved config is compared with a checkpoint's on resume
        out["dataset"] = {key: name if key == "name" else numbers[key] for key in out["dataset"]}
        if name == "synthetic" and numbers.get("min_ops", 1) > numbers.get("max_ops", 3):
            raise ConfigError(
                f"dataset.min_ops must be <= dataset.max_ops; got {config['dataset']!r}{_from(source)}"
            )
    if out.get("tiny"):
        out["tiny"] = _int_options("tiny", out["tiny"], TINY_KEYS, source)
    output_dir = Path(out.get("output_dir", ".")).expanduser()
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir: {out['output_dir']} is a file; give a directory path")
    if "trainer" in out:
        out["trainer"] = coerce_trainer_options(out["trainer"], source=source)
    return out


def check_model_dir(model: str, what: str) -> None:
    """A local model path must be a directory with a readable config.json (checked before any weights load).

    ``what`` names the setting in the message ("model", "--model"). Hub ids pass (they are resolved online).
    """
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1 or path.exists()
    if not looks_local:
        return
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"{what} {model}: no model found there (no config.json at {config}); give a model directory"
            + (" (for example a run's final/), a hub id, or 'tiny'" if what == "model" else " or a hub id")
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"{what}: {config} is not valid JSON ({err}); re-save the model there") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"{what}: {config} has no model_type; it is not a transformers model config")


def yaml_error_text(err: Exception) -> str:
    """Where and what a YAML syntax error is, in a few words."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(err, "problem", None) or one_line(err))


def one_line(message: object) -> str:
    """A (possibly multi-line) error message on one line."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML run config at ``path``; a missing, empty or malformed file raises ConfigError (one line).

    Light on purpose (no torch or TRL import): a mistyped path costs a second, not the trainer's imports.
    """
    fix = "give the path of a YAML run config such as examples/tiny.yaml"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; {fix}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err}); {fix}") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(
            f"config file {path} is not valid YAML ({yaml_error_text(err)}); fix it there"
        ) from None
    if config is None:
        raise ConfigError(f"config file {path} is empty; {fix} (a mapping of method, model, trainer, ...)")
    if not isinstance(config, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of config keys at the top level, got {type(config).__name__}"
        )
    return config
