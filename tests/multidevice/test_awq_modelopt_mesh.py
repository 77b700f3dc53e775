"""AutoAWQ (int4 groups, asymmetric) and ModelOpt NVFP4 checkpoints loaded straight onto a 2-device CPU mesh (a fresh
interpreter, tests/multidevice/awq_modelopt_worker.py): every parameter equals the one-device load, the projections
stay packed and are split over the mesh, greedy tokens equal one device's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.slow  # a fresh 2-device interpreter, torch fixtures, two checkpoints loaded twice (~35 s CPU)

WORKER = Path(__file__).with_name("awq_modelopt_worker.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    wd = tmp_path_factory.mktemp("awq_modelopt_mesh")
    p = subprocess.run([sys.executable, str(WORKER), "2", str(wd)], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=600)
    return _result(p.stdout, p.stderr, p.returncode, "awq_modelopt_worker (2 devices)")


@pytest.mark.parametrize("name", ["awq", "modelopt"])
def test_mesh_load_equals_one_device_and_greedy_tokens_match(result, name):
    r = result[name]
    assert r["same"], json.dumps(r)
    assert r["packed"] == 14  # 7 projections x 2 layers, packed
    assert r["sharded"] >= 14  # ... and split over the mesh (codes, scales, zero points)
    assert r["out"] == r["ref"], json.dumps(r)
