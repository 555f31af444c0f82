"""The runs of a workflow config: its registry methods, and the named variants a study declares (a registry
method with trainer overrides, on the config's base model or on a base-model variant). docs/studies.md.

Pure and light (no torch, TRL or pandas): the workflow reads it at parse time.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from d3s.methods import METHODS, method_trainer


@dataclass(frozen=True)
class Variant:
    """One named run setting: ``runs/<name>/seed<seed>`` trains ``method`` with ``trainer`` on top of the
    config's ``train.trainer`` (and ``train.method_overrides[method]``), from base model ``base``."""

    name: str
    method: str  # a registry method (d3s.methods.METHODS)
    trainer: dict[str, Any] = field(default_factory=dict)
    base: str | None = None  # a name under the config's ``bases``; None: the config's base_model
    label: str = ""  # how figures and reports name it
    x: float | None = None  # the variant's value on a study's numeric axis (K, N / G), if it has one

    def train_settings(self, train_cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The run's trainer settings before the batch is fixed for its processes."""
        return method_trainer(train_cfg, self.method) | dict(self.trainer)

    def as_param(self) -> dict[str, Any]:
        """What a training job needs of it, as a Snakemake param (plain data, compared between runs)."""
        return {"method": self.method, "trainer": dict(self.trainer)}


def run_variants(config: Mapping[str, Any]) -> dict[str, Variant]:
    """Every run name of ``config`` (its ``methods``, then its ``variants``) -> its Variant; ValueError
    naming the key when a variant changes a registry method under its name or names an unknown base."""
    variants = {name: Variant(name, name) for name in config["methods"]}
    bases = dict(config.get("bases") or {})
    for name, spec in dict(config.get("variants") or {}).items():
        # a registry method's entry only names it (label, x): it runs as the registry defines it
        if name in METHODS and (spec.get("method") != name or spec.get("trainer") or spec.get("base")):
            raise ValueError(
                f"variants.{name}: {name!r} is a registry method, which an entry can only label (label, x, "
                "method: the same name); give the variant another name"
            )
        base = spec.get("base")
        if base is not None and base not in bases:
            known = ", ".join(sorted(bases)) or "none"
            raise ValueError(
                f"variants.{name}.base: unknown base {base!r}; declare it under bases (known: {known})"
            )
        variants[name] = Variant(
            name,
            spec["method"],
            dict(spec.get("trainer") or {}),
            base,
            str(spec.get("label") or ""),
            None if spec.get("x") is None else float(spec["x"]),
        )
    return variants


def base_model_settings(config: Mapping[str, Any], base: str | None) -> dict[str, Any]:
    """The base_model section of ``base`` (a name under ``bases``): the config's, with its keys on top."""
    settings = copy.deepcopy(dict(config["base_model"]))
    if base is None:
        return settings
    return settings | copy.deepcopy(dict(config["bases"][base]))


TASK_KEYS = ("min_ops", "max_ops", "max_operand", "bounded")


def sft_task(config: Mapping[str, Any], base: str | None) -> dict[str, Any]:
    """The synthetic task the SFT of ``base`` draws its demonstrations from: the config's ``task`` with the
    base model's ``sft_task`` on top, in one key order (so two configs that build the same base model give its
    job the same parameters)."""
    task = dict(config["task"]) | dict(base_model_settings(config, base).get("sft_task") or {})
    return {key: task[key] for key in TASK_KEYS}


def extended_config(config: Mapping[str, Any], root: str | os.PathLike[str]) -> dict[str, Any]:
    """``config`` laid over the file its ``extends`` names (a path from ``root``, the repository): mappings
    merge key by key, everything else (lists included) is replaced; ``extends`` itself is dropped. A config
    without ``extends`` comes back as it is."""
    from snakemake.utils import update_config

    config = copy.deepcopy(dict(config))
    parent = config.pop("extends", None)
    if parent is None:
        return config
    path = Path(root) / str(parent)
    try:
        base = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"config extends: {parent} not found (a path from the repository root)") from None
    if not isinstance(base, dict):
        raise ValueError(f"config extends: {parent} is not a workflow config (a mapping)")
    if "extends" in base:
        raise ValueError(f"config extends: {parent} extends another file; extend that one directly")
    update_config(base, config)
    return base
