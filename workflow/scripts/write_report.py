"""Snakemake script of rule report: results/<experiment>/report.md (see d3s.analysis.report)."""

from pathlib import Path

from d3s.analysis.report import write_report

smk = snakemake  # noqa: F821 - injected by Snakemake
text = write_report(Path(smk.params.results), Path("results/paper"), smk.params.config)
Path(smk.output.report_md).write_text(text, encoding="utf-8")
