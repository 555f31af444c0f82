"""What a workflow process need not import. jsonschema, once imported, imports rfc3987_syntax when it is
installed (jupyter-events' ``jsonschema[format-nongpl]`` brings it) to check the "iri" formats, and that
import builds a Lark grammar: 3.2-3.8 s of every `snakemake` start (the config's validation) and of every
papermill job (nbformat's validation) on the 2-core CPU. Neither the workflow's schema (config/schema.yaml)
nor nbformat's uses an "iri" format (tests/test_startup.py checks both), so no verdict depends on it."""

from __future__ import annotations

import sys

IRI_FORMAT_MODULE = "rfc3987_syntax"


def skip_iri_format_checks() -> None:
    """Hide rfc3987_syntax before jsonschema is imported (``sys.modules[name] = None`` is Python's own import
    block: jsonschema's ``import`` raises ImportError, which it expects, and registers no "iri" check); a
    process that imported jsonschema already keeps what it has."""
    if "jsonschema" not in sys.modules:
        sys.modules.setdefault(IRI_FORMAT_MODULE, None)
