"""Which results may share a table: the manifests of runs and evaluations, checked against one rule table.

Every training run (``runs/<method>/seed<seed>/manifest.json``, written by ``d3s train``) and every
evaluation (``eval/.../manifest.json``, written by ``d3s eval``) records what made it. Results are compared
in groups: the training runs; the evaluations of the final models together with the base model; the
evaluations of checkpoints along training. Within a group, each manifest key falls under the first rule of
:data:`TRAINING_RULES` or :data:`EVALUATION_RULES` whose pattern matches it:

- ``must agree``: a difference is refused (:class:`MixedSettingsError`) unless ``allow_mixed`` is set,
  and then stated prominently in the tables' ``.provenance.json`` files and the report;
- ``may differ, stated``: a difference is allowed and listed in the report (git state, hardware);
- ``may differ``: differs by design (method, seed, the model evaluated, paths, times).

Unlisted keys fall to the last rule (``*``: must agree), so a setting added later is compared by default.
A key a manifest does not have counts as null. A missing manifest means unknown settings, which counts as
a difference that must agree.

Git commit and dirty flag only warn: a commit that changed documentation or tests does not invalidate
results, and refusing would force re-running every run after any commit. They are stated in the report,
with each run's commit, so a reader can judge.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from d3s import results_layout
from d3s.manifest import atomic_write_text, stable_hash
from d3s.methods import METHODS

AGREE = "must agree"
WARN = "may differ, stated"
FREE = "may differ"

CONFIG_OPTION = "analysis.allow_mixed_settings"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a dotted key of the flattened manifest; fnmatch wildcards (``*`` also spans dots)
    policy: str  # AGREE, WARN or FREE
    why: str


# D3SConfig fields the method registry sets (d3s.methods), and the TRL fields any method sets (GSPO's
# sequence-level ratio and clip range): they differ between methods by design.
SELECTION_FIELDS = (
    "method",
    "sample_rule",
    "sample_scope",
    "renormalize",
    "keep_per_prompt",
    "keep_per_prompt_final",
    "token_rule",
    "token_scope",
    "token_keep_ratio",
    "token_keep_ratio_final",
    "schedule",
)
METHOD_TRL_FIELDS = tuple(sorted({name for method in METHODS.values() for name in method.trl_settings}))

_SHARED_TAIL = (
    Rule("versions.*", AGREE, "package versions change what is computed"),
    Rule("git.*", WARN, "the code's commit and dirty flag; stated, not refused (see the module docstring)"),
    Rule("hardware.*", WARN, "different machines: wall-clock times are not comparable across them"),
    Rule("torch_interop_threads", WARN, "follows the machine's CPU count"),
    Rule("started", FREE, "start time"),
    Rule("finished", FREE, "end time"),
    Rule("kind", FREE, "training or evaluation"),
    Rule("inputs.*.path", FREE, "where an input was read; its checksum identifies it"),
)

TRAINING_RULES: tuple[Rule, ...] = (
    Rule("config.method", FREE, "the method is what the table compares"),
    Rule("config.method_settings.*", FREE, "method-specific selection settings"),
    *(
        Rule(f"config.resolved_trainer.{name}", FREE, "method-specific selection setting")
        for name in SELECTION_FIELDS
    ),
    *(
        Rule(f"config.resolved_trainer.{name}", FREE, "TRL setting a method sets")
        for name in METHOD_TRL_FIELDS
    ),
    Rule("seed", FREE, "seeds are what the intervals are taken over"),
    Rule("config.seed", FREE, "seed"),
    Rule("config.resolved_trainer.seed", FREE, "seed"),
    Rule("config.resolved_trainer.data_seed", FREE, "seed"),
    Rule("config.output_dir", FREE, "where the run is written"),
    Rule("config.resolved_trainer.output_dir", FREE, "where the run is written"),
    Rule("config.resolved_trainer.logging_dir", FREE, "where the run is written"),
    Rule("config.resolved_trainer.run_name", FREE, "the run's name"),
    Rule(
        "config.trainer.*",
        FREE,
        "options as written (with per-method overrides); resolved_trainer is compared",
    ),
    Rule("config.data_dir", FREE, "a path; the dataset file's checksum is compared"),
    Rule("config.resume", FREE, "whether an interrupted run resumes"),
    Rule("resumed_from", FREE, "the checkpoint an interrupted run resumed from"),
    Rule("inputs.*.sha256", AGREE, "the base model and the training data must be the same files"),
    Rule(
        "config.resolved_trainer.*",
        AGREE,
        "trainer setting shared by all methods (G, batch size, steps, learning rate, lengths, ...)",
    ),
    Rule("config.model", AGREE, "the base model"),
    Rule("config.dataset*", AGREE, "the training data"),
    Rule("config.threads", AGREE, "torch threads change CPU numerics and the wall-clock compared"),
    Rule("torch_threads", AGREE, "torch threads change CPU numerics and the wall-clock compared"),
    *_SHARED_TAIL,
    Rule("*", AGREE, "any other recorded setting"),
)

EVALUATION_RULES: tuple[Rule, ...] = (
    Rule("config.model_path", FREE, "the model evaluated is what differs"),
    Rule("inputs.model*", FREE, "the model's files and its training run's manifest differ between models"),
    Rule("model_run*", FREE, "the training run (method, seed, method settings) the model came from"),
    Rule("inputs.*.sha256", AGREE, "benchmark files must be the same"),
    Rule("config.benchmarks.*.data_source", FREE, "a path; the problems' checksum is compared"),
    Rule("config.benchmarks.*.batch_size", WARN, "problems per generate call: throughput (and padding)"),
    Rule(
        "config.benchmarks.*",
        AGREE,
        "evaluation setting (samples per problem, temperature, top-p, max tokens, template, grader, "
        "problems checksum, Pass@k scoring)",
    ),
    Rule("config.benchmark_names", AGREE, "the benchmarks"),
    Rule("seed", AGREE, "the sampling seed"),
    Rule("torch_threads", WARN, "speed; evaluation times are not compared"),
    Rule("problems_resumed*", FREE, "problems kept from an interrupted evaluation"),
    Rule("parts.*", FREE, "the per-benchmark manifests"),
    *_SHARED_TAIL,
    Rule("*", AGREE, "any other recorded setting"),
)

# The comparison groups: results in one group may share a table; rules per group.
GROUPS: dict[str, tuple[str, tuple[Rule, ...]]] = {
    "training": ("training runs", TRAINING_RULES),
    "final": ("evaluations of the final models and the base model", EVALUATION_RULES),
    "checkpoints": ("evaluations of checkpoints along training", EVALUATION_RULES),
}
MISSING = Rule("manifest.json", AGREE, "no manifest: the settings are unknown (re-run to write one)")


class MixedSettingsError(ValueError):
    """Results made with different settings would be combined without ``allow_mixed``."""


@lru_cache(maxsize=4096)
def rule_for(key: str, rules: tuple[Rule, ...]) -> Rule:
    """The first rule whose pattern matches ``key`` (the tables end with a catch-all)."""
    return next(rule for rule in rules if fnmatch.fnmatchcase(key, rule.pattern))


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists and other values stay whole."""
    if isinstance(obj, dict) and obj:
        flat: dict[str, Any] = {}
        for key, value in obj.items():
            flat |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return flat
    return {prefix: obj}


def _show(value: Any, width: int = 70) -> str:
    text = "null" if value is None else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class ManifestRecord:
    """One run's or evaluation's manifest (``manifest`` None when the file is missing)."""

    label: str  # e.g. "d3s seed 0", "d3s seed 0 final", "base model"
    path: str  # relative to the results folder
    manifest: dict[str, Any] | None

    @property
    def commit(self) -> str | None:
        return ((self.manifest or {}).get("git") or {}).get("commit")

    @property
    def dirty(self) -> bool | None:
        return ((self.manifest or {}).get("git") or {}).get("dirty")


@dataclass
class Difference:
    """One key whose values differ within a group: value (as shown) -> labels of the runs holding it."""

    key: str
    rule: Rule
    values: dict[str, list[str]]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "policy": self.rule.policy, "why": self.rule.why, "values": self.values}

    def one_line(self) -> str:
        return f"`{self.key}`: " + "; ".join(
            f"{v} ({', '.join(labels)})" for v, labels in self.values.items()
        )


@dataclass
class GroupCheck:
    """The result of comparing one group's manifests."""

    group: str
    name: str
    records: list[ManifestRecord]
    mismatches: list[Difference] = field(default_factory=list)  # must agree, but differ
    warnings: list[Difference] = field(default_factory=list)  # may differ, stated
    hashes: dict[str, str] = field(default_factory=dict)  # label -> hash of its must-agree settings

    @property
    def consistent(self) -> bool:
        return not self.mismatches

    @property
    def settings_hash(self) -> str | None:
        values = set(self.hashes.values())
        return values.pop() if self.consistent and len(values) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "name": self.name,
            "consistent": self.consistent,
            "settings_hash": self.settings_hash,
            "manifests": [
                {
                    "label": r.label,
                    "path": r.path,
                    "git_commit": r.commit,
                    "git_dirty": r.dirty,
                    "settings_hash": self.hashes.get(r.label),
                    "started": (r.manifest or {}).get("started"),
                    "finished": (r.manifest or {}).get("finished"),
                }
                for r in self.records
            ],
            "mixed": [d.to_dict() for d in self.mismatches],
            "warnings": [d.to_dict() for d in self.warnings],
        }


def compare(
    group: str, records: Sequence[ManifestRecord], rules: tuple[Rule, ...] | None = None
) -> GroupCheck:
    """Compare the manifests of one group key by key under ``rules`` (the group's by default)."""
    name, default_rules = GROUPS[group]
    rules = rules or default_rules
    check = GroupCheck(group, name, list(records))
    flats = {r.label: flatten(r.manifest) for r in records if r.manifest is not None}
    missing = [r.label for r in records if r.manifest is None]
    if missing:
        present = [r.label for r in records if r.manifest is not None]
        values = {"missing": missing} | ({"present": present} if present else {})
        check.mismatches.append(Difference(MISSING.pattern, MISSING, values))
    agreed: dict[str, dict[str, Any]] = {label: {} for label in flats}
    for key in sorted(set().union(*flats.values()) if flats else ()):
        rule = rule_for(key, rules)
        if rule.policy == FREE:
            continue
        by_value: dict[str, list[str]] = {}
        for label, flat in flats.items():
            value = flat.get(key)
            by_value.setdefault(_show(value), []).append(label)
            if rule.policy == AGREE and value is not None:
                agreed[label][key] = value
        if len(by_value) > 1:
            (check.mismatches if rule.policy == AGREE else check.warnings).append(
                Difference(key, rule, by_value)
            )
    check.hashes = {label: stable_hash(values) for label, values in agreed.items()}
    return check


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def collect(results: str | Path) -> dict[str, list[ManifestRecord]]:
    """The manifests of every run and evaluation whose results the analysis reads, by group."""
    results = Path(results)
    groups: dict[str, list[ManifestRecord]] = {name: [] for name in GROUPS}
    for method, seed, run in results_layout.runs(results):
        if (run / "metrics.jsonl").is_file() or (run / "train_summary.json").is_file():
            path = run / results_layout.MANIFEST
            groups["training"].append(
                ManifestRecord(f"{method} seed {seed}", str(path.relative_to(results)), _read(path))
            )
    for point in results_layout.eval_points(results):
        label = "base model" if point.method == "base" else f"{point.method} seed {point.seed} {point.name}"
        record = ManifestRecord(label, str(point.manifest.relative_to(results)), _read(point.manifest))
        groups["checkpoints" if point.step is not None else "final"].append(record)
    return groups


@dataclass
class Provenance:
    """The checked manifests of a results folder, for tables' sidecars and the report."""

    results: str
    checks: list[GroupCheck]
    allow_mixed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def mixed(self) -> bool:
        return any(not c.consistent for c in self.checks)

    def select(self, *groups: str) -> Provenance:
        """The same check restricted to ``groups`` (what one table was made from)."""
        return Provenance(
            self.results, [c for c in self.checks if c.group in groups], self.allow_mixed, self.notes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": self.results,
            "settings": ("MIXED (allowed by allow_mixed_settings)" if self.mixed else "consistent"),
            "allow_mixed": self.allow_mixed,
            "groups": [c.to_dict() for c in self.checks],
            "notes": self.notes,
            "rules": "d3s.orchestration.settings_check (TRAINING_RULES, EVALUATION_RULES); docs/workflow.md",
        }

    def write_sidecar(self, table: str | Path) -> Path:
        """``<table>.provenance.json`` beside a table file: the manifests it came from and their check."""
        table = Path(table)
        path = table.with_name(f"{table.stem}.provenance.json")
        atomic_write_text(path, json.dumps({"table": table.name} | self.to_dict(), indent=2) + "\n")
        return path

    def banner(self) -> str:
        """A prominent Markdown warning when mixed settings were allowed; empty otherwise."""
        if not self.mixed:
            return ""
        lines = [
            f"> **Warning: mixed settings.** `{CONFIG_OPTION}` is true and these results combine runs made "
            "with different settings, so differences between rows may come from the settings, not the methods:"
        ]
        for check in self.checks:
            lines += [f"> - {check.name}: {d.one_line()}" for d in check.mismatches]
        return "\n".join(lines)

    def summary(self) -> str:
        """One Markdown line per group: manifests, settings hash or MIXED, commits."""
        lines = []
        for check in self.checks:
            if not check.records:
                continue
            commits = sorted({(r.commit or "unknown")[:7] for r in check.records})
            state = f"settings `{check.settings_hash}`" if check.consistent else "**MIXED settings**"
            lines.append(
                f"- {check.name}: {len(check.records)} manifest(s), {state}, git {', '.join(commits)}"
                + (", uncommitted changes" if any(r.dirty for r in check.records) else "")
            )
        return "\n".join(lines)

    def markdown(self) -> str:
        """The report's provenance section (links relative to the results folder, where report.md is)."""
        out = [
            "Every number in this report comes from the runs and evaluations below. Each manifest holds the "
            "resolved configuration, method settings, package versions, git commit and dirty flag, seed, torch "
            "threads, hardware, start and end time, and the input files' checksums. Within each group the "
            "settings that must agree were checked (rule table: `d3s.orchestration.settings_check`, docs/workflow.md); "
            "the settings hash is a hash of those settings, equal across a consistent group.",
            "",
            "| group | manifests | settings hash | settings |",
            "|---|---|---|---|",
        ]
        for check in self.checks:
            if check.records:
                state = (
                    "consistent"
                    if check.consistent
                    else "**MIXED**: " + ", ".join(f"`{d.key}`" for d in check.mismatches)
                )
                out.append(
                    f"| {check.name} | {len(check.records)} | `{check.settings_hash or '-'}` | {state} |"
                )
        out.append("")
        stated = [(c, d) for c in self.checks for d in c.mismatches + c.warnings]
        dirty = [r.label for c in self.checks for r in c.records if r.dirty]
        if stated or dirty or self.notes:
            out += ["Differences stated:", ""]
            out += [f"- {c.name}, {d.rule.policy}: {d.one_line()}" for c, d in stated]
            if dirty:
                out.append(
                    "- made from a tree with uncommitted changes (the commit does not pin the code): "
                    + ", ".join(dirty)
                )
            out += [f"- {note}" for note in self.notes]
            out.append("")
        out += [
            "| manifest | run | git commit | dirty | settings hash | started | finished |",
            "|---|---|---|---|---|---|---|",
        ]
        for check in self.checks:
            for r in check.records:
                manifest = r.manifest or {}
                out.append(
                    f"| [{r.path}]({r.path}) | {r.label} | `{(r.commit or 'unknown')[:12]}` | "
                    f"{'missing' if r.manifest is None else ('yes' if r.dirty else 'no')} | "
                    f"`{check.hashes.get(r.label, '-')}` | {manifest.get('started', '-')} | "
                    f"{manifest.get('finished') or '-'} |"
                )
        return "\n".join(out)


def _cross_group_notes(checks: dict[str, GroupCheck]) -> list[str]:
    """Learning curves join the base and final evaluations with the checkpoint ones: say how they differ
    (by design, through eval.checkpoint_* settings) instead of refusing."""
    final, ckpt = checks.get("final"), checks.get("checkpoints")
    if not final or not ckpt:
        return []
    first = [next((r for r in c.records if r.manifest), None) for c in (final, ckpt)]
    if None in first:
        return []
    pair = compare(
        "final",
        [
            ManifestRecord("final and base", "", first[0].manifest),
            ManifestRecord("checkpoints", "", first[1].manifest),
        ],
    )
    if not pair.mismatches:
        return []
    return [
        "learning curves join the final and base evaluations with the checkpoint evaluations, which differ "
        "by design (eval.checkpoint_* settings) in: " + "; ".join(d.one_line() for d in pair.mismatches)
    ]


def mixed_settings_message(checks: Iterable[GroupCheck], limit: int = 12) -> str:
    """The refusal: which keys differ, their values, the runs holding them, and how to proceed."""
    lines = ["Refusing to combine results made with different settings in one table."]
    for check in checks:
        if check.consistent:
            continue
        lines.append(f"{check.name.capitalize()} differ in settings that must agree:")
        for diff in check.mismatches[:limit]:
            lines.append(f"  - {diff.key} ({diff.rule.why}):")
            lines += [f"      {value}: {', '.join(labels)}" for value, labels in diff.values.items()]
        if len(check.mismatches) > limit:
            lines.append(f"  ... and {len(check.mismatches) - limit} more keys")
        lines.append("  manifests: " + ", ".join(f"{r.label} = {r.path}" for r in check.records))
    lines.append(
        "To proceed: re-run the differing runs with the shared settings, or analyse them as separate "
        f"experiments; or combine them knowingly with `{CONFIG_OPTION}: true` in the workflow config "
        "(allow_mixed=True in d3s.analysis), and the tables' .provenance.json files and the report will "
        "state the mix."
    )
    return "\n".join(lines)


def check_results(
    results: str | Path, allow_mixed: bool = False, groups: Sequence[str] = tuple(GROUPS)
) -> Provenance:
    """Read and compare the manifests of ``groups`` in a results folder.

    Raises :class:`MixedSettingsError` (naming keys, values, runs and the way out) when a group mixes
    settings that must agree, unless ``allow_mixed``; then the returned :class:`Provenance` says so.
    """
    collected = collect(results)
    checks = {group: compare(group, collected[group]) for group in groups if collected[group]}
    provenance = Provenance(str(results), list(checks.values()), allow_mixed, _cross_group_notes(checks))
    if provenance.mixed and not allow_mixed:
        raise MixedSettingsError(mixed_settings_message(provenance.checks))
    return provenance
