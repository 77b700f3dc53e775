"""Round-to-nearest FP8 / FP6 (channel) and NVFP4 weight quantization on the host (numpy + ml_dtypes), bit for bit
`qformats.quantize` as XLA:CPU computes it, without compiling anything.

`quantize_weight(W, schemes, "rtn")` on XLA:CPU costs one compilation per distinct weight shape (0.2 to 0.5 s
each on a small CPU) for a few memory passes of work. For the two schemes below the same codes and scales come
from numpy and ml_dtypes in a few passes over the weight, with XLA:CPU's float semantics reproduced exactly:
float32 subnormal operands and results of its divisions and multiplications are flushed to a zero of the same
sign (`flush`), each operation is rounded once to the input dtype where `qformats.rounding` rounds it, and
ml_dtypes' `astype` rounds to nearest even like `qformats.codec.encode` (overflow saturated by a clip first).

Covered (`host_quantizable`): weight-only round-to-nearest of a float32 / bfloat16 W [*stacked, K, N] along K
under (float16 is not: a NaN scale's payload bits differ from XLA's)
  - float channel scales in the input dtype (FP8_E4M3, FP8_DYNAMIC's weights, FP6_E3M2, FP6_E2M3):
    s_n = amax_n / max_fmt (448, 28, 7.5; 0 -> eps of the dtype), q = fmt(x / s) (6-bit codes packed four in
    three bytes, `qformats.packing.pack`);
  - NVFP4 (tensor_group, fp8 group scales of 16, absmax rule): g = (1 / max(amax_W, tiny)) * 448 * 6 (NaN / inf
    -> 1), s_G = fp8(clip(g * (amax_G / 6), +-448)) (0 -> 0.125), q = fp4(x / (s_G / g)), packed two per byte;
stacked leading axes quantized one layer at a time (each layer its own global scale, as `quantize_weight` vmaps).
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

from qformats.qarray import QArray
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
    if (s.strategy == "channel" and s.scale_format == "input" and name in _CHANNEL_FORMATS and s.symmetric
            and s.scale_rule == "absmax"):
        return "channel"
    if (s.strategy == "tensor_group" and s.group_size == 16 and s.scale_format == "fp8_e4m3fn"
            and name == "fp4_e2m1" and s.scale_rule == "absmax"):
        return "nvfp4"
    return None


def _fmt_name(s: QuantScheme) -> str:
    return s.format.name if hasattr(s.format, "name") else str(s.format)


def host_quantizable(value, schemes: SchemeSet, weight_search: str, k_inner: Optional[int] = None) -> bool:
    """Whether `quantize(value, schemes)` takes the host path: round-to-nearest, an FP8 / FP6 channel or NVFP4
    weight scheme, a float32 / bfloat16 value of 2 or more dims, for NVFP4 the innermost axis of K (`k_inner`, default
    the size of the value's axis -2: a [.., K, N] kernel) a multiple of 16 (groups within one axis), and jax's
    default backend the CPU (on an accelerator the jitted path is the fast one), the value on one device."""
    ws = schemes.weights
    if weight_search != "rtn" or ws is None or _kind(ws) is None or jax.default_backend() != "cpu":
        return False
    if jnp.result_type(value).name not in _DTYPES or jnp.ndim(value) < 2:
        return False
    if isinstance(value, jax.core.Tracer):  # under a trace (jit, eval_shape): the jitted path
        return False
    if isinstance(value, jax.Array) and len(value.sharding.device_set) != 1:
        return False
    k_inner = jnp.shape(value)[-2] if k_inner is None else k_inner
    return _kind(ws) != "nvfp4" or k_inner % 16 == 0


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


def _float_channel(x: np.ndarray, red: tuple, dt, fmt: np.dtype, fmax: float) -> Optional[tuple]:
    """x (float32 holding `dt` values), the channel reduced over axes `red` -> (codes uint8 shaped like x, in
    the low bits of each byte; scale `dt` keepdims over `red`) for the float format `fmt` of largest value
    `fmax`; None when x holds a NaN."""
    amax = _absmax(x, red)
    if np.isnan(amax).any():
        return None
    if (amax < _FLUSH_BELOW).any():
        x = flush(np.array(x))
        amax = _absmax(x, red)
    s = _rnd(flush(np.divide(amax, _F32(fmax), dtype=_F32)), dt)
    s[s == 0] = _F32(np.finfo(dt).eps)
    return _chunked(x, s, dt, fmt, fmax), s.astype(dt)


CHUNK = 1 << 18
"""Elements divided and rounded at a time (the float temporaries of the elementwise part: about 1 MB each)."""


def _chunked(x: np.ndarray, s: np.ndarray, dt, fmt: np.dtype, fmax: float) -> np.ndarray:
    """`_encode(x / s)` (s broadcast against x) in slices of x's axis 0 of about `CHUNK` elements."""
    codes = np.empty(x.shape, np.uint8)
    step = max(1, CHUNK // max(1, x.size // max(1, x.shape[0])))
    for a in range(0, x.shape[0], step):
        xc = x[a:a + step]
        sc = s if s.shape[0] == 1 else s[a:a + step]
        codes[a:a + step] = _encode(np.divide(xc, sc, dtype=_F32), xc, dt, fmt, fmax)
    return codes


def _nvfp4(x: np.ndarray, grp: int, layer: tuple, dt) -> Optional[tuple]:
    """x (float32 holding `dt` values) with its groups of 16 along axis `grp`, each layer's elements over axes
    `layer` -> (codes uint8 shaped like x, scale fp8 keepdims over `grp`, global scale float32 keepdims over
    `layer`); None when x holds a NaN."""
    amax = _absmax(x, grp)
    if np.isnan(amax).any():
        return None
    amax_t = np.max(amax, axis=layer, keepdims=True)
    if (amax_t < _FLUSH_BELOW).any():
        x = flush(np.array(x))
        amax = _absmax(x, grp)
        amax_t = np.max(amax, axis=layer, keepdims=True)
    tiny = _F32(np.finfo(dt).tiny)
    g = _rnd(flush(np.divide(_F32(1.0), np.maximum(amax_t, tiny), dtype=_F32)), dt)
    g = _rnd(flush(np.multiply(g, _F32(NVFP4_GLOBAL_NUMERATOR), dtype=_F32)), dt)
    g = np.where(np.isfinite(g), g, _F32(1.0)).astype(_F32)
    s32 = flush(np.multiply(g, _rnd(flush(np.divide(amax, _F32(6.0), dtype=_F32)), dt), dtype=_F32))
    s = np.clip(s32, -FP8_MAX, FP8_MAX).astype(_FP8)
    s[s.astype(_F32) == 0] = _FP8.type(0.125)
    eff = flush(np.divide(s.astype(_F32), g, dtype=_F32))
    return _chunked(x, eff, np.float32, _FP4, 6.0), s, g


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
    of the per-layer value, then the free ones), for a value [*stacked, *per-layer] held as it is: the scales
    and codes are computed in the value's own layout (no transposed float copy), one stacked layer at a time
    (the float temporaries are one layer's), and only the uint8 codes are transposed to [*stacked, N, K]. None
    when it holds a NaN."""
    ws = schemes.weights
    dt = _DTYPES[jnp.result_type(value).name]
    v = np.asarray(value)
    lead, per = v.shape[:stacked], v.shape[stacked:]
    perm = tuple(int(p) for p in perm)
    k = math.prod(per[a] for a in perm[:n_contracted])
    n = math.prod(per[a] for a in perm[n_contracted:])
    parts = []
    with np.errstate(all="ignore"):
        for idx in np.ndindex(*lead):
            parts.append(_layer(v[idx], perm, n_contracted, _kind(ws), dt, k, n, _fmt_name(ws), ws.format.max))
            if parts[-1] is None:
                return None
    leaves = []
    for i in range(3):
        if parts[0][i] is None:
            leaves.append(None)
            continue
        a = parts[0][i] if not lead else np.stack([p[i] for p in parts]).reshape(lead + parts[0][i].shape)
        leaves.append(jnp.asarray(a, copy=False))
    return QArray(leaves[0], leaves[1], None, leaves[2], scheme=ws, shape=(k, n), dtype=dt, axis=0)


def pack6(codes: np.ndarray) -> np.ndarray:
    """`qformats.packing.pack(codes, 6)` in numpy: along the last axis, four 6-bit codes c0..c3 in three bytes
    holding c0 | c1 << 6 | c2 << 12 | c3 << 18 little-endian; a partial last quartet padded with zero codes,
    then cut to ceil(n * 6 / 8) bytes."""
    n = codes.shape[-1]
    pad = -n % 4
    if pad:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), np.uint8)], axis=-1)
    c = codes.reshape(codes.shape[:-1] + (-1, 4)).astype(np.uint32)
    w = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = np.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=-1).astype(np.uint8)
    return out.reshape(codes.shape[:-1] + (-1,))[..., :-(-n * 6 // 8)]


def _layer(v: np.ndarray, perm: tuple, nc: int, kind: str, dt, k: int, n: int, fmt_name: str = "",
           fmax: float = 0.0) -> Optional[tuple]:
    """(codes [N, K * bits / 8], scale [N, K / g], global scale [1] or None) of one layer `v` (see
    `host_quantize`); None when it holds a NaN."""
    con, free = perm[:nc], perm[nc:]
    x = v if v.dtype == np.float32 else v.astype(_F32)
    if kind == "channel":
        fmt = _CHANNEL_FORMATS[fmt_name]
        out = _float_channel(x, con, dt, fmt, fmax)
        if out is None:
            return None
        codes, scale = out
        order = free + con
        codes = _transposed(codes, order, (n, k))
        return (codes if fmt == _FP8 else pack6(codes)), _transposed(scale, order, (n, 1)), None
    last = con[-1]  # K's innermost axis: split it into (groups, 16); the view's axes after it shift by one
    view = x.reshape(v.shape[:last] + (v.shape[last] // 16, 16) + v.shape[last + 1:])

    def at(a):
        return a + (1 if a > last else 0)

    out = _nvfp4(view, at(last) + 1, tuple(range(view.ndim)), dt)
    if out is None:
        return None
    codes, scale, gs = out
    g16 = at(last) + 1
    ev = (slice(None),) * g16 + (slice(0, None, 2),)
    od = (slice(None),) * g16 + (slice(1, None, 2),)
    packed = codes[ev] | (codes[od] << np.uint8(4))
    order = tuple(at(a) for a in free) + tuple(at(a) for a in con) + (g16,)
    return _transposed(packed, order, (n, k // 2)), _transposed(scale, order, (n, k // 16)), gs.reshape(1)


def _transposed(a: np.ndarray, order: tuple, shape: tuple) -> np.ndarray:
    """transpose(a, order).reshape(shape), C-contiguous."""
    return np.ascontiguousarray(np.transpose(a, order)).reshape(shape)


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
