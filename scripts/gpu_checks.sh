#!/usr/bin/env bash
# The project's GPU checks on a lent device machine (docs/gpu/first-run.md), one call of the device
# tool at a time. Its image has torch 2.11 (CUDA), transformers and accelerate but not the rest of the pinned
# set, which travels as wheels in .whl/ (69 wheels, 40 MB, listed in results/gpu/2026-11-27-h100/README.md; name
# .whl in the tool's carry). The checkout goes on PYTHONPATH; the project's pinned torch is not installed there.
#
#   bash scripts/gpu_checks.sh STEPS SECONDS
#
# STEPS, comma-separated:
#   tests    pytest on CUDA: tests/test_selection.py, tests/test_gpu_smoke_config.py and the truncation table's
#            by-hand case of tests/test_perf_scripts.py (their CUDA-only tests)
#   trainer  pytest tests/test_trainer.py (trainers on the CPU)
#   smoke    snakemake --cores 4 --configfile config/gpu-smoke.yaml; a later call resumes where it was cut off
#            (results/ and .snakemake/ stay on a warm machine). With smoke, tests and trainer run beside the
#            workflow (16 cores: the workflow's jobs take 4, pytest 4 and 2), not before it.
#   bench    perf/update_cost.py --device cuda --quick --skip-cpu-memory --micro-batch 8, the CUDA rows of
#            BENCH_GEOMETRIES (default 1x1024,4x1024; only 1x1024 when under BENCH_BOTH seconds are left);
#            its rows include D3S packed (pack_micro_batches true) beside D3S in TRL's micro-batches
#   update-cost  scripts/device_update_cost.sh with what is left of SECONDS (it wants about 400): GRPO vs D3S
#            unpacked vs packed at micro-batches 32 and 8, 1,024 and 1,536 tokens (3,000 with time to spare),
#            and a torch.profiler trace of one D3S micro-batch; its files under $OUT/update-cost
# SECONDS: the wall time this call may use. Every step is cut (timeout) so that the call ends inside it, with
# RESERVE seconds (default 20) left to pack; with bench, smoke leaves BENCH_NEED seconds (default 100) for it.
# Writes under $OUT (default ./gpu-checks-out): log-<steps>.txt (everything printed) and results-<steps>.tgz
# (the small files of results/gpu-smoke, Snakemake's logs, the pytest reports, the benchmark's tables), packed
# again after every step; $WORK (/tmp/gpu-checks) keeps them between calls.
set -u
set -o pipefail
STEPS=${1:?usage: gpu_checks.sh STEPS SECONDS}
BUDGET=${2:?usage: gpu_checks.sh STEPS SECONDS}
RESERVE=${RESERVE:-20}
BENCH_NEED=${BENCH_NEED:-100}
BENCH_BOTH=${BENCH_BOTH:-130}
OUT=${OUT:-$PWD/gpu-checks-out}
TAG=${STEPS//,/-}
WORK=${WORK:-/tmp/gpu-checks} # kept between calls while the machine stays warm, as $SITE and results/ are
mkdir -p "$OUT" "$WORK"
START=$(date +%s)

# shellcheck source=scripts/device_env.sh
source "$(dirname "$0")/device_env.sh" # SITE, the environment, install_wheels

stamp() { echo "=== $(date -u +%H:%M:%S) +$(($(date +%s) - START))s: $*"; }
left() { echo $((BUDGET - RESERVE - ($(date +%s) - START))); }
# cap SECONDS [KEEP]: at most SECONDS, and no more than what is left of the budget less KEEP
cap() {
    local l=$(($(left) - ${2:-0}))
    if ((l < $1)); then echo "$l"; else echo "$1"; fi
}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
pack() {
    cp -r .snakemake/log/. "$WORK/snakemake-log/" 2>/dev/null
    # small files only: no weights, optimizer states or checkpoints
    find results/gpu-smoke "$WORK" -type f -size -4M \
        \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' -o -name '*.txt' \
        -o -name '*.csv' -o -name '*.yaml' -o -name '*.xml' -o -name '*.ipynb' -o -name '*.png' \) \
        -not -path '*/checkpoint-*/*' 2>/dev/null | tar -czf "$OUT/results-$TAG.tgz" -T - 2>/dev/null
}
# PYTEST_EXTRA: more pytest arguments (e.g. -k cuda, to try the script where there is no GPU)
# shellcheck disable=SC2206
PYTEST=(python3 -m pytest -p no:benchmark -p no:cacheprovider -o addopts= -n 0 -q -ra --durations=20 ${PYTEST_EXTRA:-})
# pytest_run NAME LIMIT FILES...: the report in $WORK/pytest-NAME.txt and .xml
pytest_run() {
    local name=$1 limit=$2
    shift 2
    if ((limit < 20)); then
        echo "skipped: ${limit}s left" | tee "$WORK/pytest-$name.txt" >"$WORK/pytest-$name.time"
        return 124
    fi
    echo "start $(date +%s)" >"$WORK/pytest-$name.time"
    timeout -k 10 "$limit" "${PYTEST[@]}" --junitxml="$WORK/pytest-$name.xml" "$@" >"$WORK/pytest-$name.txt" 2>&1
    local code=$?
    echo "end $(date +%s) exit $code" >>"$WORK/pytest-$name.time"
    return $code
}
CUDA_TESTS=(tests/test_selection.py tests/test_gpu_smoke_config.py
    "tests/test_perf_scripts.py::test_tail_after_last_selected_by_hand")
show_pytest() {
    stamp "pytest $1 exit $2 ($(tr '\n' ' ' <"$WORK/pytest-$1.time"))"
    grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" "$WORK/pytest-$1.txt" | tail -25
}

main() {
    stamp "start: steps $STEPS, budget ${BUDGET}s"
    install_wheels || return 1
    if [[ ! -f $WORK/env.txt ]]; then
        {
            nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
            echo "cores: $(nproc)"
            python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
            python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|trl|datasets|snakemake|papermill|ipykernel|pandas|numpy|pyarrow|math-verify|xxhash|fsspec|huggingface-hub|scipy|matplotlib) "
            python3 -c "from jupyter_client.kernelspec import KernelSpecManager as K; print(K().find_kernel_specs())"
        } >"$WORK/env.txt" 2>&1
        cat "$WORK/env.txt"
        stamp "environment read"
    fi

    local tests_pid="" trainer_pid="" code
    if has tests; then
        if has smoke; then
            stamp "pytest test_selection + test_gpu_smoke_config, beside the workflow"
            OMP_NUM_THREADS=4 pytest_run selection "$(cap 240)" "${CUDA_TESTS[@]}" &
            tests_pid=$!
        else
            pytest_run selection "$(cap 240)" "${CUDA_TESTS[@]}"
            show_pytest selection $?
        fi
    fi
    if has trainer; then
        if has smoke; then
            stamp "pytest test_trainer, beside the workflow"
            OMP_NUM_THREADS=2 pytest_run trainer "$(cap 300)" tests/test_trainer.py &
            trainer_pid=$!
        else
            pytest_run trainer "$(cap 300)" tests/test_trainer.py
            show_pytest trainer $?
        fi
    fi

    if has smoke; then
        if [[ -f results/gpu-smoke/report.md ]]; then
            stamp "smoke: results/gpu-smoke/report.md exists, nothing to run"
        else
            local t
            t=$(cap 600 "$(has bench && echo "$BENCH_NEED" || echo 0)")
            ((t < 20)) && t=20 # timeout 0 would mean no limit
            stamp "snakemake gpu-smoke (limit ${t}s)"
            echo "start $(date +%s)" >>"$WORK/smoke.time"
            # TERM: Snakemake stops its jobs and marks their outputs incomplete; a later call reruns them
            timeout -k 30 -s TERM "$t" python3 -m snakemake --cores 4 --configfile config/gpu-smoke.yaml \
                --nolock --rerun-incomplete --keep-going
            code=$?
            echo "end $(date +%s) exit $code" >>"$WORK/smoke.time"
            stamp "snakemake exit $code"
        fi
        pack
    fi
    if [[ -n $tests_pid ]]; then
        wait "$tests_pid"
        show_pytest selection $?
    fi
    if [[ -n $trainer_pid ]]; then
        wait "$trainer_pid"
        show_pytest trainer $?
    fi
    pack

    if has bench; then
        local l geometries
        l=$(left)
        geometries=${BENCH_GEOMETRIES:-1x1024,4x1024}
        ((l < BENCH_BOTH)) && geometries=${geometries%%,*}
        if ((l < 50)); then
            stamp "bench: skipped, ${l}s left"
        else
            stamp "perf/update_cost.py --device cuda --geometries $geometries (limit ${l}s)"
            # --quick and --skip-cpu-memory: the CPU part (tiny model, truncation table) small
            timeout -k 10 "$l" python3 perf/update_cost.py --device cuda --quick --skip-cpu-memory \
                --geometries "$geometries" --micro-batch 8 --repeats 3 --out "$WORK/perf"
            stamp "bench exit $?"
        fi
        pack
    fi
    if has update-cost; then
        stamp "scripts/device_update_cost.sh ($(left)s)"
        OUT=$OUT RESERVE=5 bash "$(dirname "$0")/device_update_cost.sh" "$(left)"
        stamp "update-cost exit $?"
    fi
    ls -la "$OUT"
    stamp "done"
}

main 2>&1 | tee -a "$OUT/log-$TAG.txt"
