"""The regime sweep's provenance across its points: every point's own provenance check, then the points'
training and final-evaluation manifests compared with each other, which may differ only in the batch
(:data:`POINT_KEYS`, the values ``d3s regime`` sets per point) and must share the base model's weights."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from d3s.provenance.settings_check import MixedSettingsError, compare, load_provenance

# Settings that differ between the points by design: the batch (the --config values of d3s regime) and the
# synthetic training set's size, which grows with the batch so that no point trains on a prompt twice.
POINT_KEYS = (
    "config.resolved_trainer.per_device_train_batch_size",
    "config.dataset.count",
    "config.resolved_trainer.generation_batch_size",
    "config.resolved_trainer.gradient_accumulation_steps",
    "config.resolved_trainer.steps_per_generation",
)


def check_points(root: Path, points: Sequence[int], allow_mixed: bool = False) -> dict[str, Any]:
    """Every point's own provenance check (load_provenance), then the points' training and final-evaluation
    manifests compared with each other: they may differ only in the batch (POINT_KEYS). Raises
    MixedSettingsError naming the keys unless ``allow_mixed``."""
    records: dict[str, list] = {"training": [], "final": []}
    for prompts in points:
        provenance = load_provenance(root / f"p{prompts}", allow_mixed=allow_mixed)
        for check in provenance.checks:
            if check["group"] in records:
                for manifest in check["manifests"]:
                    path = root / f"p{prompts}" / manifest["path"]
                    content = _json(path)
                    records[check["group"]].append((f"p{prompts} {manifest['label']}", str(path), content))
    differences = []
    for group, group_records in records.items():
        if group_records:
            result = compare(group, group_records)
            differences += [{"group": group} | d for d in result["mixed"] if d["key"] not in POINT_KEYS]
    base_models = {  # the base model's files, by checksum (an evaluation records every file it read)
        label: json.dumps(
            {
                k: v.get("sha256")
                for k, v in ((content or {}).get("inputs") or {}).items()
                if k.startswith("model/")
            },
            sort_keys=True,
        )
        for label, _, content in records["final"]
        if label.endswith("base model")
    }
    if len(set(base_models.values())) > 1:
        differences.append({"group": "final", "key": "base model weights", "values": base_models})
    if differences and not allow_mixed:
        keys = "; ".join(f"{d['group']} {d['key']}" for d in differences[:8])
        raise MixedSettingsError(
            f"the regime points under {root} differ in more than the batch: {keys}. Re-run the sweep with "
            "one config (d3s regime), or set analysis.allow_mixed_settings: true to combine them anyway"
        )
    return {"points": [f"p{p}" for p in points], "differ_only_in": list(POINT_KEYS), "mixed": differences}


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
