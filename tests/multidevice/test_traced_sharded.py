"""Matmul weights of third-party-style layers (quantized through qformats.nn.traced) sharded over 8 CPU devices:
the jitted forward on the mesh equals the one-device forward (a fresh interpreter: tests/multidevice/traced_worker.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env

pytestmark = pytest.mark.slow  # a fresh 8-device interpreter that quantizes four models

WORKER = Path(__file__).with_name("traced_worker.py")
CASES = ("nnx W4A16", "nnx FP8_DYNAMIC", "linen NVFP4A16", "linen FP8_E4M3")


@pytest.fixture(scope="module")
def result():
    env = _env("--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false")
    p = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", CASES)
def test_sharded_packed_weights_give_the_one_device_forward(result, case):
    r = result[case]
    assert result["devices"] == 8
    assert r["matmul_weights"] >= 4  # q / o / up and the head (NNX), every einsum of 2 blocks (linen)
    # every packed codes / scale leaf of N rows holds N / 8 of them per device (stacked axes whole)
    assert r["shards"] and all(s[:-2] == h[:-2] and s[-2] * 8 == h[-2] and s[-1] == h[-1] for h, s in r["shards"])
    assert r["out_devices"] == 8
    # the same weights and inputs: only the order of accumulation may differ between the partitioned and the
    # one-device programs (f32 sums over K <= 256 elements)
    assert r["rel"] < 1e-5, r
