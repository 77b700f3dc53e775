"""load_quantized / export_quantized: pure glue between quantized NNX models and checkpoint tensors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats import presets, quantize
from qformats.errors import ModelError
from qformats.nn import QLinear, Rule, export_quantized, load_quantized, quantize_model


class Net(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(128, 16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.head(x)


X = jax.random.normal(jax.random.key(0), (3, 128))


def test_export_then_load_into_a_fresh_model_is_identical():
    src = quantize_model(Net(), [Rule("head", "W8A16"), Rule(".*", "FP8")], calibration_data=[X])
    tensors = export_quantized(src)
    assert sorted(tensors) == ["head", "layers/0", "layers/1"]
    assert tensors["layers/0"]["input_scale"].shape == (1,) and "bias" not in tensors["head"]
    dst = Net(seed=1)  # different float weights: everything quantized must come from the tensors
    schemes = {p: t["schemes"].input_activations for p, t in tensors.items()}
    done = load_quantized(dst, tensors, schemes)
    assert sorted(done) == ["head", "layers/0", "layers/1"] and isinstance(dst.head, QLinear)
    np.testing.assert_array_equal(np.asarray(dst(X)), np.asarray(src(X)))


def test_load_quantized_validates_before_swapping():
    w = Net().layers[0].kernel.get_value()
    good = {"weight": quantize(w, presets["W4A16"].weights, 0), "bias": jnp.zeros(128)}
    bad_shape = {"weight": quantize(w[:, :64], presets["W4A16"].weights, 0), "bias": jnp.zeros(64)}
    model = Net()
    with pytest.raises(ModelError, match=r"layers/1: expected a QArray of shape \(128, 128\)"):
        load_quantized(model, {"layers/0": good, "layers/1": bad_shape})
    assert not isinstance(model.layers[0], QLinear)  # nothing swapped
    with pytest.raises(ModelError, match="nowhere: .* no nnx.Linear"):
        load_quantized(model, {"nowhere": good})
    with pytest.raises(ModelError, match="head: the model's Linear has no bias"):
        load_quantized(model, {"head": {"weight": quantize(Net().head.kernel.get_value(),
                                                           presets["W8A16"].weights, 0), "bias": jnp.zeros(16)}})
    with pytest.raises(ModelError, match="convert"):
        export_quantized(quantize_model(Net(), [Rule(".*", "W8A16")], mode="qat"))
