#!/usr/bin/env bash
# One tiny D3S run and its evaluation on held-out problems, without Snakemake (the main job is
# `snakemake --cores 2`, which runs every method and seed).
set -euo pipefail
cd "$(dirname "$0")/.."
method=${1:-d3s}
run=runs/tiny-$method
.venv/bin/d3s train --config examples/tiny.yaml --method "$method" --output-dir "$run"
.venv/bin/d3s eval --model "$run/final" --benchmarks synthetic --synthetic count=200,max_ops=2,max_operand=9 \
  --samples 8 --k 1,4 --max-tokens 32 --temperature 1.0 --top-p 1.0 --template raw --backend transformers \
  --batch-size 32 --out "$run/eval" --overwrite
