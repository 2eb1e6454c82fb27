#!/usr/bin/env bash
# The CUDA checks in one run (under 8 minutes on one H100), from the repository root, results under $OUT:
#
#   OUT=/some/dir PYTHONPATH=$PWD bash benchmarks/gpu_check.sh
#
# 1. the gpu-marked tests (tests/gpu)                    -> $OUT/gpu_tests.log           (at most 130 s)
# 2. repeated fits with DataLoader workers + the preset  -> $OUT/gpu_dataloader.{json,md} (about 80 s)
# 3. the benchmark (ms/step, syncs/step, snapshot cost)  -> $OUT/gpu_bench.{json,md}     (the time left, <= 230 s)
#
# Each part runs under its own time limit and whatever the others did; $OUT/summary.txt has each one's exit status.
# Needs torch with CUDA, lightning, pytest, pytest-timeout and torchmetrics; no network, jsonargparse or deepspeed.
# A dry run of the script itself on a machine without a GPU: BENCH_ARGS=--smoke DL_SECONDS=10 bash benchmarks/gpu_check.sh

set -u
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

note() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PY" -c "import sys, torch, lightning; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('lightning', lightning.__version__)" 2>&1
} > "$OUT/env.txt"
note "environment: $(tr '\n' ' ' < "$OUT/env.txt" | cut -c1-300)"

note "1/3 tests/gpu"
timeout -k 10 130 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rA tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
note "1/3 tests/gpu: exit ${PIPESTATUS[0]} ($(tail -n 1 "$OUT/gpu_tests.log"))"

note "2/3 DataLoader workers, repeated fits"
timeout -k 10 110 "$PY" benchmarks/gpu_dataloader.py --seconds "${DL_SECONDS:-75}" --out "$OUT" 2>&1 | tee "$OUT/gpu_dataloader.log" | grep -E "gpu_dataloader.py|Error|error" | tail -n 40
note "2/3 DataLoader: exit ${PIPESTATUS[0]} ($(cat "$OUT/gpu_dataloader.md" 2>/dev/null))"

LEFT=$(( 450 - ($(date +%s) - START) ))
BUDGET=$(( LEFT - 40 ))
if [ "$BUDGET" -gt 230 ]; then BUDGET=230; fi
if [ "$BUDGET" -lt 60 ]; then BUDGET=60; fi
note "3/3 benchmark, budget ${BUDGET}s"
timeout -k 10 $(( BUDGET + 40 )) "$PY" benchmarks/gpu.py --out "$OUT" --budget-s "$BUDGET" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_bench.log" | grep -E "gpu.py|Error|error|Traceback" | tail -n 80
note "3/3 benchmark: exit ${PIPESTATUS[0]}"
cat "$OUT/gpu_bench.md" 2>/dev/null
note "done in $(( $(date +%s) - START ))s"
