"""Snakemake script of rule study_report: the study's claims, figure and report (d3s.analysis.studies)."""

from d3s.analysis.studies import write_study

smk = snakemake  # noqa: F821 - injected by Snakemake
for name, path in write_study(smk.params.results, smk.params.config).items():
    print(f"{name}: {path}")
