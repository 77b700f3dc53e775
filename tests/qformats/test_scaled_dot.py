"""scaled_dot: W8A8 / FP8 matmuls on the codes (int8 x int8 -> int32, fp8 x fp8 -> f32), scales after the K-sum;
and the qformats.nn layers (NNX and linen) that use it."""

import jax.numpy as jnp
import numpy as np
import pytest

import qformats
from qformats import KernelError, dequantize, presets, quantize
from qformats.scaled_dot import scaled_dot, scaled_dot_supported

RNG = np.random.default_rng(7)
ON_CODES = ["W8A8", "FP8_DYNAMIC", "FP8"]


def _xw(dtype, k=384, n=96):
    x = jnp.asarray(RNG.normal(size=(2, 5, k)) * RNG.uniform(0.2, 4, size=(2, 5, 1)), dtype)
    w = jnp.asarray(RNG.normal(size=(k, n)) * RNG.uniform(0.01, 0.2, size=(1, n)), dtype)
    return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ON_CODES)
def test_equals_the_integer_formula_exactly(name, dtype):
    """y = float32(sum_k qx qw) * sx * sw, the K-sum exact (int64 in numpy; fp8 products are exact in
    float64 and the f32 sum of at most 384 of them is compared with a stated bound)."""
    ss = presets[name]
    x, w = _xw(dtype)
    xq, wq = quantize(x, ss.input_activations, -1), quantize(w, ss.weights, 0)
    y = np.asarray(scaled_dot(xq, wq), np.float32)
    assert y.dtype == np.float32 and y.shape == (2, 5, 96)
    qx = np.asarray(xq.element_values(jnp.float32), np.float64)
    qw = np.asarray(wq.element_values(jnp.float32), np.float64)          # [N, K]
    acc = qx @ qw.T
    sx = np.asarray(xq.scale_values(jnp.float32))
    sw = np.asarray(wq.scale_values(jnp.float32)).reshape(-1)
    if ss.weights.format.kind == "int":
        acc32 = acc.astype(np.float32)                                   # exact integers
        want = ((acc32 * sx).astype(np.float32) * sw).astype(np.float32)
        got = np.asarray(scaled_dot(xq, wq, jnp.float32))
        np.testing.assert_array_equal(got, want)
    else:
        got = np.asarray(scaled_dot(xq, wq, jnp.float32), np.float64)
        want = acc * sx * sw
        bound = 384 * 2.0 ** -24 * (np.abs(qx) @ np.abs(qw).T) * np.abs(sx) * np.abs(sw) + 1e-30
        assert np.all(np.abs(got - want) <= 2 * bound)
    # and it is the dequantized product up to the output's rounding
    ref = np.asarray(dequantize(xq, jnp.float32), np.float64) @ np.asarray(dequantize(wq, jnp.float32), np.float64)
    tol = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max()


def test_support_rules():
    p = presets
    assert scaled_dot_supported(p["W8A8"].input_activations, p["W8A8"].weights, 4096)
    assert scaled_dot_supported(p["FP8_DYNAMIC"].input_activations, p["FP8_DYNAMIC"].weights, 4096)
    assert not scaled_dot_supported(p["W8A8"].input_activations, p["W8A8"].weights, 1 << 17)  # int32 overflow
    assert not scaled_dot_supported(p["W4A8"].input_activations, p["W4A8"].weights, 4096)  # groups along K
    assert not scaled_dot_supported(p["W4AFP8"].input_activations, p["W4AFP8"].weights, 4096)  # int x fp8
    assert not scaled_dot_supported(p["NVFP4"].input_activations, p["NVFP4"].weights, 4096)
    assert not scaled_dot_supported(p["MXFP8"].input_activations, p["MXFP8"].weights, 4096)
    assert not scaled_dot_supported(None, p["W8A16"].weights, 4096)


def test_errors_name_shapes_and_schemes():
    x, w = _xw(jnp.float32)
    xq = quantize(x, presets["W8A8"].input_activations, -1)
    with pytest.raises(KernelError, match="cannot run on the codes"):
        scaled_dot(xq, quantize(w, presets["W4A16"].weights, 0))
    with pytest.raises(KernelError, match=r"do not contract"):
        scaled_dot(xq, quantize(w[:128], presets["W8A8"].weights, 0))


@pytest.mark.parametrize("name", ON_CODES)
def test_layers_multiply_codes_and_the_flag_turns_it_off(name):
    """QLinear (NNX) and QDense (linen) give scaled_dot's result, bit for bit; with kernels disabled they
    dequantize (the simulated path), which agrees to the output's rounding."""
    from flax import nnx
    from qformats.nn import QDense, QLinear, Rule, quantize_model
    ss = presets[name]
    x, _ = _xw(jnp.float32, k=128)

    class One(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(128, 64, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, v):
            return self.lin(v)

    m = One()
    calib = [x, 2 * x] if not ss.input_activations.dynamic else None
    quantize_model(m, [Rule(".*", name)], calibration_data=calib)
    assert isinstance(m.lin, QLinear) and m.lin.kernel_cache is None
    q = m.lin.kernel.get_value()
    scale = None if m.lin.input_scale is None else m.lin.input_scale.get_value()
    want = scaled_dot(quantize(x, ss.input_activations, -1, scale=scale), q)
    np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda mm, v: mm(v))(m, x)), np.asarray(want))
    if scale is None:
        layer = QDense(64, name, use_bias=False)
        np.testing.assert_array_equal(np.asarray(layer.apply({"params": {"kernel": q}}, x)), np.asarray(want))
    qformats.set_kernels_enabled(False)
    try:
        sim = np.asarray(m(x))
    finally:
        qformats.set_kernels_enabled(True)
    assert not np.array_equal(sim, np.asarray(want))  # really another path
    np.testing.assert_allclose(sim, np.asarray(want), rtol=0, atol=1e-5 * float(np.abs(want).max()))
