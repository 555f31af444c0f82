#!/usr/bin/env bash
# The regime sweep (config/regime.yaml, docs/workflow.md "The regime sweep") on a lent device machine's 16 CPU
# cores, where the 2-core testbed would take about an hour. CPU only: CUDA is hidden, so every job runs as on
# the testbed, one torch thread each. The image's torch (2.11) and Python (3.12) differ from the testbed's
# pinned set; the rest of the pinned set travels as wheels in .whl/ (as for scripts/gpu_checks.sh; name .whl in
# the device tool's carry). A later call on a warm machine resumes the sweep (Snakemake skips finished jobs).
#
#   bash scripts/device_regime.sh SECONDS [CONFIG]      # CONFIG: default config/regime.yaml
#
# Writes under $OUT: log.txt and regime.tgz (the sweep's small files: tables, figures, reports, manifests,
# summaries and logs; no weights).
set -u
set -o pipefail
BUDGET=${1:?usage: device_regime.sh SECONDS [CONFIG]}
CONFIG=${2:-config/regime.yaml}
OUT=${OUT:-$PWD/regime-out}
SITE=${SITE:-/tmp/site}
CORES=${CORES:-$(nproc)}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false GIT_PYTHON_REFRESH=quiet CUDA_VISIBLE_DEVICES=""
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH JUPYTER_PATH=$SITE/share/jupyter
stamp() { echo "=== $(date -u +%H:%M:%S) +$(($(date +%s) - START))s: $*"; }

pack() {
    find results/regime -type f -size -4M \
        \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' -o -name '*.txt' \
        -o -name '*.csv' -o -name '*.yaml' -o -name '*.png' -o -name '*.pdf' \) \
        -not -path '*/checkpoint-*/*' -not -path '*/final/*' -not -path '*/base_model/*' 2>/dev/null |
        tar -czf "$OUT/regime.tgz" -T - 2>/dev/null
}

main() {
    stamp "start: budget ${BUDGET}s, $CORES cores, $CONFIG"
    if [[ ! -f $SITE/.installed ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl && touch "$SITE/.installed" || {
            echo "wheel install failed"
            return 1
        }
        stamp "wheels installed"
    fi
    python3 -c "import sys, torch, trl, transformers; print(sys.version.split()[0], torch.__version__, trl.__version__, transformers.__version__)"
    local limit=$((BUDGET - 30 - ($(date +%s) - START)))
    stamp "d3s regime (limit ${limit}s)"
    # TERM: Snakemake stops its jobs and marks their outputs incomplete; the next call reruns them
    timeout -k 20 -s TERM "$limit" python3 -m d3s.cli \
        regime --config "$CONFIG" --cores "$CORES"
    local code=$?
    stamp "d3s regime exit $code"
    pack
    stamp "packed $(du -h "$OUT/regime.tgz" | cut -f1)"
    return $code
}

main 2>&1 | tee "$OUT/log.txt"
