"""`qformats quantize SRC DST --calibrate FILE` on mixture-of-experts checkpoints (tiny random Qwen3-MoE and Mixtral
written by transformers 5): the streamed calibration (one decoder layer, all its experts, resident at a time) writes
a compressed-tensors checkpoint with every expert quantized per expert and the routers dense and ignored, which
`load_causal_lm` reads back with exactly the codes of the same calibration run on the model in memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qformats" / "models" / "decoder"))
import moe_tiny  # noqa: E402

from converters.cli import main  # noqa: E402
from converters.evaluation.calibration_data import load_calibration  # noqa: E402
from converters.formats.safetensors_io import open_checkpoint  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder.calibration import calibrate_decoder  # noqa: E402
from qformats.nn.experts import QExperts  # noqa: E402

# the loaded checkpoints' forward as one jitted program (eagerly, each operation of each layer compiled on its own)
_forward = nnx.jit(lambda m, x: m(x))


@pytest.mark.slow  # 50-120 s each on the loaded 2-core machine: two calibrations of a one- or two-layer model
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_cli_calibrated_moe_checkpoint_reads_back(arch, tmp_path, capsys):
    src = tmp_path / "src"
    # qwen3_moe: a sparse layer and its dense layer 1 (mlp_only_layers); mixtral: every layer sparse, one suffices
    moe_tiny.write_checkpoint(arch, src, num_hidden_layers=2 if arch == "qwen3_moe" else 1)
    ids = tmp_path / "calib.npy"
    np.save(ids, np.random.default_rng(3).integers(0, 256, 600).astype(np.int32))
    dst = tmp_path / "dst"
    assert main(["quantize", str(src), str(dst), "--scheme", "W4A16:g16", "--calibrate", str(ids),
                 "--seq-len", "40", "--calibration-tokens", "200"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    config = load_causal_lm(src, tokenizer=False)[0].config
    m = config.moe
    block = m.block_name
    sparse = [i for i, f in enumerate(config.moe_layers) if f]  # qwen3_moe's tiny config: layer 1 dense
    routers = [f"model.layers.{i}.{block}.gate" for i in sparse]
    assert set(routers) <= set(qc["ignore"]) and "lm_head" in qc["ignore"]
    with open_checkpoint(dst) as ck:
        names = set(ck.keys())
    g, u, dn = m.projections
    for e in range(m.num_experts):
        for p in (g, u, dn):
            assert f"model.layers.{sparse[-1]}.{block}.experts.{e}.{p}.weight_packed" in names
    assert f"model.layers.0.{block}.gate.weight" in names

    back, _, _ = load_causal_lm(dst, tokenizer=False)
    # the same calibration on the model in memory (same samples: the file read the same way)
    model, _, _ = load_causal_lm(src, tokenizer=False)
    samples = load_calibration(ids, None, seq_len=40, max_tokens=200, seed=0, vocab_size=256)
    calibrate_decoder(model, samples, "W4A16:g16")
    for i in sparse:
        ex_b = getattr(back.model.layers[i], block).experts
        ex_m = getattr(model.model.layers[i], block).experts
        for p in (g, u, dn):
            qb, qm = getattr(ex_b, p), getattr(ex_m, p)
            assert isinstance(qb, QExperts) and isinstance(qm, QExperts)
            qa, qc_ = qb.kernel.get_value(), qm.kernel.get_value()
            for a, b in zip(jax.tree.leaves(qa), jax.tree.leaves(qc_)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"layer {i} {p}")
    out = _forward(back, np.asarray(moe_tiny.ids(1, 10)))
    out = np.asarray(out[0] if isinstance(out, tuple) else out)
    assert np.all(np.isfinite(out))


def test_cli_routed_statistics_refuse_empty_experts_and_awq(tmp_path, capsys):
    src = tmp_path / "src"
    moe_tiny.write_checkpoint("qwen3_moe", src, num_hidden_layers=1, num_experts=16, num_experts_per_tok=2)
    ids = tmp_path / "calib.npy"
    np.save(ids, np.array([5, 17, 200], np.int32))
    assert main(["quantize", str(src), str(tmp_path / "d1"), "--scheme", "W4A16:g16", "--calibrate", str(ids),
                 "--moe-statistics", "routed"]) == 1
    err = capsys.readouterr().err
    assert "model/layers/0/mlp/experts: experts" in err and "received no calibration tokens" in err
    assert not (tmp_path / "d1").exists()
    with pytest.raises(ModelError, match="moe_statistics='routed' is not supported"):
        from converters.pipelines.calibrate import quantize_calibrated_lm

        quantize_calibrated_lm(src, tmp_path / "d2", "W4A16:g16", ids, awq=True, moe_statistics="routed")


@pytest.mark.slow  # ~110 s on the loaded 2-core machine: one calibration
def test_in_memory_path_qwen2_moe_with_static_kv_cache(tmp_path):
    """A static FP8 KV cache takes the in-memory path (`save_compressed` with the per-expert name map): qwen2_moe's
    experts and shared expert quantized, routers and shared-expert gates dense and ignored, k/v scales calibrated,
    and the checkpoint loads back packed."""
    from converters.pipelines.calibrate import quantize_calibrated_lm
    from qformats.nn import QLinear

    src = tmp_path / "src"
    moe_tiny.write_checkpoint("qwen2_moe", src, num_hidden_layers=1)  # one sparse layer: its experts and shared expert
    ids = tmp_path / "c.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 300).astype(np.int32))
    r = quantize_calibrated_lm(src, tmp_path / "dst", "W4A16:g16", ids, kv_cache="fp8", seq_len=40,
                               calibration_tokens=150)
    assert r["projections"] == 4 + 3 + 3 * 10
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert set(qc["ignore"]) == {"lm_head"} | {f"model.layers.{i}.mlp.{m}" for i in range(1)
                                               for m in ("gate", "shared_expert_gate")}
    assert qc["kv_cache_scheme"]["dynamic"] is False
    back, _, _ = load_causal_lm(tmp_path / "dst", tokenizer=False)
    for i in range(1):
        assert isinstance(back.model.layers[i].mlp.experts.down_proj, QExperts)
        assert isinstance(back.model.layers[i].mlp.shared_expert.down_proj, QLinear)
    out = _forward(back, np.asarray(moe_tiny.ids(1, 8)))
    assert np.all(np.isfinite(np.asarray(out[0] if isinstance(out, tuple) else out)))


@pytest.mark.slow  # ~20 s (streamed) and ~35 s (in-memory) on the 2-core machine: a calibration and two loads
@pytest.mark.parametrize("path", ["streamed", "in-memory"])
def test_static_fp8_expert_input_scales_written_per_expert(path, tmp_path):
    """FP8 (static per-tensor input scales) on a tiny Qwen3-MoE: every expert's gate / up / down carries its own
    `input_scale` under its per-expert name, as compressed-tensors writes an MoE checkpoint, equal to the scales of
    the same calibration in memory; the checkpoint loads back with them. "in-memory": a static FP8 KV cache takes
    the `save_compressed` path."""
    from converters.pipelines.calibrate import quantize_calibrated_lm

    src = tmp_path / "src"
    moe_tiny.write_checkpoint("qwen3_moe", src, num_hidden_layers=1)
    ids = tmp_path / "c.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 200).astype(np.int32))
    kw = dict(weight_search="rtn", seq_len=40, calibration_tokens=120)
    quantize_calibrated_lm(src, tmp_path / "dst", "FP8", ids, kv_cache="fp8" if path == "in-memory" else None, **kw)
    model, _, _ = load_causal_lm(src, tokenizer=False)
    samples = load_calibration(ids, None, seq_len=40, max_tokens=120, seed=0, vocab_size=256)
    from qformats.kv_cache import parse_kv_cache

    calibrate_decoder(model, samples, "FP8", weight_search="rtn", propagate="float",  # the same graph as the file's
                      kv_cache=parse_kv_cache("fp8") if path == "in-memory" else None)
    back, _, _ = load_causal_lm(tmp_path / "dst", tokenizer=False)
    n = model.config.moe.num_experts
    with open_checkpoint(tmp_path / "dst") as ck:
        for p in ("gate_proj", "up_proj", "down_proj"):
            mine = np.asarray(getattr(model.model.layers[0].mlp.experts, p).input_scale.get_value())
            read = np.asarray(getattr(back.model.layers[0].mlp.experts, p).input_scale.get_value())
            assert mine.shape == read.shape == (n, 1)
            np.testing.assert_array_equal(read, mine, err_msg=p)
            for e in range(n):
                np.testing.assert_array_equal(
                    np.asarray(ck.get(f"model.layers.0.mlp.experts.{e}.{p}.input_scale"), np.float32).reshape(1),
                    mine[e], err_msg=f"{p} expert {e}")
    assert len(np.unique(mine)) == n  # down_proj: each expert its own range
    out = _forward(back, np.asarray(moe_tiny.ids(1, 8)))
    assert np.all(np.isfinite(np.asarray(out[0] if isinstance(out, tuple) else out)))
