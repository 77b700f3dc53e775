"""quantize_linen on linen models that have already run (nn.jit methods whose traces jax caches): discovery finds
the same kernels every time, wrappers never share a trace made under another interceptor, and a run that
reaches no quantizable layer is refused loudly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import presets
from qformats.errors import ModelError
from qformats.nn.traced import MatmulWeight
from qformats.nn import Rule, quantize_linen, record_layouts
from qformats.qarray import QArray
from qformats.schemes import SchemeSet

X = jax.random.normal(jax.random.key(0), (4, 128))
TRACES = {"jitted": 0}


class Plain(nn.Module):
    """The reference: two Dense layers, nothing lifted."""

    def setup(self):
        self.up = nn.Dense(256)
        self.down = nn.Dense(128)

    def __call__(self, x):
        return self.down(nn.relu(self.up(x)))


class Jitted(Plain):
    """The same model with its forward jitted the way gemma's linen Transformer is (`nn.jit` on __call__)."""

    @nn.jit
    def __call__(self, x):
        TRACES["jitted"] += 1  # runs only when jax traces the body (not on a cache hit)
        return self.down(nn.relu(self.up(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(128, name="fc")(x)


JBlock = nn.jit(Block)  # a lifted class: one jitted function for every instance


class JittedBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        return JBlock(name="b1")(nn.relu(JBlock(name="b0")(x)))


def _packed(qparams):
    flat = jax.tree_util.tree_flatten_with_path(qparams, is_leaf=lambda t: isinstance(t, QArray))[0]
    return {jax.tree_util.keystr(k): v for k, v in flat if isinstance(v, QArray)}


def _assert_same_packing(a, b):
    assert set(a) == set(b)
    for k in a:
        for la, lb in zip(jax.tree.leaves(a[k]), jax.tree.leaves(b[k])):
            np.testing.assert_array_equal(np.asarray(la), np.asarray(lb), err_msg=k)


@pytest.mark.parametrize("cls, paths", [(Jitted, {"up", "down"}), (JittedBlocks, {"b0/fc", "b1/fc"})])
def test_quantize_twice_after_jitted_runs_finds_the_same_kernels(cls, paths):
    module = cls()
    params = module.init(jax.random.key(1), X)
    module.apply(params, X)  # the model has run: its jitted body is in jax's trace cache for X's shapes
    jax.jit(module.apply)(params, X)
    rules = [Rule(".*", "FP8_DYNAMIC")]
    qmod1, q1 = quantize_linen(module, params, rules, X)
    qmod2, q2 = quantize_linen(module, params, rules, X)
    assert set(qmod1.schemes) == set(qmod2.schemes) == paths
    assert qmod1.layouts == qmod2.layouts and set(record_layouts(module, params, X)) == paths
    p1, p2 = _packed(q1), _packed(q2)
    assert len(p1) == len(paths)
    _assert_same_packing(p1, p2)
    # and equal to the quantization of a model that never ran (nothing lifted, so nothing cached)
    if cls is Jitted:
        fresh_mod, fresh = quantize_linen(Plain(), params, rules, X)
        assert fresh_mod.layouts == qmod1.layouts
        _assert_same_packing(_packed(fresh), p1)
        np.testing.assert_array_equal(np.asarray(qmod2.apply(q2, X)), np.asarray(fresh_mod.apply(fresh, X)))
        _, state = qmod2.apply(q2, X, mutable=True)  # the variables come back as they went in
        _assert_same_packing(_packed(state), _packed(q2))


def test_wrappers_do_not_share_a_jitted_trace():
    """Two wrappers over the same packed params that quantize activations differently (FP8_DYNAMIC vs the same
    weights weight-only): each computes its own function, equal to the unlifted model's; equal wrappers reuse
    one trace."""
    params = Jitted().init(jax.random.key(2), X)
    fp8 = presets["FP8_DYNAMIC"]
    weight_only = SchemeSet("fp8_weights_only", weights=fp8.weights)
    outs = []
    for ss in (fp8, weight_only, fp8):
        qmod, qparams = quantize_linen(Jitted(), params, [Rule(".*", ss)], X)
        ref_mod, ref = quantize_linen(Plain(), params, [Rule(".*", ss)], X)
        _assert_same_packing(_packed(qparams), _packed(ref))
        got = qmod.apply(qparams, X)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref_mod.apply(ref, X)))
        np.testing.assert_array_equal(np.asarray(jax.jit(qmod.apply)(qparams, X)), np.asarray(got))
        outs.append(np.asarray(got))
    assert not np.array_equal(outs[0], outs[1])  # the activation quantization shows in the output
    qmod, qparams = quantize_linen(Jitted(), params, [Rule(".*", fp8)], X)
    TRACES["jitted"] = 0
    for _ in range(3):
        quantize_linen(Jitted(), params, [Rule(".*", fp8)], X)[0].apply(qparams, X)  # equal wrappers
    assert TRACES["jitted"] == 3  # once per discovery, never for the equal wrappers' applies (traced above)


class NoDense(nn.Module):
    """A matmul in no flax layer class: a plain jnp.dot on a param (reached by the traced path)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 64))
        return x @ w


class ConvOnly(nn.Module):
    """No matmul on a param at all: a convolution."""

    @nn.compact
    def __call__(self, x):
        return nn.Conv(8, (3,), name="conv")(x)


class ConvAndDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="head")(nn.Conv(8, (3,), name="conv")(x).reshape(x.shape[0], -1))


def test_a_matmul_on_a_bare_param_is_quantized():
    params = NoDense().init(jax.random.key(3), X)
    qmod, qparams = quantize_linen(NoDense(), params, [Rule(".*", "FP8_DYNAMIC")], X)
    assert [d.path for d in qmod.summary.quantized] == ["kernel"]
    assert isinstance(qparams["params"]["kernel"], MatmulWeight)


def test_discovery_that_reaches_no_matmul_is_an_error():
    x = jnp.ones((2, 16, 4))
    params = ConvOnly().init(jax.random.key(3), x)
    with pytest.raises(ModelError, match="ConvOnly: module.apply on the example inputs reached no matmul on a param, "
                                         "but its params hold 2 arrays .*the rules select conv/kernel\\)"):
        quantize_linen(ConvOnly(), params, [Rule(".*", "FP8_DYNAMIC")], x)
    with pytest.warns(UserWarning, match="matched no"):  # nothing asked for: only the rule warning
        quantize_linen(ConvOnly(), params, [Rule(".*", None)], x)


def test_rule_selected_kernels_no_layer_reached_are_named():
    x = jnp.ones((2, 16, 4))
    params = ConvAndDense().init(jax.random.key(4), x)
    with pytest.warns(UserWarning, match="no matmul reached the rule-selected params conv/kernel; they stay float"):
        qmod, qparams = quantize_linen(ConvAndDense(), params, [Rule(".*", "FP8_DYNAMIC")], x)
    assert set(qmod.schemes) == {"head"} and not isinstance(qparams["params"]["conv"]["kernel"], QArray)


class MethodJittedBlock(nn.Module):
    def setup(self):
        self.fc = nn.Dense(128)

    @nn.jit
    def __call__(self, x):
        return self.fc(x)


class TwoMethodJitted(nn.Module):
    """Two instances of one class whose method is lifted with nn.jit: jax would give both one trace."""

    @nn.compact
    def __call__(self, x):
        return MethodJittedBlock(name="b1")(nn.relu(MethodJittedBlock(name="b0")(x)))


class TwoPlain(nn.Module):
    """The reference: the same params tree, nothing lifted."""

    @nn.compact
    def __call__(self, x):
        return Block(name="b1")(nn.relu(Block(name="b0")(x)))


def test_instances_of_one_jitted_class_keep_their_own_schemes():
    """b0 quantizes its inputs (FP8_DYNAMIC), b1 is weight-only with the same packed weights' format: the second
    instance must not reuse the first one's trace."""
    params = TwoMethodJitted().init(jax.random.key(5), X)
    fp8 = presets["FP8_DYNAMIC"]
    rules = [Rule("b0/fc", fp8), Rule("b1/fc", SchemeSet("fp8_weights_only", weights=fp8.weights))]
    qmod, qparams = quantize_linen(TwoMethodJitted(), params, rules, X)
    ref_mod, ref = quantize_linen(TwoPlain(), params, rules, X)
    assert set(qmod.schemes) == {"b0/fc", "b1/fc"}
    _assert_same_packing(_packed(qparams), _packed(ref))
    want = np.asarray(ref_mod.apply(ref, X))
    np.testing.assert_array_equal(np.asarray(qmod.apply(qparams, X)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(qmod.apply)(qparams, X)), want)
