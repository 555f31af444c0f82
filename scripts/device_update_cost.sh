#!/usr/bin/env bash
# Update cost on one lent GPU (H100 / H200): GRPO vs D3S in TRL's micro-batches vs D3S packed
# (perf/update_cost.py's variants), on a random model with Qwen2.5-Math-1.5B's architecture, at the paper's
# micro-batch (32 rows) and at 8, and a torch.profiler trace of one D3S micro-batch (unpacked and packed) that
# says where a small micro-batch's fixed cost goes. One device call; see scripts/gpu_checks.sh for the set-up
# (the wheels in .whl/, carried) and ../shared/docs/gpu-device-notes.md.
#
#   bash scripts/device_update_cost.sh [SECONDS]      # default 480: the whole call, packing included
#
# Runs, each its own perf/update_cost.py process (cut by `timeout`, so a late one cannot lose the earlier ones),
# each writing update_cost.{json,md} under $OUT/update-cost/<run>/:
#   t1024     4 x 32 rollouts, 1,024 tokens, micro-batches 32 and 8; --profile at micro-batch 8 (the traces
#             update_cost_profile_*.json.gz and update_cost_profile.{json,md})
#   t1536     4 x 32, 1,536 tokens, micro-batches 32 and 8
#   t3000     4 x 32, 3,000 tokens, micro-batches 32 and 8: only with LONG_NEED seconds (default 200) left and
#             LONG_MIB MiB (default 100,000) of GPU memory; an out-of-memory micro-batch is a note, not a failure
# 4 prompts: at micro-batch 32 an optimizer step is 4 micro-batches, D3S's 32 kept rows 4 x 8 unpacked, 1 x 32
# packed (1 prompt would be one micro-batch either way).
# About 6 minutes on an H100 without t3000 (model builds, 3 timed updates per variant after a warm-up).
# Environment: REPEATS (default 3) timed updates per variant; DRY=1 runs the same steps on the CPU with a tiny
# geometry (2-3 minutes: a check by hand; tests/test_perf_scripts.py runs this script with a stand-in Python
# and parses every run's arguments); PY (default python3); RESERVE (default 15) seconds kept to pack.
set -u
set -o pipefail
BUDGET=${1:-480}
RESERVE=${RESERVE:-15}
LONG_NEED=${LONG_NEED:-200}
LONG_MIB=${LONG_MIB:-100000}
read -r -a PY <<<"${PY:-python3}" # a command, words split (e.g. "env PYTHONPATH=. .venv/bin/python")
DRY=${DRY:-}
OUT=${OUT:-$PWD/device-update-cost-out}
DEST=$OUT/update-cost
mkdir -p "$DEST"
START=$(date +%s)

stamp() { echo "=== $(date -u +%H:%M:%S) +$(($(date +%s) - START))s: $*"; }
left() { echo $((BUDGET - RESERVE - ($(date +%s) - START))); }

if [[ -n $DRY ]]; then
    # the CPU: no wheels to install, the tiny model only (its 2 prompts x 32 rollouts, micro-batches 4 and 8)
    COMMON=(--device cpu --quick --skip-cpu-memory --sft-steps 2 --repeats 1)
    MB_ARGS=(--tiny-micro-batch 8,4)
    GEOMETRY=(none none none)
else
    # shellcheck source=scripts/device_env.sh
    source "$(dirname "$0")/device_env.sh" # SITE, the environment, install_wheels
    COMMON=(--device cuda --no-tiny --skip-cpu-memory --repeats "${REPEATS:-3}")
    MB_ARGS=(--micro-batch 32,8)
    GEOMETRY=(4x1024 4x1536 4x3000)
fi

# run NAME LIMIT ARGS...: perf/update_cost.py into $DEST/NAME, cut after LIMIT seconds
run() {
    local name=$1 limit=$2
    shift 2
    if ((limit < 30)); then
        stamp "$name: skipped, ${limit}s left"
        return 124
    fi
    stamp "$name: perf/update_cost.py $* (limit ${limit}s)"
    mkdir -p "$DEST/$name"
    timeout -k 10 "$limit" "${PY[@]}" perf/update_cost.py "${COMMON[@]}" "$@" --out "$DEST/$name"
    local code=$?
    stamp "$name: exit $code"
    return $code
}

main() {
    stamp "start: budget ${BUDGET}s${DRY:+ (dry run on the CPU)}"
    if [[ -z $DRY ]]; then
        install_wheels || return 1
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
    run t1024 "$(left)" "${MB_ARGS[@]}" --geometries "${GEOMETRY[0]}" --profile
    run t1536 "$(left)" "${MB_ARGS[@]}" --geometries "${GEOMETRY[1]}"
    local mib
    mib=$([[ -n $DRY ]] && echo "$LONG_MIB" || nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    if (($(left) < LONG_NEED)); then
        stamp "t3000: skipped, $(left)s left (needs ${LONG_NEED}s)"
    elif ((mib < LONG_MIB)); then
        stamp "t3000: skipped, ${mib} MiB of GPU memory (needs ${LONG_MIB})"
    else
        run t3000 "$(left)" "${MB_ARGS[@]}" --geometries "${GEOMETRY[2]}"
    fi
    # one table of every run's update rows, for a first look (the JSON files hold everything)
    for md in "$DEST"/*/update_cost.md "$DEST"/t1024/update_cost_profile.md; do
        [[ -f $md ]] && grep -E '^\|' "$md"
    done >"$DEST/summary.md"
    ls -la "$DEST" "$DEST"/*
    stamp "done"
}

main 2>&1 | tee -a "$OUT/log-update-cost.txt"
