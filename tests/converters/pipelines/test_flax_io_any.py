"""save / load round trips of models whose matmul weights are in custom layers, einsums and scan stacks."""

import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "qformats", "nn"))
from gemma_style import Einsum, Gemma, NnxCustom, StackedMHA  # noqa: E402

from converters.formats.quantized import read_quantized  # noqa: E402
from converters.pipelines.flax_io import (LAYOUTS_KEY, load_compressed, load_linen, save_compressed,  # noqa: E402
                                          save_linen)
from qformats.errors import CheckpointError  # noqa: E402
from qformats.nn import Rule, quantize_linen, quantize_model  # noqa: E402

TOKENS = jnp.arange(12).reshape(2, 6) % 50


def test_nnx_custom_layers_and_stacks_round_trip_exactly(tmp_path):
    model = NnxCustom()
    quantize_model(model, [Rule("embed", None), Rule(".*", "W4A16")], example=TOKENS)
    want = np.asarray(model(TOKENS))
    save_compressed(model, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    lay = cfg[LAYOUTS_KEY]
    assert lay["blocks.q.w"] == {"param": "blocks/q/w", "shape": [2, 128, 64], "perm": [1, 0, 2], "contracted": 1,
                                 "stacked": [2], "layers": ["blocks.0.q.w", "blocks.1.q.w"]}
    assert lay["proj"]["layers"] == ["proj"] and lay["blocks.down"]["param"] == "blocks/down/kernel"
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    cm = read_quantized(tmp_path / "ck")
    assert cm.modules["blocks.1.q.w"]["weight"].shape == (128, 128)  # the [K, N] matrix, as a Linear [in, out]
    fresh = NnxCustom(seed=9)  # other float weights: everything must come from the checkpoint
    load_compressed(tmp_path / "ck", fresh)
    np.testing.assert_array_equal(np.asarray(fresh(TOKENS)), want)


def test_vmapped_multi_head_attention_round_trips(tmp_path):
    model = StackedMHA()
    x = jax.random.normal(jax.random.key(2), (2, 5, 128))
    with pytest.raises(Exception, match="layers/out: a matmul of this weight does not contract the input's last "
                                        "axis alone"):  # out contracts (heads, head_dim)
        quantize_model(model, [Rule(".*", "FP8_DYNAMIC")], example=x)
    quantize_model(model, [Rule("layers/out", "W8A16"), Rule(".*", "FP8_DYNAMIC")], example=x)
    want = np.asarray(model(x))
    save_compressed(model, tmp_path / "ck")
    fresh = StackedMHA(seed=4)
    load_compressed(tmp_path / "ck", fresh)
    np.testing.assert_array_equal(np.asarray(fresh(x)), want)


def test_gemma_linen_round_trips(tmp_path):
    model = Gemma(scan=True)
    params = model.init(jax.random.key(0), TOKENS)
    qmod, qparams = quantize_linen(model, params, [Rule("embedder/.*", None), Rule(".*", "W4A16")], TOKENS)
    want = np.asarray(qmod.apply(qparams, TOKENS))
    save_linen(qmod, qparams, tmp_path / "ck")
    lay = json.loads((tmp_path / "ck" / "config.json").read_text())[LAYOUTS_KEY]
    assert lay["layers.attn.kv_einsum.w"]["shape"] == [2, 1, 128, 128]
    assert lay["layers.attn.kv_einsum.w"]["perm"] == [2, 0, 1, 3]
    qmod2, qparams2 = load_linen(tmp_path / "ck", model, model.init(jax.random.key(5), TOKENS))
    np.testing.assert_array_equal(np.asarray(qmod2.apply(qparams2, TOKENS)), want)


class EinsumList(nn.Module):
    """gemma's layer style, small: a tied embedding, then a Python list of its Einsum modules (3-D kernels)."""

    @nn.compact
    def __call__(self, tokens):
        table = self.param("embed", nn.initializers.normal(), (50, 128))
        x = table[tokens]
        for i in range(2):
            h = Einsum((2, 128, 64), name=f"in_{i}")("btd,ndh->btnh", x)
            x = x + Einsum((2, 64, 128), name=f"out_{i}")("btnh,nhd->btd", jnp.tanh(h))
        return x @ table.T


def test_linen_list_of_custom_einsum_layers_round_trips(tmp_path):
    model = EinsumList()
    params = model.init(jax.random.key(0), TOKENS)
    qmod, qparams = quantize_linen(model, params, [Rule("embed", None), Rule(".*", "W8A16")], TOKENS, strict=True)
    want = np.asarray(qmod.apply(qparams, TOKENS))
    save_linen(qmod, qparams, tmp_path / "ck")
    lay = json.loads((tmp_path / "ck" / "config.json").read_text())[LAYOUTS_KEY]
    assert lay["in_1.w"] == {"param": "in_1/w", "shape": [2, 128, 64], "perm": [1, 0, 2], "contracted": 1,
                             "stacked": [], "layers": ["in_1.w"]}
    assert lay["out_0.w"]["shape"] == [2, 64, 128] and lay["out_0.w"]["contracted"] == 2
    qmod2, qparams2 = load_linen(tmp_path / "ck", model, model.init(jax.random.key(5), TOKENS))
    np.testing.assert_array_equal(np.asarray(qmod2.apply(qparams2, TOKENS)), want)


def test_nothing_quantized_is_refused_not_written(tmp_path):
    with pytest.raises(CheckpointError, match="nothing in this model is quantized"):
        save_compressed(NnxCustom(), tmp_path / "a")
    model = Gemma()
    params = model.init(jax.random.key(0), TOKENS)
    with pytest.raises(CheckpointError, match="save_compressed takes an NNX model; a linen params tree is saved "
                                              "with save_linen"):
        save_compressed(params, tmp_path / "b")
    qmod, _ = quantize_linen(model, params, [Rule(".*", None)], TOKENS)
    with pytest.raises(CheckpointError, match="nothing in this model is quantized"):
        save_linen(qmod, params, tmp_path / "c")
    assert not any(tmp_path.iterdir())


def test_a_layout_that_does_not_fit_the_model_is_named(tmp_path):
    model = NnxCustom()
    quantize_model(model, [Rule("embed", None), Rule(".*", "W4A16")], example=TOKENS)
    save_compressed(model, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"'blocks/\S+' has shape \(3, .*\) in the model, the checkpoint's "
                                              r"packed weight 'blocks\.\S+' is \(2, "):
        load_compressed(tmp_path / "ck", NnxCustom(layers=3))
