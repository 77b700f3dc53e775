"""packed_dot: fused 4/8-bit GEMVs equal to dequantize-then-dot up to summation order; no dense copy in a loop.
packed_matmul: many rows, the same weight elements decoded once; the same bound."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qformats.packed_dot as packed_dot_module
from qformats import dequantize, quantize
from qformats.dispatch import xla_qdot
from qformats.errors import FormatError, KernelError
from qformats.formats import FloatFormat
from qformats.packed_dot import MAX_ROWS, packed_dot, packed_dot_supported, packed_matmul, packed_matmul_supported
from qformats.presets import presets
from qformats.qarray import element_values
from qformats.schemes import QuantScheme

EPS = float(np.finfo(np.float32).eps)

# One jitted function object per entry point, so that a (weight, x) shape seen by another test is not compiled again
_packed_dot = jax.jit(packed_dot)
_packed_matmul = jax.jit(packed_matmul)


@jax.jit
def _dense_dot(x, w):
    """x [..., K] @ w [K, N] in float32 (the dequantize-then-dot path, given dequantize's dense weight)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


@functools.lru_cache(maxsize=None)
def _weight(name_or_scheme, k, n, seed=0):
    """A [k, n] weight quantized along k (0.05 N(0, 1)), made once per argument set for the whole module."""
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
    """float64 x @ dequantize(q) (the exact products of the same weight elements) per row, and the bound
    2 K eps_f32 sum_k |x_k| |W_kn| on float32 accumulation in any order."""
    w = np.asarray(dequantize(q, dtype=x.dtype), np.float64)
    x64 = np.asarray(x, np.float64).reshape(-1, w.shape[0])
    return x64 @ w, 2 * w.shape[0] * EPS * (np.abs(x64) @ np.abs(w))


SCHEMES = ["W4A16:g64", "W4A16", "W4A16_ASYM", "NVFP4A16", "MXFP4A16", "FP4_E2M1", "FP4_E2M1_G32",
           "W8A16:g64", "W8A16", "FP8_E4M3", "MXFP8A16",
           QuantScheme("int4", "tensor", scale_format="input"),
           QuantScheme("int4", "channel", symmetric=False, scale_format="input"),
           QuantScheme("int8", "group", group_size=32, symmetric=False, scale_format="input"),
           QuantScheme("fp4_e2m1", "group", group_size=32, scale_format="bfloat16")]


def _fit(scheme, k):
    if isinstance(scheme, str) and scheme.startswith("W") and ":g" not in scheme and k % 128:
        return scheme + ":g64"  # 128 does not divide 576
    return scheme


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("k,n,rows", [(256, 96, 1), (576, 192, 3)])
def test_matches_dequantize_then_dot(scheme, k, n, rows):
    q = _weight(_fit(scheme, k), k, n)
    x = jnp.asarray(np.random.RandomState(1).standard_normal((1, rows, k)).astype(np.float32))
    y = np.asarray(_packed_dot(x, q))
    assert y.shape == (1, rows, n) and y.dtype == np.float32
    ref, bound = _reference(x, q)
    err = np.abs(y.reshape(rows, n).astype(np.float64) - ref)
    assert np.all(err <= bound), (err / bound).max()
    # the dequantize-then-dot path (a full dense weight) agrees to the same bound
    yd = np.asarray(_dense_dot(x, dequantize(q, dtype=x.dtype)), np.float64).reshape(rows, n)
    assert np.all(np.abs(yd - ref) <= bound)


@pytest.mark.parametrize("scheme", ["W4A16:g64", "W4A16_ASYM:g32", "NVFP4A16", "W8A16:g64", "FP8_E4M3", "FP4_E2M1"])
def test_chunks_of_k(monkeypatch, scheme):
    """K cut into several fused dots (XLA fuses a weight into a matrix-vector dot only for vectors < 16 KiB):
    the same result bound, whatever the chunk size, including a last partial chunk."""
    monkeypatch.setattr(packed_dot_module, "CHUNK", 64)
    k, n = 448, 40  # 4-bit: chunks of 128 elements (two nibble dots of 64), the last one partial
    assert k > 3 * 2 * packed_dot_module.CHUNK  # at least 3 chunks at any bit width (4-bit: 2 * CHUNK elements)
    q = _weight(scheme, k, n, seed=5)
    x = jnp.asarray(np.random.RandomState(6).standard_normal((2, k)).astype(np.float32))
    ref, bound = _reference(x, q)
    err = np.abs(np.asarray(jax.jit(packed_dot)(x, q), np.float64) - ref)
    assert np.all(err <= bound), (err / bound).max()


def test_weight_elements_equal_dequantize():
    """The in-loop weight is dequantize's, bit for bit: with x a one-hot row, y is row k of the weight. (The weights
    and x shape of test_matches_dequantize_then_dot's [256, 96] one-row case: its compiled programs serve here.)"""
    for name in ("W4A16:g64", "W4A16_ASYM", "NVFP4A16", "MXFP4A16", "W8A16:g64", "FP8_E4M3", "MXFP8A16"):
        q = _weight(name, 256, 96)
        w = np.asarray(dequantize(q, dtype=jnp.float32))
        for k in (0, 1, 63, 127, 255):
            x = jnp.zeros((1, 1, 256), jnp.float32).at[0, 0, k].set(1.0)
            np.testing.assert_array_equal(np.asarray(_packed_dot(x, q))[0, 0], w[k], err_msg=f"{name} row {k}")




def _float_formats():
    """Every 4- and 8-bit FloatFormat (the codes packed_dot takes) under each specials convention it admits."""
    out = []
    for eb in range(1, 8):
        for mb in range(0, 7):
            for sp in ("ieee", "fn", "fnuz", "finite"):
                if 1 + eb + mb in (4, 8):
                    try:
                        out.append(FloatFormat(eb, mb, sp))
                    except FormatError:
                        pass  # a convention the format cannot have (e.g. ieee without a mantissa bit)
    return out


def test_float_values_equal_element_values_bit_for_bit():
    """The in-loop decode of float codes (bit operations, no table read) gives element_values' value for every
    code of every 4- and 8-bit float format, bit for bit: signed zeros, subnormals, inf and NaN (with its sign) included, and
    in float32, bfloat16 and float16 (rounded as astype rounds)."""
    fmts = _float_formats()
    assert len(fmts) > 25
    dtypes = ((jnp.float32, np.uint32), (jnp.bfloat16, np.uint16), (jnp.float16, np.uint16))
    codes = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)

    @jax.jit
    def decode_all(codes):  # one compilation for every format and dtype, the reference (codec.decode) beside
        return [[(packed_dot_module._float_values(codes[:2 ** f.bits], f, dt), element_values(codes[:2 ** f.bits], f, dt))
                 for dt, _ in dtypes] for f in fmts]

    for fmt, pairs in zip(fmts, decode_all(codes)):
        for (dt, view), (got, want) in zip(dtypes, pairs):
            np.testing.assert_array_equal(np.asarray(got).view(view), np.asarray(want).view(view),
                                          err_msg=f"{fmt.name} ({fmt.specials}) in {jnp.dtype(dt).name}")


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16", "FP8_E4M3"])
def test_float_codes_decoded_without_a_table_read(name):
    """Float weight codes are decoded by elementwise operations inside the fused GEMV, not read from a table by code:
    a table read is a gather in the loop, which XLA:CPU scalarises (one load per weight element)."""
    q = _weight(name, 256, 64)
    text = jax.jit(packed_dot).lower(jnp.ones((1, 256), jnp.float32), q).compile().as_text()
    assert " dot(" in text and " gather(" not in text


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("k,n,rows", [(256, 96, 13), (576, 192, 2)])
def test_packed_matmul_matches_dequantize_then_dot(scheme, k, n, rows):
    """Any number of rows: within the float32 accumulation bound of the exact product of dequantize's elements."""
    q = _weight(_fit(scheme, k), k, n)
    x = jnp.asarray(np.random.RandomState(1).standard_normal((rows, k)).astype(np.float32))
    y = np.asarray(_packed_matmul(x, q))
    assert y.shape == (rows, n) and y.dtype == np.float32
    ref, bound = _reference(x, q)
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound), (err / bound).max()


def test_packed_matmul_weight_elements_equal_dequantize():
    """The decoded weight is dequantize's, bit for bit: with x the identity, y is the weight (odd K included: the
    last byte's high nibble is padding)."""
    odd = QuantScheme("int4", "channel", symmetric=False, scale_format="input")
    for name, k in (("W4A16:g64", 128), ("W4A16_ASYM:g64", 128), ("NVFP4A16", 128), ("MXFP4A16", 128),
                    ("W8A16:g64", 128), ("FP8_E4M3", 128), ("MXFP8A16", 128), (odd, 77), (odd, 128)):
        q = _weight(name, k, 48, seed=3)
        w = np.asarray(dequantize(q, dtype=jnp.float32))
        y = np.asarray(jax.jit(packed_matmul)(jnp.eye(k, dtype=jnp.float32), q))
        np.testing.assert_array_equal(y, w, err_msg=f"{name} K={k}")


def test_packed_matmul_supported_and_refused():
    assert packed_matmul_supported(_weight("W4A16:g64", 128, 32))
    assert packed_matmul_supported(_weight("NVFP4A16", 128, 32))
    assert packed_matmul_supported(_weight("FP8_E4M3", 128, 32))
    assert not packed_matmul_supported(_weight("MXFP6A16", 128, 32))
    assert not packed_matmul_supported(_weight(presets["FP8_BLOCK"].weights, 128, 128))
    assert not packed_matmul_supported(quantize(jnp.ones((32, 128)), presets["W4A16"].weights, axis=1))
    with pytest.raises(KernelError, match="4- or 8-bit"):
        packed_matmul(jnp.ones((3, 128)), _weight("MXFP6A16", 128, 32))
    with pytest.raises(KernelError, match="activations"):
        packed_matmul(jnp.ones((3, 64)), _weight("W4A16:g64", 128, 32))

def _dot_fusion_parameters(text: str):
    """The parameter shapes ("u8[64,8]") of every fused computation of an optimized HLO module that holds a dot."""
    out, params, has_dot, fused = [], [], False, False
    for line in text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            params, has_dot, fused = [], False, line.startswith("%fused")
        elif line.startswith("}"):
            if has_dot and fused:
                out.append(params)
        elif " parameter(" in line:
            params.append(re.search(r"= (\w+\[[\d,]*\])", line).group(1))
        elif " dot(" in line:
            has_dot = True
    return out


@pytest.mark.parametrize("name", ["MXFP4A16", "MXFP8A16"])
def test_e8m0_scale_decoded_once_per_group(name):
    """The E8M0 scale codes are decoded to float32 once per group, outside the fused GEMV loops: no dot's fusion
    reads the uint8 codes (XLA:CPU would otherwise decode them again for every weight element)."""
    q = _weight(name, 256, 64)
    x = jnp.ones((1, 256), jnp.float32)
    fusions = _dot_fusion_parameters(jax.jit(packed_dot).lower(x, q).compile().as_text())
    raw = "u8[%s]" % ",".join(str(d) for d in q.scale.shape)
    decoded = "f32[%s]" % ",".join(str(d) for d in q.scale.shape)
    assert fusions and all(raw not in p for p in fusions), fusions
    assert any(decoded in p for p in fusions), fusions


def test_bf16_activations():
    q = _weight("NVFP4A16", 256, 64)
    x = jnp.asarray(np.random.RandomState(2).standard_normal((1, 256)), jnp.bfloat16)
    y = _packed_dot(x, q)
    assert y.dtype == jnp.bfloat16
    ref, bound = _reference(x, q)
    # float32 accumulation, then one rounding to bfloat16 (half an ulp of 2^-8 relative)
    assert np.all(np.abs(np.asarray(y, np.float64).reshape(-1) - ref) <= bound + np.abs(ref) * 2.0 ** -8)


def test_supported():
    q4 = _weight("W4A16:g64", 128, 32)
    assert packed_dot_supported((1, 128), q4) and packed_dot_supported((128,), q4)
    assert packed_dot_supported((1, 1, 128), q4)
    assert packed_dot_supported((2, 4, 128), q4) and packed_dot_supported((MAX_ROWS, 128), q4)
    assert not packed_dot_supported((MAX_ROWS + 1, 128), q4)  # many rows: dequantize once, XLA dot
    assert not packed_dot_supported((1, 64), q4)          # K mismatch
    assert packed_dot_supported((1, 128), _weight("W8A16:g64", 128, 32))
    assert not packed_dot_supported((1, 128), _weight("MXFP6A16", 128, 32))    # 6-bit
    assert not packed_dot_supported((1, 128), _weight(presets["FP8_BLOCK"].weights, 128, 128))   # block scales
    q1 = quantize(jnp.ones((32, 128)), presets["W4A16"].weights, axis=1)
    assert not packed_dot_supported((1, 32), q1)           # quantized along N, not K


def test_refuses_unsupported():
    with pytest.raises(KernelError, match="activation rows"):
        packed_dot(jnp.ones((MAX_ROWS + 1, 128)), _weight("W4A16:g64", 128, 32))
    with pytest.raises(KernelError, match="4- or 8-bit"):
        packed_dot(jnp.ones((1, 128)), _weight("MXFP6A16", 128, 32))


def _while_shapes(text: str):
    """(dtype, element count) of every array in the tuple of each `while` of an optimized HLO module."""
    out = []
    for line in text.splitlines():
        if " while(" in line:
            head = line.split(" while(")[0]
            for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", head):
                out.append((dt, int(np.prod([int(d) for d in dims.split(",") if d] or [1]))))
    return out


@pytest.mark.parametrize("name", ["W8A16:g64", "W4A16:g64", "NVFP4A16", "MXFP4A16"])
def test_no_dense_copy_of_the_weight_in_a_decode_loop(name):
    """In a lax loop with a loop-invariant weight (a decode loop), XLA would hoist the whole dequantize out of
    the loop and keep a dense float32 copy in the loop state; the packed arrays must be what the loop reads,
    the scales included (no float32 copy of decoded per-group scales either)."""
    k = 256

    def loop(x, q):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(xla_qdot(h, q))[..., :k] + h, x)

    x = jnp.asarray(np.random.RandomState(7).standard_normal((1, k)).astype(np.float32))
    qk = _weight(name, k, k)
    text = jax.jit(loop).lower(x, qk).compile().as_text()
    shapes = _while_shapes(text)
    assert shapes, "no while loop in the compiled module"
    assert all(c < k * k for dt, c in shapes if dt[0] in "fb"), shapes   # no float array of the weight's size
    if qk.scale.dtype != jnp.float32:   # fp8 / E8M0 scales: the stored ones, not a decoded float32 copy
        assert not any(dt == "f32" and c == qk.scale.size for dt, c in shapes), shapes
    assert any(dt in ("u8", "s8") and c == qk.codes.size for dt, c in shapes), shapes   # the packed codes
    # and the loop computes the same as three dequantize-then-dot steps
    w = dequantize(qk, dtype=jnp.float32)
    h = x
    for _ in range(3):
        h = jnp.tanh(h @ w)[..., :k] + h
    np.testing.assert_allclose(np.asarray(jax.jit(loop)(x, qk)), np.asarray(h), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_decode_loop_decodes_one_weights_scales_at_a_time(name):
    """A decode step through several layers: each weight's per-group factor (fp8 / E8M0 scales decoded to
    float32) is made when its layer runs, not all at the start of the step (XLA:CPU schedules a computation of
    the weights alone first, which held every layer's float32 scales at once: 26 MB in SmolLM2's decode loop).
    Bound on the loop's temporary buffer: two weights' float32 factors plus a few activation rows."""
    k, layers = 256, 8
    qs = [_weight(name, k, k, seed=i) for i in range(layers)]

    def loop(x, qs):
        def body(i, h):
            for q in qs:
                h = jnp.tanh(xla_qdot(h, q)) + h
            return h
        return jax.lax.fori_loop(0, 3, body, x)

    temp = jax.jit(loop).lower(jnp.ones((1, k)), qs).compile().memory_analysis().temp_size_in_bytes
    factor = qs[0].scale.size * 4
    assert temp <= 2 * factor + 8 * k * 4, (temp, factor)


def test_dispatch_routes_one_row_to_packed_dot():
    """xla_qdot takes packed_dot for FUSED_GEMV_ROWS (1) row of a 4/8-bit weight (its jaxpr has packed_dot's
    barrier) and the dense dequantize for more rows; both agree with the reference."""
    from qformats.dispatch import FUSED_GEMV_ROWS
    assert FUSED_GEMV_ROWS == 1
    q = _weight("MXFP4A16", 256, 64)
    x1 = jnp.asarray(np.random.RandomState(4).standard_normal((1, 1, 256)).astype(np.float32))
    assert "optimization_barrier" in str(jax.make_jaxpr(xla_qdot)(x1, q))
    assert "optimization_barrier" in str(jax.make_jaxpr(xla_qdot)(x1, _weight("W8A16:g64", 256, 64)))
    x2 = jnp.concatenate([x1, 2 * x1], 1)
    assert "optimization_barrier" not in str(jax.make_jaxpr(xla_qdot)(x2, q))
    many = jnp.concatenate([x1] * (MAX_ROWS + 1), 1)
    assert "optimization_barrier" not in str(jax.make_jaxpr(xla_qdot)(many, q))
    ref, bound = _reference(x1, q)
    assert np.all(np.abs(np.asarray(xla_qdot(x1, q), np.float64).reshape(-1) - ref) <= bound)
    y2 = np.asarray(xla_qdot(x2, q), np.float64)
    assert np.all(np.abs(y2[0, 1] - 2 * ref) <= 2 * bound)
    ym = np.asarray(xla_qdot(many, q), np.float64)
    assert np.all(np.abs(ym[0, -1] - ref) <= bound)


def test_kernels_off_means_dequantize_then_dot():
    """set_kernels_enabled(False): xla_qdot dequantizes, bit-identical to dequantize-then-dot."""
    import qformats
    q = _weight("W4A16:g64", 256, 64)
    x = jnp.asarray(np.random.RandomState(8).standard_normal((2, 256)).astype(np.float32))
    qformats.set_kernels_enabled(False)
    try:
        assert "optimization_barrier" not in str(jax.make_jaxpr(xla_qdot)(x, q))
        y = np.asarray(jax.jit(xla_qdot)(x, q))
    finally:
        qformats.set_kernels_enabled(True)
    want = jax.jit(lambda x, q: jax.lax.dot_general(x, dequantize(q, x.dtype), (((1,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.float32))(x, q)
    np.testing.assert_array_equal(y, np.asarray(want))


def _gguf_like(fmt, k, n, seed, offset=False):
    """A weight laid out as GGUF's Q8_0 / Q4_0 / Q4_1 load (`converters.formats.gguf_packed`): int codes in groups
    of 32 under float16 scales (and float16 offsets: w = d q + m), computed in float32 (`compute_dtype`)."""
    rng = np.random.RandomState(seed)
    scheme = QuantScheme(fmt, "group", group_size=32, scale_format="float16")
    q = quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) * 0.05), scheme, axis=0)
    q = q.replace(compute_dtype=jnp.float32)
    if offset:
        q = q.replace(offset=jnp.asarray(rng.uniform(-0.1, 0.0, q.scale.shape), jnp.float16))
    return q


@pytest.mark.parametrize("fmt,offset", [("int8", False), ("int4", False), ("uint4", True)])
def test_gguf_float16_scales(fmt, offset):
    """GGUF's layout (float16 d and m, computed in float32): one-hot rows read dequantize's weight back bit for bit;
    random rows are within the float32 accumulation bound 2 K eps sum_k |x_k| |W_kn| of the exact product."""
    k, n = 576, 48
    q = _gguf_like(fmt, k, n, seed=11, offset=offset)
    assert q.scale.dtype == jnp.float16 and q.work_dtype == jnp.float32
    w = np.asarray(dequantize(q, dtype=jnp.float32))
    f = jax.jit(packed_dot)
    for i in (0, 1, 31, 32, k - 1):
        x = jnp.zeros((1, k), jnp.float32).at[0, i].set(1.0)
        np.testing.assert_array_equal(np.asarray(f(x, q))[0], w[i], err_msg=f"{fmt} row {i}")
    x = jnp.asarray(np.random.RandomState(12).standard_normal((2, k)).astype(np.float32))
    ref, bound = _reference(x, q)
    err = np.abs(np.asarray(f(x, q), np.float64) - ref)
    assert np.all(err <= bound), (err / bound).max()


def test_q8_0_float16_scales_widened_in_the_loop():
    """8-bit codes under float16 scales (Q8_0): the widening to float32 is done in the GEMV loop (one per group),
    not by a fusion of its own writing a float32 copy of the scales [N, G] that the loop reads back; in a decode
    loop the state holds the float16 scales, no float32 copy."""
    k = n = 256
    q = _gguf_like("int8", k, n, seed=13)
    x = jnp.asarray(np.random.RandomState(14).standard_normal((1, k)).astype(np.float32))
    text = jax.jit(packed_dot).lower(x, q).compile().as_text()
    entry = text.split("\nENTRY")[1]
    assert f"f32[{n},{k // 32}]" not in entry, entry
    assert any(f"f16[{n},{k // 32}]" in p for p in _dot_fusion_parameters(text))

    def loop(x, q):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(xla_qdot(h, q))[..., :k] + h, x)

    shapes = _while_shapes(jax.jit(loop).lower(x, q).compile().as_text())
    assert shapes and not any(dt == "f32" and c == q.scale.size for dt, c in shapes), shapes
    assert any(dt == "f16" and c == q.scale.size for dt, c in shapes), shapes


@pytest.mark.parametrize("fmt,offset", [("uint4", True), ("int4", False)])
def test_int4_bytes_read_by_one_gemv(fmt, offset):
    """4-bit integer codes (GGUF Q4_1 / Q4_0 layout): one fused GEMV per chunk of K reads the packed bytes, once
    (both nibbles of a byte in the same loop), not one dot per nibble each reading every byte."""
    k, n = 576, 48
    q = _gguf_like(fmt, k, n, seed=15, offset=offset)
    x = jnp.ones((1, k), jnp.float32)
    fusions = _dot_fusion_parameters(jax.jit(packed_dot).lower(x, q).compile().as_text())
    codes = f"u8[{n},{k // 2}]"
    assert len(fusions) == 1 and fusions[0].count(codes) == 1, fusions
