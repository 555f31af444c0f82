"""The workflow's own glue: launching jobs on GPUs (accelerate, GPU slots, the vLLM server) and the check
that the results sharing a table were made with the same settings."""
