"""qformats.nn on linen: QDense and quantize_linen (params transform + Dense interceptor) with the NNX rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import dequantize, presets, quantize
from qformats.errors import ModelError
from qformats.nn import QDense, Rule, param_bytes, quantize_linen
from qformats.qarray import QArray


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(256, name="up")(x))
        h = nn.Dense(128, name="down", use_bias=False)(h)
        return nn.Dense(32, name="head")(x + h)


X = jax.random.normal(jax.random.key(0), (4, 128))


@pytest.fixture(scope="module")
def mlp():
    m = MLP()
    return m, m.init(jax.random.key(1), X)


def test_quantize_linen_matches_dequantized_reference(mlp):
    module, params = mlp
    qmod, qparams = quantize_linen(module, params, [Rule("head", None), Rule(".*", "FP8_DYNAMIC")])
    p = qparams["params"]
    assert isinstance(p["up"]["kernel"], QArray) and isinstance(p["down"]["kernel"], QArray)
    assert not isinstance(p["head"]["kernel"], QArray)
    assert not isinstance(params["params"]["up"]["kernel"], QArray)  # input untouched
    ss = presets["FP8_DYNAMIC"]

    def deq(k):
        return dequantize(quantize(k, ss.weights, 0))

    def act(x):
        return dequantize(quantize(x, ss.input_activations, -1))

    f = params["params"]
    h = nn.gelu(act(X) @ deq(f["up"]["kernel"]) + f["up"]["bias"])
    h = act(h) @ deq(f["down"]["kernel"])
    want = (X + h) @ f["head"]["kernel"] + f["head"]["bias"]
    got = jax.jit(qmod.apply)(qparams, X)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert param_bytes(qparams) < param_bytes(params)


def test_quantize_linen_validates_before_anything(mlp):
    module, params = mlp
    with pytest.raises(ModelError, match="unknown preset"):
        quantize_linen(module, params, [Rule(".*", "NOPE")])
    with pytest.raises(ModelError, match="up: weight group size 96"):
        quantize_linen(module, params, [Rule("up", __import__("qformats").QuantScheme("int4", "group", group_size=96))])
    with pytest.warns(UserWarning, match="nomatch"):
        quantize_linen(module, params, [Rule("nomatch", "W8A16")])


def test_qdense_init_and_apply():
    layer = QDense(16, "W4A16")
    v = layer.init(jax.random.key(2), X)
    k = v["params"]["kernel"]
    assert isinstance(k, QArray) and k.shape == (128, 16) and k.codes.dtype == jnp.uint8
    want = X @ dequantize(k) + v["params"]["bias"]
    np.testing.assert_allclose(np.asarray(layer.apply(v, X)), np.asarray(want), rtol=1e-5, atol=1e-5)
