"""Snakemake script of rule provenance: compare every manifest before the analysis (provenance.json, .md);
mixed settings stop it here unless analysis.allow_mixed_settings (docs/workflow.md, "Provenance")."""

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
