"""qformats.nn on linen: QDense / QDenseGeneral / QEinsum, and quantize_linen (params transform + interceptor for
Dense, DenseGeneral, Einsum) with the NNX rules; outputs equal the NNX layers and the float modules run with
dequantized kernels, bit for bit."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qformats
from qformats import dequantize, presets, quantize
from qformats.errors import ModelError
from qformats.nn import QDense, QDenseGeneral, Rule, param_bytes, quantize_linen
from qformats.nn import nnx_layers
from qformats.nn.linen import QEinsum
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


# ---- QDenseGeneral / QEinsum ------------------------------------------------------------------------------

SCHEMES = ["W4A16", "FP8_DYNAMIC", "NVFP4", "MXFP4"]
X4 = jax.random.normal(jax.random.key(3), (2, 3, 4, 32))
XT = jax.random.normal(jax.random.key(4), (2, 5, 128))


@contextlib.contextmanager
def dequantized_path():
    """Every packed matmul dequantizes (no code path, no kernels) inside; for functions traced inside."""
    qformats.set_kernels_enabled(False)
    try:
        yield
    finally:
        qformats.set_kernels_enabled(True)


def _act_fn(ss):
    a = ss.input_activations
    return (lambda t: t) if a is None else (lambda t: dequantize(quantize(t, a, -1)))


def _float_kernel(q, shape, perm):
    """dequantize(W [K, N]) back to the float kernel layout (contracted axes were moved first)."""
    w = dequantize(q).reshape(tuple(shape[i] for i in perm))
    return jnp.transpose(w, tuple(sorted(range(len(perm)), key=lambda i: perm[i])))


@pytest.mark.parametrize("name", SCHEMES)
def test_qdense_general_equals_nnx_and_float_dense_general(name):
    ss = presets[name]
    layer = QDenseGeneral((2, 8), name, axis=(-2, -1))
    v = layer.init(jax.random.key(1), X4)
    q, b = v["params"]["kernel"], v["params"]["bias"] + 0.5
    assert isinstance(q, QArray) and q.shape == (128, 16) and b.shape == (2, 8)
    # init: DenseGeneral's float kernel (same key) flattened to [K, N] and quantized along K
    fv = nn.DenseGeneral((2, 8), axis=(-2, -1)).init(jax.random.key(1), X4)
    assert np.array_equal(q.codes, quantize(fv["params"]["kernel"].reshape(128, 16), ss.weights, 0).codes)
    v = {"params": {"kernel": q, "bias": b}}
    got = jax.jit(layer.apply)(v, X4)
    assert got.shape == (2, 3, 2, 8)
    nnx_layer = nnx_layers.QLinearGeneral(q, b, ss, in_features=(4, 32), out_features=(2, 8), axis=(-2, -1))
    np.testing.assert_array_equal(np.asarray(layer.apply(v, X4)), np.asarray(nnx_layer(X4)))
    # the float module with the dequantized kernel, on activations quantized along the flattened K
    xq = _act_fn(ss)(X4.reshape(2, 3, 128)).reshape(X4.shape)
    want = jax.jit(nn.DenseGeneral((2, 8), axis=(-2, -1)).apply)(
        {"params": {"kernel": dequantize(q).reshape(4, 32, 2, 8), "bias": b}}, xq)
    with dequantized_path():  # FP8_DYNAMIC multiplies codes (scaled_dot) otherwise: see test_w8a8_on_codes
        got = jax.jit(lambda v, x: layer.apply(v, x))(v, X4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_qdense_general_rejects_batch_dims_and_bad_groups():
    with pytest.raises(ModelError, match="QDenseGeneral bd: batch_dims"):
        QDenseGeneral(4, "W8A16", batch_dims=(0,), name="bd").init(jax.random.key(0), X4)
    with pytest.raises(ModelError, match="g: weight group size 128 .* in_features = 32"):
        QDenseGeneral(4, "W4A16", name="g").init(jax.random.key(0), X4)
    with pytest.raises(ModelError, match="unknown preset"):
        QDenseGeneral(4, "NOPE").init(jax.random.key(0), X4)


@pytest.mark.parametrize("eq,name", [("bti,hid->bthd", s) for s in SCHEMES]
                         + [("...i,hid->...hd", "W4A16"), ("...i,hid->...hd", "NVFP4")])
def test_qeinsum_equals_nnx_and_float_einsum(eq, name):
    ss = presets[name]
    shape, perm = (2, 128, 8), (1, 0, 2)  # the contracted i (kernel axis 1) is moved first
    layer = QEinsum(shape, eq, name)
    v = layer.init(jax.random.key(5), XT)
    q, b = v["params"]["kernel"], v["params"]["bias"] + 0.5
    fv = nn.Einsum(shape, eq).init(jax.random.key(5), XT)
    assert q.shape == (128, 16) and b.shape == fv["params"]["bias"].shape == (2, 8)
    assert np.array_equal(q.codes, quantize(jnp.transpose(fv["params"]["kernel"], perm).reshape(128, 16),
                                            ss.weights, 0).codes)
    v = {"params": {"kernel": q, "bias": b}}
    got = jax.jit(layer.apply)(v, XT)
    assert got.shape == (2, 5, 2, 8)
    want = nn.Einsum(shape, eq).apply({"params": {"kernel": _float_kernel(q, shape, perm), "bias": b}},
                                      _act_fn(ss)(XT))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref = nnx_layers.QEinsum(q, b, ss, einsum_str=eq, kernel_shape=shape)  # the NNX layer: the same function
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref(XT)))


def test_qeinsum_over_several_axes_is_weight_only():
    x = jax.random.normal(jax.random.key(6), (2, 8, 16))
    with pytest.raises(ModelError, match="QEinsum mix: einsum .* use a weight-only scheme"):
        QEinsum((8, 16, 32), "btd,tde->be", "FP8_DYNAMIC", name="mix").init(jax.random.key(0), x)
    layer = QEinsum((8, 16, 32), "btd,tde->be", "FP8_E4M3", use_bias=False)
    v = layer.init(jax.random.key(0), x)
    assert v["params"]["kernel"].shape == (128, 32)
    want = jnp.einsum("btd,tde->be", x, dequantize(v["params"]["kernel"]).reshape(8, 16, 32))
    np.testing.assert_array_equal(np.asarray(layer.apply(v, x)), np.asarray(want))


# ---- quantize_linen on Dense + DenseGeneral + Einsum (+ nn.scan) --------------------------------------------
class Mixed(nn.Module):
    @nn.compact
    def __call__(self, x):  # x [B, T, 32]
        h = nn.Dense(64, name="up")(x)
        h = nn.Einsum((2, 64, 32), "btd,ndh->btnh", name="qkv")(h)  # contracted d is kernel axis 1
        h = nn.DenseGeneral(32, axis=(-2, -1), name="out")(h)       # kernel [2, 32, 32]
        mixed = nn.Einsum((4, 32, 16), "btd,tde->be", name="mix")(h)  # contracts t and d
        return nn.Dense(8, name="head")(h), mixed


XM = jax.random.normal(jax.random.key(8), (2, 4, 32))
MIXED_RULES = [Rule("head", None), Rule("up", "FP8_DYNAMIC"), Rule("qkv", "MXFP4"), Rule("out", "NVFP4"),
               Rule("mix", "W4A16")]
# float kernel layout of each quantized layer: (shape, perm moving the contracted axes first)
MIXED_LAYOUT = {"up": ((32, 64), (0, 1)), "qkv": ((2, 64, 32), (1, 0, 2)), "out": ((2, 32, 32), (0, 1, 2)),
                "mix": ((4, 32, 16), (0, 1, 2))}


@pytest.fixture(scope="module")
def mixed():
    m = Mixed()
    return m, jax.jit(m.init)(jax.random.key(9), XM)


def _reference(module, params, qparams, rules_by_path, *args):
    """The float module with every packed kernel replaced by dequantize(W) reshaped back, and the inputs of
    the quantized layers fake-quantized along the contraction (what QuantizedLinen computes)."""
    fparams = jax.tree.map(lambda a: a, params)
    for path, (shape, perm) in MIXED_LAYOUT.items():
        if path in rules_by_path:
            fparams["params"][path]["kernel"] = _float_kernel(qparams["params"][path]["kernel"], shape, perm)

    def fake_acts(next_fun, args, kwargs, context):
        path = "/".join(context.module.scope.path)
        if context.method_name != "__call__" or path not in rules_by_path:
            return next_fun(*args, **kwargs)
        act, x = _act_fn(presets[rules_by_path[path]]), args[0]
        if isinstance(context.module, nn.DenseGeneral):  # K = the two last axes, flattened
            x = act(x.reshape(x.shape[:-2] + (-1,))).reshape(x.shape)
        elif not (isinstance(context.module, nn.Einsum) and path == "mix"):
            x = act(x)
        return next_fun(x, *args[1:], **kwargs)

    with nn.intercept_methods(fake_acts):
        return module.apply(fparams, *args)


def test_quantize_linen_dense_general_einsum_equal_float_reference(mixed):
    module, params = mixed
    before = jax.tree.map(np.asarray, params)
    qmod, qparams = quantize_linen(module, params, MIXED_RULES, XM)
    p = qparams["params"]
    for path, kn in {"up": (32, 64), "qkv": (64, 64), "out": (64, 32), "mix": (128, 16)}.items():
        assert isinstance(p[path]["kernel"], QArray) and p[path]["kernel"].shape == kn, path
    assert not isinstance(p["head"]["kernel"], QArray)
    assert qmod.schemes["qkv"].name == "MXFP4" and qmod.layouts["qkv"].perm == (1, 0, 2)
    assert qmod.layouts["out"].axis == (2, 3) and qmod.layouts["out"].features == (32,)
    # the input tree is untouched
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before)
    assert not any(isinstance(leaf, QArray) for leaf in jax.tree.leaves(params, is_leaf=lambda t: isinstance(t, QArray)))

    rules_by_path = {r.pattern: r.scheme for r in MIXED_RULES if r.scheme}
    got = jax.jit(qmod.apply)(qparams, XM)
    want = jax.jit(lambda p, q, x: _reference(module, p, q, rules_by_path, x))(params, qparams, XM)
    for g, w in zip(got, want):  # bit-identical, jit against jit (XLA fuses the two programs alike)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    for g, w in zip(qmod.apply(qparams, XM), _reference(module, params, qparams, rules_by_path, XM)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # and eager against eager
    assert param_bytes(qparams) < param_bytes(params)


def test_quantize_linen_equals_nnx_layers(mixed):
    """The intercepted calls compute what QLinear / QEinsum / QLinearGeneral compute, bit for bit."""
    module, params = mixed
    qmod, qparams = quantize_linen(module, params, [Rule("up|qkv|out", "FP8_DYNAMIC"), Rule(".*", None)], XM)
    p, ss = qparams["params"], presets["FP8_DYNAMIC"]
    h = nnx_layers.QLinear(p["up"]["kernel"], p["up"]["bias"], ss)(XM)
    h = nnx_layers.QEinsum(p["qkv"]["kernel"], p["qkv"]["bias"], ss, einsum_str="btd,ndh->btnh",
                           kernel_shape=(2, 64, 32))(h)
    h = nnx_layers.QLinearGeneral(p["out"]["kernel"], p["out"]["bias"], ss, in_features=(2, 32), out_features=(32,),
                                  axis=(-2, -1))(h)
    want = nn.Dense(8).apply({"params": p["head"]}, h)
    np.testing.assert_array_equal(np.asarray(qmod.apply(qparams, XM)[0]), np.asarray(want))


def test_quantize_linen_errors_name_the_path(mixed):
    module, params = mixed
    with pytest.raises(ModelError, match="not a valid regex"):
        quantize_linen(module, params, [Rule("(", "W4A16")], XM)
    with pytest.raises(ModelError, match="unknown preset"):
        quantize_linen(module, params, [Rule(".*", "NOPE")], XM)
    with pytest.raises(ModelError, match="qkv: weight group size 128 .* in_features = 64"):
        quantize_linen(module, params, [Rule("qkv", "W4A16")], XM)
    with pytest.raises(ModelError, match="mix: einsum .* use a weight-only scheme"):
        quantize_linen(module, params, [Rule("mix", "FP8_DYNAMIC")], XM)
    with pytest.raises(ModelError, match="(qkv|out|mix): kernel of shape \\(\\d+, \\d+, \\d+\\) .* pass example inputs"):
        quantize_linen(module, params, [Rule(".*", "FP8_E4M3")])  # 3-D kernels need example inputs
    with pytest.raises(ModelError, match="weight_search"):
        quantize_linen(module, params, [Rule(".*", "FP8_E4M3")], XM, weight_search="bogus")
    with pytest.raises(ModelError, match="example inputs .* failed"):
        quantize_linen(module, params, [Rule(".*", "FP8_E4M3")], XM[..., :5])
    # without example inputs, 2-D Dense kernels still work (and a None rule skips the 3-D ones)
    qmod, qparams = quantize_linen(module, params, [Rule("up", "FP8_E4M3"), Rule(".*", None)])
    assert isinstance(qparams["params"]["up"]["kernel"], QArray) and set(qmod.schemes) == {"up"}


def test_quantize_linen_batch_dims_is_an_error():
    class BD(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.DenseGeneral(4, batch_dims=(0,), name="bd")(x)

    x = jnp.ones((2, 3, 8))
    params = BD().init(jax.random.key(0), x)
    with pytest.raises(ModelError, match="bd: DenseGeneral with batch_dims \\(0,\\)"):
        quantize_linen(BD(), params, [Rule(".*", "FP8_E4M3")], x)
    quantize_linen(BD(), params, [Rule("bd", None)], x)  # left float: fine


def test_einsum_guessed_as_dense_without_examples_is_refused_at_apply():
    """A 2-D Einsum kernel contracted along its axis 1: without example inputs it is packed as a Dense [K, N];
    applying must then fail loudly, never give a wrong answer."""
    class E(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Einsum((16, 32), "bj,ij->bi", name="e")(x)

    x = jnp.ones((2, 32))
    params = E().init(jax.random.key(0), x)
    qmod, qparams = quantize_linen(E(), params, [Rule(".*", "FP8_E4M3")])
    with pytest.raises(ModelError, match="e: .* quantized as"):
        qmod.apply(qparams, x)
    qmod, qparams = quantize_linen(E(), params, [Rule(".*", "FP8_E4M3")], x)  # with examples: right layout
    assert qparams["params"]["e"]["kernel"].shape == (32, 16)
    want = jnp.einsum("bj,ij->bi", x, dequantize(qparams["params"]["e"]["kernel"]).T) + params["params"]["e"]["bias"]
    np.testing.assert_array_equal(np.asarray(qmod.apply(qparams, x)), np.asarray(want))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(64, name="fc")(nn.gelu(x)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return layers(name="layers")(x, None)[0]


def test_quantize_linen_scanned_layers_per_layer():
    x = jax.random.normal(jax.random.key(10), (2, 64))
    module = Scanned()
    params = module.init(jax.random.key(11), x)
    assert params["params"]["layers"]["fc"]["kernel"].shape == (3, 64, 64)
    with pytest.raises(ModelError, match="layers/fc: kernel of shape \\(3, 64, 64\\) .* example inputs"):
        quantize_linen(module, params, [Rule(".*", "FP8_DYNAMIC")])
    with pytest.raises(ModelError, match="layers/fc: block scales .* stacked"):
        quantize_linen(module, params, [Rule(".*", "FP8_BLOCK")], x)
    qmod, qparams = quantize_linen(module, params, [Rule(".*", "FP8_DYNAMIC")], x)
    k = qparams["params"]["layers"]["fc"]["kernel"]
    assert k.shape == (64, 64) and k.codes.shape == (3, 64, 64)  # per-layer QArray, layers on its leaves
    for i in range(3):  # each layer quantized on its own
        np.testing.assert_array_equal(np.asarray(k.codes[i]), np.asarray(
            quantize(params["params"]["layers"]["fc"]["kernel"][i], presets["FP8_DYNAMIC"].weights, 0).codes))
    with dequantized_path():  # the float reference below dequantizes; FP8_DYNAMIC would multiply codes
        got = jax.jit(lambda p, v: qmod.apply(p, v))(qparams, x)
    act = _act_fn(presets["FP8_DYNAMIC"])
    fparams = {"params": {"layers": {"fc": {"kernel": jax.vmap(dequantize)(k),
                                            "bias": params["params"]["layers"]["fc"]["bias"]}}}}

    def fake_acts(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Dense) and context.method_name == "__call__":
            return next_fun(act(args[0]), **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(fake_acts):
        want = module.apply(fparams, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
