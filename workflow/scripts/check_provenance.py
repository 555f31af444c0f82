"""Snakemake script of rule provenance: compare every run's and evaluation's manifest before the analysis.

Writes provenance.json (the check, which the notebooks, loaders and report read) and provenance.md (the
report's provenance section). Results whose settings must agree but differ stop the workflow here with
d3s.provenance.settings_check's message (keys, values, runs, and how to proceed; in the log and on the
terminal), unless analysis.allow_mixed_settings is true.
"""

from pathlib import Path

from d3s.provenance.settings_check import MixedSettingsError, write_provenance

smk = snakemake  # noqa: F821 - injected by Snakemake
log = Path(smk.log[0])
try:
    provenance = write_provenance(smk.params.results, allow_mixed=bool(smk.params.allow_mixed))
except MixedSettingsError as error:
    log.write_text(f"{error}\n", encoding="utf-8")
    raise
log.write_text(provenance.summary() + "\n" + provenance.banner() + "\n", encoding="utf-8")
