"""Which results may share a table: their manifests compared group by group, each key under the first
matching rule of TRAINING_RULES / EVALUATION_RULES (docs/workflow/provenance.md)."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from d3s.methods import METHODS
from d3s.provenance import layout
from d3s.provenance.config_change import PER_ATTEMPT_TRAINER_KEYS, TRAINING_PER_ATTEMPT, flatten
from d3s.provenance.manifest import atomic_write_text, stable_hash, write_json

AGREE = "must agree"
WARN = "may differ, stated"
FREE = "may differ"

CONFIG_OPTION = "analysis.allow_mixed_settings"
PROVENANCE_FILE = "provenance.json"  # written by the workflow's rule provenance (write_provenance)


class Rule(NamedTuple):
    pattern: str  # a dotted key of the flattened manifest; fnmatch wildcards (``*`` also spans dots)
    policy: str  # AGREE, WARN or FREE
    why: str


def _rules(*table: tuple[str | Sequence[str], str, str]) -> tuple[Rule, ...]:
    """Rules from (pattern or patterns, policy, why) rows, in order."""
    return tuple(
        Rule(pattern, policy, why)
        for patterns, policy, why in table
        for pattern in ([patterns] if isinstance(patterns, str) else patterns)
    )


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
    "minibatches_per_generation",
    "zeroed_rollouts",
)
# Geometry following from a method's settings: GSPO updates 4 times per generation batch
# (docs/fidelity/objectives.md).
# G itself (num_generations) must agree; PODS's own protocol, which compares n = 4m with m, says so in its
# config (analysis.allow_mixed_settings).
BATCH_GEOMETRY_FIELDS = ("steps_per_generation", "generation_batch_size", "gradient_accumulation_steps")
METHOD_TRL_FIELDS = tuple(sorted({name for method in METHODS.values() for name in method.trl_settings}))
TRAINER = "config.resolved_trainer."
THREADS_WHY = "torch threads change CPU numerics and the wall-clock compared"

_SHARED_TAIL = (
    ("versions.*", AGREE, "package versions change what is computed"),
    ("git.*", WARN, "the code's commit and dirty flag; stated, not refused (docs/workflow/provenance.md)"),
    (
        "hardware.*",
        WARN,
        "different machines: wall-clock times are not comparable across them, and another CPU "
        "(cpu_id, cpu_capability) can change the float results and so the trajectories",
    ),
    ("torch_interop_threads", WARN, "follows the machine's CPU count"),
    ("started", FREE, "start time"),
    ("finished", FREE, "end time"),
    ("kind", FREE, "training or evaluation"),
    ("inputs.*.path", FREE, "where an input was read; its checksum identifies it"),
    ("*", AGREE, "any other recorded setting"),
)

TRAINING_RULES: tuple[Rule, ...] = _rules(
    ("config.method", FREE, "the method is what the table compares"),
    ("config.method_settings.*", FREE, "method-specific selection settings"),
    ([TRAINER + name for name in SELECTION_FIELDS], FREE, "method-specific selection setting"),
    ([TRAINER + name for name in METHOD_TRL_FIELDS], FREE, "TRL setting a method sets"),
    (
        [TRAINER + name for name in BATCH_GEOMETRY_FIELDS],
        WARN,
        "batch geometry a method sets (GSPO's 4 mini-batches per generation batch; the accumulation that "
        "follows from a method's G): stated, not refused",
    ),
    (("seed", "config.seed", TRAINER + "seed", TRAINER + "data_seed"), FREE, "seeds: what intervals span"),
    (
        [f"config.{key}" for key in sorted(TRAINING_PER_ATTEMPT) if not key.startswith("trainer.")]
        + [TRAINER + key for key in sorted(PER_ATTEMPT_TRAINER_KEYS)],
        FREE,
        "per-attempt value (run folder, resume policy, vLLM server address): TRAINING_PER_ATTEMPT",
    ),
    ((TRAINER + "logging_dir", TRAINER + "run_name"), FREE, "the run's folder and name"),
    ("config.trainer.*", FREE, "options as written (per-method overrides); resolved_trainer is compared"),
    ("config.data_dir", FREE, "a path; the dataset file's checksum is compared"),
    ("resumed_from", FREE, "the checkpoint an interrupted run resumed from"),
    ("inputs.*.sha256", AGREE, "the base model and the training data must be the same files"),
    (TRAINER + "*", AGREE, "trainer setting shared by all methods (G, batch size, steps, lr, lengths, ...)"),
    ("config.model", AGREE, "the base model"),
    ("config.dataset*", AGREE, "the training data"),
    (("config.threads", "torch_threads"), AGREE, THREADS_WHY),
    *_SHARED_TAIL,
)

EVALUATION_RULES: tuple[Rule, ...] = _rules(
    ("config.model_path", FREE, "the model evaluated is what differs"),
    ("inputs.model*", FREE, "the model's files and its training run's manifest differ between models"),
    ("model_run*", FREE, "the training run (method, seed, method settings) the model came from"),
    ("inputs.*.sha256", AGREE, "benchmark files must be the same"),
    ("config.benchmarks.*.data_source", FREE, "a path; the problems' checksum is compared"),
    ("config.benchmarks.*.batch_size", WARN, "problems per generate call: throughput (and padding)"),
    (
        "config.benchmarks.*",
        AGREE,
        "evaluation setting (samples per problem, temperature, top-p, max tokens, "
        "template, grader, problems checksum, Pass@k scoring)",
    ),
    ("config.benchmark_names", AGREE, "the benchmarks"),
    ("seed", AGREE, "the sampling seed"),
    ("torch_threads", WARN, "speed; evaluation times are not compared"),
    ("problems_resumed*", FREE, "problems kept from an interrupted evaluation"),
    ("parts.*", FREE, "the per-benchmark manifests"),
    *_SHARED_TAIL,
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


def _show(value: Any, width: int = 70) -> str:
    text = "null" if value is None else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def _one_line(difference: dict[str, Any]) -> str:
    """A difference as `key`: value (labels); value (labels)."""
    values = difference["values"].items()
    return f"`{difference['key']}`: " + "; ".join(f"{v} ({', '.join(labels)})" for v, labels in values)


# One manifest of a group: its label (e.g. "d3s seed 0 final"), path relative to the results folder, and
# content (None when the file is missing).
Record = tuple[str, str, "dict[str, Any] | None"]


def compare(group: str, records: Sequence[Record]) -> dict[str, Any]:
    """Compare the manifests of one group key by key under its rules: the group's entry of provenance.json
    (its manifests, the differences that must agree (``mixed``) and those stated (``warnings``))."""
    name, rules = GROUPS[group]
    flats = {label: flatten(manifest) for label, _, manifest in records if manifest is not None}
    mixed: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    missing = [label for label, _, manifest in records if manifest is None]
    if missing:
        values = {"missing": missing} | ({"present": list(flats)} if flats else {})
        mixed.append({"key": MISSING.pattern, "policy": AGREE, "why": MISSING.why, "values": values})
    agreed: dict[str, dict[str, Any]] = {label: {} for label in flats}
    for key in sorted(set().union(*flats.values())):
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
            difference = {"key": key, "policy": rule.policy, "why": rule.why, "values": by_value}
            (mixed if rule.policy == AGREE else warnings).append(difference)
    hashes = {label: stable_hash(values) for label, values in agreed.items()}
    distinct = set(hashes.values())
    manifests = [
        {"label": label, "path": path, "missing": manifest is None}
        | {f"git_{key}": ((manifest or {}).get("git") or {}).get(key) for key in ("commit", "dirty")}
        | {"settings_hash": hashes.get(label)}
        | {key: (manifest or {}).get(key) for key in ("started", "finished")}
        for label, path, manifest in records
    ]
    return {
        "group": group,
        "name": name,
        "consistent": not mixed,
        "settings_hash": distinct.pop() if not mixed and len(distinct) == 1 else None,
        "manifests": manifests,
        "mixed": mixed,
        "warnings": warnings,
    }


def collect(results: str | Path) -> dict[str, list[tuple[str, str]]]:
    """(label, manifest path relative to ``results``) of each run and evaluation read by the analysis."""
    results = Path(results)
    groups: dict[str, list[tuple[str, str]]] = {name: [] for name in GROUPS}
    for method, seed, run in layout.runs(results):
        if (run / "metrics.jsonl").is_file() or (run / "train_summary.json").is_file():
            path = run / layout.MANIFEST
            groups["training"].append((f"{method} seed {seed}", str(path.relative_to(results))))
    for point in layout.eval_points(results):
        label = "base model" if point.method == "base" else f"{point.method} seed {point.seed} {point.name}"
        group = "checkpoints" if point.step is not None else "final"
        groups[group].append((label, str(point.manifest.relative_to(results))))
    return groups


@dataclass
class Provenance:
    """The checked manifests of a results folder (provenance.json)."""

    results: str
    checks: list[dict[str, Any]]  # one compare() entry per group
    allow_mixed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def mixed(self) -> bool:
        return any(not check["consistent"] for check in self.checks)

    def select(self, *groups: str) -> Provenance:
        """The same check restricted to ``groups`` (what one table was made from)."""
        notes = self.notes if {"final", "checkpoints"} <= set(groups) else []  # notes on joining the two
        return Provenance(
            self.results, [c for c in self.checks if c["group"] in groups], self.allow_mixed, notes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": self.results,
            "settings": ("MIXED (allowed by allow_mixed_settings)" if self.mixed else "consistent"),
            "allow_mixed": self.allow_mixed,
            "groups": self.checks,
            "notes": self.notes,
            "rules": "d3s.provenance.settings_check (TRAINING_RULES, EVALUATION_RULES); "
            "docs/workflow/provenance.md",
        }

    def write_sidecar(self, table: str | Path) -> Path:
        """``<table>.provenance.json`` beside a table file: the manifests it came from and their check."""
        table = Path(table)
        path = table.with_name(f"{table.stem}.provenance.json")
        write_json(path, {"table": table.name} | self.to_dict())
        return path

    def banner(self) -> str:
        """A prominent Markdown warning when mixed settings were allowed; empty otherwise."""
        if not self.mixed:
            return ""
        lines = [
            f"> **Warning: mixed settings.** `{CONFIG_OPTION}` is true and these results combine runs made "
            "with different settings, so differences between rows may come from the settings, not the "
            "methods:"
        ]
        for check in self.checks:
            lines += [f"> - {check['name']}: {_one_line(d)}" for d in check["mixed"]]
        return "\n".join(lines)

    def summary(self) -> str:
        """One Markdown line per group: manifests, settings hash or MIXED, commits."""
        lines = []
        for check in self.checks:
            records = check["manifests"]
            commits = sorted({(r["git_commit"] or "unknown")[:7] for r in records})
            state = f"settings `{check['settings_hash']}`" if check["consistent"] else "**MIXED settings**"
            lines.append(
                f"- {check['name']}: {len(records)} manifest(s), {state}, git {', '.join(commits)}"
                + (", uncommitted changes" if any(r["git_dirty"] for r in records) else "")
            )
        return "\n".join(lines)

    def markdown(self) -> str:
        """The report's provenance section (links relative to the results folder, where report.md is)."""
        out = [
            "Every number in this report comes from the runs and evaluations below. Each manifest holds the "
            "resolved configuration, method settings, package versions, git commit and dirty flag, seed, "
            "torch threads, hardware, start and end time, and the input files' checksums. Within each group "
            "the settings that must agree were checked (rule table: `d3s.provenance.settings_check`, "
            "docs/workflow/provenance.md); the settings hash is a hash of those settings, equal across a "
            "consistent group.",
            "",
            "| group | manifests | settings hash | settings |",
            "|---|---|---|---|",
        ]
        for check in self.checks:
            mixed = ", ".join(f"`{d['key']}`" for d in check["mixed"])
            state = "consistent" if check["consistent"] else f"**MIXED**: {mixed}"
            hash_ = check["settings_hash"] or "-"
            out.append(f"| {check['name']} | {len(check['manifests'])} | `{hash_}` | {state} |")
        out.append("")
        stated = [(c, d) for c in self.checks for d in c["mixed"] + c["warnings"]]
        dirty = [r["label"] for c in self.checks for r in c["manifests"] if r["git_dirty"]]
        if stated or dirty or self.notes:
            out += ["Differences stated:", ""]
            out += [f"- {c['name']}, {d['policy']}: {_one_line(d)}" for c, d in stated]
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
        for r in (r for check in self.checks for r in check["manifests"]):
            dirty = "missing" if r["missing"] else ("yes" if r["git_dirty"] else "no")
            out.append(
                f"| [{r['path']}]({r['path']}) | {r['label']} | `{(r['git_commit'] or 'unknown')[:12]}` | "
                f"{dirty} | `{r['settings_hash'] or '-'}` | {r['started'] or '-'} | {r['finished'] or '-'} |"
            )
        return "\n".join(out)

    def refuse_unless_allowed(self, limit: int = 12) -> Provenance:
        """Self, unless a group mixes settings that must agree without ``allow_mixed``: then
        MixedSettingsError naming the keys, their values, the runs holding them, and how to proceed."""
        if not self.mixed or self.allow_mixed:
            return self
        lines = ["Refusing to combine results made with different settings in one table."]
        for check in (c for c in self.checks if not c["consistent"]):
            lines.append(f"{check['name'].capitalize()} differ in settings that must agree:")
            for diff in check["mixed"][:limit]:
                lines.append(f"  - {diff['key']} ({diff['why']}):")
                lines += [f"      {value}: {', '.join(labels)}" for value, labels in diff["values"].items()]
            if len(check["mixed"]) > limit:
                lines.append(f"  ... and {len(check['mixed']) - limit} more keys")
            lines.append(
                "  manifests: " + ", ".join(f"{r['label']} = {r['path']}" for r in check["manifests"])
            )
        lines.append(
            "To proceed: re-run the differing runs with the shared settings, or analyse them as separate "
            f"experiments; or combine them knowingly with `{CONFIG_OPTION}: true` in the workflow config "
            "(allow_mixed=True in d3s.analysis), and the tables' .provenance.json files and the report will "
            "state the mix."
        )
        raise MixedSettingsError("\n".join(lines))


def _cross_group_notes(final: Sequence[Record], checkpoints: Sequence[Record]) -> list[str]:
    """How the final and base evaluations differ from the checkpoint ones, which learning curves join."""
    first = [next((m for _, _, m in records if m), None) for records in (final, checkpoints)]
    if None in first:
        return []
    pair = compare("final", [("final and base", "", first[0]), ("checkpoints", "", first[1])])
    if pair["consistent"]:
        return []
    return [
        "learning curves join the final and base evaluations, rescored on the checkpoints' problems, with "
        "the checkpoint evaluations, which differ by design (eval.checkpoint_* settings) in: "
        + "; ".join(_one_line(d) for d in pair["mixed"])
    ]


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def check_results(
    results: str | Path, allow_mixed: bool = False, groups: Sequence[str] = tuple(GROUPS)
) -> Provenance:
    """Read and compare the manifests of ``groups`` in a results folder (refuse_unless_allowed)."""
    results = Path(results)
    read = {
        group: [(label, path, _read(results / path)) for label, path in records]
        for group, records in collect(results).items()
        if group in groups and records
    }
    checks = [compare(group, records) for group, records in read.items()]
    notes = _cross_group_notes(read.get("final", []), read.get("checkpoints", []))
    return Provenance(str(results), checks, allow_mixed, notes).refuse_unless_allowed()


def load_provenance(
    results: str | Path, allow_mixed: bool = False, groups: Sequence[str] = tuple(GROUPS)
) -> Provenance:
    """:func:`check_results`, read from ``provenance.json`` (rule provenance) while it lists exactly the
    manifests there are and none is newer (docs/workflow/provenance.md); else checked now."""
    results = Path(results)
    saved = results / PROVENANCE_FILE
    if saved.is_file():
        data = json.loads(saved.read_text(encoding="utf-8"))
        listed = {r["path"] for check in data["groups"] for r in check["manifests"]}
        current = {path for records in collect(results).values() for _, path in records}
        newest = max(
            ((results / p).stat().st_mtime_ns for p in current if (results / p).is_file()), default=0
        )
        if listed == current and newest <= saved.stat().st_mtime_ns:
            whole = Provenance(str(results), data["groups"], allow_mixed, data["notes"])
            return whole.select(*groups).refuse_unless_allowed()
    return check_results(results, allow_mixed, groups)


def write_provenance(results: str | Path, allow_mixed: bool) -> Provenance:
    """Check every group, then write ``provenance.json`` and ``provenance.md`` (the report's section)."""
    results = Path(results)
    provenance = check_results(results, allow_mixed)
    write_json(results / PROVENANCE_FILE, provenance.to_dict())
    banner = provenance.banner()
    markdown = "# Provenance\n\n" + (banner + "\n\n" if banner else "") + provenance.markdown() + "\n"
    atomic_write_text(results / "provenance.md", markdown)
    return provenance
