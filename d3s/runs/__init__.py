"""`d3s train`: one RL run from a config, with its checkpoints, logs and resume rules."""
