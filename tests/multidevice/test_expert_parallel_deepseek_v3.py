"""Expert parallelism of deepseek_v3 on 8 CPU devices (a fresh interpreter): the routed-expert stacks split by experts
(one of 8 per device), latent attention replicated; greedy tokens equal one device's (W4A16 packed experts)."""

import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

pytestmark = pytest.mark.slow  # a fresh multi-device interpreter

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ep8():
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("deepseek_v3_worker.py")), "8"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    return _result(p.stdout, p.stderr, p.returncode, "deepseek_v3_worker (8 devices)")


def test_expert_parallel_greedy_tokens_equal_one_device(ep8):
    r = ep8["W4A16:g16"]
    assert r["devices"] == 8 and r["out"] == r["ref"] and len(r["out"][0]) == 8
    assert r["spec"].split(",")[0].endswith("('ep'") and r["shard"][0] == 1


def test_tensor_axis_is_refused_for_latent_attention():
    from qformats.errors import ModelError
    from qformats.models.decoder import DecoderConfig, expert_parallel_rules

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "qformats" / "models" / "decoder"))
    import test_deepseek_v3 as ds

    cfg = DecoderConfig.from_hf(dict(ds.TINY, model_type="deepseek_v3"))
    with pytest.raises(ModelError, match="multi-head latent attention"):
        expert_parallel_rules(cfg, "ep", "tp")
