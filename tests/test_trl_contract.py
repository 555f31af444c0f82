"""d3s/trl_contract.py lists every seam with TRL and transformers: each override of a GRPOTrainer or
transformers.Trainer method by a d3s class of D3STrainer's MRO, and each private name the d3s code reads."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
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
# The modules of D3STrainer, its mixins and its vLLM plumbing, whose reads of `self._x` (and `trainer._x`,
# `generation._x`: TRL's VLLMGeneration) are checked.
TRAINER_SOURCES = [
    "d3s/trainer.py",
    "d3s/trainer_metrics.py",
    "d3s/logprob_passes.py",
    "d3s/loss_terms.py",
    "d3s/packing.py",
    "d3s/savings",
    "d3s/callbacks",
    "d3s/vllm_engine.py",
]


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
    mixins |= {"TrlLogprobPasses", "SelectionLossTerms", "PackedMicroBatches"}
    assert names == {"D3STrainer"} | mixins


def test_every_override_of_trl_or_transformers_is_in_the_contract():
    assert {"log", "_save_checkpoint", "_get_per_token_logps_and_entropies"} <= set(_overrides())  # the walk
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
                and node.value.id in ("self", "trainer", "generation")
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
        | set(trl_contract.VLLM_GENERATION_METHODS)
    )
    reads = _reads_of_private_names()
    # the scan sees what it must
    assert {"_metrics", "_tokenizer", "_get_output_dir", "_iter_named_params"} <= set(reads)
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


@functools.cache
def _source(cls: type) -> str:
    return inspect.getsource(cls)


def _assigned_in(cls: type, name: str) -> bool:
    return re.search(rf"self\.{name}\s*(:[^=]+)?=[^=]", _source(cls)) is not None


@pytest.mark.parametrize("name", trl_contract.TRAINER_ATTRIBUTES)
def test_the_trainer_attributes_are_set_by_grpo_trainer_or_transformers(name):
    """Each attribute read from a built trainer is one TRL 1.16's GRPOTrainer (or transformers' Trainer) sets,
    before any trainer is built (check_trainer_attributes checks a built one at run time)."""
    from transformers import Trainer
    from trl import GRPOTrainer

    assert _assigned_in(GRPOTrainer, name) or _assigned_in(Trainer, name), (
        f"neither GRPOTrainer nor transformers.Trainer sets {name} (d3s/trl_contract.py TRAINER_ATTRIBUTES)"
    )


@pytest.mark.parametrize("name", trl_contract.VLLM_GENERATION_ATTRIBUTES)
def test_the_vllm_generation_attributes_are_set_by_trl(name):
    from trl.generation.vllm_generation import VLLMGeneration

    assert _assigned_in(VLLMGeneration, name), f"TRL's VLLMGeneration never sets {name}"


def test_every_vllm_generation_attribute_read_is_in_the_contract():
    text = (ROOT / "d3s/vllm_engine.py").read_text(encoding="utf-8")
    read = set(re.findall(r"\bgeneration\.([a-z]\w*)\b", text))
    listed = set(trl_contract.VLLM_GENERATION_ATTRIBUTES) | set(trl_contract.VLLM_GENERATION_METHODS)
    assert read <= listed, f"d3s/vllm_engine.py reads VLLMGeneration's {sorted(read - listed)}, not listed"


# ---- the scoring passes and the copied code, against TRL's source --------------------------------------


def _scoring_pass_calls() -> list[tuple[int, str, list[str]]]:
    """Each call of self._get_per_token_logps_and_entropies in TRL's _generate_and_score_completions: (line,
    the variable it assigns, the conditions of the `if` bodies around it), in source order."""
    from trl import GRPOTrainer

    lines, first = inspect.getsourcelines(GRPOTrainer._generate_and_score_completions)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    calls = []

    def visit(node: ast.AST, conditions: list[str]) -> None:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            function = node.value.func
            if isinstance(function, ast.Attribute) and function.attr == "_get_per_token_logps_and_entropies":
                target = node.targets[0]
                name = ast.unparse(target.elts[0] if isinstance(target, ast.Tuple) else target)
                calls.append((first + node.lineno - 1, name, conditions))
        if isinstance(node, ast.If):
            for child in node.body:
                visit(child, conditions + [ast.unparse(node.test)])
            for child in node.orelse:
                visit(child, conditions)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, conditions)

    visit(tree, [])
    return calls


def test_the_scoring_passes_are_trls_in_its_order_under_its_conditions():
    """D3STrainer names TRL's log-prob passes by their order in SCORING_PASSES: TRL must run them in that
    order, each under the condition the trainer evaluates (a swap would hand the token level the reference
    model's entropies)."""
    calls = _scoring_pass_calls()
    assert calls, "TRL's _generate_and_score_completions no longer calls _get_per_token_logps_and_entropies"
    order = [name for i, (_, name, _) in enumerate(calls) if i == 0 or calls[i - 1][1] != name]
    expected = [scoring.output_key for scoring in trl_contract.SCORING_PASSES]
    where = ", ".join(f"grpo_trainer.py:{line} {name}" for line, name, _ in calls)
    assert order == expected, f"TRL's scoring passes are {order} ({where}); SCORING_PASSES expects {expected}"
    by_key = {scoring.output_key: scoring for scoring in trl_contract.SCORING_PASSES}
    for line, name, conditions in calls:
        assert by_key[name].condition in conditions, (
            f"grpo_trainer.py:{line}: TRL runs its {name} pass under {conditions}, not under "
            f"SCORING_PASSES' {by_key[name].condition!r}: port D3STrainer._trl_runs_pass"
        )


def test_the_scoring_pass_conditions_are_the_trainers():
    """D3STrainer._trl_runs_pass spells out each condition of SCORING_PASSES (TRL's names, d3s's code)."""
    from d3s.trainer import D3STrainer

    source = inspect.getsource(D3STrainer._runs_old_policy_pass)
    for part in (
        "gradient_accumulation_steps % generate_every != 0",
        "self.vllm_importance_sampling_correction",
    ):
        assert part in source and part in trl_contract.SCORING_PASSES[0].condition, part
    assert "self.beta != 0.0" in inspect.getsource(D3STrainer._trl_runs_pass)
    assert [scoring.name for scoring in trl_contract.SCORING_PASSES] == ["old_policy", "reference"]


@pytest.mark.parametrize("copied", trl_contract.COPIED_TRL_CODE, ids=lambda copied: copied.copy)
def test_the_copied_trl_code_is_trls(copied):
    """A TRL upgrade that changes a copied block fails here, naming TRL's file and line and d3s's copy."""
    module_name, qualname = copied.copy.split(":")
    owner = importlib.import_module(module_name)
    for part in qualname.split("."):
        owner = getattr(owner, part)
    copy_file = inspect.getsourcefile(owner)
    copy_line = inspect.getsourcelines(owner)[1]
    copy = f"{Path(copy_file).relative_to(ROOT)}:{copy_line} ({qualname})"
    blocks = trl_contract.trl_blocks(copied.trl_method, copied.block_condition)
    assert len(blocks) == len(copied.digests), (
        f"TRL's {copied.trl_method} has {len(blocks)} blocks `if {copied.block_condition}:`, the copy at "
        f"{copy} was made from {len(copied.digests)}: port the copy, then COPIED_TRL_CODE's digests"
    )
    for (path, line, node), digest in zip(blocks, copied.digests, strict=True):
        assert trl_contract.block_digest(node) == digest, (
            f"{path}:{line} changed since TRL {trl_contract.TRL_VERSION}: port the copy at {copy}, then its "
            "digest in d3s/trl_contract.py COPIED_TRL_CODE"
        )


def test_the_block_digest_sees_code_not_layout():
    """The digest ignores comments and layout, and changes with the code: the copy check can fail."""
    a = ast.parse("if x:\n    y = f(a,  b)  # a comment\n").body[0]
    b = ast.parse("if x:\n    y = f(\n        a, b\n    )\n").body[0]
    c = ast.parse("if x:\n    y = f(b, a)\n").body[0]
    assert trl_contract.block_digest(a) == trl_contract.block_digest(b) != trl_contract.block_digest(c)
