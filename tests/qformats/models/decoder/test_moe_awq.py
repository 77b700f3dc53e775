"""AWQ on mixture-of-experts layers (`awq_transform`'s MoE mappings, llm-compressor 0.14's Qwen-MoE ones): against
our dense AWQ (itself checked against llm-compressor's, BENCHMARKS.md) on the model the MoE one equals, and the
refusals. A Qwen3-MoE layer with one expert, top-1, renormalised, computes exactly a dense Qwen3 layer's MLP (routing
weight 1): post_attention_layernorm -> (router, experts' gate / up) must then choose the dense mapping's scales, and
expert 0's up_proj -> down_proj the dense up_proj -> down_proj's, with the same folded weights and codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
import moe_tiny  # noqa: E402

from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder.calibration import awq_transform, calibrate_decoder  # noqa: E402

SCHEME = "W4A16:g16"


def _dense_twin(src: Path, dst: Path) -> Path:
    """The one-expert Qwen3-MoE checkpoint `src` as a dense Qwen3 checkpoint: expert 0's projections as the MLP, the
    router dropped."""
    from safetensors.numpy import save_file

    cfg, t = moe_tiny.read_checkpoint(src)
    cfg = {**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
           "intermediate_size": cfg["moe_intermediate_size"]}
    for k in ("moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"):
        cfg.pop(k, None)
    dense = {k.replace("mlp.experts.0.", "mlp."): v for k, v in t.items() if not k.endswith("mlp.gate.weight")}
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(dense, str(dst / "model.safetensors"))
    return dst


def test_one_expert_moe_awq_equals_dense_awq(tmp_path):
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.algorithms import awq

    src = tmp_path / "moe"
    moe_tiny.write_checkpoint("qwen3_moe", src, num_hidden_layers=1, num_experts=1, num_experts_per_tok=1,
                              mlp_only_layers=[])
    rng = np.random.default_rng(4)
    samples = [rng.integers(0, 256, int(n)).astype(np.int32) for n in (5, 9, 12)]
    runs = {}
    for kind, path in (("moe", src), ("dense", _dense_twin(src, tmp_path / "dense"))):
        model, _, _ = load_causal_lm(path, tokenizer=False)
        layer = model.model.layers[0]
        router = None if kind == "dense" else np.asarray(layer.mlp.gate.kernel.get_value())
        rec = []
        calibrate_decoder(model, samples, SCHEME, weight_search="rtn", propagate="float",
                          transform=awq_transform(SCHEME, record=rec))
        runs[kind] = (model, {r["smooth"]: r for r in rec}, router)
    moe, mrec, router0 = runs["moe"]
    dense, drec, _ = runs["dense"]
    assert set(mrec) == {"input_layernorm", "post_attention_layernorm", "mlp/experts/up_proj/0"}
    assert mrec["post_attention_layernorm"]["balances"] == ("mlp/gate", "mlp/experts/gate_proj", "mlp/experts/up_proj")
    for m, d in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm"),
                 ("mlp/experts/up_proj/0", "mlp/up_proj")):
        a, b = mrec[m], drec[d]
        np.testing.assert_array_equal(a["x_mean"], b["x_mean"], err_msg=m)
        # the block's output (routing weight exactly 1) against the dense MLP's: the same products, other kernels
        np.testing.assert_allclose(a["errors"], b["errors"], rtol=1e-5, err_msg=m)
        assert (a["ratio"], a["duo"]) == (b["ratio"], b["duo"]), m
        np.testing.assert_array_equal(a["scales"], b["scales"], err_msg=m)
    ml, dl = moe.model.layers[0], dense.model.layers[0]
    np.testing.assert_array_equal(np.asarray(ml.post_attention_layernorm.weight.get_value()),
                                  np.asarray(dl.post_attention_layernorm.weight.get_value()))
    s = mrec["post_attention_layernorm"]["scales"]  # the router's rows * s: its logits unchanged
    np.testing.assert_array_equal(np.asarray(ml.mlp.gate.kernel.get_value()), np.asarray(awq.scale_rows(router0, s)))
    for p in ("gate_proj", "up_proj", "down_proj"):
        mine = getattr(ml.mlp.experts, p).expert_weight(0)
        ref = getattr(dl.mlp, p).kernel.get_value()
        for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)


def test_awq_moe_refusals(tmp_path):
    """Routed-only statistics with AWQ, gpt-oss (llm-compressor has no AWQ mapping for it): typed errors naming the
    layer or checkpoint, before any work."""
    from converters.pipelines.calibrate import quantize_calibrated_lm

    ids = tmp_path / "c.npy"
    np.save(ids, np.arange(20, dtype=np.int32))
    moe_tiny.write_checkpoint("qwen3_moe", tmp_path / "q3", num_hidden_layers=1)
    with pytest.raises(ModelError, match="moe_statistics='routed' is not supported"):
        quantize_calibrated_lm(tmp_path / "q3", tmp_path / "d", SCHEME, ids, awq=True, moe_statistics="routed")
    moe_tiny.write_checkpoint("gpt_oss", tmp_path / "g", num_hidden_layers=1)
    with pytest.raises(ModelError, match="AWQ on gpt_oss models is not supported .*no AWQ mapping for GptOss"):
        quantize_calibrated_lm(tmp_path / "g", tmp_path / "d", SCHEME, ids, awq=True)
