"""quantize_model's fit check (qformats.plan.check_fits): every layer whose in_features a scheme's groups do not
divide is named in one ModelError, and the model is left untouched."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from qformats.errors import ModelError
from qformats.nn import QLinear, Rule, quantize_model


class Smol(nnx.Module):
    """SmolLM2-135M's projection widths, fewer outputs: q/k take 576 inputs, down 1536, tiny 64."""

    def __init__(self, rngs):
        self.q_proj = nnx.Linear(576, 16, rngs=rngs)
        self.k_proj = nnx.Linear(576, 8, rngs=rngs)
        self.down_proj = nnx.Linear(1536, 16, rngs=rngs)
        self.tiny = nnx.Linear(64, 8, rngs=rngs)


def test_every_misfit_layer_in_one_error_and_model_unchanged():
    model = Smol(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(ModelError) as e:
        quantize_model(model, [Rule(".*", "W4A16")])
    msg = str(e.value)
    assert msg.startswith("3 layer(s) do not fit their scheme's groups")
    assert ("  k_proj: weight group size 128 of W4A16 (int4 group128 scale=input/absmax) does not divide "
            "in_features = 576 (columns=576 not divisible by group_size=128)") in msg
    assert "  q_proj: weight group size 128" in msg
    assert "  tiny: weight group size 128 of W4A16 (int4 group128 scale=input/absmax) does not divide in_features = " \
           "64 (columns=64 < group_size=128" in msg
    assert "down_proj" not in msg and "Rule(path, None)" in msg and "'W4A16:g64'" in msg
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model)))


def test_ways_out_a_rule_leaving_them_dense_or_a_group_override():
    model = Smol(nnx.Rngs(0))
    quantize_model(model, [Rule("q_proj|k_proj|tiny", None), Rule(".*", "W4A16")])
    assert isinstance(model.down_proj, QLinear) and not isinstance(model.q_proj, QLinear)
    model = Smol(nnx.Rngs(0))
    quantize_model(model, [Rule("tiny", None), Rule(".*", "W4A16:g64")])
    assert all(isinstance(getattr(model, n), QLinear) for n in ("q_proj", "k_proj", "down_proj"))
    assert model.q_proj.kernel.get_value().scheme.group_size == 64


def test_activation_groups_are_checked_too():
    model = Smol(nnx.Rngs(0))
    with pytest.raises(ModelError, match=r"q_proj: activation group size 128 of FP8_BLOCK"):
        quantize_model(model, [Rule("q_proj", "FP8_BLOCK")])
