"""A quantized NNX model round-trips through Orbax: packed leaves saved as they are, restored into an abstract twin."""

import jax
import numpy as np
import pytest
from flax import nnx

ocp = pytest.importorskip("orbax.checkpoint")

from qformats.nn import Rule, quantize_model  # noqa: E402
from qformats.qarray import QArray  # noqa: E402



class Toy(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.blocks = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(2)])
        self.heads = nnx.Dict({"cls": nnx.Linear(128, 32, rngs=rngs)})

    def __call__(self, x):
        for b in self.blocks:
            x = jax.nn.gelu(b(x))
        return self.heads["cls"](x)


X = jax.random.normal(jax.random.key(1), (4, 128))

RULES = [Rule("heads/.*", "NVFP4A16"), Rule(".*", "W4A16")]


def test_orbax_roundtrip(tmp_path):
    model = quantize_model(Toy(), RULES)
    _, state = nnx.split(model)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "q", state)
    ckpt.wait_until_finished()
    # restore into a model of the same structure built abstractly (no float weights materialised)
    abstract = nnx.eval_shape(lambda: quantize_model(Toy(seed=1), RULES))
    graphdef, abstract_state = nnx.split(abstract)
    restored = ckpt.restore(tmp_path / "q", abstract_state)
    m2 = nnx.merge(graphdef, restored)
    assert isinstance(m2.heads["cls"].kernel.get_value(), QArray)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(m2)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(m2(X)), np.asarray(model(X)))
