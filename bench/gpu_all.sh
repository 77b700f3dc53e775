#!/usr/bin/env bash
# One device run for issue #5: GPU correctness tests of kernels_pallas, then bench/kernels.py.
# Fits in ~8 minutes (tests <= 150 s, benchmark <= 330 s with a 270 s budget for starting rows);
# writes everything under $OUT (at most 8 files): env.txt, gpu_tests.txt, gpu_tests.xml, bench.log,
# bench.json, bench.md. Run from anywhere: `OUT=/tmp/out bash bench/gpu_all.sh`.
# Usage through the device tool: run(command="bash bench/gpu_all.sh", timeout_s=560).
# BENCH_ARGS adds bench/kernels.py options (a CPU smoke test of this script: BENCH_ARGS="--shapes 256x256
# --ms 1 --formats FP6_E3M2 --reps 1 --max-calls 1" PYTHON=.venv/bin/python bash bench/gpu_all.sh).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/qformats_gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# XLA:GPU preallocates 75% of the memory per process; the test and bench processes run one after the other.

{
  date -u +%FT%TZ
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
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels_pallas/test_qmatmul_gpu.py \
  -k "not lowers" --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.txt"
tail -n 25 "$OUT/gpu_tests.txt"

echo "== benchmark ($(date -u +%T))"
timeout 330 "$PY" bench/kernels.py --budget-s 270 --json "$OUT/bench.json" --md "$OUT/bench.md" ${BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
grep -E "^\[|kernel|FAILED|rc=" "$OUT/bench.log" | tail -n 60
echo "== done ($(date -u +%T))"
