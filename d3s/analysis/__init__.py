"""Read what the workflow logged (io) into pandas and turn it into the claims, tables, figures and report of
the reproduction (docs/workflow/provenance.md). Nothing here trains or evaluates."""
