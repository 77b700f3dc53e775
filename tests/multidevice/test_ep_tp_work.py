"""Expert parallelism combined with tensor parallelism (2 expert x 2 tensor CPU devices, ep_tp_work_worker.py in a
fresh interpreter): every expert row is computed once on the whole mesh -- the tensor devices, which hold the same
experts, split their expert group's rows instead of both computing them -- and the MoE block's output equals one
device's exactly (gathered decode rows and sorted + grouped prefill rows; float and W4A16)."""

import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

WORKER = Path(__file__).with_name("ep_tp_work_worker.py")


@pytest.fixture(scope="module")
def work():
    p = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=600)
    return _result(p.stdout, p.stderr, p.returncode, "ep_tp_work_worker (4 devices)")


@pytest.mark.slow  # 12 compiled blocks in a 4-device interpreter: ~90 s on a busy 2-core machine
@pytest.mark.parametrize("mesh", ["ep2", "ep2xtp2"])
@pytest.mark.parametrize("path", ["gathered", "grouped"])
@pytest.mark.parametrize("scheme", ["float", "W4A16:g16"])
def test_each_expert_row_computed_once_and_output_equals_one_device(work, scheme, path, mesh):
    r, one = work[f"{scheme}/{path}/{mesh}"], work[f"{scheme}/{path}/one"]
    # 3 projections x tokens x top_k rows: the same count as one device, not once per tensor (or expert) device
    assert one["rows"] == one["expected"]
    assert r["rows"] == r["expected"], (r["rows"], r["expected"])
    assert r["y"] == one["y"]
