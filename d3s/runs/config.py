"""The `d3s train` boundary: a run config (YAML file and flags) parsed once into typed, checked values.

YAML reads ``1e-4`` as a string and ``no`` as a boolean; ``--set KEY=VALUE`` gives text. Each value is
converted by the argparse action transformers' ``HfArgumentParser`` builds for its dataclass field (type,
true/false words, Literal, enum and ``choices``, list items); the run's dataclasses (:class:`RunKeys` and its
sections) and ``D3SConfig`` then check ranges in their ``__post_init__``. The pre-pass here does only what
that parser cannot, each marked ``pre-pass:`` below; every error is one :class:`ConfigError` line naming the
key, the value, where it came from and what to write instead.
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from d3s.data.templates import TEMPLATES
from d3s.rewards import REWARD_SETS


class ConfigError(ValueError):
    """A config value that cannot be used; the message is one line naming the key and the fix. ``key`` names
    the setting when a dataclass check raised it, so the parser can add where its value came from."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class RunConfig(dict):
    """A run config parsed by :func:`coerce_run_config` (typed, checked): parsed again, returned as is."""


def _check_minimums(section: str, options: Any, minimums: Mapping[str, int] | None = None) -> None:
    """Every integer field of ``options`` at least its minimum (1 unless ``minimums`` says otherwise)."""
    for f in dataclasses.fields(options):
        value, minimum = getattr(options, f.name), (minimums or {}).get(f.name, 1)
        if isinstance(value, int) and not isinstance(value, bool) and value < minimum:
            raise ConfigError(
                f"{section}.{f.name} must be >= {minimum}; got {value!r}", key=f"{section}.{f.name}"
            )


@dataclasses.dataclass
class RunKeys:
    """The top-level keys of a ``d3s train`` config (d3s/runs/run.py documents them)."""

    method: str = "grpo"
    model: str = "tiny"
    seed: int = 0
    threads: int = 1
    output_dir: str = "runs/<method>"
    dataset: dict | None = None
    template: str = dataclasses.field(default="auto", metadata={"choices": tuple(TEMPLATES)})
    tiny: dict | None = None
    trainer: dict | None = None
    data_dir: str | None = None
    resume: str = dataclasses.field(default="auto", metadata={"choices": ("auto", "never")})
    # the reward functions by name (d3s.rewards.REWARD_SETS): accuracy, or pods (accuracy + PODS's format term)
    reward: str = dataclasses.field(default="accuracy", metadata={"choices": tuple(REWARD_SETS)})

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**32:
            raise ConfigError(
                f"seed must be in [0, 2**32 - 1] (numpy's seed range); got {self.seed!r}", "seed"
            )
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1 (torch threads); got {self.threads!r}", "threads")


@dataclasses.dataclass
class SyntheticDataset:
    """``dataset:`` of the synthetic arithmetic task (d3s.data.synthetic.arithmetic_problems)."""

    name: str = "synthetic"
    count: int = 2000
    min_ops: int = 1
    max_ops: int = 3
    max_operand: int = 99
    bounded: bool = False  # intermediate values stay in 0..max_operand

    def __post_init__(self) -> None:
        _check_minimums("dataset", self)
        if self.min_ops > self.max_ops:
            raise ConfigError(
                f"dataset.min_ops must be <= dataset.max_ops; got {self.min_ops} > {self.max_ops}",
                "dataset.min_ops",
            )


@dataclasses.dataclass
class BenchmarkDataset:
    """``dataset:`` of a benchmark (d3s.data.benchmarks)."""

    name: str = "math_level3to5"
    limit: int | None = None

    def __post_init__(self) -> None:
        _check_minimums("dataset", self)


@dataclasses.dataclass
class TinyOptions:
    """``tiny:``, the model built in code and its SFT warm start (d3s.tiny_model)."""

    sft_steps: int = 150
    sft_problems: int = 2000
    max_ops: int = 1
    max_operand: int = 9

    def __post_init__(self) -> None:
        _check_minimums("tiny", self, {"sft_steps": 0})


TOP_LEVEL_KEYS = frozenset(f.name for f in dataclasses.fields(RunKeys))
NULL_WORDS = ("null", "Null", "NULL", "~")
BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}

# pre-pass: annotations that understate what TRL accepts (it maps True/False to "group"/"none" itself).
TYPE_OVERRIDES: dict[str, Any] = {"scale_rewards": str | bool}

# pre-pass: dict | str fields whose string form is a path to a JSON file (TrainingArguments reads it).
PATH_OR_MAPPING_FIELDS = ("deepspeed", "fsdp_config", "accelerator_config")

EXPECTED = {int: "an integer", float: "a number such as 1e-6", str: "a string"}
MAPPING = "a mapping such as {key: value} (YAML or JSON)"


class _Refused(Exception):
    """Internal: the value does not fit the field; ``expected`` says what would."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


@dataclasses.dataclass(frozen=True)
class _Field:
    """A field's annotation (its union members) and the argparse action HfArgumentParser builds for it."""

    name: str
    members: tuple[Any, ...]
    action: Any


@functools.cache
def _fields(dataclass_type: type) -> dict[str, _Field]:
    from transformers import HfArgumentParser

    hints = typing.get_type_hints(dataclass_type)  # before the parser narrows the fields' types
    actions = {
        a.dest: a for a in HfArgumentParser(dataclass_type)._actions if f"--{a.dest}" in a.option_strings
    }
    out = {}
    for field in dataclasses.fields(dataclass_type):
        hint = TYPE_OVERRIDES.get(field.name, hints[field.name])
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        out[field.name] = _Field(field.name, typing.get_args(hint) if union else (hint,), actions[field.name])
    return out


def _trainer_fields() -> dict[str, _Field]:
    from d3s.trainer_config import D3SConfig

    return _fields(D3SConfig)


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


def _choices_text(choices: Any) -> str:
    return "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)


def _convert(field: _Field, value: Any) -> Any:
    """``value`` as ``field``'s type, or _Refused. pre-pass: null words, mappings and lists written in YAML or
    JSON, which HfArgumentParser reads only as argv words; scalars go to its action (_scalar)."""
    members, action = field.members, field.action
    if type(None) in members and (value is None or value in NULL_WORDS):
        return None
    literals = [v for m in members if typing.get_origin(m) is typing.Literal for v in typing.get_args(m)]
    if isinstance(value, (bool, int)) and (type(value) in members or value in literals):
        return value
    if any(m is dict or typing.get_origin(m) is dict for m in members):
        path_ok = field.name in PATH_OR_MAPPING_FIELDS
        if isinstance(value, str) and not (path_ok and not value.lstrip().startswith("{")):
            value = _parse_text(value)
        if isinstance(value, Mapping) or (path_ok and isinstance(value, str) and value):
            return dict(value) if isinstance(value, Mapping) else value
        raise _Refused(MAPPING + (" or a JSON file" if path_ok else ""))
    lists = [m for m in members if m is list or typing.get_origin(m) is list]
    text = isinstance(value, str)
    if lists and (
        isinstance(value, (list, tuple)) or text and (value.lstrip().startswith("[") or str not in members)
    ):
        items = _parse_text(value) if text else value
        items = items if isinstance(items, (list, tuple)) else [value]
        item = (
            field if action.nargs == "+" else _Field(field.name, typing.get_args(lists[0]) or (str,), action)
        )
        try:
            return [_scalar(item, v) for v in items]
        except _Refused as refused:
            raise _Refused(f"a list whose items are each {refused.expected}") from None
    if lists and str not in members:
        raise _Refused("a list such as [a, b]")
    return _scalar(field, value)


def _scalar(field: _Field, value: Any) -> Any:
    """One value converted from its text by the argparse type of the field, as HfArgumentParser does."""
    from transformers.hf_argparser import string_to_bool

    action, members = field.action, field.members
    # HfArgumentParser types a `str | bool` field as bool: such a field takes words, typed at the end
    kind = (
        str if str in members and (action.choices is None or action.type is string_to_bool) else action.type
    )
    if value is False and action.choices and "no" in action.choices:
        value = "no"  # YAML 1.1 reads `save_strategy: no` as False
    if kind is string_to_bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
        raise _Refused("true or false (also yes/no, 1/0)")
    expected = _choices_text(action.choices) if action.choices else EXPECTED.get(kind, "")
    if isinstance(kind, type) and kind not in EXPECTED and not issubclass(kind, enum.Enum):
        raise _Refused(f"a {kind.__name__} object (set it from Python, not from a config file)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        hint = "; YAML reads yes/no/on/off as booleans, so quote the word" if isinstance(value, bool) else ""
        raise _Refused(expected + hint)
    text = value if isinstance(value, str) and kind is str else str(value).strip()
    try:
        converted = kind(text)
    except (ValueError, TypeError, OverflowError):
        converted = _whole_number(text) if kind is int else None
        if converted is None:
            raise _Refused(expected) from None
    if isinstance(converted, float) and not math.isfinite(converted):
        raise _Refused("a finite number such as 1e-6")
    if (
        isinstance(converted, str) and kind is str
    ):  # pre-pass: `int | str`, `str | bool` keep a number or a word
        word = converted.strip().lower()
        if bool in members and word in BOOL_WORDS:
            converted = BOOL_WORDS[word]
        elif int in members and word.lstrip("-").isdigit():
            converted = int(word)
    if action.choices and converted not in action.choices:
        raise _Refused(expected)
    return getattr(converted, "value", converted)  # an enum member as its value (YAML-safe)


def _whole_number(text: str) -> int | None:
    """pre-pass: 1e3 or 8.0, an integer written as a float."""
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _from(source: str | None) -> str:
    return f" ({source})" if source else ""


def _check_keys(options: Any, fields: Mapping[str, _Field], what: str, fix: str, source: str | None) -> None:
    """pre-pass: unknown keys refused all together, with close matches (the parser names only the first)."""
    unknown = sorted(str(key) for key in options if key not in fields)
    if unknown:
        hints = "".join(_did_you_mean(name, list(fields)) for name in unknown)
        raise ConfigError(f"unknown {what} {unknown}{hints}{_from(source)}; {fix}")


def _typed(field: _Field, value: Any, label: str, source: str | None) -> Any:
    """``value`` converted (see _convert); ConfigError naming ``label`` and ``source`` otherwise."""
    try:
        return _convert(field, value)
    except _Refused as refused:
        raise ConfigError(f"{label}: expected {refused.expected}, got {value!r}{_from(source)}") from None


def _checked(
    dataclass_type: type, values: Mapping[str, Any], sources: Mapping[str, str], source: str | None
) -> None:
    """Run ``dataclass_type``'s range checks on ``values``; an error says where the value came from."""
    try:
        dataclass_type(**values)
    except ConfigError as err:
        raise ConfigError(f"{err}{_from(sources.get(err.key or '', source))}") from None


def coerce_trainer_option(name: str, value: Any, *, source: str | None = None) -> Any:
    """``value`` of trainer option ``name`` as its field's type (its choices included); ConfigError naming the
    key and fix otherwise. Ranges are D3SConfig.__post_init__'s, the trainer's one check."""
    fields = _trainer_fields()
    _check_keys(
        {name: value}, fields, "trainer option(s)", "every option must be a field of D3SConfig", source
    )
    if name == "method":
        raise ConfigError(
            f"trainer.method{_from(source)}: set the top-level method (or --method), not trainer.method"
        )
    coerced = _typed(fields[name], value, f"trainer.{name}", source)
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
    return coerced


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


def _coerce_section(
    options: Any, dataclass_type: type, section: str, sources: Mapping[str, str], source: str | None
) -> dict[str, Any]:
    fields = _fields(dataclass_type)
    _check_keys(options, fields, f"{section} option(s)", f"valid: {', '.join(fields)}", source)
    typed = {
        key: _typed(fields[key], value, f"{section}.{key}", sources.get(f"{section}.{key}", source))
        for key, value in options.items()
    }
    _checked(dataclass_type, typed, sources, source)
    return typed


def coerce_run_config(
    config: Any, *, source: str | None = None, sources: Mapping[str, str] | None = None
) -> RunConfig:
    """A ``d3s train`` config with every value typed and checked, once; ConfigError (one line) otherwise.

    Checks the top-level keys (RunKeys), the dataset and tiny sections and every trainer option's type (its
    ranges: D3SConfig). ``sources`` says where a key's value came from (``trainer.max_steps``: "from
    --max-steps 0"), ``source`` where the others did. Needs no model and no data: paths are checked by
    d3s.runs.run. Only the keys given are returned (no defaults added): the config is compared with a
    checkpoint's on resume. A RunConfig is returned as is.
    """
    from d3s.methods import METHODS

    if isinstance(config, RunConfig):
        return config
    sources = sources or {}
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"expected a mapping of config keys at the top level, got {config!r}{_from(source)}"
        )
    fields = _fields(RunKeys)
    _check_keys(config, fields, "config keys", f"valid keys: {sorted(fields)}", source)
    out = {key: _typed(fields[key], value, key, sources.get(key, source)) for key, value in config.items()}
    for key, value in out.items():
        if value == "":
            raise ConfigError(f"{key}: expected a non-empty string, got ''{_from(sources.get(key, source))}")
    if "method" in out and out["method"] not in METHODS:
        raise ConfigError(
            f"unknown method {out['method']!r}{_from(sources.get('method', source))}; valid methods: "
            f"{', '.join(sorted(METHODS))}"
        )
    _checked(RunKeys, out, sources, source)
    if out.get("dataset"):
        kind = (
            SyntheticDataset if out["dataset"].get("name", "synthetic") == "synthetic" else BenchmarkDataset
        )
        out["dataset"] = _coerce_section(out["dataset"], kind, "dataset", sources, source)
    if out.get("tiny"):
        out["tiny"] = _coerce_section(out["tiny"], TinyOptions, "tiny", sources, source)
    output_dir = Path(out.get("output_dir") or ".").expanduser()
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir: {out['output_dir']} is a file; give a directory path")
    if out.get("trainer") is not None:
        fields = _trainer_fields()
        _check_keys(
            out["trainer"], fields, "trainer option(s)", "every option must be a field of D3SConfig", source
        )
        out["trainer"] = {
            k: coerce_trainer_option(k, v, source=sources.get(f"trainer.{k}", source))
            for k, v in out["trainer"].items()
        }
    return RunConfig(out)


def check_model_dir(model: str, what: str) -> bool:
    """A local model path must be a directory with a readable config.json (checked before any weights load).

    ``what`` names the setting in the message ("model", "--model"). Hub ids pass (they are resolved online).
    Returns whether ``model`` is a local path (False: a hub id).
    """
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1 or path.exists()
    if not looks_local:
        return False
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
    return True


def one_line(message: object) -> str:
    """A (possibly multi-line) error message on one line."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML run config at ``path``; a missing, empty or malformed file raises ConfigError (one line).

    Light on purpose (no torch or TRL import): a mistyped path costs a second, not the trainer's imports.
    """
    fix = "give the path of a YAML run config such as examples/tiny.yaml"
    try:
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; {fix}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err}); {fix}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(err, "problem", None) or one_line(err)
        raise ConfigError(f"config file {path} is not valid YAML ({where}{what}); fix it there") from None
    if config is None:
        raise ConfigError(f"config file {path} is empty; {fix} (a mapping of method, model, trainer, ...)")
    if not isinstance(config, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of config keys at the top level, got {type(config).__name__}"
        )
    return config
