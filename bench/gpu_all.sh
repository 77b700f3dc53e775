#!/usr/bin/env bash
# One device run for issue #5: GPU correctness tests of kernels_pallas, then bench/kernels.py, then a short
# tiling sweep. Fits in ~8 minutes (tests <= 180 s; benchmark <= 250 s, rows started within 190 s;
# sweep <= 60 s). Writes under $OUT (at most 8 files): env.txt, gpu_tests.txt, gpu_tests.xml, bench.log,
# bench.json, bench.md, tune.log, tune.json. Run from anywhere: `OUT=/tmp/out bash bench/gpu_all.sh`.
# Through the device tool: run(command="bash bench/gpu_all.sh", timeout_s=540).
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
# XLA:GPU preallocates 75% of the memory per process; the three processes run one after the other.

{
  date -u +%FT%TZ
  git log --oneline -1 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
  "$PY" - <<'PYEOF'
import jax, jaxlib, sys
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), jax.devices())
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton import:", e)
PYEOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== GPU tests ($(date -u +%T))"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/kernels_pallas/test_qmatmul_gpu.py \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.txt"
tail -n 25 "$OUT/gpu_tests.txt"

echo "== benchmark ($(date -u +%T))"
timeout 250 "$PY" bench/kernels.py --budget-s 190 --json "$OUT/bench.json" --md "$OUT/bench.md" ${BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
grep -E "^\[|kernel|FAILED|rc=|prepared" "$OUT/bench.log" | tail -n 45

echo "== tiling sweep, 4096x4096, M = 1 and 16 ($(date -u +%T))"
timeout 60 "$PY" bench/kernels.py --shapes 4096x4096 --ms 1,16 --formats FP6_E3M2,NVFP4A16 --no-xla --tune --probe \
  --layouts 128x64,256x64,128x128 --budget-s 45 --reps 5 --json "$OUT/tune.json" ${TUNE_ARGS:-} \
  > "$OUT/tune.log" 2>&1
echo "tune rc=$?" >> "$OUT/tune.log"
grep -E "^\[|kernel|FAILED|rc=" "$OUT/tune.log" | tail -n 8
echo "== done ($(date -u +%T))"
