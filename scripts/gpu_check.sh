#!/usr/bin/env bash
# Check the CUDA code paths and take the GPU figures in one call, in under 9 minutes:
#
#     scripts/gpu_check.sh OUTDIR
#
# 1. the tests marked `cuda` (tests/cuda/: fp16 + GradScaler and its exact resume, bf16, channels_last, pinned memory,
#    a one-process NCCL group, two DDP processes on one GPU over gloo, --compile, a real out-of-memory error);
# 2. scripts/benchmark.py at Carvana scale 0.5 (959x640 network input from 1918x1280 files), channels_last, bf16 and
#    fp16, batch 8 and 16, with and without --compile, with and without the pixel cache; the loader figures (items/s
#    per worker with augmentation, uncached and from the pixel cache; the first dataset construction with 1 and 2
#    scan processes);
# 3. the benchmark's epoch section: one whole train.py epoch of milesial's flags (-e 1 -b 4 -s 0.5 --amp: fp16),
#    its wall time split (start-up, steps, validation, checkpoints, curves) and its fraction of the compute bound;
# 4. the benchmark's compile section: train.py eager against --compile (bf16, batch 16, two epochs each), the compile
#    time cold (empty cache) and warm (a run folder holding the compiled run's compile-cache/), the second
#    epoch's steady-state images/s and its time.
# Every step runs under `timeout`; a step cut short keeps what it measured (the benchmark rewrites its JSON after each
# section). Results: OUTDIR/gpu_check.json and OUTDIR/gpu_check.md, plus each step's log and JSON.
#
# GPU_CHECK_DRY_RUN=1 runs the same steps on the CPU at a tiny size (the CUDA tests skip): a check of the script.
# PYTHON overrides the interpreter (default: .venv/bin/python, else python).
set -uo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
WORK=$(mktemp -d "${TMPDIR:-/tmp}/unet-gpu-check-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
    # Same sections and flags, CPU-sized: fp16 needs CUDA, so both precision lists become fp32.
    BENCH=(--device cpu --quick --size 64x48 --full-size 128x96 --n-masks 24 --startup-pairs 200)
    BOTH=fp32 BF16=fp32 FP16=fp32
    LIMITS=(60 120 60 200 200 90 300)
else
    BENCH=(--device cuda --size 959x640 --scale 0.5 --channels-last --steps 10 --warmup 3 --n-masks 500 --items 10
           --loader-workers 4,8 --loader-batches 10)
    BOTH=bf16,fp16 BF16=bf16 FP16=fp16
    # tests, batch 16 (both precisions, cache off/on, data, memory), batch 8, batch 16 compiled, batch 8 compiled, epoch,
    # compile section (cold and warm cache)
    LIMITS=(80 150 50 60 50 55 90)
fi

status=0
step() {
    local limit=$1 name=$2
    shift 2
    echo "[gpu_check] $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local code=$?
    if [ "$code" -ne 0 ]; then
        echo "[gpu_check] $name: exit $code (124: time limit); see $OUT/$name.log"
        status=1
    fi
}

step "${LIMITS[0]}" tests "$PY" -m pytest -m cuda tests/cuda -q -rs -p no:cacheprovider --junitxml "$OUT/cuda-tests.xml"
step "${LIMITS[1]}" b16 "$PY" scripts/benchmark.py "${BENCH[@]}" --batch-size 16 --precisions "$BOTH" \
    --pixel-cache both --sections compute,e2e,data,memory --work-dir "$WORK" --json "$OUT/b16.json"
step "${LIMITS[2]}" b8 "$PY" scripts/benchmark.py "${BENCH[@]}" --batch-size 8 --precisions "$BOTH" \
    --pixel-cache on --sections compute,e2e --work-dir "$WORK" --json "$OUT/b8.json"
step "${LIMITS[3]}" b16-compile "$PY" scripts/benchmark.py "${BENCH[@]}" --batch-size 16 --precisions "$BF16" \
    --compile --pixel-cache on --sections compute,e2e --work-dir "$WORK" --json "$OUT/b16-compile.json"
step "${LIMITS[4]}" b8-compile "$PY" scripts/benchmark.py "${BENCH[@]}" --batch-size 8 --precisions "$FP16" \
    --compile --pixel-cache on --sections compute,e2e --work-dir "$WORK" --json "$OUT/b8-compile.json"
step "${LIMITS[5]}" epoch "$PY" scripts/benchmark.py "${BENCH[@]}" --sections epoch --work-dir "$WORK" \
    --json "$OUT/epoch.json"

step "${LIMITS[6]}" compile "$PY" scripts/benchmark.py "${BENCH[@]}" --batch-size 16 --precisions "$BF16" \
    --steps 4 --warmup 2 --sections compile --work-dir "$WORK" --json "$OUT/compile.json"

"$PY" -m scripts.bench.gpu_summary "$OUT" tests b16 b8 b16-compile b8-compile epoch compile || status=1
exit $status
