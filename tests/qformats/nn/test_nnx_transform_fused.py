"""quantize_model shares NVFP4 global scales across fused siblings (q/k/v_proj, gate/up_proj) as the checkpoint
path and llm-compressor do; explicit groups, opting out, partial groups, QAT / searches, calibration, nnx.scan."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats import presets, quantize
from qformats.errors import ModelError
from qformats.algorithms.shared_scales import group_amax, shared_global_scale
from qformats.nn import QLinear, Rule, quantize_model
from qformats.presets import parse_scheme

NVFP4 = presets["NVFP4A16"].weights
SIBLINGS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


class Attn(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(64, 64, rngs=rngs)
        self.k_proj = nnx.Linear(64, 32, rngs=rngs)
        self.v_proj = nnx.Linear(64, 32, rngs=rngs)
        self.o_proj = nnx.Linear(64, 64, rngs=rngs)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(64, 96, rngs=rngs)
        self.up_proj = nnx.Linear(64, 96, rngs=rngs)
        self.down_proj = nnx.Linear(96, 64, rngs=rngs)


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.self_attn = Attn(rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        a = self.self_attn
        h = x + a.o_proj(a.q_proj(x) * jnp.tile(a.k_proj(x) + a.v_proj(x), 2))
        return h + self.mlp.down_proj(jax.nn.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Model(nnx.Module):
    """Two decoder-like layers; every member of a group has its own amax (v_proj and up_proj scaled up)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([Layer(rngs) for _ in range(2)])
        for i, layer in enumerate(self.layers):
            for m, s in ((layer.self_attn.v_proj, 7.0 + i), (layer.mlp.up_proj, 3.0), (layer.self_attn.q_proj, 0.5)):
                m.kernel.set_value(m.kernel.get_value() * s)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _linears(model):
    return {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model) if isinstance(m, (nnx.Linear, QLinear))}


def _floats(model):
    return {p: m.kernel.get_value() for p, m in _linears(model).items()}


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _groups(paths):
    out = []
    for i in range(2):
        for parent, names in SIBLINGS.items():
            out.append(tuple(f"layers/{i}/{parent}/{n}" for n in names))
    return [g for g in out if all(p in paths for p in g)]


def test_siblings_share_one_global_scale_and_are_quantized_under_it():
    m = Model()
    w = _floats(m)
    quantize_model(m, [Rule(".*", "NVFP4A16")])
    q = _linears(m)
    groups = _groups(w)
    assert len(groups) == 4
    for g in groups:
        shared = shared_global_scale(group_amax([w[p] for p in g]), NVFP4, jnp.float32)
        own = [quantize(w[p], NVFP4, 0).global_scale for p in g]
        assert float(shared[0]) == min(float(x[0]) for x in own) and len({float(x[0]) for x in own}) > 1
        for p in g:  # codes, fp8 scales, global scale: exactly quantize under the shared g
            _same(q[p].kernel.get_value(), quantize(w[p], NVFP4, 0, global_scale=shared))
    for p in ("layers/0/self_attn/o_proj", "layers/1/mlp/down_proj"):  # not fused: its own scale
        _same(q[p].kernel.get_value(), quantize(w[p], NVFP4, 0))
    assert all(layer.weight_method == "rtn" for layer in q.values())
    y = nnx.jit(lambda m, x: m(x))(m, jnp.ones((2, 64)))
    assert bool(jnp.all(jnp.isfinite(y)))


def test_opt_out_and_other_schemes_keep_their_own_scales():
    m = Model()
    w = _floats(m)
    quantize_model(m, [Rule(".*", "NVFP4A16")], fuse_global_scales=False)
    for p, layer in _linears(m).items():
        _same(layer.kernel.get_value(), quantize(w[p], NVFP4, 0))
    m = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no global scale: nothing to share, nothing to warn about
        quantize_model(m, [Rule(".*", "W4A16:g32")])
    for p, layer in _linears(m).items():
        _same(layer.kernel.get_value(), quantize(w[p], parse_scheme("W4A16:g32").weights, 0))


def test_explicit_groups_are_exactly_those():
    m = Model()
    w = _floats(m)
    group = ("layers/0/self_attn/o_proj", "layers/1/mlp/down_proj")
    quantize_model(m, [Rule(".*", "NVFP4A16")], fuse_global_scales=[group])
    q = _linears(m)
    g = shared_global_scale(group_amax([w[p] for p in group]), NVFP4, jnp.float32)
    for p in q:
        want = quantize(w[p], NVFP4, 0, global_scale=g) if p in group else quantize(w[p], NVFP4, 0)
        _same(q[p].kernel.get_value(), want)


@pytest.mark.parametrize("groups, msg", [
    ([("layers/0/self_attn/q_proj", "nope")], "nope is not quantized with a tensor_group"),
    ([("layers/0/self_attn/q_proj", "layers/0/self_attn/k_proj"), ("layers/0/self_attn/k_proj",
                                                                   "layers/0/self_attn/v_proj")], "in two groups"),
    (["layers/0/self_attn/q_proj"], "sequence of groups"),
])
def test_bad_explicit_groups_leave_the_model_untouched(groups, msg):
    m = Model()
    with pytest.raises(ModelError, match=msg):
        quantize_model(m, [Rule(".*", "NVFP4A16")], fuse_global_scales=groups)
    assert not any(isinstance(x, QLinear) for x in _linears(m).values())
    with pytest.raises(ModelError, match="layers/0/mlp/up_proj is not quantized with a tensor_group"):
        quantize_model(m, [Rule(r".*self_attn.*", "NVFP4A16"), Rule(".*", "FP8_DYNAMIC")],
                       fuse_global_scales=[("layers/0/self_attn/q_proj", "layers/0/mlp/up_proj")])


def test_partly_quantized_group_warns_and_keeps_own_scales():
    m = Model()
    w = _floats(m)
    with pytest.warns(UserWarning, match=r"layers/0/self_attn/q_proj, layers/0/self_attn/k_proj, "
                                         r"layers/0/self_attn/v_proj are fused siblings .* only "
                                         r"layers/0/self_attn/q_proj, layers/0/self_attn/k_proj take"):
        quantize_model(m, [Rule(r"layers/0/self_attn/v_proj", None), Rule(".*", "NVFP4A16")])
    q = _linears(m)
    assert isinstance(q["layers/0/self_attn/v_proj"], nnx.Linear)
    for p in ("layers/0/self_attn/q_proj", "layers/0/self_attn/k_proj"):
        _same(q[p].kernel.get_value(), quantize(w[p], NVFP4, 0))
    g = shared_global_scale(group_amax([w[f"layers/1/self_attn/{n}"] for n in SIBLINGS["self_attn"]]), NVFP4,
                            jnp.float32)  # the complete groups still share
    _same(q["layers/1/self_attn/k_proj"].kernel.get_value(), quantize(w["layers/1/self_attn/k_proj"], NVFP4, 0,
                                                                      global_scale=g))


def test_qat_and_weight_searches_say_they_do_not_share():
    with pytest.warns(UserWarning, match="only round-to-nearest PTQ shares global scales"):
        quantize_model(Model(), [Rule(".*", "NVFP4A16")], mode="qat")
    with pytest.warns(UserWarning, match="weight_search='mse'"):
        quantize_model(Model(), [Rule(".*", "NVFP4A16")], weight_search="mse")
    with pytest.raises(ModelError, match="only round-to-nearest PTQ"):
        quantize_model(Model(), [Rule(".*", "NVFP4A16")], mode="qat",
                       fuse_global_scales=[("layers/0/mlp/gate_proj", "layers/0/mlp/up_proj")])


def test_calibrated_round_to_nearest_shares_too():
    m = Model()
    w = _floats(m)
    x = jax.random.normal(jax.random.key(0), (4, 64))
    quantize_model(m, [Rule(".*", "NVFP4")], calibration_data=[x, 2 * x])
    q = _linears(m)
    for g in _groups(w):
        shared = shared_global_scale(group_amax([w[p] for p in g]), NVFP4, jnp.float32)
        for p in g:
            _same(q[p].kernel.get_value(), quantize(w[p], NVFP4, 0, global_scale=shared))
            assert q[p].input_global_scale is not None  # static activation scales from calibration kept


class ScanLayer(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(64, 32, rngs=rngs)
        self.up_proj = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tile(self.gate_proj(x) * self.up_proj(x), 2)


class Scanned(nnx.Module):
    def __init__(self):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return ScanLayer(rngs)
        self.layers = create(nnx.Rngs(0))
        k = self.layers.up_proj.kernel
        k.set_value(k.get_value() * jnp.array([1.0, 9.0, 0.2])[:, None, None])  # a different amax per layer

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)
        return body(x, self.layers)


def test_stacked_siblings_share_per_stacked_layer():
    m = Scanned()
    gate, up = m.layers.gate_proj.kernel.get_value(), m.layers.up_proj.kernel.get_value()
    quantize_model(m, [Rule(".*", "NVFP4A16")])
    qg, qu = m.layers.gate_proj.kernel.get_value(), m.layers.up_proj.kernel.get_value()
    assert qg.global_scale.shape == (3, 1)
    for i in range(3):
        g = shared_global_scale(group_amax([gate[i], up[i]]), NVFP4, jnp.float32)
        _same(jax.tree.map(lambda a: a[i], qg), quantize(gate[i], NVFP4, 0, global_scale=g))
        _same(jax.tree.map(lambda a: a[i], qu), quantize(up[i], NVFP4, 0, global_scale=g))
    y = m(jnp.ones((2, 64)))
    assert y.shape == (2, 64) and bool(jnp.all(jnp.isfinite(y)))
