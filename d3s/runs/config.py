"""The `d3s train` boundary: a run config (YAML file and flags) parsed once into typed, checked values.

Each section (top level, dataset, tiny, trainer) is converted by one parse of its whole mapping with
transformers' ``HfArgumentParser`` of its dataclass, after a pre-pass only where that parser falls short
(``pre-pass:`` below; docs/workflow/checks.md, "How a setting travels"). Every error is one
:class:`ConfigError` line naming the key, the value, where it came from and what to write instead.
"""

from __future__ import annotations

import argparse
import contextlib
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
    # the reward functions (d3s.rewards.REWARD_SETS): accuracy, or pods (accuracy + PODS's format term)
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
    head_dim: int = 16  # 32 for vLLM on the CPU, whose attention refuses 16 (tiny_model.HEADS_BY_HEAD_DIM)

    def __post_init__(self) -> None:
        _check_minimums("tiny", self, {"sft_steps": 0})
        from d3s.tiny_model import HEADS_BY_HEAD_DIM

        if self.head_dim not in HEADS_BY_HEAD_DIM:
            raise ConfigError(
                f"tiny.head_dim must be one of {', '.join(map(str, HEADS_BY_HEAD_DIM))}; "
                f"got {self.head_dim!r}",
                "tiny.head_dim",
            )


TOP_LEVEL_KEYS = frozenset(f.name for f in dataclasses.fields(RunKeys))
NULL_WORDS = ("null", "Null", "NULL", "~")
BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}
# dict | str fields whose string form is a path to a JSON file (TrainingArguments reads it)
PATH_OR_MAPPING_FIELDS = ("deepspeed", "fsdp_config", "accelerator_config")
EXPECTED = {int: "an integer", float: "a number such as 1e-6", str: "a string"}


@functools.cache
def _parser(dataclass_type: type) -> tuple[Any, dict[str, Any], dict[str, tuple[Any, ...]]]:
    """HfArgumentParser of ``dataclass_type`` (errors raised, not exits), its actions and annotations."""
    from transformers import HfArgumentParser

    hints = typing.get_type_hints(dataclass_type)  # before the parser narrows the fields' types
    parser = HfArgumentParser(dataclass_type, exit_on_error=False, allow_abbrev=False)
    actions = {a.dest: a for a in parser._actions if a.dest in hints and f"--{a.dest}" in a.option_strings}
    union = (typing.Union, types.UnionType)
    kinds = {
        name: typing.get_args(hint) if typing.get_origin(hint) in union else (hint,)
        for name, hint in hints.items()
        if name in actions
    }
    return parser, actions, kinds


def _parse_text(value: str) -> Any:
    """JSON, else YAML (which reads the 1e-6 of ``{"min_lr": 1e-6}`` as a string), else the text."""
    for load, error in ((json.loads, json.JSONDecodeError), (yaml.safe_load, yaml.YAMLError)):
        with contextlib.suppress(error):
            return load(value)
    return value


def _expected(action: Any) -> str:
    """What ``action`` accepts, for the error message."""
    from transformers.hf_argparser import string_to_bool

    choices = action.choices or ([e.value for e in action.type] if _is_enum(action.type) else None)
    if choices:
        return "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
    if action.type is string_to_bool:
        return "true or false (also yes/no, 1/0)"
    return EXPECTED.get(action.type, f"a {getattr(action.type, '__name__', action.type)} object")


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


class _Settled(typing.NamedTuple):
    """A value a pre-pass settled (the parser cannot take it); it is not put on the command line."""

    value: Any


def _refuser(value: Any, label: str, source: str | None) -> Callable[[str], typing.NoReturn]:
    """Raise ConfigError for ``label``: expected what, got ``value``, from ``source``."""

    def refuse(expected: str) -> typing.NoReturn:
        hint = "; YAML reads yes/no/on/off as booleans, so quote the word" if isinstance(value, bool) else ""
        raise ConfigError(f"{label}: expected {expected}{hint}, got {value!r}{_from(source)}")

    return refuse


def _word(action: Any, item: Any, refuse: Callable[[str], typing.NoReturn]) -> str:
    """``item`` as the word the parser reads for ``action`` (``--name=word``)."""
    from transformers.hf_argparser import string_to_bool

    if item is False and action.choices and "no" in action.choices:
        item = "no"  # pre-pass: YAML 1.1 reads `save_strategy: no` as False
    bool_field = action.type is string_to_bool
    if not isinstance(item, (str, int, float)) or (isinstance(item, bool) and not bool_field):
        refuse(_expected(action))  # pre-pass: the parser would take True as the word "True"
    word = item if isinstance(item, str) and action.type is str else str(item).strip()
    number = _whole_number(word) if action.type is int else None
    return str(number) if number is not None else word  # pre-pass: 1e3 or 8.0 for an int field


def _pre_pass(
    name: str, value: Any, action: Any, kind: tuple[Any, ...], refuse: Callable[[str], typing.NoReturn]
) -> _Settled | tuple[list[str], bool]:
    """What the parser cannot take, settled here (each ``pre-pass:``); else the words of ``value`` on the
    parser's command line and whether they make a list."""
    text = isinstance(value, str)
    if type(None) in kind and (value is None or value in NULL_WORDS):
        return _Settled(None)  # pre-pass: argv has no null
    literals = [v for m in kind if typing.get_origin(m) is typing.Literal for v in typing.get_args(m)]
    if isinstance(value, bool) and value in literals:
        return _Settled(value)  # pre-pass: the parser types `str | Literal[False]` as str
    if any(isinstance(c, bool) for c in action.choices or ()):  # pre-pass: str | bool, typed as bool
        word = BOOL_WORDS.get(str(value).strip().lower(), value if text else None)
        return _Settled(word) if word in action.choices else refuse(_expected(action))
    if any(m is dict or typing.get_origin(m) is dict for m in kind):  # pre-pass: a mapping, or its text
        path_ok = name in PATH_OR_MAPPING_FIELDS
        mapping = _parse_text(value) if text and (not path_ok or value.lstrip().startswith("{")) else value
        if isinstance(mapping, Mapping) or (path_ok and isinstance(mapping, str) and mapping):
            return _Settled(dict(mapping) if isinstance(mapping, Mapping) else mapping)
        refuse("a mapping such as {key: value} (YAML or JSON)" + (" or a JSON file" if path_ok else ""))
    if any(m is list or typing.get_origin(m) is list for m in kind):  # pre-pass: a list, or its text
        items = _parse_text(value) if text and value.lstrip().startswith("[") else value
        if isinstance(items, (list, tuple)) or (text and str not in kind):

            def refuse_item(expected: str) -> typing.NoReturn:
                refuse(f"a list whose items are each {_expected(action)}")

            items = items if isinstance(items, (list, tuple)) else [value]
            return [_word(action, item, refuse_item) for item in items], True
        if str not in kind:
            refuse("a list such as [a, b]")
        if text:
            return _Settled(value)  # `str | list`: a word is the str
    elif isinstance(action.type, type) and action.type not in EXPECTED and not _is_enum(action.type):
        # pre-pass: the parser would call the class on the text (ParallelismConfig("x"))
        refuse(f"{_expected(action)} (set it from Python, not from a config file)")
    return [_word(action, value, refuse)], False


def _typed_options(
    dataclass_type: type,
    options: Mapping[str, Any],
    prefix: str,
    sources: Mapping[str, str],
    source: str | None,
) -> dict[str, Any]:
    """``options`` typed by one parse of the whole mapping with the HfArgumentParser of ``dataclass_type``
    (its fields' argparse actions); ConfigError naming the key and where its value came from otherwise.
    The pre-passes settle what the parser cannot take; the checks after the parse, what it lets through."""
    parser, actions, kinds = _parser(dataclass_type)
    refusers = {
        name: _refuser(value, f"{prefix}{name}", sources.get(f"{prefix}{name}", source))
        for name, value in options.items()
    }
    settled: dict[str, Any] = {}
    words: dict[str, tuple[list[str], bool]] = {}
    for name, value in options.items():
        done = _pre_pass(name, value, actions[name], kinds[name], refusers[name])
        if isinstance(done, _Settled):
            settled[name] = done.value
        else:
            words[name] = done
    argv = []
    for name, (items, is_list) in words.items():
        if is_list and not items:
            settled[name] = []  # an empty list: no words to parse
        elif is_list and actions[name].nargs != "+":
            # pre-pass: a `str | list[str]` field (report_to) reads one word; its items are each the word
            settled[name] = [actions[name].type(item) for item in items]
        else:
            argv += [f"--{name}", *items] if is_list else [f"--{name}={items[0]}"]
    try:
        namespace = parser.parse_known_args(argv)[0]
    except argparse.ArgumentError as err:
        name = (err.argument_name or "").split("/")[0].removeprefix("--")
        if name not in words:
            raise
        expected = _expected(actions[name])
        refusers[name](f"a list whose items are each {expected}" if words[name][1] else expected)
    for name, (_, is_list) in words.items():
        if name in settled:
            continue
        action, kind, refuse = actions[name], kinds[name], refusers[name]
        parsed = getattr(namespace, name)
        items = parsed if is_list else [parsed[0] if action.nargs == "+" else parsed]
        checked = []
        for item in items:
            if isinstance(item, float) and not math.isfinite(item):  # pre-pass: float() takes nan and inf
                refuse(
                    f"a list whose items are each {_expected(action)}"
                    if is_list
                    else "a finite number such as 1e-6"
                )
            if int in kind and isinstance(item, str) and item.strip().lstrip("-").isdigit():
                item = int(item)  # pre-pass: `int | str` keeps a number (the parser types it str)
            checked.append(getattr(item, "value", item))  # an enum member as its value (YAML-safe)
        settled[name] = checked if is_list else checked[0]
    return {name: settled[name] for name in options}


def _whole_number(text: str) -> int | None:
    with contextlib.suppress(ValueError):
        number = float(text)
        return int(number) if math.isfinite(number) and number.is_integer() else None
    return None


def _from(source: str | None) -> str:
    return f" ({source})" if source else ""


def _check_keys(options: Any, fields: Any, what: str, fix: str, source: str | None) -> None:
    """pre-pass: unknown keys refused all together, with close matches (the parser passes them over)."""
    unknown = sorted(str(key) for key in options if key not in fields)
    if unknown:
        close = [difflib.get_close_matches(name, list(fields), n=1) for name in unknown]
        hints = "".join(f" (did you mean {match[0]}?)" for match in close if match)
        raise ConfigError(f"unknown {what} {unknown}{hints}{_from(source)}; {fix}")


def _section(
    dataclass_type: type, options: Any, label: str, sources: Mapping[str, str], source: str | None, fix=""
) -> dict[str, Any]:
    """``options`` typed (one parse of the whole mapping), then checked by ``dataclass_type``'s
    __post_init__ (ranges); not D3SConfig's (``fix`` given): resolve_config builds it once the CPU defaults
    are added."""
    fields = _parser(dataclass_type)[1]
    prefix = f"{label}." if label else ""
    what = f"{label} option(s)" if label else "config keys"
    _check_keys(options, fields, what, fix or f"valid: {', '.join(fields)}", source)
    typed = _typed_options(dataclass_type, options, prefix, sources, source)
    if not fix:
        try:
            dataclass_type(**typed)
        except ConfigError as err:
            raise ConfigError(f"{err}{_from(sources.get(err.key or '', source))}") from None
    return typed


def _check_trainer(options: Mapping[str, Any], sources: Mapping[str, str], source: str | None) -> None:
    """What the trainer's fields cannot say: method is top-level, files exist, report_to is installed."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    for name, value in options.items():
        where = _from(sources.get(f"trainer.{name}", source))
        if name == "method":
            raise ConfigError(
                f"trainer.method{where}: set the top-level method (or --method), not trainer.method"
            )
        path = Path(value).expanduser() if name in PATH_OR_MAPPING_FIELDS and isinstance(value, str) else None
        if path and not path.is_file():
            raise ConfigError(
                f"trainer.{name}: file {value} not found{where}; give an existing JSON file or a mapping"
            )
    report_to, where = options.get("report_to"), _from(sources.get("trainer.report_to", source))
    for name in [report_to] if isinstance(report_to, str) else report_to or []:
        if name not in ("none", "all", *INTEGRATION_TO_CALLBACK):
            raise ConfigError(
                f"trainer.report_to: unknown integration {name!r}{where}; use none, all or one of "
                f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}"
            )
        if name not in ("none", "all", *get_available_reporting_integrations()):
            raise ConfigError(
                f"trainer.report_to: {name} is not installed here{where}; install it or set report_to: none"
            )


def coerce_run_config(
    config: Any, *, source: str | None = None, sources: Mapping[str, str] | None = None
) -> RunConfig:
    """A ``d3s train`` config with every value typed and checked, once; ConfigError (one line) otherwise.

    ``sources`` says where a key's value came from (``trainer.max_steps``: "from --max-steps 0"), ``source``
    where the others did. Needs no model or data (d3s.runs.resolve checks paths). Only the keys given are
    returned, no defaults: the config is compared with a checkpoint's on resume. A RunConfig comes back as is.
    """
    from d3s.methods import METHODS

    if isinstance(config, RunConfig):
        return config
    sources = sources or {}
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"expected a mapping of config keys at the top level, got {config!r}{_from(source)}"
        )
    out = _section(RunKeys, config, "", sources, source)
    for key, value in out.items():
        if value == "":
            raise ConfigError(f"{key}: expected a non-empty string, got ''{_from(sources.get(key, source))}")
    if "method" in out and out["method"] not in METHODS:
        raise ConfigError(
            f"unknown method {out['method']!r}{_from(sources.get('method', source))}; valid methods: "
            f"{', '.join(sorted(METHODS))}"
        )
    if out.get("dataset"):
        synthetic = out["dataset"].get("name", "synthetic") == "synthetic"
        kind = SyntheticDataset if synthetic else BenchmarkDataset
        out["dataset"] = _section(kind, out["dataset"], "dataset", sources, source)
    if out.get("tiny"):
        out["tiny"] = _section(TinyOptions, out["tiny"], "tiny", sources, source)
    output_dir = Path(out.get("output_dir") or ".").expanduser()
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir: {out['output_dir']} is a file; give a directory path")
    if out.get("trainer") is not None:
        from d3s.trainer_config import D3SConfig

        fix = "every option must be a field of D3SConfig"
        out["trainer"] = _section(D3SConfig, out["trainer"], "trainer", sources, source, fix)
        _check_trainer(out["trainer"], sources, source)
    return RunConfig(out)


def check_model_dir(model: str, what: str) -> bool:
    """Whether ``model`` is a local path (False: a hub id); a local one must hold a readable config.json
    (checked before any weights load). ``what`` names the setting in the message ("model", "--model")."""
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
    No torch or TRL import: a mistyped path costs a second, not the trainer's imports."""
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
            f"config file {path}: expected a mapping of config keys at the top level, got "
            f"{type(config).__name__}"
        )
    return config
