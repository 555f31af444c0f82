# Stage 0: what the pending jobs need beyond the config's text (trainer settings, models, data), once per
# `snakemake` run before any job starts; onstart, not a rule (docs/workflow/checks.md).


onstart:
    check_inputs_of_pending_jobs()
