"""Snakemake script of rule provenance: compare every run's and evaluation's manifest before the analysis.

Writes provenance.json (the check, machine-readable) and provenance.md (the report's provenance section).
Results whose settings must agree but differ stop the workflow here with d3s.orchestration.settings_check's
message (keys, values, runs, and how to proceed; in the log and on the terminal), unless
analysis.allow_mixed_settings is true.
"""

import json
from pathlib import Path

from d3s.manifest import atomic_write_text
from d3s.orchestration.settings_check import MixedSettingsError, check_results

smk = snakemake  # noqa: F821 - injected by Snakemake
log = Path(smk.log[0])
try:
    provenance = check_results(Path(smk.params.results), allow_mixed=bool(smk.params.allow_mixed))
except MixedSettingsError as error:
    log.write_text(f"{error}\n", encoding="utf-8")
    raise
atomic_write_text(smk.output.json, json.dumps(provenance.to_dict(), indent=2) + "\n")
banner = provenance.banner()
text = "# Provenance\n\n" + (banner + "\n\n" if banner else "") + provenance.markdown() + "\n"
atomic_write_text(smk.output.md, text)
log.write_text(provenance.summary() + "\n" + (banner + "\n" if banner else ""), encoding="utf-8")
