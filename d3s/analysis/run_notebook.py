"""`python -m d3s.analysis.run_notebook ARGS`: papermill's command line, as the workflow's notebook jobs run
it (workflow/rules/analyse.smk), without the "iri" format checker's import (d3s.startup: 3-4 s a job)."""

from d3s.startup import skip_iri_format_checks

if __name__ == "__main__":
    skip_iri_format_checks()
    from papermill.cli import papermill

    papermill()
