"""Snakemake script of rule report: tables/claims.csv, then report.md (d3s.analysis.report)."""

from pathlib import Path

from d3s.analysis.report import write_claims, write_report
from d3s.provenance.manifest import atomic_write_text

smk = snakemake  # noqa: F821 - injected by Snakemake
results, paper = Path(smk.params.results), Path("results/paper")
write_claims(results, paper, smk.params.config)
atomic_write_text(smk.output.report_md, write_report(results, paper, smk.params.config))
