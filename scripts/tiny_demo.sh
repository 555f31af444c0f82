#!/usr/bin/env bash
# The main job for now: train D3S on the tiny offline model, then evaluate the result on held-out problems.
set -euo pipefail
cd "$(dirname "$0")/.."
method=${1:-d3s}
run=runs/tiny-$method
.venv/bin/d3s train --config examples/tiny.yaml --method "$method" --output-dir "$run"
.venv/bin/d3s eval --model "$run/final" --benchmarks synthetic --synthetic count=200,max_ops=1,max_operand=9 \
  --samples 8 --k 1,4 --max-tokens 24 --temperature 1.0 --top-p 1.0 --template raw --backend transformers \
  --batch-size 32 --out "$run/eval" --overwrite
