"""packed_dot: one-row 4-bit GEMV equal to dequantize-then-dot up to summation order; dispatch routes to it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import dequantize, quantize
from qformats.dispatch import xla_qdot
from qformats.errors import KernelError
from qformats.packed_dot import packed_dot, packed_dot_supported
from qformats.presets import presets
from qformats.schemes import QuantScheme

EPS = float(np.finfo(np.float32).eps)


def _weight(name_or_scheme, k, n, seed=0):
    if isinstance(name_or_scheme, QuantScheme):
        scheme = name_or_scheme
    else:
        base, _, g = name_or_scheme.partition(":g")
        scheme = presets[base].weights
        if g:
            scheme = dataclasses.replace(scheme, group_size=int(g))
    w = np.random.RandomState(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    return quantize(jnp.asarray(w), scheme, axis=0)


def _reference(x, q):
    """float64 sum of x * dequantize(q) (the exact product of the same weight elements) and the bound
    2 K eps_f32 sum_k |x_k| |W_kn| on float32 accumulation in any order."""
    w = np.asarray(dequantize(q, dtype=x.dtype), np.float64)
    x64 = np.asarray(x, np.float64).reshape(-1)
    return x64 @ w, 2 * w.shape[0] * EPS * (np.abs(x64) @ np.abs(w))


SCHEMES = ["W4A16:g64", "W4A16", "W4A16_ASYM", "NVFP4A16", "MXFP4A16", "FP4_E2M1", "FP4_E2M1_G32",
           QuantScheme("int4", "tensor", scale_format="input"),
           QuantScheme("int4", "channel", symmetric=False, scale_format="input"),
           QuantScheme("fp4_e2m1", "group", group_size=32, scale_format="bfloat16")]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("k,n", [(256, 96), (576, 192)])
def test_matches_dequantize_then_dot(scheme, k, n):
    if isinstance(scheme, str) and scheme.startswith("W4A16") and ":g" not in scheme and k % 128:
        scheme = scheme + ":g64"  # 128 does not divide 576
    q = _weight(scheme, k, n)
    x = jnp.asarray(np.random.RandomState(1).standard_normal((1, 1, k)).astype(np.float32))
    y = np.asarray(jax.jit(packed_dot)(x, q))
    assert y.shape == (1, 1, n) and y.dtype == np.float32
    ref, bound = _reference(x, q)
    err = np.abs(y.reshape(-1).astype(np.float64) - ref)
    assert np.all(err <= bound), (err / bound).max()
    # the dequantize-then-dot path (a full dense weight) agrees to the same bound
    yd = np.asarray(jax.jit(lambda x, q: jax.lax.dot_general(
        x, dequantize(q, dtype=x.dtype), (((2,), (0,)), ((), ()))))(x, q), np.float64).reshape(-1)
    assert np.all(np.abs(yd - ref) <= bound)


def test_weight_elements_equal_dequantize():
    """The in-loop weight is dequantize's, bit for bit: with x a one-hot row, y is row k of the weight."""
    for name in ("W4A16:g64", "W4A16_ASYM:g64", "NVFP4A16", "MXFP4A16"):
        q = _weight(name, 128, 48, seed=3)
        w = np.asarray(dequantize(q, dtype=jnp.float32))
        f = jax.jit(packed_dot)
        for k in (0, 1, 63, 127):
            x = jnp.zeros((1, 128), jnp.float32).at[0, k].set(1.0)
            np.testing.assert_array_equal(np.asarray(f(x, q))[0], w[k], err_msg=f"{name} row {k}")


def test_bf16_activations():
    q = _weight("NVFP4A16", 256, 64)
    x = jnp.asarray(np.random.RandomState(2).standard_normal((1, 256)), jnp.bfloat16)
    y = packed_dot(x, q)
    assert y.dtype == jnp.bfloat16
    ref, bound = _reference(x, q)
    # float32 accumulation, then one rounding to bfloat16 (half an ulp of 2^-8 relative)
    assert np.all(np.abs(np.asarray(y, np.float64).reshape(-1) - ref) <= bound + np.abs(ref) * 2.0 ** -8)


def test_supported():
    q4 = _weight("W4A16:g64", 128, 32)
    assert packed_dot_supported((1, 128), q4) and packed_dot_supported((128,), q4)
    assert packed_dot_supported((1, 1, 128), q4)
    assert not packed_dot_supported((2, 128), q4)        # several rows: dequantize once, XLA dot
    assert not packed_dot_supported((1, 64), q4)         # K mismatch
    assert not packed_dot_supported((1, 128), _weight("W8A16:g64", 128, 32))   # 8-bit: no unpacking
    assert not packed_dot_supported((1, 128), _weight("MXFP6A16", 128, 32))    # 6-bit
    q1 = quantize(jnp.ones((32, 128)), presets["W4A16"].weights, axis=1)
    assert not packed_dot_supported((1, 32), q1)           # quantized along N, not K


def test_refuses_unsupported():
    with pytest.raises(KernelError, match="one activation row"):
        packed_dot(jnp.ones((3, 128)), _weight("W4A16:g64", 128, 32))
    with pytest.raises(KernelError, match="4-bit"):
        packed_dot(jnp.ones((1, 128)), _weight("W8A16:g64", 128, 32))


def test_dispatch_routes_one_row_to_packed_dot():
    """xla_qdot takes packed_dot for one row of a 4-bit weight (its jaxpr has packed_dot's barrier) and the
    dense dequantize for several rows; both agree with the reference."""
    q = _weight("MXFP4A16", 256, 64)
    x1 = jnp.asarray(np.random.RandomState(4).standard_normal((1, 1, 256)).astype(np.float32))
    assert "optimization_barrier" in str(jax.make_jaxpr(xla_qdot)(x1, q))
    assert "optimization_barrier" not in str(jax.make_jaxpr(xla_qdot)(jnp.concatenate([x1, x1], 1), q))
    ref, bound = _reference(x1, q)
    assert np.all(np.abs(np.asarray(xla_qdot(x1, q), np.float64).reshape(-1) - ref) <= bound)
    y2 = np.asarray(xla_qdot(jnp.concatenate([x1, 2 * x1], 1), q), np.float64)
    assert np.all(np.abs(y2[0, 1] - 2 * ref) <= 2 * bound)
