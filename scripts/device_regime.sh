#!/usr/bin/env bash
# The regime sweep (config/regime.yaml, docs/workflow/regime-sweep.md) on a lent device machine's 16 CPU
# cores, where the 2-core testbed would take about an hour. CPU only: CUDA is hidden, so every job runs as on
# the testbed, one torch thread each. The image's torch (2.11) and Python (3.12) differ from the testbed's
# pinned set; the rest of the pinned set travels as wheels in .whl/ (as for scripts/gpu_checks.sh; name .whl in
# the device tool's carry). A later call on a warm machine resumes the sweep (Snakemake skips finished jobs).
#
#   bash scripts/device_regime.sh SECONDS [CONFIG]      # CONFIG: default config/regime.yaml
#
# Writes under $OUT: log.txt, each point's snakemake log (p<P>.log) and regime.tgz (the sweep's small files: tables, figures, reports, manifests,
# summaries and logs; no weights).
set -u
set -o pipefail
BUDGET=${1:?usage: device_regime.sh SECONDS [CONFIG]}
CONFIG=${2:-config/regime.yaml}
OUT=${OUT:-$PWD/regime-out}
CORES=${CORES:-$(nproc)}
mkdir -p "$OUT"
START=$(date +%s)
export CUDA_VISIBLE_DEVICES="" # CPU only, as on the testbed
# shellcheck source=scripts/device_env.sh
source "$(dirname "$0")/device_env.sh" # SITE, the environment, install_wheels
stamp() { echo "=== $(date -u +%H:%M:%S) +$(($(date +%s) - START))s: $*"; }

pack() {
    local experiment
    experiment=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['experiment'])" "$CONFIG")
    find "results/$experiment" -type f -size -4M \
        \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' -o -name '*.txt' \
        -o -name '*.csv' -o -name '*.yaml' -o -name '*.png' -o -name '*.pdf' \) \
        -not -path '*/checkpoint-*/*' -not -path '*/runs/*/final/*' -not -path '*/base_model/*' 2>/dev/null |
        tar -czf "$OUT/regime.tgz" -T - 2>/dev/null
}

main() {
    stamp "start: budget ${BUDGET}s, $CORES cores, $CONFIG"
    install_wheels || return 1
    python3 -c "import sys, torch, trl, transformers; print(sys.version.split()[0], torch.__version__, trl.__version__, transformers.__version__)"
    local limit=$((BUDGET - 40 - ($(date +%s) - START)))
    # The points side by side, not one after another as `d3s regime` runs them: its --dry-run prints each
    # step's snakemake command; the base model first, then every point on a share of the cores weighted by
    # P + 16 (a run's fixed cost is about 16 prompts' worth), then `d3s regime` itself, which finds the points
    # done and writes the sweep's analysis.
    python3 -m d3s.cli regime --config "$CONFIG" --cores 1 --dry-run | grep -v '^#' >"$OUT/commands.txt" || return 2
    mapfile -t commands <"$OUT/commands.txt"
    stamp "base model: ${commands[0]}"
    eval "timeout -k 20 -s TERM $limit ${commands[0]/--cores 1/--cores $CORES}" >"$OUT/base.log" 2>&1 || {
        tail -20 "$OUT/base.log"
        return 1
    }
    local weights=0 pids=() command p
    for command in "${commands[@]:1}"; do
        p=${command#*experiment=*/p}
        weights=$((weights + ${p%% *} + 16))
    done
    limit=$((BUDGET - 40 - ($(date +%s) - START)))
    for command in "${commands[@]:1}"; do
        p=${command#*experiment=*/p}
        p=${p%% *}
        local cores=$(((CORES * (p + 16) + weights / 2) / weights))
        ((cores < 1)) && cores=1
        stamp "P = $p on $cores cores (limit ${limit}s)"
        eval "timeout -k 20 -s TERM $limit ${command/--cores 1/--cores $cores --nolock}" >"$OUT/p$p.log" 2>&1 &
        pids+=($!)
    done
    local failed=0 pid
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    stamp "points done (failed: $failed)"
    for command in "${commands[@]:1}"; do
        p=${command#*experiment=*/p}
        grep -E "steps \(|Error|error" "$OUT/p${p%% *}.log" | tail -3
    done
    limit=$((BUDGET - 25 - ($(date +%s) - START)))
    stamp "d3s regime (limit ${limit}s)"
    timeout -k 10 -s TERM "$limit" python3 -m d3s.cli regime --config "$CONFIG" --cores "$CORES"
    local code=$?
    stamp "d3s regime exit $code"
    pack
    stamp "packed $(du -h "$OUT/regime.tgz" | cut -f1)"
    return $code
}

main 2>&1 | tee "$OUT/log.txt"
