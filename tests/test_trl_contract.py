"""d3s/trl_contract.py lists every seam with TRL and transformers: each override of a GRPOTrainer or
transformers.Trainer method by a d3s class of D3STrainer's MRO, and each private name the d3s code reads."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from d3s import trl_contract
from d3s.trainer import D3STrainer

ROOT = Path(__file__).resolve().parents[1]
# What Python puts in every class's namespace: not overrides.
CLASS_MACHINERY = {
    "__module__",
    "__qualname__",
    "__doc__",
    "__dict__",
    "__weakref__",
    "__annotations__",
    "__firstlineno__",
    "__static_attributes__",
    "__orig_bases__",
    "__parameters__",
}
# The modules of D3STrainer and its mixins, whose reads of `self._x` (and `trainer._x`) are checked.
TRAINER_SOURCES = ["d3s/trainer.py", "d3s/trainer_metrics.py", "d3s/savings", "d3s/callbacks"]


def _trl_classes() -> list[type]:
    from trl import GRPOTrainer

    return [cls for cls in GRPOTrainer.__mro__ if cls is not object]


def _d3s_classes() -> list[type]:
    return [cls for cls in D3STrainer.__mro__ if cls.__module__.split(".")[0] == "d3s"]


def _overrides() -> dict[str, list[str]]:
    """Each name a d3s class of D3STrainer's MRO defines that GRPOTrainer or one of its bases also defines,
    with the d3s classes that define it."""
    trl_names = set().union(*(vars(cls) for cls in _trl_classes())) - CLASS_MACHINERY
    found: dict[str, list[str]] = {}
    for cls in _d3s_classes():
        for name in sorted(set(vars(cls)) & trl_names):
            found.setdefault(name, []).append(cls.__qualname__)
    return found


def test_the_d3s_classes_of_the_mro_are_the_trainer_and_its_mixins():
    names = {cls.__qualname__ for cls in _d3s_classes()}
    mixins = {"SelectionMetrics", "DeferredLogprobPasses", "CpuRanksOptimizerLoad", "CheckpointSaveErrors"}
    assert names == {"D3STrainer"} | mixins


def test_every_override_of_trl_or_transformers_is_in_the_contract():
    missing = [
        f"{owner}.{name}"
        for name, owners in _overrides().items()
        if name not in trl_contract.OVERRIDES
        for owner in owners
    ]
    assert not missing, (
        "these d3s methods override GRPOTrainer's (or transformers.Trainer's) of the same name; list each in "
        f"d3s/trl_contract.py OVERRIDES with its reason: {', '.join(missing)}"
    )


def test_every_listed_override_is_a_real_override_of_trl():
    from transformers import Trainer

    overrides = _overrides()
    for name, reason in trl_contract.OVERRIDES.items():
        owner = reason.split(":")[0]
        assert name in overrides, f"trl_contract.OVERRIDES lists {name}, which no d3s class overrides"
        assert overrides[name] == [owner], f"{name}: the reason names {owner}, defined by {overrides[name]}"
        assert any(callable(vars(cls).get(name)) for cls in _trl_classes()), f"TRL has no method {name}"
    # the transformers.Trainer methods overridden are also pinned against transformers
    for name in trl_contract.OVERRIDES:
        if name in vars(Trainer) and name != "__init__":
            assert name in trl_contract.TRANSFORMERS_TRAINER_METHODS, name
    for name in trl_contract.TRANSFORMERS_TRAINER_METHODS:
        assert callable(vars(Trainer).get(name)), f"transformers.Trainer has no method {name}"


def _reads_of_private_names() -> dict[str, str]:
    """`self._x` and `trainer._x` read in the trainer's modules: name -> first place."""
    files = []
    for source in TRAINER_SOURCES:
        path = ROOT / source
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    reads, assigned = {}, set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "trainer")
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                if isinstance(node.ctx, ast.Store):
                    assigned.add(node.attr)
                else:
                    reads.setdefault(node.attr, f"{path.relative_to(ROOT)}:{node.lineno}")
    defined_by_d3s = set().union(*(vars(cls) for cls in _d3s_classes())) | assigned
    trl_defined = set().union(*(vars(cls) for cls in _trl_classes()))
    # d3s's own names, unless they override TRL's (those are in OVERRIDES, checked above)
    return {name: where for name, where in reads.items() if name not in defined_by_d3s or name in trl_defined}


def test_every_private_trl_name_the_trainer_reads_is_in_the_contract():
    listed = (
        set(trl_contract.OVERRIDES)
        | set(trl_contract.TRANSFORMERS_TRAINER_METHODS)
        | set(trl_contract.TRAINER_ATTRIBUTES)
        | set(trl_contract.VLLM_TRAINER_ATTRIBUTES)
        | set(trl_contract.TRAINING_LOOP_ATTRIBUTES)
    )
    reads = _reads_of_private_names()
    assert {"_metrics", "_tokenizer", "_get_output_dir"} <= set(reads)  # the scan sees what it must
    missing = [f"{name} ({where})" for name, where in sorted(reads.items()) if name not in listed]
    assert not missing, f"private TRL/transformers names read but not in d3s/trl_contract.py: {missing}"


@pytest.mark.parametrize("name", trl_contract.TRAINING_LOOP_ATTRIBUTES)
def test_the_training_loop_attributes_are_set_by_transformers(name):
    from transformers import Trainer

    assert re.search(rf"self\.{name}\s*=", inspect.getsource(Trainer)), (
        f"transformers.Trainer never sets {name}"
    )


@pytest.mark.parametrize("name", trl_contract.VLLM_TRAINER_ATTRIBUTES)
def test_the_vllm_attributes_are_set_by_grpo_trainer(name):
    from trl import GRPOTrainer

    assert re.search(rf"self\.{name}\s*=", inspect.getsource(GRPOTrainer.__init__)), name


def test_every_listed_attribute_is_read_by_d3s():
    """The contract lists what d3s uses, no more: each attribute is read as `self.x` or `trainer.x`."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in (ROOT / "d3s").rglob("*.py"))
    listed = (
        trl_contract.TRAINER_ATTRIBUTES
        + trl_contract.VLLM_TRAINER_ATTRIBUTES
        + trl_contract.TRAINING_LOOP_ATTRIBUTES
    )
    unread = [name for name in listed if not re.search(rf"\b(self|trainer)\.{name}\b(?!\s*=[^=])", text)]
    assert not unread, f"d3s/trl_contract.py lists attributes no d3s code reads: {unread}"
