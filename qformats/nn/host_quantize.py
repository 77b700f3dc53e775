"""Round-to-nearest integer, FP8 / FP6 and NVFP4 weight quantization on the host (numpy + ml_dtypes), bit for bit
`qformats.quantize` as XLA:CPU computes it, without compiling anything.

`quantize_weight(W, schemes, "rtn")` on XLA:CPU costs one compilation per distinct weight shape (0.2 to 0.5 s
each on a small CPU, and tens of MB of compiler memory) for a few memory passes of work. For the schemes below the
same codes and scales come from numpy and ml_dtypes in a few passes over the weight, with XLA:CPU's float
semantics reproduced exactly: float32 subnormal operands and results of its divisions and multiplications are
flushed to a zero of the same sign (`flush`), each operation is rounded once to the input dtype where
`qformats.rounding` rounds it, and ml_dtypes' `astype` rounds to nearest even like `qformats.codec.encode`
(overflow saturated by a clip first).

Covered (`host_quantizable`): weight-only round-to-nearest of a float32 / bfloat16 W [*stacked, K, N] along K
under (float16 is not: a NaN scale's payload bits differ from XLA's)
  - symmetric integer channel or group scales in the input dtype (W8A16, W4A16, W8A8's weights, ...):
    s = amax / ((qmax - qmin) / 2) (0 -> eps of the dtype), q = round_half_even(clip(x / s, qmin, qmax))
    (NaN -> 0), int8 stored as is, narrower codes offset by -qmin and packed (`qformats.packing.pack_numpy`);
  - float channel scales in the input dtype (FP8_E4M3, FP8_DYNAMIC's weights, FP6_E3M2, FP6_E2M3):
    s_n = amax_n / max_fmt (448, 28, 7.5; 0 -> eps of the dtype), q = fmt(x / s) (6-bit codes packed four in
    three bytes);
  - NVFP4 (tensor_group, fp8 group scales of 16, absmax rule): g = (1 / max(amax_W, tiny)) * 448 * 6 (NaN / inf
    -> 1), s_G = fp8(clip(g * (amax_G / 6), +-448)) (0 -> 0.125), q = fp4(x / (s_G / g)), packed two per byte;
stacked leading axes quantized one layer at a time (each layer its own global scale, as `quantize_weight` vmaps).
Memory: the weight is read in its own layout (a CPU jax array is viewed, not copied), `CHUNK` elements of output
rows at a time, and the codes and scales are written straight into their final [N, K] buffers, which the QArray
then holds without a copy: the float temporaries are one chunk's, never a weight's.
Everything else takes the jitted path.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qformats.formats import IntFormat
from qformats.qarray import QArray
from qformats.packing import pack_numpy
from qformats.scales import FP8_MAX, NVFP4_GLOBAL_NUMERATOR
from qformats.schemes import QuantScheme, SchemeSet

_F32 = np.float32
_TINY = np.finfo(np.float32).tiny
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_FP4 = np.dtype(ml_dtypes.float4_e2m1fn)
# float element formats of a channel scheme the host path rounds (ml_dtypes' type of each, round to nearest even)
_CHANNEL_FORMATS = {"fp8_e4m3fn": _FP8, "fp6_e3m2": np.dtype(ml_dtypes.float6_e3m2fn),
                    "fp6_e2m3": np.dtype(ml_dtypes.float6_e2m3fn)}


def _kind(s: QuantScheme) -> Optional[str]:
    name = _fmt_name(s)
    if (isinstance(s.format, IntFormat) and s.strategy in ("channel", "group") and s.symmetric
            and s.scale_format == "input" and s.scale_rule == "absmax"):
        return "int"
    if (s.strategy == "channel" and s.scale_format == "input" and name in _CHANNEL_FORMATS and s.symmetric
            and s.scale_rule == "absmax"):
        return "channel"
    if (s.strategy == "tensor_group" and s.group_size == 16 and s.scale_format == "fp8_e4m3fn"
            and name == "fp4_e2m1" and s.scale_rule == "absmax"):
        return "nvfp4"
    return None


def _fmt_name(s: QuantScheme) -> str:
    return s.format.name if hasattr(s.format, "name") else str(s.format)


def host_quantizable(value, schemes: SchemeSet, weight_search: str, k: Optional[int] = None) -> bool:
    """Whether `quantize(value, schemes)` takes the host path: round-to-nearest, a scheme `_kind` covers (see the
    module docstring), a float32 / bfloat16 value of 2 or more dims, the contracted size `k` (default the size of
    the value's axis -2: a [.., K, N] kernel) a multiple of the group size, and jax's default backend the CPU (on
    an accelerator the jitted path is the fast one), the value on one device."""
    ws = schemes.weights
    if weight_search != "rtn" or ws is None or _kind(ws) is None or jax.default_backend() != "cpu":
        return False
    if jnp.result_type(value).name not in _DTYPES or jnp.ndim(value) < 2:
        return False
    if isinstance(value, jax.core.Tracer):  # under a trace (jit, eval_shape): the jitted path
        return False
    if isinstance(value, jax.Array) and len(value.sharding.device_set) != 1:
        return False
    k = jnp.shape(value)[-2] if k is None else k
    return ws.group_size is None or k % ws.group_size == 0


def flush(x: np.ndarray) -> np.ndarray:
    """x (float32) with its subnormals replaced by zeros of the same sign, in place (XLA:CPU's flush-to-zero)."""
    u = x.view(np.uint32)
    sub = (u & np.uint32(0x7F800000)) == 0
    if sub.any():
        np.bitwise_and(u, np.uint32(0x80000000), out=u, where=sub)
    return x


def _rnd(x: np.ndarray, dt) -> np.ndarray:
    """x (float32) rounded once to `dt` (nearest even, subnormals kept: `qformats.rounding.rnd`), as float32."""
    return x if dt is np.float32 else x.astype(dt).astype(_F32)


# A weight whose per-channel (FP8) or per-tensor (NVFP4) absmax is below this may hold subnormals that a scale
# this small would lift to nonzero codes: then the whole weight is flushed first, as XLA:CPU reads it. Above it,
# a subnormal element's quotient is far below the smallest code, so it gives a zero code either way, fixed in
# sign by `_encode`.
_FLUSH_BELOW = _F32(2.0 ** -90)


def _absmax(x: np.ndarray, axis) -> np.ndarray:
    """max |x| over `axis` (keepdims), from max and min: no |x| temporary (NaN propagates)."""
    return np.maximum(np.max(x, axis=axis, keepdims=True), -np.min(x, axis=axis, keepdims=True))


CHUNK = 1 << 16
"""Elements of output rows quantized at a time (the float temporaries: about 256 KB each)."""


def _float_channel(x: np.ndarray, dt, fmt: np.dtype, fmax: float) -> Optional[tuple]:
    """x [rows, K] (float32 holding `dt` values, changed in place), one channel per row -> (codes uint8 [rows, K],
    in the low bits of each byte; scale `dt` [rows, 1]) for the float format `fmt` of largest value `fmax`; None
    when x holds a NaN."""
    amax = _absmax(x, 1)
    if np.isnan(amax).any():
        return None
    if (amax < _FLUSH_BELOW).any():
        amax = _absmax(flush(x), 1)
    s = _rnd(flush(np.divide(amax, _F32(fmax), dtype=_F32)), dt)
    s[s == 0] = _F32(np.finfo(dt).eps)
    return _encode(np.divide(x, s, dtype=_F32), x, dt, fmt, fmax), s.astype(dt)


def _int_rows(x: np.ndarray, dt, fmt: IntFormat, group: int, half: float) -> Optional[tuple]:
    """x [rows, K] (float32 holding `dt` values, changed in place), scales per `group` elements of a row ->
    (codes [rows, K]: int8 q for signed 8 bits, else uint8 q - qmin; scale `dt` [rows, K / group]); None when x
    holds a NaN. s = rnd(amax / half) (0 -> eps), q = round_half_even(clip(rnd(x / s), qmin, qmax)), NaN -> 0."""
    rows, k = x.shape
    xg = x.reshape(rows, k // group, group)
    amax = _absmax(xg, 2)
    if np.isnan(amax).any():
        return None
    if (amax < _FLUSH_BELOW).any():
        amax = _absmax(flush(xg), 2)
    s = _rnd(flush(np.divide(amax, _F32(half), dtype=_F32)), dt)
    s[s == 0] = _F32(np.finfo(dt).eps)
    y = _rnd(np.divide(xg, s, dtype=_F32), dt)
    np.clip(y, fmt.qmin, fmt.qmax, out=y)
    np.rint(y, out=y)
    y[np.isnan(y)] = 0
    if fmt.bits == 8 and fmt.signed:
        q = y.astype(np.int8)
    else:
        if fmt.qmin:
            y -= _F32(fmt.qmin)
        q = y.astype(np.uint8)
    return q.reshape(rows, k), s.reshape(rows, k // group).astype(dt)


def _nvfp4_global(amax_t, dt):
    """The float32 global scale g [1] = rnd(rnd(1 / max(amax_t, tiny)) * 448 * 6) (NaN / inf -> 1) of one layer."""
    tiny = _F32(np.finfo(dt).tiny)
    g = _rnd(flush(np.divide(_F32(1.0), np.maximum(np.asarray(amax_t, _F32).reshape(1), tiny), dtype=_F32)), dt)
    g = _rnd(flush(np.multiply(g, _F32(NVFP4_GLOBAL_NUMERATOR), dtype=_F32)), dt)
    return np.where(np.isfinite(g), g, _F32(1.0)).astype(_F32)


def _nvfp4_rows(x: np.ndarray, dt, g, flush_all: bool) -> tuple:
    """x [rows, K] (float32 holding `dt` values, changed in place) with its groups of 16, under the layer's global
    scale `g` -> (fp4 codes packed two per byte [rows, K / 2], scale fp8 [rows, K / 16]); `flush_all`: the layer
    is read flushed (its absmax is below `_FLUSH_BELOW`)."""
    rows, k = x.shape
    xg = x.reshape(rows, k // 16, 16)
    if flush_all:
        flush(xg)
    amax = _absmax(xg, 2)
    s32 = flush(np.multiply(g, _rnd(flush(np.divide(amax, _F32(6.0), dtype=_F32)), dt), dtype=_F32))
    s = np.clip(s32, -FP8_MAX, FP8_MAX).astype(_FP8)
    s[s.astype(_F32) == 0] = _FP8.type(0.125)
    eff = flush(np.divide(s.astype(_F32), g, dtype=_F32))
    c = _encode(np.divide(xg, eff, dtype=_F32), xg, np.float32, _FP4, 6.0).reshape(rows, k)
    return c[:, 0::2] | (c[:, 1::2] << np.uint8(4)), s.reshape(rows, k // 16)


# FP4 E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7): |y| rounds to code #{t in _FP4_CUTS: |y| > t}; the
# midpoints whose tie goes up (to the even code 2, 4, 6) are moved one float below, so ">" counts them.
_FP4_CUTS = tuple(_F32(c) if up is None else np.nextafter(_F32(c), _F32(0))
                  for c, up in ((0.25, None), (0.75, 1), (1.25, None), (1.75, 1), (2.5, None), (3.5, 1), (5.0, None)))


def _fp4_codes(y: np.ndarray) -> np.ndarray:
    """ml_dtypes' float4_e2m1fn bit patterns of y (float32, |y| <= 6 or NaN): round to nearest, ties to even,
    sign kept; NaN (which E2M1 lacks) -> the zero of the opposite sign, as ml_dtypes; a count of the cuts |y|
    exceeds (a quarter of astype's time). y is replaced by |y|."""
    sign = np.signbit(y)
    a = np.abs(y, out=y)
    c = np.zeros(y.shape, np.uint8)
    above = np.empty(y.shape, bool)
    for t in _FP4_CUTS:
        np.greater(a, t, out=above)
        c += above.view(np.uint8)
    nan = np.isnan(a)
    if nan.any():
        sign ^= nan
    c |= sign.view(np.uint8) << np.uint8(3)
    return c


def _encode(r: np.ndarray, x: np.ndarray, dt, fmt: np.dtype, fmax: float) -> np.ndarray:
    """`qformats.qarray.round_elements(rnd(flush(r), dt))` for a float format, r = x / s: overflow saturated to
    +-max, nearest code ties to even (ml_dtypes' astype), as uint8 bit patterns (6- and 4-bit codes in
    the low bits). A zero quotient gives the +0 code; so does one XLA:CPU flushes (r or x subnormal), which numpy
    left a tiny negative: the -0 codes are looked at only where they occur."""
    y = _rnd(r, dt)  # r itself for float32, changed in place only where |r| is not below tiny (what the fix reads)
    np.clip(y, -fmax, fmax, out=y)
    bits = 8 if fmt == _FP8 else (4 if fmt == _FP4 else 6)
    if fmt == _FP4:
        c = _fp4_codes(y)
    else:
        c = np.ascontiguousarray(y.astype(fmt)).view(np.uint8)
        if bits < 8:
            c &= np.uint8((1 << bits) - 1)
    neg0 = np.uint8(1 << (bits - 1))
    at = np.flatnonzero(c == neg0)
    if at.size:
        rr, xx = np.abs(r.reshape(-1)[at]), np.abs(x.reshape(-1)[at])
        c.reshape(-1)[at[(rr < _TINY) | (xx < _TINY)]] = 0
    return c


def host_quantize_weight(value, schemes: SchemeSet) -> Optional[QArray]:
    """`qformats.algorithms.weight_search.quantize_weight(value, schemes, "rtn")` computed on the host (see the
    module docstring): W [*stacked, K, N] along K; the QArray's leaves carry the stacked axes in front and its
    static shape is the per-layer [K, N]. Only for `host_quantizable` arguments. None when W holds a NaN (XLA:CPU's
    max reduction does not propagate NaN in a way numpy reproduces): quantize it with the jitted path."""
    return host_quantize(value, (0, 1), 1, jnp.ndim(value) - 2, schemes)


def host_quantize(value, perm, n_contracted: int, stacked: int, schemes: SchemeSet) -> Optional[QArray]:
    """`host_quantize_weight` of W = transpose(per-layer value, perm).reshape(K, N) (`perm`: the contracted axes
    of the per-layer value, then the free ones), for a value [*stacked, *per-layer] held as it is: read through a
    transposed view of each layer, `CHUNK` elements of W's rows (output channels) at a time, each chunk's codes and
    scales written into the final [*stacked, N, K'] buffers, which the QArray holds without a copy (no float copy
    of a weight or of a layer, no transposed copy of the codes). None when it holds a NaN."""
    ws = schemes.weights
    kind = _kind(ws)
    dt = _DTYPES[jnp.result_type(value).name]
    v = np.asarray(value)  # a CPU jax array: a view of its buffer
    lead, per = tuple(v.shape[:stacked]), tuple(v.shape[stacked:])
    perm = tuple(int(p) for p in perm)
    con, free = perm[:n_contracted], perm[n_contracted:]
    k = math.prod(per[a] for a in con)
    n = math.prod(per[a] for a in free)
    layers = math.prod(lead)
    bits = ws.format.bits
    if kind == "int":
        group = ws.group_size or k
        codes = _aligned((layers, n, -(-k * bits // 8)),
                         np.int8 if bits == 8 and ws.format.signed else np.uint8)
        scale = _aligned((layers, n, k // group), dt)
        rows_fn = functools.partial(_int_rows, dt=dt, fmt=ws.format, group=group,
                                    half=float(np.asarray(ws.half_range, dt)))
    elif kind == "channel":
        codes = _aligned((layers, n, -(-k * bits // 8)), np.uint8)
        scale = _aligned((layers, n, 1), dt)
        rows_fn = functools.partial(_float_channel, dt=dt, fmt=_CHANNEL_FORMATS[_fmt_name(ws)], fmax=ws.format.max)
    else:
        codes = _aligned((layers, n, k // 2), np.uint8)
        scale = _aligned((layers, n, k // 16), _FP8)
    gs = np.empty((layers, 1), _F32) if kind == "nvfp4" else None
    vl = v.reshape((layers,) + per)
    with np.errstate(all="ignore"):
        for i in range(layers):
            view = np.transpose(vl[i], free + con)  # [*free, *contracted]: W^T of this layer, not copied
            if kind == "nvfp4":
                amax_t = _F32(0)
                for _, _, x in _row_chunks(view, len(free), k):
                    amax_t = np.maximum(amax_t, _absmax(x, None).reshape(()))
                if np.isnan(amax_t):
                    return None
                flush_all = bool(amax_t < _FLUSH_BELOW)
                if flush_all and not amax_t >= _TINY:  # every element subnormal: read flushed, all zeros
                    amax_t = _F32(0)
                g = _nvfp4_global(amax_t, dt)
                gs[i] = g
                rows_fn = functools.partial(_nvfp4_rows, dt=dt, g=g, flush_all=flush_all)
            for r0, r1, x in _row_chunks(view, len(free), k):
                out = rows_fn(x)
                if out is None:
                    return None
                c, s = out
                if kind != "nvfp4" and bits < 8:
                    c = pack_numpy(c, bits)
                codes[i, r0:r1] = c
                scale[i, r0:r1] = s
    leaves = [a if a is None else jax.device_put(a.reshape(lead + a.shape[1:]), may_alias=True)
              for a in (codes, scale, gs)]
    return QArray(leaves[0], leaves[1], None, leaves[2], scheme=ws, shape=(k, n), dtype=dt, axis=0)


def _row_chunks(view: np.ndarray, n_free: int, k: int):
    """(r0, r1, x) over `view` [*free, *contracted] (a layer's W^T, any strides): x = float32 [r1 - r0, K], a
    fresh contiguous copy of the rows r0..r1 of W^T flattened to [N, K], about `CHUNK` elements each (whole rows,
    one index of the leading free axes at a time)."""
    fs = view.shape[:n_free]
    if not fs:
        yield 0, 1, _as_f32(view[None]).reshape(1, k)
        return
    last = fs[-1]
    step = max(1, CHUNK // max(1, k))
    for j, idx in enumerate(np.ndindex(*fs[:-1])):
        base = j * last
        sub = view[idx]
        for a in range(0, last, step):
            b = min(a + step, last)
            yield base + a, base + b, _as_f32(sub[a:b]).reshape(b - a, k)


def _as_f32(a: np.ndarray) -> np.ndarray:
    """A fresh C-contiguous float32 copy of `a` (float32 or bfloat16, any strides): bfloat16 widened exactly,
    its 16 bits moved to the high half of a float32."""
    if a.dtype == np.float32:
        return np.array(a, dtype=np.float32, order="C")
    u = np.empty(a.shape, np.uint32)
    np.copyto(u, a.view(np.uint16), casting="safe")
    u <<= np.uint32(16)
    return u.view(np.float32)


def _aligned(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned (so that `jax.device_put(a,
    may_alias=True)` on the CPU wraps it instead of copying it)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = np.empty(nbytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return buf[off:off + nbytes].view(dtype).reshape(shape)


def quantize_weight(kernel, schemes: SchemeSet, weight_search: str = "rtn") -> QArray:
    """`qformats.algorithms.weight_search.quantize_weight(kernel, schemes, weight_search)`, computed on the host
    when `host_quantizable` (the same bits, no compilation), else by it, the stacked layers of a kernel on one
    device one at a time (`layer_by_layer`: the same bits, a layer's temporaries instead of the stack's)."""
    if host_quantizable(kernel, schemes, weight_search):
        q = host_quantize_weight(kernel, schemes)
        if q is not None:
            return q
    from qformats.algorithms.weight_search import quantize_weight as jitted

    stacked = jnp.ndim(kernel) - 2 if one_device(kernel) else 0
    if stacked <= 0:
        return jitted(kernel, schemes, weight_search)
    return _stack_quantizer(schemes, weight_search, stacked)(kernel)


@functools.lru_cache(maxsize=64)
def _stack_quantizer(schemes: SchemeSet, weight_search: str, stacked: int):
    """The jitted `layer_by_layer` quantization of a kernel with `stacked` leading axes (one compilation per
    distinct shape, as `quantize_weight`'s own)."""
    from qformats.algorithms.weight_search import quantize_weight as jitted

    return jax.jit(lambda k: layer_by_layer(lambda w: jitted(w, schemes, weight_search), k, stacked))


def one_device(value) -> bool:
    """Whether `value` is a host array, a tracer, or a jax.Array on a single device (not sharded)."""
    return not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer) or \
        len(value.sharding.device_set) == 1


def layer_by_layer(fn, value, stacked: int):
    """fn(value[i]) for each index i of `value`'s leading `stacked` axes, computed one layer after the other
    (`jax.lax.map` over them flattened to one), the results' leaves stacked with those axes in front: what
    `jax.vmap(fn)` nested `stacked` times gives, with the temporaries of one layer's computation live at a time
    instead of the whole stack's (XLA:CPU materialises a transposed float copy of a weight to quantize it along
    K: one layer's, not the stack's). `stacked` = 0: fn(value)."""
    if stacked <= 0:
        return fn(value)
    lead = tuple(jnp.shape(value)[:stacked])
    out = jax.lax.map(fn, jnp.reshape(value, (-1,) + tuple(jnp.shape(value)[stacked:])))
    return jax.tree_util.tree_map(lambda a: a.reshape(lead + a.shape[1:]), out)
