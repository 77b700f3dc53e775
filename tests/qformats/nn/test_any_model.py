"""quantize_model / quantize_linen on third-party-style models: custom layers, scan stacks, vmapped flax MHA."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma_style import Gemma, NnxCustom, ParallelLinear, StackedMHA
from qformats.errors import ModelError
from qformats.nn import QLinear, Rule, quantize_linen, quantize_model
from qformats.nn.nnx_traced import packed_weights, variable_at
from qformats.nn.traced import MatmulWeight
from qformats.quantize import dequantize

TOKENS = jnp.arange(12).reshape(2, 6) % 50
FWD = nnx.jit(lambda m, t: m(t))


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture(scope="module")
def custom():
    return NnxCustom()


def dequantized_twin(model, twin):
    """`twin` (a float model of the same architecture) holding the packed weights of `model`, dequantized."""
    for path, mw in packed_weights(model).items():
        variable_at(twin, path).set_value(mw.dense())
    for path, m in [("blocks/down/kernel", model.blocks.down)]:
        variable_at(twin, path).set_value(jax.vmap(dequantize)(m.kernel.get_value()))
    return twin


def test_nnx_custom_layers_and_scan_stack_are_quantized_and_the_tied_embedding_is_named(custom):
    model = nnx.clone(custom)
    ref = FWD(model, TOKENS)
    with pytest.warns(UserWarning, match=r"rule #0 '\.\*' selects 6 matmul weights; 1 stay dense: embed \(used in a "
                                         r"matmul and outside one \(gather\)\)"):
        _, plan = quantize_model(model, [Rule(".*", "W4A16")], example=TOKENS, return_summary=True)
    assert {d.path: d.scheme.name for d in plan.quantized} == {
        "blocks/down": "W4A16", "blocks/q/w": "W4A16", "blocks/o": "W4A16", "blocks/up": "W4A16", "proj": "W4A16"}
    assert [(d.path, d.why) for d in plan.dense] == [("embed", "used in a matmul and outside one (gather)")]
    assert "left dense (used in a matmul and outside one (gather)): 1: embed" in plan.summary()
    packed = packed_weights(model)
    assert set(packed) == {"blocks/q/w", "blocks/o/kernel", "blocks/up/kernel", "proj/kernel"}
    assert packed["blocks/q/w"].stacked == (2,) and packed["blocks/q/w"].shape == (2, 128, 64)
    assert isinstance(model.blocks.down, QLinear)  # flax's own Linear: swapped as before (stacked QLinear)
    out = FWD(model, TOKENS)
    # the float model on the dequantized weights gives the same logits (up to accumulation order)
    assert rel(out, FWD(dequantized_twin(model, nnx.clone(custom)), TOKENS)) < 1e-5
    assert 0 < rel(out, ref) < 0.3  # int4 on random Gaussian weights through 2 blocks and a tied head


def test_strict_refuses_a_selected_weight_that_stays_dense_and_leaves_the_model_unchanged(custom):
    model = nnx.clone(custom)
    before = jax.tree.leaves(nnx.state(model))
    with pytest.raises(ModelError, match=r"strict=True.*embed \(used in a matmul and outside one \(gather\)\)"):
        quantize_model(model, [Rule(".*", "W4A16")], example=TOKENS, strict=True)
    assert not packed_weights(model)
    for a, b in zip(before, jax.tree.leaves(nnx.state(model))):
        assert a is b
    quantize_model(model, [Rule("embed", None), Rule(".*", "W4A16")], example=TOKENS, strict=True)  # said so: fine


def test_without_example_custom_weights_are_never_skipped_quietly(custom):
    with pytest.raises(ModelError, match="nothing would be quantized: the rules select .* params outside nnx.Linear "
                                         ".*pass example="):
        quantize_model(nnx.clone(custom), [Rule(r"blocks/(q/w|o|up)|proj", "W4A16")])
    with pytest.warns(UserWarning, match="outside nnx.Linear / LinearGeneral / Einsum .*they stay float"):
        quantize_model(nnx.clone(custom), [Rule(".*", "W4A16")])


def test_example_changes_nothing_for_flax_layers():
    """The flax-layer path packs the same codes with or without the trace."""
    class Mlp(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(128, 256, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(256, 128, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    x = jnp.ones((2, 128))
    m1, m2 = Mlp(), Mlp()
    quantize_model(m1, [Rule(".*", "W4A16")])
    quantize_model(m2, [Rule(".*", "W4A16")], example=x)
    for a, b in zip(jax.tree.leaves(nnx.state(m1)), jax.tree.leaves(nnx.state(m2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert type(m2) is Mlp  # nothing traced to install: the model's class is untouched


def test_w_plus_a_on_custom_layers_where_the_contraction_allows(custom):
    model = nnx.clone(custom)
    ref = FWD(model, TOKENS)
    quantize_model(model, [Rule("embed", None), Rule(".*", "W8A8")], example=TOKENS)
    assert packed_weights(model)["proj/kernel"].schemes.input_activations is not None
    assert 0 < rel(FWD(model, TOKENS), ref) < 0.05


def test_vmapped_flax_multi_head_attention():
    model = StackedMHA()
    x = jax.random.normal(jax.random.key(2), (2, 5, 128))
    ref = FWD(model, x)
    _, plan = quantize_model(model, [Rule(".*", "W8A16")], example=x, return_summary=True)
    assert sorted(d.path for d in plan.quantized) == ["layers/key", "layers/out", "layers/query", "layers/value"]
    mw = packed_weights(model)["layers/out/kernel"]
    assert mw.stacked == (2,) and mw.shape == (2, 64, 128) and mw.perm == (0, 1, 2) and mw.n_contracted == 2
    assert 0 < rel(FWD(model, x), ref) < 0.05


@pytest.mark.slow
def test_gemma_linen_every_einsum_is_quantized_and_the_tied_embedding_is_named():
    model = Gemma()
    params = jax.jit(model.init)(jax.random.key(0), TOKENS)
    ref = jax.jit(model.apply)(params, TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmod, qparams = quantize_linen(model, params, [Rule(".*", "W4A16")], TOKENS)
    assert [str(w.message) for w in caught] == [
        "qformats.nn: rule #0 '.*' selects 11 matmul weights; 1 stay dense: embedder/input_embedding (used in a "
        "matmul and outside one (gather))"]
    assert len(qmod.summary.quantized) == 10
    p = qparams["params"]
    assert isinstance(p["layer_0"]["attn"]["kv_einsum"]["w"], MatmulWeight)
    assert isinstance(p["layer_1"]["mlp"]["gating_einsum"], MatmulWeight)
    out = qmod.apply(qparams, TOKENS)
    assert 0 < rel(out, ref) < 0.1
    np.testing.assert_allclose(np.asarray(jax.jit(qmod.apply)(qparams, TOKENS)), np.asarray(out), rtol=1e-5,
                               atol=1e-4)


@pytest.mark.slow
def test_gemma_linen_under_nn_scan():
    model = Gemma(scan=True)
    params = jax.jit(model.init)(jax.random.key(0), TOKENS)
    ref = jax.jit(model.apply)(params, TOKENS)
    qmod, qparams = quantize_linen(model, params, [Rule("embedder/.*", None), Rule(".*", "NVFP4A16")], TOKENS,
                                   strict=True)
    w = qparams["params"]["layers"]["attn"]["q_einsum"]["w"]
    assert isinstance(w, MatmulWeight) and w.stacked == (2,) and w.shape == (4, 128, 128)
    assert 0 < rel(jax.jit(qmod.apply)(qparams, TOKENS), ref) < 0.2


# ---- small and fast: every skip reason in the summary, the partial-match warning and strict=True, NNX and linen ----
class TinyLinen(nn.Module):
    """A tied embedding (gathered and multiplied), an einsum weight, a `@` weight whose K = 96 does not take
    W4A16's groups of 128, and a weight the rules keep float."""

    @nn.compact
    def __call__(self, tokens):
        table = self.param("embed", nn.initializers.normal(), (50, 128))
        up = self.param("up", nn.initializers.normal(), (128, 96))
        odd = self.param("odd", nn.initializers.normal(), (96, 128))
        keep = self.param("keep", nn.initializers.normal(), (128, 128))
        x = table[tokens]
        x = jnp.tanh(jnp.einsum("btd,dh->bth", x, up)) @ odd
        return (x @ keep) @ table.T


class TinyNnx(nnx.Module):
    """TinyLinen in NNX, with EasyDeL-style ParallelLinear layers."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (50, 128)))
        self.up = ParallelLinear(128, 96, rngs=rngs)
        self.odd = ParallelLinear(96, 128, rngs=rngs)
        self.keep = ParallelLinear(128, 128, rngs=rngs)

    def __call__(self, tokens):
        x = self.odd(jnp.tanh(self.up(self.embed[...][tokens])))
        return self.keep(x) @ self.embed[...].T


GATHER = "used in a matmul and outside one (gather)"


def _reasons(plan):
    return {d.path: d.why for d in plan.dense}


def test_linen_summary_names_every_skip_and_strict_refuses_before_quantizing():
    model = TinyLinen()
    params = model.init(jax.random.key(0), TOKENS)
    rules = [Rule("keep", None), Rule(".*", "W4A16")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmod, qparams = quantize_linen(model, params, rules, TOKENS)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and msgs[0].startswith("qformats.nn: rule #1 '.*' selects 3 matmul weights; 2 stay dense: ")
    assert f"embed ({GATHER})" in msgs[0] and "odd (shape does not fit: odd: weight group size 128" in msgs[0]
    plan = qmod.summary
    assert [d.path for d in plan.quantized] == ["up"] and plan.quantized[0].scheme.name == "W4A16"
    why = _reasons(plan)
    assert why["keep"] == "rule #0 'keep' says so" and why["embed"] == GATHER
    assert why["odd"].startswith("shape does not fit: ") and "96" in why["odd"]
    text = plan.summary()
    for line in (f"left dense ({GATHER}): 1: embed", "left dense (rule #0 'keep' says so): 1: keep"):
        assert line in text
    assert isinstance(qparams["params"]["up"], MatmulWeight)
    for name in ("embed", "odd", "keep"):
        assert qparams["params"][name] is params["params"][name]
    with pytest.raises(ModelError, match=r"quantize_linen\(strict=True\): rule #1 '\.\*' selects 3 matmul weights; "
                                         r"2 stay dense: .*odd \(shape does not fit") as e:
        quantize_linen(model, params, rules, TOKENS, strict=True)
    assert f"embed ({GATHER})" in str(e.value)
    quantize_linen(model, params, [Rule("embed|keep|odd", None), Rule(".*", "W4A16")], TOKENS, strict=True)


def test_nnx_summary_names_every_skip_and_strict_refuses_leaving_the_model_unchanged():
    model = TinyNnx()
    rules = [Rule("keep", None), Rule(".*", "W4A16")]
    before = jax.tree.leaves(nnx.state(model))
    with pytest.raises(ModelError, match=r"strict=True.*rule #1 '\.\*' selects 3 matmul weights; 2 stay dense: "
                                         r".*odd \(shape does not fit") as e:
        quantize_model(model, rules, example=TOKENS, strict=True)
    assert f"embed ({GATHER})" in str(e.value)
    assert all(a is b for a, b in zip(before, jax.tree.leaves(nnx.state(model)), strict=True))
    with pytest.warns(UserWarning, match=rf"rule #1 '\.\*' selects 3 matmul weights; 2 stay dense: .*"
                                         rf"embed \({re.escape(GATHER)}\)") as rec:
        _, plan = quantize_model(model, rules, example=TOKENS, return_summary=True)
    assert "odd (shape does not fit: odd: weight group size 128" in str(rec[0].message)
    assert [d.path for d in plan.quantized] == ["up"]
    why = _reasons(plan)
    assert why["keep"] == "rule #0 'keep' says so" and why["embed"] == GATHER
    assert why["odd"].startswith("shape does not fit: ")
    assert set(packed_weights(model)) == {"up/kernel"}
