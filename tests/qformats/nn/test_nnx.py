"""qformats.nn on NNX: QLinear, quantize_model (in place, rules, containers, sharing), calibration, QAT → convert."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats import dequantize, presets, quantize
from qformats.errors import ModelError
from qformats.nn import QLinear, QuantStat, Rule, convert, param_bytes, quantize_model, quantized_layers
from qformats.qarray import QArray


class Block(nnx.Module):
    def __init__(self, shared, rngs):
        self.shared = shared
        self.up = nnx.Linear(128, 256, rngs=rngs)
        self.down = nnx.Linear(256, 128, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.shared(x))))


class Toy(nnx.Module):
    """Linear layers in attributes, an nnx.List, an nnx.Dict, and one shared across blocks."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        shared = nnx.Linear(128, 128, rngs=rngs)
        self.blocks = nnx.List([Block(shared, rngs) for _ in range(2)])
        self.heads = nnx.Dict({"cls": nnx.Linear(128, 32, rngs=rngs)})
        self.norm = nnx.LayerNorm(128, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.heads["cls"](self.norm(x))


X = jax.random.normal(jax.random.key(1), (4, 128))
# one jitted forward for the whole module: models of the same structure (graphdef) reuse its trace and executable
FWD = nnx.jit(lambda m, x: m(x))
PATHS = ["blocks/0/down", "blocks/0/shared", "blocks/0/up", "blocks/1/down", "blocks/1/up", "heads/cls"]


def _manual(model: Toy, x, scheme_name, acts=False):
    """The reference forward with every kernel replaced by dequantize(quantize(kernel))."""
    ss = presets[scheme_name]

    def lin(m, x):
        if acts and ss.input_activations is not None:
            x = dequantize(quantize(x, ss.input_activations, -1))
        w = dequantize(quantize(m.kernel.get_value(), ss.weights, 0))
        y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return y if m.bias is None else y + m.bias.get_value()

    for b in model.blocks:
        h = lin(b.shared, x)
        x = x + lin(b.down, jax.nn.gelu(lin(b.up, h)))
    return lin(model.heads["cls"], model.norm(x))


@pytest.mark.parametrize("name", ["W4A16", "FP8_DYNAMIC", "NVFP4A16"])
def test_ptq_swaps_in_place_and_matches_reference(name):
    ref_model = Toy()
    want = _manual(ref_model, X, name, acts=True)
    model = Toy()
    ids = id(model), id(model.blocks), id(model.heads)
    out = quantize_model(model, [Rule(".*", name)])
    assert out is model and (id(model), id(model.blocks), id(model.heads)) == ids
    assert sorted(quantized_layers(model)) == PATHS
    # the shared Linear became one shared QLinear
    assert isinstance(model.blocks[0].shared, QLinear) and model.blocks[0].shared is model.blocks[1].shared
    assert isinstance(model.heads["cls"], QLinear)
    got = FWD(model, X)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_param_bytes_shrink_exactly_to_qarray_nbytes():
    model = Toy()
    dense = param_bytes(model)
    layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
    kernel_bytes = sum(m.kernel.get_value().nbytes for m in layers)
    quantize_model(model, [Rule(".*", "W4A16")])
    q = quantized_layers(model)
    assert all(isinstance(m.kernel.get_value(), QArray) for m in q.values())
    packed = sum(m.kernel.get_value().nbytes for m in q.values())
    assert param_bytes(model) == dense - kernel_bytes + packed


def test_int4_takes_half_of_int8():
    m4, m8 = Toy(), Toy()
    quantize_model(m4, [Rule(".*", "W4A16")])
    quantize_model(m8, [Rule(".*", "W8A16")])
    k4 = sum(m.kernel.get_value().codes.nbytes for m in quantized_layers(m4).values())
    k8 = sum(m.kernel.get_value().codes.nbytes for m in quantized_layers(m8).values())
    assert 2 * k4 == k8
    assert param_bytes(m4) - param_bytes(m8) == k4 - k8  # same scales and biases, codes halve


def test_rules_first_match_wins_none_skips_and_unused_warns():
    model = Toy()
    rules = [Rule(r"heads/.*", None), Rule(r"blocks/\d+/up", "W8A16"), Rule(r".*", "FP8_DYNAMIC"),
             Rule(r"nothing/here", "W4A16")]
    with pytest.warns(UserWarning, match="nothing/here"):
        quantize_model(model, rules)
    q = quantized_layers(model)
    assert "heads/cls" not in q and isinstance(model.heads["cls"], nnx.Linear)
    assert q["blocks/0/up"].schemes.name == "W8A16"
    assert q["blocks/0/down"].schemes.name == "FP8_DYNAMIC"


G96 = __import__("qformats").QuantScheme("int4", "group", group_size=96)


@pytest.mark.parametrize("rules, msg", [
    ([Rule("blocks/(", "W4A16")], "not a valid regex"),
    ([Rule(".*", "W9A99")], "unknown preset"),
    ([Rule("heads/.*", "W8A16"), Rule(".*", G96)], "blocks/"),  # 128 % 96 → names the path
])
def test_bad_rules_raise_and_leave_model_untouched(rules, msg):
    model = Toy()
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(ModelError, match=msg):
        quantize_model(model, rules)
    assert not quantized_layers(model)
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_group_error_message_names_size_and_features():
    with pytest.raises(ModelError, match=r"heads/cls: weight group size 96 .* does not divide in_features = 128"):
        quantize_model(Toy(), [Rule("heads/cls", G96)])


def test_qat_grads_reach_every_float_weight_and_convert_is_identical():
    model = Toy()
    quantize_model(model, [Rule(".*", "W4A16")], mode="qat")
    q = quantized_layers(model)
    assert all(m.mode == "qat" and not isinstance(m.kernel.get_value(), QArray) for m in q.values())

    def loss(m):
        return jnp.mean(m(X) ** 2)

    grads = nnx.jit(nnx.grad(loss))(model)
    for path, m in q.items():
        node = grads
        for part in path.split("/"):
            node = node[int(part)] if part.isdigit() else node[part]
        assert float(jnp.abs(node["kernel"].get_value()).sum()) > 0, path
    # one SGD step changes the weights, then convert: outputs identical
    opt = nnx.Optimizer(model, __import__("optax").sgd(1e-2), wrt=nnx.Param)
    opt.update(model, grads)
    fwd = FWD
    before = fwd(model, X)
    dense_bytes = param_bytes(model)
    convert(model)
    assert all(m.mode == "ptq" and isinstance(m.kernel.get_value(), QArray) for m in q.values())
    np.testing.assert_array_equal(np.asarray(fwd(model, X)), np.asarray(before))
    assert param_bytes(model) < dense_bytes / 3


def test_calibration_static_fp8_scale_is_observed_amax():
    model = Toy()
    batches = [X * (i + 1) for i in range(3)]
    quantize_model(model, [Rule("heads/cls", "FP8")], calibration_data=batches)
    layer = model.heads["cls"]
    assert layer.mode == "ptq" and layer.calib_amax is None
    scale = layer.input_scale.get_value()
    assert isinstance(layer.input_scale, QuantStat) and scale.shape == (1,)
    # the head's input is the LayerNorm output of the largest batch
    ref = Toy()
    h = ref.norm(_trunk(ref, batches[0]))
    amax = max(float(jnp.max(jnp.abs(ref.norm(_trunk(ref, b))))) for b in batches)
    np.testing.assert_allclose(float(scale[0]), amax / 448.0, rtol=1e-6)
    # static scales are used: outputs are those of quantize(x, scale=static)
    ss = presets["FP8"]
    xq = dequantize(quantize(h, ss.input_activations, -1, scale=scale))
    w = dequantize(quantize(ref.heads["cls"].kernel.get_value(), ss.weights, 0))
    want = xq @ w + ref.heads["cls"].bias.get_value()
    np.testing.assert_allclose(np.asarray(layer(h)), np.asarray(want), rtol=1e-5, atol=1e-5)


def _trunk(m, x):
    for b in m.blocks:
        x = b(x)
    return x


def test_calibration_nvfp4_global_scale_and_mse_weights_improve():
    batches = [X, X * 2]
    rtn, cal = Toy(), Toy()
    ref = FWD(Toy(), X)
    rules = [Rule(r"blocks/\d/up|heads/cls", "NVFP4")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(rtn, rules)
    quantize_model(cal, rules, calibration_data=batches, weight_search="mse")
    g = cal.heads["cls"].input_global_scale.get_value()
    assert g.shape == (1,) and float(g[0]) > 0
    err = lambda m: float(jnp.mean((FWD(m, X) - ref) ** 2))  # noqa: E731
    assert err(cal) < err(rtn)


@pytest.mark.parametrize("scheme", ["W8A16", "FP8_DYNAMIC", "W4A16"])
def test_weight_search_never_loses_to_rtn_on_the_calibration_batches(scheme):
    """compare_rtn: the packed model's output error on the calibration batches is the smaller of the
    searched and the round-to-nearest model's (each measured independently here)."""
    batches = [X, X * 2]
    rules = [Rule(".*", scheme)]
    float_model = Toy()
    ref = [FWD(float_model, b) for b in batches]
    err = lambda m: sum(float(jnp.sum((FWD(m, b) - r) ** 2))  # noqa: E731
                        for b, r in zip(batches, ref))
    rtn, unguarded, guarded = Toy(), Toy(), Toy()
    quantize_model(rtn, rules, calibration_data=batches)
    quantize_model(unguarded, rules, calibration_data=batches, weight_search="mse", compare_rtn=False)
    quantize_model(guarded, rules, calibration_data=batches, weight_search="mse")
    e_rtn, e_search, e = err(rtn), err(unguarded), err(guarded)
    assert e == min(e_rtn, e_search)
    layer = guarded.heads["cls"]
    methods = {m.weight_method for m in quantized_layers(guarded).values()}
    assert methods == {"rtn"} if e_rtn <= e_search else "mse" in methods  # per layer: where the search won
    same = rtn if e_rtn <= e_search else unguarded
    for a, b in zip(jax.tree.leaves(layer.kernel.get_value()), jax.tree.leaves(same.heads["cls"].kernel.get_value())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class One(nnx.Module):
    def __init__(self, k=256, n=64):
        self.lin = nnx.Linear(k, n, rngs=nnx.Rngs(5))

    def __call__(self, x):
        return self.lin(x)


@pytest.mark.parametrize("scheme,actorder", [("W4A16", "static"), ("FP8_DYNAMIC", "static"), ("NVFP4A16", "static"),
                                             ("W4A16", None)])
def test_gptq_layer_uses_the_calibration_moments(scheme, actorder):
    """quantize_model(weight_search="gptq") packs exactly gptq_quantize(W, scheme, E[x x^T]) of the inputs
    the layer saw, and lowers the output error below round-to-nearest's."""
    from qformats.algorithms.gptq import gptq_quantize
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(256, 256)) / 16 + np.eye(256)  # correlated inputs: where GPTQ helps
    batches = [jnp.asarray(rng.normal(size=(64, 256)) @ mix, jnp.float32) for _ in range(3)]
    model, rtn = One(), One()
    w = model.lin.kernel.get_value()
    quantize_model(model, [Rule(".*", scheme)], calibration_data=batches, weight_search="gptq", compare_rtn=False,
                   actorder=actorder)
    quantize_model(rtn, [Rule(".*", scheme)])
    xs = jnp.concatenate(batches).astype(jnp.float32)
    total = jnp.zeros((256, 256), jnp.float32)
    for b in batches:  # summed batch by batch, as the calibrating layer does (GPTQ amplifies 1-ulp differences of H)
        total = total + b.T @ b
    h = total / xs.shape[0]
    want = gptq_quantize(w, presets[scheme].weights, h, actorder=actorder)
    got = model.lin.kernel.get_value()
    assert model.lin.weight_method == "gptq"
    same = np.mean(np.asarray(got.codes) == np.asarray(want.codes))
    assert same == 1.0, same
    for a, b in zip(jax.tree.leaves(got)[1:], jax.tree.leaves(want)[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # scales (round-to-nearest's)
    ref = xs @ w + model.lin.bias.get_value()
    err = lambda m: float(jnp.sum((m(xs) - ref) ** 2))  # noqa: E731
    assert err(model) < 0.9 * err(rtn)


def test_gptq_needs_calibration_data_and_fitting_layers():
    with pytest.raises(ModelError, match="calibration_data"):
        quantize_model(One(), [Rule(".*", "W4A16")], weight_search="gptq")
    with pytest.raises(ModelError, match="weight_search"):
        quantize_model(One(), [Rule(".*", "W4A16")], weight_search="gpt")
    m = One(k=4224)
    with pytest.raises(ModelError, match="lin: GPTQ needs"):
        quantize_model(m, [Rule(".*", "W4A16")],
                       calibration_data=[jnp.ones((2, 4224))], weight_search="gptq")
    assert isinstance(m.lin, nnx.Linear)


def test_without_calibration_static_scheme_warns_and_runs_dynamic():
    """FP8's static per-tensor activation scale, uncalibrated, becomes a dynamic per-tensor one: the output is
    the manual reference quantizing x with quantize(x, acts, -1) (FP8 multiplies codes: float rounding only)."""
    want = _manual(Toy(), X, "FP8", acts=True)
    model = Toy()
    with pytest.warns(UserWarning, match="calibration_data"):
        quantize_model(model, [Rule(".*", "FP8")])
    assert model.heads["cls"].input_scale is None
    np.testing.assert_allclose(np.asarray(model(X)), np.asarray(want), rtol=2e-5, atol=2e-5)
    # and not the weight-only result: the activations were quantized
    weight_only = _manual(Toy(), X, "FP8", acts=False)
    assert np.abs(np.asarray(model(X)) - np.asarray(weight_only)).max() > 1e-3


def test_split_merge_and_jit_roundtrip():
    model = Toy()
    quantize_model(model, [Rule(".*", "MXFP4A16")])
    graphdef, state = nnx.split(model)
    m2 = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    np.testing.assert_array_equal(np.asarray(m2(X)), np.asarray(model(X)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert any(leaf.dtype == jnp.uint8 for leaf in leaves)


def test_qlinear_direct_construction_bias_and_dtype():
    w = jax.random.normal(jax.random.key(3), (128, 16)) * 0.1
    b = jnp.arange(16, dtype=jnp.float32)
    layer = QLinear(quantize(w, presets["W8A16"].weights, 0), b, presets["W8A16"])
    y = layer(X)
    want = X @ dequantize(quantize(w, presets["W8A16"].weights, 0)) + b
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelError, match="mode"):
        QLinear(w, None, presets["W8A16"], mode="bogus")


class Mixed(nnx.Module):
    """LinearGeneral (multi-axis in and out) and Einsum (attention-style projections)."""

    def __init__(self):
        rngs = nnx.Rngs(5)
        self.qkv = nnx.Einsum("btd,dnh->btnh", (128, 4, 32), (4, 32), rngs=rngs)
        self.out = nnx.LinearGeneral((4, 32), 128, axis=(-2, -1), rngs=rngs)
        self.mix = nnx.Einsum("btd,tde->be", (8, 16, 32), rngs=rngs)  # contracts t and d: weight-only

    def __call__(self, x):
        return self.out(self.qkv(x))


XT = jax.random.normal(jax.random.key(7), (2, 8, 128))


@pytest.mark.parametrize("name", ["FP8_DYNAMIC"])
def test_linear_general_and_einsum(name):
    model = Mixed()
    ss = presets[name]
    kq = model.qkv.kernel.get_value()
    ko = model.out.kernel.get_value()

    def fq(k):  # [K, N] view quantized along K, back to the kernel's shape
        return dequantize(quantize(k.reshape(128, -1), ss.weights, 0)).reshape(k.shape)

    def act(x):
        return dequantize(quantize(x, ss.input_activations, -1)) if ss.input_activations else x

    h = jnp.einsum("btd,dnh->btnh", act(XT), fq(kq)) + model.qkv.bias.get_value()
    want = act(h.reshape(2, 8, 128)) @ fq(ko.reshape(128, 128)) + model.out.bias.get_value()
    quantize_model(model, [Rule("qkv|out", name)])
    from qformats.nn import QEinsum, QLinearGeneral
    assert isinstance(model.qkv, QEinsum) and isinstance(model.out, QLinearGeneral)
    assert model.qkv.kernel.get_value().shape == (128, 128)
    got = FWD(model, XT)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=5e-5, atol=5e-5)


def test_einsum_over_several_axes_is_weight_only():
    with pytest.raises(ModelError, match="mix: einsum .* use a weight-only scheme"):
        quantize_model(Mixed(), [Rule("mix", "FP8_DYNAMIC")])
    model = Mixed()
    w = model.mix.kernel.get_value()
    x = jax.random.normal(jax.random.key(8), (2, 8, 16))
    quantize_model(model, [Rule("mix", "FP8_E4M3")])
    wq = dequantize(quantize(w.reshape(128, 32), presets["FP8_E4M3"].weights, 0)).reshape(w.shape)
    want = jnp.einsum("btd,tde->be", x, wq)
    np.testing.assert_allclose(np.asarray(model.mix(x)), np.asarray(want), rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("observer", ["mse", "percentile"])
def test_calibration_with_other_observers_gives_smaller_static_scale(observer):
    batches = [X * (i + 1) for i in range(3)]
    mm, other = Toy(), Toy()
    quantize_model(mm, [Rule("heads/cls", "FP8")], calibration_data=batches)
    quantize_model(other, [Rule("heads/cls", "FP8")], calibration_data=batches, observer=observer)
    s_mm = float(mm.heads["cls"].input_scale.get_value()[0])
    s_o = float(other.heads["cls"].input_scale.get_value()[0])
    assert 0 < s_o <= s_mm if observer == "mse" else 0 < s_o < s_mm  # fp8: clipping rarely pays


class Scanned(nnx.Module):
    """Three layers stacked with nnx.vmap and run with nnx.scan: the Linear kernel is [3, 128, 128]."""

    def __init__(self):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return ScanBlock(rngs)
        self.layers = create(nnx.Rngs(0))

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return body(x, self.layers)


class ScanBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(128, 128, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.lin(x))


@pytest.mark.parametrize("mode", ["ptq", "qat"])
def test_scanned_layers(mode):
    model = Scanned()
    k = model.layers.lin.kernel.get_value()
    b = model.layers.lin.bias.get_value()
    ss = presets["W4A16"]
    want = X
    for i in range(3):
        want = want + jax.nn.gelu(want @ dequantize(quantize(k[i], ss.weights, 0)) + b[i])
    quantize_model(model, [Rule(".*", "W4A16")], mode=mode)
    lin = model.layers.lin
    assert isinstance(lin, QLinear) and lin.stacked == (3,)
    if mode == "ptq":
        q = lin.kernel.get_value()
        assert q.shape == (128, 128) and q.codes.shape == (3, 128, 64) and q.scale.shape == (3, 128, 1)
    else:
        convert(model)
        assert lin.kernel.get_value().codes.shape == (3, 128, 64)
    got = FWD(model, X)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelError, match="stacked"):
        quantize_model(Scanned(), [Rule(".*", "FP8_BLOCK")])


class Unrolled(nnx.Module):
    """The three layers of a Scanned model as separate Linears run in a Python loop."""

    def __init__(self, scanned):
        k = scanned.layers.lin.kernel.get_value()
        b = scanned.layers.lin.bias.get_value()
        self.blocks = nnx.List([ScanBlock(nnx.Rngs(i)) for i in range(3)])
        for i, blk in enumerate(self.blocks):
            blk.lin.kernel.set_value(k[i])
            blk.lin.bias.set_value(b[i])

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


@pytest.mark.parametrize("scheme,search", [("FP8", "rtn"), ("W4A16", "mse"), ("NVFP4", "rtn"), ("W4A16", "gptq")])
def test_scanned_layers_calibrate_like_unrolled_ones(scheme, search):
    """Calibrating a scanned stack gives each layer the scales (and searched weights) it gets unrolled."""
    rng = np.random.default_rng(3)
    batches = [jnp.asarray(rng.normal(size=(4, 8, 128)), jnp.float32) * (1 + i) for i in range(2)]
    scanned = Scanned()
    unrolled = Unrolled(scanned)
    quantize_model(scanned, [Rule(".*", scheme)], calibration_data=batches, weight_search=search)
    quantize_model(unrolled, [Rule(".*", scheme)], calibration_data=batches, weight_search=search)
    lin = scanned.layers.lin
    assert lin.stacked == (3,) and lin.mode == "ptq" and lin.calib_sq is None
    q = lin.kernel.get_value()
    for i, blk in enumerate(unrolled.blocks):
        ref = blk.lin
        for got, want in zip(jax.tree.leaves(q), jax.tree.leaves(ref.kernel.get_value())):
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))
        for name in ("input_scale", "input_global_scale"):
            r = getattr(ref, name)
            if r is None:
                assert getattr(lin, name) is None
            else:
                np.testing.assert_array_equal(np.asarray(getattr(lin, name).get_value()[i]), np.asarray(r.get_value()))
    assert (lin.input_scale is not None) == (scheme == "FP8")
    got = FWD(scanned, X)
    want = FWD(unrolled, X)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_calibration_failure_or_no_batches_leaves_model_unchanged():
    model = Toy()
    with pytest.raises(ModelError, match="no batches"):
        quantize_model(model, [Rule(".*", "FP8")], calibration_data=[])
    assert not quantized_layers(model)

    def bad_batches():
        yield X
        yield jnp.ones((4, 7))  # wrong feature size: the forward pass fails

    with pytest.raises(Exception):
        quantize_model(model, [Rule(".*", "FP8")], calibration_data=bad_batches())
    assert not quantized_layers(model)
    assert isinstance(model.blocks[0].shared, nnx.Linear) and model.blocks[0].shared is model.blocks[1].shared


def test_bf16_model_keeps_bf16_scales_and_outputs():
    rngs = nnx.Rngs(0)
    lin = nnx.Linear(128, 64, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
    holder = nnx.Dict({"lin": lin})
    w = lin.kernel.get_value()
    quantize_model(holder, [Rule(".*", "W4A16")])
    q = holder["lin"].kernel.get_value()
    assert q.dtype == jnp.bfloat16 and q.scale.dtype == jnp.bfloat16  # compressed-tensors: scale in w's dtype
    x = X.astype(jnp.bfloat16)
    y = holder["lin"](x)
    assert y.dtype == jnp.bfloat16
    want = x.astype(jnp.float32) @ dequantize(quantize(w, presets["W4A16"].weights, 0)).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)


def test_packed_model_trains_its_float_params_with_the_packed_filter():
    from qformats.nn import PackedParam

    model = quantize_model(Toy(), [Rule(".*", "W4A16")])
    assert isinstance(model.heads["cls"].kernel, PackedParam) and isinstance(model.heads["cls"].kernel, nnx.Param)
    trainable = nnx.All(nnx.Param, nnx.Not(PackedParam))
    grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2), argnums=nnx.DiffState(0, trainable))(model)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(jnp.issubdtype(g.dtype, jnp.floating) for g in leaves)
    assert float(jnp.abs(grads["heads"]["cls"]["bias"].get_value()).sum()) > 0


def test_gptq_dampening_reaches_the_layer():
    """quantize_model(dampening_frac=d) runs GPTQ with H += d * mean(diag H) * I: the codes are gptq_quantize's
    at that dampening, and differ from the default 0.01's."""
    from qformats.algorithms.gptq import gptq_quantize
    rng = np.random.default_rng(1)
    mix = rng.normal(size=(256, 256)) / 16 + np.eye(256)
    batch = jnp.asarray(rng.normal(size=(96, 256)) @ mix, jnp.float32)
    h = (batch.T @ batch) / batch.shape[0]
    codes = {}
    for d in (0.01, 0.3):
        model = One()
        w = model.lin.kernel.get_value()
        quantize_model(model, [Rule(".*", "W4A16")], calibration_data=[batch], weight_search="gptq",
                       compare_rtn=False, dampening_frac=d)
        want = gptq_quantize(w, presets["W4A16"].weights, h, actorder="static", dampening_frac=d)
        codes[d] = np.asarray(model.lin.kernel.get_value().codes)
        np.testing.assert_array_equal(codes[d], np.asarray(want.codes))
    assert not np.array_equal(codes[0.01], codes[0.3])
