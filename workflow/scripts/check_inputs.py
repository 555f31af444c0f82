"""The workflow's input check (common.smk runs it in a process of its own, keeping TRL out of Snakemake's):
`python check_inputs.py OUT.json LOG < request.json`; a thin caller of
d3s.orchestration.input_checks.run_input_checks."""

import json
import sys

from d3s.orchestration.input_checks import run_input_checks

if __name__ == "__main__":
    out, log = sys.argv[1:]
    sys.exit(run_input_checks(json.load(sys.stdin), out, log))
