"""load_compressed / save_compressed: a quantized NNX model through a compressed-tensors checkpoint and back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from converters.pipelines.flax_io import default_name_map, load_compressed, save_compressed
from qformats.errors import CheckpointError
from qformats.nn import Rule, quantize_model


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.up = nnx.Linear(128, 256, rngs=rngs)
        self.down = nnx.Linear(256, 128, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(self.norm(x))))


class Tiny(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(128, 32, rngs=rngs)

    def __call__(self, x):
        for b in self.layers:
            x = x + b(x)
        return self.head(x)


def test_default_name_map_follows_hf_convention():
    m = default_name_map(Tiny())
    assert m["layers.0.up.weight"] == ("layers/0/up/kernel", True)
    assert m["layers.0.up.bias"] == ("layers/0/up/bias", False)
    assert m["layers.1.norm.weight"] == ("layers/1/norm/scale", False)
    assert "layers.0.down.bias" not in m


@pytest.mark.parametrize("preset", ["W4A16", "NVFP4A16", "FP8_DYNAMIC"])
def test_save_then_load_reproduces_the_quantized_model(tmp_path, preset):
    model = Tiny(seed=0)
    quantize_model(model, [Rule("head", None), Rule(".*", preset)])
    x = jax.random.normal(jax.random.key(1), (3, 128))
    want = np.asarray(model(x))
    save_compressed(model, tmp_path / "ck", config={"architectures": ["Tiny"]})
    fresh = Tiny(seed=7)  # different float weights: everything must come from the checkpoint
    load_compressed(tmp_path / "ck", fresh)
    np.testing.assert_array_equal(np.asarray(fresh(x)), want)


def test_unknown_tensor_is_named(tmp_path):
    model = Tiny()
    quantize_model(model, [Rule(".*", "W8A16")])
    save_compressed(model, tmp_path / "ck", config={})

    class Smaller(nnx.Module):
        def __init__(self):
            self.head = nnx.Linear(128, 32, rngs=nnx.Rngs(0))
    with pytest.raises(CheckpointError, match="layers.0"):
        load_compressed(tmp_path / "ck", Smaller())
