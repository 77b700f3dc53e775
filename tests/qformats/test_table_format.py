"""TableFormat (a 2^b-entry codebook, e.g. GGUF's IQ4_NL grid) as a QArray element format: exact decode, packed
codes, the fused GEMV, and refusals (quantize; malformed tables)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import dequantize, quantize
from qformats.errors import FormatError, SchemeError
from qformats.formats import IQ4_NL, TableFormat, get_format
from qformats.packed_dot import packed_dot, packed_dot_supported
from qformats.packing import pack
from qformats.qarray import QArray, element_values
from qformats.schemes import QuantScheme

EPS = float(np.finfo(np.float32).eps)


def _table_qarray(k=192, n=40, g=32, sdt=jnp.float16, compute=jnp.float32, seed=0):
    """A [k, n] IQ4_NL QArray of random 4-bit indices and random group scales stored in `sdt`."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = (rng.standard_normal((n, k // g)) * 0.01).astype(np.float32)
    scheme = QuantScheme(IQ4_NL, "group", group_size=g, scale_format=jnp.dtype(sdt).name)
    q = QArray(pack(jnp.asarray(u), 4), jnp.asarray(s, sdt), None, None, scheme=scheme, shape=(k, n),
               dtype=jnp.float32, axis=0, compute_dtype=compute)
    q.check()
    return q, u


def test_iq4_nl_is_ggufs_grid():
    gguf = pytest.importorskip("gguf")
    assert IQ4_NL.values == tuple(float(v) for v in gguf.quants.IQ4_NL.kvalues)
    assert get_format("iq4_nl") is IQ4_NL and get_format("IQ4_NL") is IQ4_NL and get_format(IQ4_NL) is IQ4_NL
    assert (IQ4_NL.bits, IQ4_NL.kind, IQ4_NL.max, IQ4_NL.name) == (4, "table", 127.0, "iq4_nl")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_element_values_are_the_table_exactly(dtype):
    codes = jnp.arange(16, dtype=jnp.uint8)
    v = np.asarray(element_values(codes, IQ4_NL, dtype).astype(jnp.float32))
    np.testing.assert_array_equal(v, np.asarray(IQ4_NL.values, np.float32))


def test_dequantize_is_table_times_scale():
    """w[k, n] = values[c[n, k]] * s[n, k // 32]: the product of an int8-sized table value and a float16 scale is
    exact in float32, so the float64 oracle equals it."""
    q, u = _table_qarray()
    s = np.asarray(q.scale, np.float64)
    ref = np.asarray(IQ4_NL.values, np.float64)[u] * np.repeat(s, 32, axis=1)
    assert q.nbytes == 40 * 192 // 2 + 40 * 6 * 2  # 4.5 bits per weight: two codes a byte, a float16 per 32
    np.testing.assert_array_equal(np.asarray(dequantize(q), np.float64).T, ref)


def test_packed_dot_equals_dequantized_dot():
    """One-hot rows read each weight back exactly; random rows within float32 summation order of the exact sum."""
    q, _ = _table_qarray(k=4160, n=24)  # more than one CHUNK of K
    k = q.shape[0]
    assert packed_dot_supported((1, k), q)
    w = np.asarray(dequantize(q))
    f = jax.jit(packed_dot)
    for i in (0, 1, 2049, k - 1):
        np.testing.assert_array_equal(f(jnp.zeros((1, k), jnp.float32).at[0, i].set(1.0), q)[0], w[i])
    x = np.random.default_rng(3).standard_normal((3, k)).astype(np.float32)
    y = np.asarray(f(jnp.asarray(x), q), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.all(np.abs(y - exact) <= 2 * k * EPS * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))))


def test_quantize_refuses_a_table_format():
    with pytest.raises(SchemeError, match="table format iq4_nl is read from files"):
        quantize(jnp.ones((64, 4)), QuantScheme("iq4_nl", "group", group_size=32), axis=0)


@pytest.mark.parametrize("values, match", [
    ((0, 1, 2), "expected 2\\^b values"),
    ((1, 0), "strictly ascending"),
    ((0.0, float("nan")), "strictly ascending finite"),
    ((0, 257), "more than 8 significant bits"),
])
def test_malformed_tables_refused(values, match):
    with pytest.raises(FormatError, match=match):
        TableFormat("t", values)
    assert TableFormat("t", (-0.5, 0.25, 384, 2 ** 40)).bits == 2  # 384 = 3 2^7: two significant bits
