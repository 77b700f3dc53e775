#!/usr/bin/env bash
# One device run, most valuable first: GPU correctness tests of the Mosaic GPU kernel (and dispatch, layer
# cache), bench/kernels.py with both backends side by side against dense bf16 jnp.dot (cuBLAS) on Llama-7B
# and 8192x8192 shapes, M in {1, 4, 16, 64, 256}, the Pallas Triton kernel's GPU tests, a short tiling sweep.
# Fits in ~8 minutes (Mosaic tests <= 150 s, benchmark <= 200 s with rows started within 150 s, Triton tests
# <= 60 s, sweep <= 40 s). Writes under $OUT (at most 10 files): env.txt, mgpu_tests.txt, mgpu_tests.xml,
# triton_tests.txt, triton_tests.xml, bench.log, bench.json, bench.md, tune.log, tune.json.
# The Mosaic tests turn DeprecationWarning into errors (their own mark), the Triton ones cannot (the
# backend itself is deprecated in jax 0.11). Run from anywhere: `OUT=/tmp/out bash bench/gpu_all.sh`;
# through the device tool: run(command="bash bench/gpu_all.sh", timeout_s=540).
# BENCH_ARGS / TUNE_ARGS add bench/kernels.py options (a CPU smoke test of this script:
#   BENCH_ARGS="--shapes 256x256 --ms 1 --formats FP6_E3M2 --reps 1 --max-calls 1" TUNE_ARGS="$BENCH_ARGS"
#   PYTHON=.venv/bin/python bash bench/gpu_all.sh).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/qformats_gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# XLA:GPU preallocates 75% of the memory per process; the processes run one after the other.

{
  date -u +%FT%TZ
  git log --oneline -1 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
  "$PY" - <<'PYEOF'
import jax, jaxlib, sys
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), jax.devices())
PYEOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== Mosaic GPU tests ($(date -u +%T))"
timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider \
  tests/kernels_pallas/test_qmatmul_gpu.py -k "mosaic or dispatch or layer" \
  --junitxml="$OUT/mgpu_tests.xml" > "$OUT/mgpu_tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/mgpu_tests.txt"
tail -n 25 "$OUT/mgpu_tests.txt"

echo "== benchmark: mosaic, triton, dense ($(date -u +%T))"
timeout 200 "$PY" bench/kernels.py --budget-s 150 --reps 5 --formats FP8_E4M3,FP6_E3M2,MXFP4A16,NVFP4A16,W4A16 --json "$OUT/bench.json" --md "$OUT/bench.md" \
  ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
grep -E "^\[|mosaic|FAILED|rc=|prepared" "$OUT/bench.log" | tail -n 45

echo "== Pallas Triton tests ($(date -u +%T))"
timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/kernels_pallas/test_qmatmul_gpu.py \
  -k "not mosaic and not dispatch and not layer" --junitxml="$OUT/triton_tests.xml" > "$OUT/triton_tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/triton_tests.txt"
tail -n 12 "$OUT/triton_tests.txt"

echo "== tiling sweep, 4096x4096, M = 1 and 16 ($(date -u +%T))"
timeout 40 "$PY" bench/kernels.py --shapes 4096x4096 --ms 1,16 --formats FP6_E3M2,MXFP4A16 --tune \
  --budget-s 28 --reps 3 --json "$OUT/tune.json" ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
echo "tune rc=$?" >> "$OUT/tune.log"
grep -E "^\[|mosaic|FAILED|rc=" "$OUT/tune.log" | tail -n 8
echo "== done ($(date -u +%T))"
