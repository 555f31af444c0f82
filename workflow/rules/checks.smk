# Stage 0: what the pending jobs need beyond the config's text, checked once per `snakemake` run before any
# job starts. onstart runs in the main process only, never in a dry run or a cluster job; it runs
# check_inputs_of_pending_jobs (common.smk): every method's trainer settings as its training job resolves
# them (TRL), the base model, the training data and every evaluation benchmark, as far as the pending jobs
# need them. The parse-time checks (common.smk) read no data and import no TRL, so `snakemake -n` stays fast
# and offline. A missing input stops the run with one line per problem naming the fix, before a GPU is asked
# for. Not a rule on purpose: a rule that jobs depend on re-runs them when it re-runs, and as an ancient()
# input it hides their own re-run reasons (changed params) from Snakemake 9.27 whenever it re-runs itself.


onstart:
    check_inputs_of_pending_jobs()
