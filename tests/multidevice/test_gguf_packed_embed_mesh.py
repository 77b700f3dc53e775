"""A GGUF's block-quantized token embedding stays packed on a 4-device CPU mesh (a fresh interpreter,
tests/multidevice/packed_embed_worker.py): a `PackedEmbed` whose codes, scales and offsets are split by vocabulary rows,
equal leaf for leaf to the one-device load; lookups bit for bit equal, logits equal up to float32 summation order
(the tied lm_head a vocabulary-parallel packed GEMV), greedy tokens equal."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # a fresh 4-device interpreter, three models loaded twice each (~35 s of CPU)

WORKER = Path(__file__).with_name("packed_embed_worker.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    wd = tmp_path_factory.mktemp("packed_embed_mesh")
    p = subprocess.run([sys.executable, str(WORKER), "4", str(wd)], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=600)
    return _result(p.stdout, p.stderr, p.returncode, "packed_embed_worker (4 devices)")


@pytest.mark.parametrize("case", ["tied_q8_0", "tied_q4_1", "untied_q8_0"])
def test_packed_embedding_on_the_mesh_equals_one_device(result, case):
    r = result[case]
    assert r["packed"], json.dumps(r)
    # split by vocabulary: codes [vocab, packed hidden] and the per-row scales (offsets) on their first axis
    assert all(spec == "P('tp', None)" for spec in r["embed_specs"].values()), r["embed_specs"]
    assert ("offset" in r["embed_specs"]) == (case == "tied_q4_1")
    assert "float16" in r["embed_leaf_dtypes"]  # the file's d (and m) as stored
    assert r["params_equal"] and r["rows_bits_equal"], json.dumps(r)
    # logits: the same weights, float32 sums in another order only (|logit| here is O(1); K = 128)
    assert r["logits_max_abs_diff"] <= 1e-4 * max(1.0, r["logits_max_abs"]), json.dumps(r)
    assert r["tokens_got"] == r["tokens_ref"], json.dumps(r)
