"""qformats.nn.projection: the layer math shared by NNX and linen, against Flax's float layers and by hand."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qformats
from qformats import dequantize, presets, quantize
from qformats.errors import ModelError
from qformats.nn import Rule, quantize_model
from qformats.nn.projection import (add_einsum_bias, einsum_kernel, einsum_layout, einsum_matrix, on_codes,
                                    packed_einsum, packed_linear, packed_linear_general, to_rows)


@contextlib.contextmanager
def dequantized_path():
    qformats.set_kernels_enabled(False)
    try:
        yield
    finally:
        qformats.set_kernels_enabled(True)


@pytest.mark.parametrize("eq,shape,perm,k,last", [
    ("btd,dnh->btnh", (128, 4, 32), (0, 1, 2), 128, True),
    ("bti,hid->bthd", (2, 128, 8), (1, 0, 2), 128, True),
    ("...i,hid->...hd", (2, 128, 8), (1, 0, 2), 128, True),
    ("btd,tde->be", (8, 16, 32), (0, 1, 2), 128, False),
    ("bj,ij->bi", (16, 32), (1, 0), 32, True),
    ("i...,ij->...j", (32, 16), (0, 1), 32, False),  # x's last axis is the ellipsis
])
def test_einsum_layout_and_its_inverse(eq, shape, perm, k, last):
    assert einsum_layout(eq, shape) == (perm, k, last)
    kern = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    w = einsum_matrix(kern, perm, k)
    assert w.shape == (k, np.prod(shape) // k)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(jnp.transpose(kern, perm).reshape(k, -1)))
    np.testing.assert_array_equal(np.asarray(einsum_kernel(w, shape, perm)), np.asarray(kern))
    stacked = jnp.stack([kern, kern + 1])  # a leading (scanned) axis is kept in front
    np.testing.assert_array_equal(np.asarray(einsum_matrix(stacked, perm, k, (2,))[1]), np.asarray(w + 1))


@pytest.mark.parametrize("eq,shape,msg", [
    ("btd,dnh", (4, 2, 2), "expected 'x,kernel->out'"),
    ("btd,d...->bt...", (4,), "ellipsis"),
    ("btd,dn->btn", (4, 2, 2), "does not fit kernel shape"),
    ("btd,nh->btnh", (2, 2), "shares no contracted axis"),
])
def test_einsum_layout_errors(eq, shape, msg):
    with pytest.raises(ModelError, match=msg):
        einsum_layout(eq, shape)


def test_to_rows_moves_the_contracted_axes_last_in_order():
    x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    xr, lead = to_rows(x, (-1, 1))  # contract axes 3 then 1
    assert lead == (2, 4) and xr.shape == (2, 4, 15)
    np.testing.assert_array_equal(np.asarray(xr), np.asarray(jnp.transpose(x, (0, 2, 3, 1)).reshape(2, 4, 15)))
    with pytest.raises(ModelError, match=r"\[4\] out of range for an input of 4 dims"):
        to_rows(x, (1, 4))


def test_on_codes_follows_the_schemes_and_the_flag():
    w = jax.random.normal(jax.random.key(0), (128, 16))
    for name, want in (("W8A8", True), ("FP8_DYNAMIC", True), ("W4A16", False), ("NVFP4", False)):
        ss = presets[name]
        assert on_codes(quantize(w, ss.weights, 0), ss) is want, name
    with dequantized_path():
        assert not on_codes(quantize(w, presets["W8A8"].weights, 0), presets["W8A8"])


@pytest.mark.parametrize("name", ["W4A16", "FP8_DYNAMIC", "NVFP4"])
def test_packed_linear_and_general_equal_the_dequantized_math(name):
    ss = presets[name]
    w = jax.random.normal(jax.random.key(1), (128, 16)) * 0.1
    b = jnp.arange(16, dtype=jnp.float32) / 8
    x = jax.random.normal(jax.random.key(2), (2, 4, 32))
    q = quantize(w, ss.weights, 0)
    xr = x.reshape(2, 128)
    xq = xr if ss.input_activations is None else dequantize(quantize(xr, ss.input_activations, -1))
    want = jax.lax.dot_general(xq, dequantize(q), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) + b
    with dequantized_path():
        got = packed_linear(xr, q, b, ss)
        gen = packed_linear_general(x, q, b.reshape(2, 8), ss, axis=(1, 2), out_shape=(2, 8))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(gen), np.asarray(want.reshape(2, 2, 8)))
    assert packed_linear(xr.astype(jnp.bfloat16), q, None, ss).dtype == jnp.bfloat16
    assert packed_linear(xr, q, None, ss, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_packed_einsum_refuses_activations_off_the_last_axis():
    q = quantize(jnp.ones((128, 32)), presets["FP8_DYNAMIC"].weights, 0)
    with pytest.raises(ModelError, match="here: einsum 'btd,tde->be' does not contract the input's last axis "
                                         "alone, so its activations cannot be quantized"):
        packed_einsum(jnp.ones((2, 8, 16)), q, None, presets["FP8_DYNAMIC"], einsum_str="btd,tde->be",
                      kernel_shape=(8, 16, 32), perm=(0, 1, 2), contracts_last=False, where="here")


def test_einsum_bias_broadcasts_as_flax_einsum():
    """A bias on a kernel axis that is not the output's last one (out 'hb'): broadcast as nnx.Einsum does."""
    class M(nnx.Module):
        def __init__(self):
            self.e = nnx.Einsum("bd,dh->hb", (128, 16), (16,), rngs=nnx.Rngs(0))

    m = M()
    m.e.bias.set_value(jnp.arange(16, dtype=jnp.float32))
    x = jax.random.normal(jax.random.key(3), (16, 128))  # B == H: a wrong broadcast would not raise
    kernel = m.e.kernel.get_value()
    quantize_model(m, [Rule(".*", "W8A16")])
    ref = nnx.Einsum("bd,dh->hb", (128, 16), (16,), rngs=nnx.Rngs(0))
    ref.kernel.set_value(dequantize(quantize(kernel, presets["W8A16"].weights, 0)))
    ref.bias.set_value(jnp.arange(16, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(m.e(x)), np.asarray(ref(x)))
    y = jnp.zeros((16, 16))
    np.testing.assert_array_equal(np.asarray(add_einsum_bias(y, jnp.arange(16.0), "bd,dh->hb", (128, 16))),
                                  np.broadcast_to(np.arange(16.0)[:, None], (16, 16)))
