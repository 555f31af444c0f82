"""The regime sweep's analysis (docs/workflow/regime-sweep.md): how the gaps of the methods to the
reference (D3S - GRPO, PODS - GRPO) move with the update tokens per step, from the sweep's points
``results/<experiment>/p<P>/``, each a complete experiment of the workflow.

Writes, under ``results/<experiment>/``: ``tables/regime_gap.csv`` (per point and method: update tokens, the
paired gaps at equal steps and at equal wall-clock, the step-time ratio), ``tables/regime_claims.csv`` (the
trend: the slope of each gap against log10 update tokens, columns of d3s.analysis.claims.COLUMNS),
``figures/regime_gap.png|pdf`` and ``report.md`` (:func:`write_regime`). The parts: the gaps and their trend
(d3s/analysis/regime_gaps.py), the provenance across points (regime_provenance.py), the figure and report
(regime_report.py) and the paper's regime, estimated (paper_regime.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from d3s.analysis.claims import pods_protocol
from d3s.analysis.paper_regime import PAPER, PaperRegime
from d3s.analysis.regime_gaps import sweep_tables
from d3s.analysis.regime_provenance import check_points
from d3s.analysis.regime_report import gap_figure, report_markdown
from d3s.methods import method_trainer
from d3s.provenance.manifest import atomic_write_text, write_json


def write_regime(
    root: str | Path, config: Mapping[str, Any], points: Sequence[int], paper: PaperRegime = PAPER
) -> list[Path]:
    """Write the sweep's tables, figure and report under ``root`` (results/<experiment>); returns the
    paths."""
    from d3s.analysis.figures import save

    root = Path(root)
    analysis = config.get("analysis") or {}
    allow_mixed = bool(analysis.get("allow_mixed_settings", False))
    reference = analysis.get("reference", "grpo")
    check = check_points(root, points, allow_mixed)
    table, gaps, claims = sweep_tables(root, points, list(config["methods"]), reference, allow_mixed)
    generations = {
        m: int(method_trainer(config["train"], m).get("num_generations", 8)) for m in config["methods"]
    }
    claims["protocol"] = [pods_protocol(m, reference, generations) for m in claims["method"]]
    tables = root / "tables"
    written = [tables / "regime_gap.csv", tables / "regime_gaps_per_seed.csv", tables / "regime_claims.csv"]
    for frame, path in zip((table, gaps, claims), written, strict=True):
        atomic_write_text(path, frame.to_csv(index=False))
    write_json(tables / "regime.provenance.json", check | {"tables": [p.name for p in written]})
    written += save(gap_figure(table, claims, paper), root / "figures" / "regime_gap")
    report = root / "report.md"
    atomic_write_text(report, report_markdown(root, config, points, table, claims, check, paper))
    return [*written, report]
