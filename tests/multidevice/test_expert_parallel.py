"""Expert parallelism on 8 CPU devices (a fresh interpreter): every expert stack split by experts (one of 8 per
device, packed stacks leaf by leaf), greedy tokens equal one device's, dense and W4A16."""

import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

pytestmark = pytest.mark.slow  # a fresh multi-device interpreter


@pytest.fixture(scope="module")
def ep8(tmp_path_factory):
    work = tmp_path_factory.mktemp("ep8")
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("moe_worker.py")), "8", str(work)],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    return _result(p.stdout, p.stderr, p.returncode, "moe_worker (8 devices)")


@pytest.mark.parametrize("scheme", ["dense", "W4A16:g16"])
def test_expert_parallel_greedy_tokens_equal_one_device(ep8, scheme):
    r = ep8[scheme]
    assert r["devices"] == 8
    assert r["out"] == r["ref"] and len(r["out"][0]) == 6
    # 2 sparse layers x 3 projections, each split by experts: 8 experts -> one per device
    assert len(r["stacks"]) == 6
    for path, (spec, shards, shape) in r["stacks"].items():
        assert spec.split(",")[0].endswith("('ep'") and shards == 8 and shape[0] == 1, (path, spec, shape)
