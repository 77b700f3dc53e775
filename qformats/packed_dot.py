"""Packed products on the XLA path: 4- and 8-bit weights decoded inside XLA:CPU's fused GEMV loops (`packed_dot`), or
decoded once in the codes' own [N, K] layout for a product of many rows (`packed_matmul`).

Why a path of its own (XLA:CPU; the figures: BENCHMARKS.md, "CPU decode (SmolLM2)"):

  - XLA never fuses a weight's producer into a library GEMM; it does fuse it into a matrix-*vector* dot, as an
    elemental loop (`copy_dot_fusion`: for each output n, a vectorised, reassociated sum over k of the fused
    weight element times x[k]) -- but only while the vector is under 16 KiB (`kFusionThresholdBytes` in
    cpu_instruction_fusion.cc): K <= 2048 float32 here. Past it XLA materialises the dequantized weight,
    transposed. So K is cut into chunks of at most `CHUNK` elements per dot and the partial sums are added.
  - Inside that loop, element k of row n must come from contiguous memory. Nibble k = 2i + j of a 4-bit row
    lives in byte i: indexing byte k // 2 per element makes LLVM scalarise the loads (one byte load and insert
    per element). Here the loop runs over the bytes i: x is split into its even and odd elements before the loop,
    W_j[n, i] is decoded from nibble j of byte i (a uniform shift), and for integer codes one GEMV per chunk sums
    P[n, i] = x_even[i] W_lo[n, i] + x_odd[i] W_hi[n, i] (`_gemv_nibble_pairs`: each byte loaded and widened to
    int32 once, split by & 15 and >> 4 there); float and table codes take two dots, x_even . W_lo + x_odd . W_hi.
    Pairs against two dots, Q4_1 [576, 1536], same process: 0.15 -> 0.11 CPU ms, a SmolLM2 Q4_1 decode step
    ~28 -> ~21 CPU ms (half the rows, each with its horizontal sum; no byte read twice; no dot summing the parts).
  - Inside `generate`'s `lax.while_loop`, XLA hoists loop-invariant code: a dequantize that depends on the
    weights only would be moved out of the decode loop, a dense float32 copy of every weight would live through
    the loop and each step would read it back. So the codes are decoded inside the dots, which read the
    activations (they change every step), and the per-group scales are tied to the activations by a data
    dependency (`tie_to`; an optimization barrier is dropped by XLA:CPU before it optimizes): nothing of the
    weight is loop-invariant, each step reads the packed codes and scales.
  - The per-group factor s' = s / c (c: the global scale, NVFP4; E8M0 / fp8 scales decoded) is computed once per
    group [N, G] per call, in a fusion of its own, instead of once per element: XLA:CPU duplicates cheap
    producers (the E8M0 bit decode) into the GEMV loop, an optimization barrier does not stop it (none is left in
    the optimized module), but it does not duplicate a float division into a consumer that reads each element
    many times (`_own_fusion`). The zero point stays int8 and is converted in the loop (one convert).
    8-bit codes under float16 / bfloat16 scales computed in float32 (GGUF Q8_0) are the exception: the exact
    widening convert is left in the loop, where LLVM loads and converts one scale per group (the loop steps
    through a row's contiguous elements), and no float32 copy of the scales is written and read back per call
    (4 bytes per 32 one-byte codes each way). For 4-bit codes the same measured no faster (their scales go
    through `_apart`, below).
  - 4-bit: the loop's other operands -- the per-group scales and offsets (with `tie_to`'s bit operations) and the
    even / odd elements of x -- are cheap producers that XLA:CPU would also fuse into the loop, re-gathering a
    group's scale by k // g and reading x with a stride of 2 for every weight element; each is written once per
    call by a division by a 1.0 computed from x (`_apart`), which XLA does not duplicate, so the loop reads them
    as arrays.
  - Float element codes (NVFP4 / MXFP4's e2m1, fp8) are decoded by integer and float operations on their bits
    (`_float_values`), not read from a table by code: inside the loop a table read is a gather, which LLVM
    scalarises (one load per weight element); the bit operations vectorise.
  - Each row of x (up to `MAX_ROWS`) is its own GEMV: several activation rows would make the dot a GEMM, which
    XLA sends to a library without fusing the decode.

The weight element is bit-identical to `dequantize(q, x.dtype)`'s (same operations, same per-op rounding in the
scale's dtype, `qformats.rounding`), so the result equals the dequantize-then-dot one up to the order XLA sums in:

    W[k, n] = (v[n, k] - z[n, G(k)]) * (s[n, G(k)] / c) [+ o[n, G(k)]]   (k along the packed axis, G(k) = k // g;
                                                                           o: the QArray's optional offset)
    y[m, n] = sum_k x[m, k] W[k, n];   |y - y_ref| <= 2 K eps_f32 sum_k |x[m, k]| |W[k, n]|

(y_ref: the exact sum; float32 accumulation in any order is within K eps of it, the chunked sums included.)
"""

from __future__ import annotations

import math
from typing import List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats import rounding as R
from qformats.errors import KernelError
from qformats.formats import FloatFormat, IntFormat
from qformats.qarray import QArray, element_values

__all__ = ["packed_dot", "packed_dot_supported", "packed_matmul", "packed_matmul_supported", "tie_to", "CHUNK",
           "MAX_ROWS"]

_STRATEGIES = ("tensor", "channel", "group", "tensor_group")

CHUNK = 2048
"""Most elements of x per fused dot: XLA:CPU fuses a weight into a matrix-vector dot only while the vector is
under 16 KiB (2048 float32 leaves room for any activation dtype)."""

MAX_ROWS = 8
"""Most activation rows `packed_dot` takes (one fused GEMV per row); more rows amortise one dense dequantize."""


def packed_dot_supported(x_shape, q: QArray) -> bool:
    """Whether `packed_dot` takes activations of shape `x_shape` [..., K] times q: at most `MAX_ROWS` activation
    rows (the product of the leading dimensions), and q a 2-D [K, N] weight of a 4- or 8-bit format (float, int or a
    16-entry table such as GGUF's IQ4_NL grid) quantized
    along K (axis 0) with tensor, channel, group or tensor_group scales (4-bit groups of even size)."""
    if not packed_matmul_supported(q):
        return False
    x_shape = tuple(x_shape)
    return (len(x_shape) >= 1 and x_shape[-1] == q.shape[0] and 1 <= math.prod(x_shape[:-1]) <= MAX_ROWS)


def tie_to(x: jax.Array, arrays):
    """`arrays` (a sequence; None entries pass through) with each array recomputed from x: a | z on its bits, with
    z = int(0 * x_0) = 0 (x_0 zeroed when not finite). No bit changes; what XLA now sees is that every array
    depends on x.

    That orders work XLA:CPU would otherwise move: a computation of the weights alone is hoisted out of a decode
    loop (loop-invariant code motion) or scheduled ahead of its layer, its result then held in memory for the
    whole loop / for every layer at once. An optimization barrier does not prevent either on XLA:CPU (none is
    left in the optimized module); a data dependency does. XLA folds `0 * x` only for integers.

    Only in a process with one device: with several, x may be sharded (a row-parallel layer's input is split
    along K) and reading x_0 would add a collective (a scalar all-reduce) to every layer, so the arrays are
    returned as they are."""
    if x.size == 0 or jax.device_count() > 1:
        return tuple(arrays)
    x0 = x[(0,) * x.ndim].astype(jnp.float32)
    zero = jnp.float32(0.0) * jnp.where(jnp.isfinite(x0), x0, jnp.float32(0.0))

    def tie(a):
        if a is None:
            return None
        bits = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
        if a.dtype == bits:
            return a | zero.astype(bits)
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, bits) | zero.astype(bits), a.dtype)

    return tuple(tie(a) for a in arrays)


def _chunks(q: QArray) -> List[Tuple[int, int]]:
    """[k0, k1) ranges of K, each a whole number of scale groups, whose per-dot vectors hold <= CHUNK elements
    (a 4-bit chunk feeds two dots of half its length)."""
    k = q.shape[0]
    per = CHUNK * (2 if q.scheme.bits == 4 else 1)
    if q.scheme.strategy in ("group", "tensor_group"):
        g = q.scheme.group_size
        per = max(g, per // g * g)
    n = -(-k // per)
    return [(i * per, min(k, (i + 1) * per)) for i in range(n)]


def _factor(q: QArray, scale, global_scale, sdt, in_loop: bool = False) -> jax.Array:
    """s' = s / c per group as `dequantize` computes it (E8M0 / fp8 decoded, R.div rounding in sdt): [N, G],
    [N, 1] or [1]. `in_loop`: a float16 / bfloat16 scale widened to float32 is returned as the convert itself, to
    be fused into the GEMV loop (module docstring), instead of written by a fusion of its own."""
    if q.scheme.scale_format == "e8m0":
        from qformats.codec import decode

        s = decode(scale, "e8m0", dtype=sdt)
    else:
        s = scale.astype(sdt)
    if global_scale is not None:
        return R.div(s, global_scale, sdt)
    if scale.dtype == s.dtype:
        return s  # read as stored: nothing to compute per element
    if in_loop and s.dtype == jnp.float32 and scale.dtype in (jnp.float16, jnp.bfloat16):
        return s  # an exact widening, one per group in the GEMV loop
    return _own_fusion(s)


def _own_fusion(a: jax.Array) -> jax.Array:
    """a, computed in a loop of its own: a / (1 + 0 a), exactly a for every finite a and NaN (a float32 subnormal
    is flushed, as the product it scales would be); used for E8M0 and fp8 scales, which hold no infinity.

    XLA:CPU duplicates a cheap elementwise producer (the E8M0 bit decode, an fp8 convert) into every consumer,
    here into the fused GEMV loop, where it ran once per weight element instead of once per group; an
    optimization barrier does not stop it (none is left in the optimized module). A float division is one of
    the ops XLA does not duplicate into a consumer that reads each element many times, and `0 a` is not folded
    for floats, so the division stays."""
    return a / (np.float32(1.0) + np.float32(0.0) * a)


def _one(x: jax.Array) -> jax.Array:
    """1.0 (float32) computed from x: 1 + 0 x_0 (x_0 zeroed when not finite); XLA does not fold `0 x` for floats."""
    x0 = x[(0,) * x.ndim].astype(jnp.float32)
    return np.float32(1.0) + np.float32(0.0) * jnp.where(jnp.isfinite(x0), x0, np.float32(0.0))


def _apart(a: jax.Array, one: jax.Array) -> jax.Array:
    """a / one (one = 1.0, `_one`): a itself for every float a (inf and NaN included; a subnormal is flushed, as
    XLA:CPU flushes it wherever it is read), computed in a loop of its own and written once.

    Without it XLA:CPU fuses a cheap producer of a GEMV operand into the GEMV loop: the per-group scales and offsets
    (with `tie_to`'s bit operations) were recomputed and re-gathered by k // g for every weight element, and the
    even / odd elements of x read with a stride of 2 inside the vectorised loop. A float division is not duplicated
    into a consumer that reads each element many times (`_own_fusion`), so each operand is materialised once per
    call ([N, G] scales, K / 2 activations) and the loop reads them contiguously."""
    return a / one.astype(a.dtype)


def _values(u: jax.Array, fmt, sdt) -> jax.Array:
    """element_values(u, fmt, sdt) for 4- or 8-bit codes u: integers and table formats (`TableFormat`: its own
    2^bits values) as `element_values` computes them; float formats by `_float_values` (the same values, bit for
    bit, in a form that vectorises inside the fused GEMV loop)."""
    if isinstance(fmt, FloatFormat):
        return _float_values(u, fmt, sdt)
    return element_values(u, fmt, sdt)


def _float_values(u: jax.Array, fmt: FloatFormat, sdt) -> jax.Array:
    """The value of each float code u (uint8, `fmt.bits` low bits), as `qformats.codec.decode` gives it, bit for
    bit (specials and the signed zero included), computed with elementwise integer and float operations only.
    With a = u & (2^(bits-1) - 1) (the magnitude bits, exponent E then mantissa M) and m = fmt.mbits:

        normal (a >= 2^m):    float32 bits (a << (23 - m)) + ((127 - bias) << 23)   = 2^(E - bias) (1 + M / 2^m)
        subnormal (a < 2^m):  a * 2^(emin - m)                                      = 2^(1 - bias) M / 2^m
        then specials per fmt.specials (inf / NaN), negated when the sign bit is set; cast to sdt.

    Why not a 2^bits-entry table read by code (the same values): inside XLA:CPU's fused GEMV loop a table read is
    a gather, which LLVM scalarises (one load per weight element); these operations vectorise."""
    c = u.astype(jnp.int32)
    m = fmt.mbits
    sign_bit = 1 << (fmt.bits - 1)
    a = c & (sign_bit - 1)
    normal = jax.lax.bitcast_convert_type((a << (23 - m)) + ((127 - fmt.bias) << 23), jnp.float32)
    val = jnp.where(a < (1 << m), a.astype(jnp.float32) * np.float32(2.0 ** (fmt.emin - m)), normal)
    if fmt.specials == "ieee":
        top = ((1 << fmt.ebits) - 1) << m
        val = jnp.where(a >= top, jnp.where(a == top, np.float32(np.inf), np.float32(np.nan)), val)
    elif fmt.specials == "fn":
        val = jnp.where(a == fmt.nan_code, np.float32(np.nan), val)
    elif fmt.specials == "fnuz":
        val = jnp.where(c == fmt.nan_code, np.float32(np.nan), val)  # the code 1000...0, negated below as decode does
    return jnp.where(c >= sign_bit, -val, val).astype(sdt)


def _weight(v, s, z, o, q: QArray, k0: int, step: int, sdt, dtype) -> jax.Array:
    """W [N, L] for elements k = k0 + step * i (i < L) of every row: (v - z[G(k)]) * s[G(k)] + o[G(k)], rounded per
    op in sdt as `dequantize` does, cast to dtype. v: [N, L] element values; step 1 (8-bit) or 2 (one nibble of
    4-bit); z (zero point) and o (offset) may be None."""
    st = q.scheme.strategy
    n, length = v.shape
    if st in ("group", "tensor_group"):
        per = q.scheme.group_size // step          # elements of one group in this strided view
        g0 = k0 // q.scheme.group_size
        gs = slice(g0, g0 + length // per)
        vg = v.reshape(n, length // per, per)
        if z is not None:
            vg = R.sub(vg, z[:, gs, None], sdt)
        w = R.mul(vg, s[:, gs, None], sdt)
        if o is not None:
            w = R.add(w, o[:, gs, None], sdt)
        return w.reshape(n, length).astype(dtype)
    if st == "tensor":
        s = s.reshape(1, 1)
        z = None if z is None else z.reshape(1, 1)
        o = None if o is None else o.reshape(1, 1)
    if z is not None:
        v = R.sub(v, z, sdt)
    w = R.mul(v, s, sdt)
    if o is not None:
        w = R.add(w, o, sdt)
    return w.astype(dtype)


def _gemv_nibble_pairs(xv, b, s, z, o, q: QArray, k0: int, sdt, dtype, one) -> jax.Array:
    """y[n] = sum_i P[n, i], P[n, i] = x_even[i] W_lo[n, i] + x_odd[i] W_hi[n, i], for the bytes b [N, L] of a 4-bit
    integer weight (codes 2i and 2i + 1 of the chunk in byte i's low and high nibble): one fused GEMV per chunk
    that reads each byte once, as `ones . P^T` (ones: a float32 1.0 per byte, computed from x by `_apart`, so that
    XLA fuses P into the vector-matrix dot as the weight and LLVM keeps its accumulators).

    The byte is widened to int32 once and split there, lo = b & 15, hi = b >> 4 (in uint8 LLVM narrows the split
    back to byte shifts and masks and a widening per nibble); each nibble's element is decoded as `_weight` decodes
    it (bit for bit `dequantize`'s), the products and their sum in float32. Against a dot per nibble (two GEMVs of
    L bytes each reading every byte, summed by a third dot): half the rows, each byte loaded and widened once, and
    no sum of the parts (module docstring)."""
    b32 = b.astype(jnp.int32)
    fmt = q.scheme.format
    w = [_weight(element_values(u, fmt, sdt), s, z, o, q, k0, 2, sdt, dtype).astype(jnp.float32)
         for u in (b32 & 15, b32 >> 4)]
    pw = xv[0].astype(jnp.float32)[None, :] * w[0] + xv[1].astype(jnp.float32)[None, :] * w[1]
    return _gemv(_apart(jnp.ones((pw.shape[1],), jnp.float32), one), pw)


def _gemv(xv: jax.Array, w: jax.Array) -> jax.Array:
    """y[n] = sum_i xv[i] w[n, i], float32: the vector-matrix form XLA:CPU fuses w's producer into (w as [L, N])."""
    return jax.lax.dot_general(xv, w.T, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def packed_dot(x: jax.Array, q: QArray) -> jax.Array:
    """y[..., n] = sum_k x[..., k] W[k, n] with W = dequantize(q, x.dtype), each activation row one fused GEMV
    per chunk of K (and per nibble for 4-bit float and table codes) that decodes the packed codes inside XLA's dot
    loop:

        W[k, n] = (v[n, k] - z[n, G(k)]) * (s[n, G(k)] / c) + o[n, G(k)]

    (v: the element values, z: zero point, s: scale, c: global scale, o: the optional additive offset; each op
    rounded as `dequantize` rounds it),
    with s / c and z prepared per group outside the loop (module docstring). Equal to dequantize-then-dot up to
    float32 summation order: |y - y_ref| <= 2 K eps sum_k |x[k]| |W[k, n]|.

    Args:
      x: activations [..., K], at most `MAX_ROWS` rows (float).
      q: a 4- or 8-bit weight of logical shape [K, N] quantized along axis 0 (`packed_dot_supported`).

    Returns:
      [..., N] in x's dtype, accumulated in float32.

    Raises:
      KernelError: (x, q) outside `packed_dot_supported`.
    """
    if not packed_dot_supported(x.shape, q):
        raise KernelError(f"packed_dot: expected at most {MAX_ROWS} activation rows [..., K] and a 4- or 8-bit "
                          f"[K, N] weight quantized along K with tensor, channel, group or tensor_group scales; "
                          f"got x {tuple(x.shape)} and {q!r}")
    scheme = q.scheme
    k, n = q.shape
    sdt = q.work_dtype
    rows = x.reshape(-1, k)
    chunks = _chunks(q)
    nib = scheme.bits == 4
    # x cut into the contiguous vectors of each dot (even / odd elements per nibble) before the loops read it
    xs = [[rows[m, k0:k1][j::2] for j in range(2)] if nib else [rows[m, k0:k1]]
          for m in range(rows.shape[0]) for k0, k1 in chunks]
    # the barrier makes the packed arrays depend on x in the jaxpr; XLA:CPU drops it, so the per-group arrays are
    # also tied to x by data (`tie_to`): their decode is not hoisted out of a decode loop as a float32 copy of
    # every layer's scales (the codes need no tie: they are decoded inside the dots, which read x)
    xs, codes, scale, zp, gscale, off = jax.lax.optimization_barrier(
        (xs, q.codes, q.scale, q.zero_point, q.global_scale, q.offset))
    scale, zp, gscale, off = tie_to(rows, (scale, zp, gscale, off))
    s = _factor(q, scale, gscale, sdt, in_loop=not nib)
    z = None if zp is None else zp
    if z is not None and scheme.strategy == "tensor":
        z = z.reshape(1)
    o = None if off is None else off.astype(sdt)
    if nib:  # operands written once per call (module docstring; measured no faster for 8-bit weights)
        one = _one(rows)
        s = _apart(s, one) if s.dtype == scale.dtype else s
        o = None if o is None else _apart(o, one)
        xs = [[_apart(v, one) for v in vs] for vs in xs]
    parts = []
    for idx, xv in enumerate(xs):
        k0, k1 = chunks[idx % len(chunks)]
        if nib and isinstance(scheme.format, IntFormat) and xv[0].shape == xv[1].shape:
            parts.append(_gemv_nibble_pairs(xv, codes[:, k0 // 2:k1 // 2], s, z, o, q, k0, sdt, x.dtype, one))
        elif nib:
            b = codes[:, k0 // 2:(k1 + 1) // 2]
            for j in range(2):
                length = xv[j].shape[0]
                u = ((b >> jnp.uint8(4 * j)) & jnp.uint8(15))[:, :length]
                v = _values(u, scheme.format, sdt)
                parts.append(_gemv(xv[j], _weight(v, s, z, o, q, k0, 2, sdt, x.dtype)))
        else:
            v = _values(codes[:, k0:k1], scheme.format, sdt)
            parts.append(_gemv(xv[0], _weight(v, s, z, o, q, k0, 1, sdt, x.dtype)))
    # summed as ones . stack(parts): XLA output-fuses a plain `a + b` of matrix-vector dots into one of them,
    # which makes that dot a library call and un-fuses its weight (and it rewrites a sum over a stack into adds)
    per_row = len(parts) // rows.shape[0]
    if per_row == 1:
        y = jnp.stack(parts)
    else:
        y = jnp.stack([jax.lax.dot_general(jnp.ones((per_row,), jnp.float32), jnp.stack(parts[m * per_row:(m + 1) * per_row]),
                                           (((0,), (0,)), ((), ()))) for m in range(rows.shape[0])])
    return y.astype(x.dtype).reshape(x.shape[:-1] + (n,))


def packed_matmul_supported(q: QArray) -> bool:
    """Whether `packed_matmul` takes q: a 2-D [K, N] weight of a 4- or 8-bit format quantized along K (axis 0) with
    tensor, channel, group or tensor_group scales (4-bit groups of even size); any number of activation rows."""
    if not isinstance(q, QArray) or q.ndim != 2 or q.axis != 0:
        return False
    s = q.scheme
    if s.bits not in (4, 8) or s.strategy not in _STRATEGIES:
        return False
    return not (s.bits == 4 and s.strategy in ("group", "tensor_group") and s.group_size % 2)


def packed_matmul(x: jax.Array, q: QArray) -> jax.Array:
    """y[m, n] = sum_k x[m, k] W[k, n], float32, for any number of rows x [M, K], W = dequantize(q, x.dtype)
    decoded once per call in the codes' own layout [N, K] (no transpose) and multiplied by XLA's dot contracting K:

        4-bit:  y = x_even W_lo^T + x_odd W_hi^T,  W_j[n, i] = decode((codes[n, i] >> 4 j) & 15)   [N, K / 2]
        8-bit:  y = x W^T,                         W[n, k]   = decode(codes[n, k])                  [N, K]

    each element (v - z[G(k)]) * (s[G(k)] / c) [+ o[G(k)]] rounded per op as `dequantize` rounds it (the same
    weight elements, bit for bit). Why not dequantize-then-dot: `dequantize` interleaves the two nibbles of a byte
    (a concatenate XLA:CPU runs as a slow elemental loop) and moves K back to axis 0 (a transposed copy); here each
    nibble's matrix is one contiguous, vectorised elementwise loop over the codes. The product is a GEMM (XLA fuses
    no decode into it), so the decode is paid once for all M rows: the form for the several rows per weight of a
    prefill (each row its own fused GEMV, `packed_dot`, pays it per row). Equal to dequantize-then-dot up to float32
    summation order: |y - y_ref| <= 2 K eps sum_k |x[m, k]| |W[k, n]|.

    Args:
      x: activations [M, K] (float).
      q: a weight of logical shape [K, N] (`packed_matmul_supported`).

    Returns:
      [M, N] float32.

    Raises:
      KernelError: q outside `packed_matmul_supported`, or x not [M, K].
    """
    if not packed_matmul_supported(q) or x.ndim != 2 or x.shape[1] != q.shape[0]:
        raise KernelError(f"packed_matmul: expected activations [M, K] and a 4- or 8-bit [K, N] weight quantized along "
                          f"K with tensor, channel, group or tensor_group scales; got x {tuple(x.shape)} and {q!r}")
    scheme = q.scheme
    sdt = q.work_dtype
    s = _factor(q, q.scale, q.global_scale, sdt)
    z = q.zero_point
    if z is not None and scheme.strategy == "tensor":
        z = z.reshape(1)
    o = None if q.offset is None else q.offset.astype(sdt)
    dims = (((1,), (1,)), ((), ()))
    if scheme.bits != 4:
        w = _weight(element_values(q.codes, scheme.format, sdt), s, z, o, q, 0, 1, sdt, x.dtype)
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    y = None
    for j in range(2):
        xj = x[:, j::2]
        u = ((q.codes >> jnp.uint8(4 * j)) & jnp.uint8(15))[:, :xj.shape[1]]
        w = _weight(element_values(u, scheme.format, sdt), s, z, o, q, 0, 2, sdt, x.dtype)
        part = jax.lax.dot_general(xj, w, dims, preferred_element_type=jnp.float32)
        y = part if y is None else y + part
    return y
