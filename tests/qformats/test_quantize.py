"""quantize/dequantize/fake_quantize properties: shapes, storage bytes, pytree behaviour, errors, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import (FormatError, QArray, QuantScheme, SchemeError, dequantize, fake_quantize, presets,
                      quantize)
from qformats.grouping import expected_shapes

KEY = jax.random.key(0)
W = jax.random.normal(KEY, (256, 96), jnp.float32) * 0.05  # a Flax kernel [in, out]

SCHEMES = {
    "FP8_DYNAMIC": presets["FP8_DYNAMIC"].weights,
    "FP8_BLOCK": presets["FP8_BLOCK"].weights,
    "W4A16": presets["W4A16"].weights,
    "W4A16_ASYM": presets["W4A16_ASYM"].weights,
    "W3A16": presets["W3A16"].weights,
    "NVFP4A16": presets["NVFP4A16"].weights,
    "MXFP4A16": presets["MXFP4A16"].weights,
    "MXFP6A16": presets["MXFP6A16"].weights,
    "FP6_E3M2": presets["FP6_E3M2"].weights,
    "FP5_E2M2_G32": presets["FP5_E2M2_G32"].weights,
    "int8_tensor": QuantScheme("int8", "tensor"),
    "fp4_e3m0_bf16scale": QuantScheme("fp4_e3m0", "group", group_size=32, scale_format="bfloat16"),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_shapes_bytes_and_roundtrip(name):
    scheme = SCHEMES[name]
    q = quantize(W, scheme, axis=0)
    q.check()
    assert q.shape == W.shape and q.axis == 0 and q.dtype == W.dtype
    shapes = expected_shapes(scheme, W.shape, 0)
    assert q.codes.shape == shapes["codes"] == (96, (256 * scheme.bits + 7) // 8)
    # storage is packed codes + contracted scales: the real size
    nbytes = q.codes.size * q.codes.dtype.itemsize + q.scale.size * q.scale.dtype.itemsize
    nbytes += 0 if q.zero_point is None else q.zero_point.size
    nbytes += 0 if q.global_scale is None else 4
    assert q.nbytes == nbytes < W.nbytes
    y = dequantize(q)
    assert y.shape == W.shape and y.dtype == W.dtype
    rel = float(jnp.linalg.norm(y - W) / jnp.linalg.norm(W))
    assert rel < {8: 0.04, 6: 0.1, 5: 0.12, 4: 0.2, 3: 0.4}[scheme.bits]
    # requantizing the dequantized values with the same scales reproduces the element values exactly
    # (codes too, except that a -0 code comes back as +0: see test_negative_zero_input_gives_positive_zero_code)
    q2 = quantize(y, scheme, axis=0, scale=q.scale, zero_point=q.zero_point, global_scale=q.global_scale)
    np.testing.assert_array_equal(np.asarray(q2.element_values()), np.asarray(q.element_values()))


def test_int4_packed_takes_half_of_int8():
    q8 = quantize(W, presets["W8A16"].weights, axis=0)
    q4 = quantize(W, presets["W4A16"].weights, axis=0)
    assert q4.codes.nbytes * 2 == q8.codes.nbytes


def test_scale_is_contracted_not_expanded():
    q = quantize(W, presets["W4A16"].weights, axis=0)
    assert q.scale.shape == (96, 2)
    assert q.expanded_scale().shape == (96, 256)


def test_axis_semantics_match_transpose():
    a = quantize(W, presets["W4A16"].weights, axis=0)
    b = quantize(W.T, presets["W4A16"].weights, axis=-1)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(dequantize(a)), np.asarray(dequantize(b)).T)


def test_pytree_jit_vmap_device_put():
    scheme = presets["NVFP4A16"].weights
    q = quantize(W, scheme, axis=0)
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3  # codes, scale, global scale (no zero point)
    q_back = jax.tree_util.tree_unflatten(tree, leaves)
    np.testing.assert_array_equal(np.asarray(dequantize(q_back)), np.asarray(dequantize(q)))
    f = jax.jit(lambda q, x: x @ dequantize(q))
    x = jnp.ones((3, 256))
    # tolerance for the dot's accumulation order only
    np.testing.assert_allclose(np.asarray(f(q, x)), np.asarray(x @ dequantize(q)), rtol=1e-5, atol=1e-5)
    qd = jax.device_put(q, jax.devices()[0])
    assert isinstance(qd, QArray)
    stacked = jax.vmap(lambda w: quantize(w, scheme, axis=0))(jnp.stack([W, 2 * W]))
    assert stacked.codes.shape == (2,) + q.codes.shape
    ys = jax.vmap(dequantize)(stacked)
    np.testing.assert_array_equal(np.asarray(ys[0]), np.asarray(dequantize(q)))


def test_sharding_places_pytree():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.device_put(quantize(W, presets["W4A16"].weights, axis=0), sh)
    assert q.codes.sharding == sh


def test_all_zero_groups_give_nonzero_scales_and_no_nan():
    z = jnp.zeros((128, 64), jnp.float32)
    for name in ["FP8_DYNAMIC", "W4A16", "W4A16_ASYM", "NVFP4A16", "MXFP4A16", "MXFP8A16", "FP6_E3M2"]:
        q = quantize(z, presets[name].weights, axis=0)
        s = np.asarray(q.scale_values())
        assert np.all(s != 0), name
        y = np.asarray(dequantize(q))
        assert np.all(y == 0) and not np.any(np.isnan(y)), name


def test_bfloat16_and_float16_inputs():
    for dt in (jnp.bfloat16, jnp.float16):
        q = quantize(W.astype(dt), presets["FP8_DYNAMIC"].weights, axis=0)
        assert q.scale.dtype == dt and dequantize(q).dtype == dt


def test_fake_quantize_forward_and_straight_through_gradient():
    scheme = QuantScheme("int4", "channel")
    x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
    np.testing.assert_array_equal(np.asarray(fake_quantize(x, scheme)),
                                  np.asarray(dequantize(quantize(x, scheme))))
    g = jax.grad(lambda v: jnp.sum(fake_quantize(v, scheme) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), 3.0)  # absmax scale: everything is inside the range


MXFP4_FLOOR = QuantScheme("fp4_e2m1", "group", group_size=32, scale_format="e8m0", scale_rule="floor")


def _mx_floor_inside(x: np.ndarray, axis: int) -> np.ndarray:
    """Where x / s stays within the fp4 range [-6, 6] for OCP's floor rule, s = 2^(floor(log2 amax_G) - 2) over
    groups of 32 along `axis` (exact powers of two: numpy float64 is exact here)."""
    xt = np.moveaxis(x.astype(np.float64), axis, -1)
    g = xt.reshape(xt.shape[:-1] + (-1, 32))
    amax = np.abs(g).max(-1, keepdims=True)
    s = 2.0 ** (np.floor(np.log2(amax)) - 2)
    inside = (np.abs(g) / s <= 6).reshape(xt.shape)
    return np.moveaxis(inside, -1, axis)


def test_fake_quantize_clipped_gradient_is_zero():
    """The floor rule clips: amax_G / s lies in [4, 8), so elements above 6 s saturate and get no gradient."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    x[5, 1], x[40, 3] = 7.9, -7.5  # groups whose amax is far into the clipped part of its binade
    inside = _mx_floor_inside(x, 0)
    assert 0 < (~inside).sum() < inside.size // 4  # some elements clipped, most not
    g = jax.grad(lambda v: jnp.sum(fake_quantize(v, MXFP4_FLOOR, axis=0) * 3.0))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(g), np.where(inside, 3.0, 0.0))
    np.testing.assert_array_equal(np.asarray(fake_quantize(jnp.asarray(x), MXFP4_FLOOR, axis=0)),
                                  np.asarray(dequantize(quantize(jnp.asarray(x), MXFP4_FLOOR, axis=0))))


def test_fake_quantize_backward_uses_the_forward_mask():
    """jax.vjp: the cotangent passes exactly where the forward pass found x inside the range (its residual),
    for an arbitrary cotangent, along a non-default axis."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32) * 4
    x[0, 5], x[2, 40] = 13.0, -30.0  # 13 / 2^(3 - 2) = 6.5 and 30 / 2^(4 - 2) = 7.5: clipped
    _, vjp = jax.vjp(lambda v: fake_quantize(v, MXFP4_FLOOR, axis=1), jnp.asarray(x))
    ct = rng.standard_normal(x.shape).astype(np.float32)
    (g,) = vjp(jnp.asarray(ct))
    inside = _mx_floor_inside(x, 1)
    assert (~inside).any() and inside.any()
    np.testing.assert_array_equal(np.asarray(g), np.where(inside, ct, 0.0))


@pytest.mark.parametrize("bad, err, match", [
    (lambda: quantize(W, QuantScheme("int4", "group", group_size=100), axis=0), SchemeError, "does not divide"),
    (lambda: quantize(jnp.ones(16), QuantScheme("fp8_e4m3fn", "block", block=(8, 8))), SchemeError, "2-D"),
    (lambda: quantize(jnp.arange(16), QuantScheme("fp8_e4m3fn", "tensor")), SchemeError, "int32"),
    (lambda: quantize(W, QuantScheme("int4", "channel"), axis=2), SchemeError, "axis 2"),
    (lambda: quantize(W, "W4A16"), SchemeError, "QuantScheme"),
    (lambda: QuantScheme("fp4_e2m1", "group"), SchemeError, "group_size"),
    (lambda: QuantScheme("fp4_e2m1", "block", block=(8,)), SchemeError, "block"),
    (lambda: QuantScheme("fp4_e2m1", "channel", symmetric=False), SchemeError, "asymmetric"),
    (lambda: QuantScheme("int4", "group", group_size=32, scale_format="e8m0", scale_rule="floor"), SchemeError,
     "float element"),
    (lambda: QuantScheme("fp4_e2m1", "channel", scale_rule="floor"), SchemeError, "does not fit"),
    (lambda: QuantScheme("fp4_e2m1", "warp"), SchemeError, "strategy"),
    (lambda: QuantScheme("fp9_e4m4", "channel"), FormatError, r"1 \+ ebits \+ mbits"),
    (lambda: presets["W4A17"], SchemeError, "valid presets"),
])
def test_bad_input_raises_typed_errors(bad, err, match):
    with pytest.raises(err, match=match):
        bad()


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_e5m2", "fp6_e3m2", "fp4_e2m1", "int4"])
def test_nan_inf_data_documented_results(name):
    """One NaN/inf in a channel: absmax becomes NaN/inf. The documented results: for scale_format float32,
    the scale of that channel is NaN/inf; other channels are unaffected."""
    x = np.array(W[:, :4]).copy()
    x[3, 1] = np.nan
    x[5, 2] = np.inf
    q = quantize(jnp.asarray(x), QuantScheme(name, "channel"), axis=0)
    s = np.asarray(q.scale_values()).ravel()
    assert np.isnan(s[1]) and np.isinf(s[2])
    y = np.asarray(dequantize(q))
    np.testing.assert_array_equal(y[:, [0, 3]], np.asarray(dequantize(quantize(W[:, [0, 3]],
                                                                                 QuantScheme(name, "channel"),
                                                                                 axis=0))))


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "NVFP4A16", "MXFP4A16", "MXFP8A16", "FP6_E3M2"])
def test_negative_zero_input_gives_positive_zero_code(name):
    """llm-compressor's oneshot writes +0 for an exact -0 weight (checked byte for byte with
    bench/oneshot_parity.py); a tiny negative that rounds to zero keeps its sign bit."""
    x = np.array(W[:, :8]).copy()
    x[4, 3] = -0.0
    x[5, 3] = -1e-12
    q = quantize(jnp.asarray(x), presets[name].weights, axis=0)
    codes = np.asarray(q.element_codes())
    sign = 1 << (q.scheme.bits - 1)
    assert codes[3, 4] == 0
    assert codes[3, 5] == sign
