"""GGUF kept packed, HF fine-grained FP8 and GPTQ checkpoints loaded straight onto an 8-device CPU mesh (a fresh
interpreter, tests/multidevice/native_worker.py): every parameter equals the one-device load, the projections are
packed and split, greedy tokens equal one device's; an FP8 block the split would cut is a typed error naming it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a fresh 8-device interpreter, three checkpoints loaded twice each

WORKER = Path(__file__).with_name("native_worker.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    wd = tmp_path_factory.mktemp("native_mesh")
    p = subprocess.run([sys.executable, str(WORKER), "8", str(wd)], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=900)
    return _result(p.stdout, p.stderr, p.returncode, "native_worker (8 devices)")


@pytest.mark.parametrize("name,packed", [("gguf", 15), ("fp8", 14), ("gptq", 14)])
def test_mesh_load_equals_one_device_and_greedy_tokens_match(result, name, packed):
    r = result[name]
    assert r["same"], json.dumps(r)
    assert r["packed"] == packed  # every projection (and the GGUF's Q8_0 lm_head) packed, none dequantized
    assert r["sharded"] >= 14  # 7 projections x 2 layers split over the mesh
    assert r["largest"] <= 33792  # one device's slice at a time (the largest: a 264 x 256 / 8 float32 slice)
    assert r["out"] == r["ref"], json.dumps(r)


def test_gguf_offsets_stay_packed_on_the_mesh(result):
    assert result["gguf"]["offsets"] == 6  # Q4_K k_proj, Q4_1 o_proj, Q5_K down_proj in each of 2 layers


def test_gguf_reads_each_devices_blocks_from_the_map(result):
    r = result["gguf"]
    # every device reads its own slices only (replicated tensors, such as the embedding and norms, once per device;
    # a quantized slice's blocks once per leaf: codes, scales, offsets): well under every device reading the file
    assert r["reads"] > 8 * 14 and r["bytes"] <= 8 * r["file_bytes"] / 1.5, r


def test_a_split_that_cuts_an_fp8_block_is_a_typed_error(result):
    kind, msg = result["fp8_128"]
    assert kind == "ModelError"
    assert "kernel" in msg and "blocks of 128" in msg and "cannot be split 8 ways" in msg
