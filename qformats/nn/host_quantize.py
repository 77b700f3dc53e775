"""Round-to-nearest FP8 (channel) and NVFP4 weight quantization on the host (numpy + ml_dtypes), bit for bit
`qformats.quantize` as XLA:CPU computes it, without compiling anything.

`quantize_weight(W, schemes, "rtn")` on XLA:CPU costs one compilation per distinct weight shape (0.2 to 0.5 s
each on a small CPU) for a few memory passes of work. For the two schemes below the same codes and scales come
from numpy and ml_dtypes in a few passes over the weight, with XLA:CPU's float semantics reproduced exactly:
float32 subnormal operands and results of its divisions and multiplications are flushed to a zero of the same
sign (`flush`), each operation is rounded once to the input dtype where `qformats.rounding` rounds it, and
ml_dtypes' `astype` rounds to nearest even like `qformats.codec.encode` (overflow saturated by a clip first).

Covered (`host_quantizable`): weight-only round-to-nearest of a float32 / bfloat16 W [*stacked, K, N] along K
under (float16 is not: a NaN scale's payload bits differ from XLA's)
  - FP8 channel scales in the input dtype (FP8_E4M3, FP8_DYNAMIC's weights): s_n = amax_n / 448 (0 -> eps of
    the dtype), q = fp8(x / s);
  - NVFP4 (tensor_group, fp8 group scales of 16, absmax rule): g = (1 / max(amax_W, tiny)) * 448 * 6 (NaN / inf
    -> 1), s_G = fp8(clip(g * (amax_G / 6), +-448)) (0 -> 0.125), q = fp4(x / (s_G / g)), packed two per byte;
stacked leading axes quantized one layer at a time (each layer its own global scale, as `quantize_weight` vmaps).
Everything else takes the jitted path.
"""

from __future__ import annotations

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


def _kind(s: QuantScheme) -> Optional[str]:
    name = s.format.name if hasattr(s.format, "name") else str(s.format)
    if (s.strategy == "channel" and s.scale_format == "input" and name == "fp8_e4m3fn" and s.symmetric
            and s.scale_rule == "absmax"):
        return "fp8"
    if (s.strategy == "tensor_group" and s.group_size == 16 and s.scale_format == "fp8_e4m3fn"
            and name == "fp4_e2m1" and s.scale_rule == "absmax"):
        return "nvfp4"
    return None


def host_quantizable(value, schemes: SchemeSet, weight_search: str) -> bool:
    """Whether `quantize(value, schemes)` takes the host path: round-to-nearest, an FP8-channel or NVFP4 weight
    scheme, a float32 / bfloat16 value of 2 or more dims with K a multiple of 16 for NVFP4, and
    jax's default backend the CPU (on an accelerator the jitted path is the fast one)."""
    ws = schemes.weights
    if weight_search != "rtn" or ws is None or _kind(ws) is None or jax.default_backend() != "cpu":
        return False
    if jnp.result_type(value).name not in _DTYPES or jnp.ndim(value) < 2:
        return False
    if isinstance(value, jax.Array) and len(value.sharding.device_set) != 1:
        return False
    return _kind(ws) != "nvfp4" or jnp.shape(value)[-2] % 16 == 0


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


def _fp8_channel(xt: np.ndarray, dt) -> Optional[tuple]:
    """xt [*, N, K] (float32 holding `dt` values) -> (codes uint8 [*, N, K], scale `dt` [*, N, 1]); None when
    xt holds a NaN."""
    amax = np.max(np.abs(xt), axis=-1, keepdims=True)
    if np.isnan(amax).any():
        return None
    if (amax < _FLUSH_BELOW).any():
        flush(xt)
        amax = np.max(np.abs(xt), axis=-1, keepdims=True)
    s = _rnd(flush(np.divide(amax, _F32(FP8_MAX), dtype=_F32)), dt)
    s[s == 0] = _F32(np.finfo(dt).eps)
    r = np.divide(xt, s, dtype=_F32)
    return _encode(r, xt, dt, _FP8, FP8_MAX), s.astype(dt)


def _nvfp4(xt: np.ndarray, dt) -> Optional[tuple]:
    """xt [N, K] (float32 holding `dt` values, one layer) -> (packed codes uint8 [N, K/2], scale fp8 [N, K/16],
    global scale float32 [1]); None when xt holds a NaN."""
    n, k = xt.shape
    view = xt.reshape(n, k // 16, 16)
    amax = np.max(np.abs(view), axis=-1, keepdims=True)
    if np.isnan(amax).any():
        return None
    amax_t = np.max(amax)
    if amax_t < _FLUSH_BELOW:
        flush(xt)
        amax = np.max(np.abs(view), axis=-1, keepdims=True)
        amax_t = np.max(amax)
    tiny = _F32(np.finfo(dt).tiny)
    g = _rnd(flush(np.divide(_F32(1.0), np.maximum(amax_t, tiny), dtype=_F32).reshape(1)), dt)
    g = _rnd(flush(np.multiply(g, _F32(NVFP4_GLOBAL_NUMERATOR), dtype=_F32)), dt)
    g = np.where(np.isfinite(g), g, _F32(1.0)).astype(_F32)
    s32 = flush(np.multiply(g, _rnd(flush(np.divide(amax, _F32(6.0), dtype=_F32)), dt), dtype=_F32))
    s = np.clip(s32, -FP8_MAX, FP8_MAX).astype(_FP8)
    s[s.astype(_F32) == 0] = _FP8.type(0.125)
    eff = flush(np.divide(s.astype(_F32), g, dtype=_F32))
    r = np.divide(view, eff, dtype=_F32).reshape(n, k)
    codes = _encode(r, xt, np.float32, _FP4, 6.0)
    packed = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    return packed, s.reshape(n, k // 16), g


# FP4 E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7): |y| rounds to code #{t in _FP4_CUTS: |y| > t}; the
# midpoints whose tie goes up (to the even code 2, 4, 6) are moved one float below, so ">" counts them.
_FP4_CUTS = tuple(_F32(c) if up is None else np.nextafter(_F32(c), _F32(0))
                  for c, up in ((0.25, None), (0.75, 1), (1.25, None), (1.75, 1), (2.5, None), (3.5, 1), (5.0, None)))


def _fp4_codes(y: np.ndarray) -> np.ndarray:
    """ml_dtypes' float4_e2m1fn bit patterns of y (float32, |y| <= 6 or NaN): round to nearest, ties to even,
    sign kept; NaN (which E2M1 lacks) -> the zero of the opposite sign, as ml_dtypes; a count of the cuts |y|
    exceeds (a quarter of astype's time)."""
    a = np.abs(y)
    c = np.zeros(y.shape, np.uint8)
    for t in _FP4_CUTS:
        c += a > t
    sign = np.signbit(y)
    nan = np.isnan(a)
    if nan.any():
        sign ^= nan
    c |= sign.view(np.uint8) << np.uint8(3)
    return c


def _encode(r: np.ndarray, x: np.ndarray, dt, fmt: np.dtype, fmax: float) -> np.ndarray:
    """`qformats.qarray.round_elements(rnd(flush(r), dt))` for a float format, r = x / s: overflow saturated to
    +-max, nearest code ties to even (ml_dtypes' astype), as uint8 bit patterns (4-bit codes in the low
    nibble). A zero quotient gives the +0 code; so does one XLA:CPU flushes (r or x subnormal), which numpy
    left a tiny negative: the -0 codes are looked at only where they occur."""
    y = np.ascontiguousarray(np.clip(_rnd(r, dt), -fmax, fmax))
    if fmt == _FP4:
        c = _fp4_codes(y)
    else:
        c = y.astype(fmt).view(np.uint8)
    neg0 = np.uint8(0x80 if fmt == _FP8 else 0x08)
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
    return host_quantize_transposed(np.swapaxes(np.asarray(value), -1, -2), schemes)


def host_quantize_transposed(wt, schemes: SchemeSet) -> Optional[QArray]:
    """`host_quantize_weight` of W given as its transpose `wt` [*stacked, N, K] (numpy, float32 or bfloat16; a
    view is fine: it is copied once, to float32); None when it holds a NaN."""
    ws = schemes.weights
    dt = _DTYPES[np.dtype(wt.dtype).name]
    lead, (n, k) = wt.shape[:-2], wt.shape[-2:]
    with np.errstate(all="ignore"):
        xt = np.array(wt, dtype=_F32, order="C")  # the reduction axis last: a float32 copy
        if _kind(ws) == "fp8":
            out = _fp8_channel(xt, dt)
            if out is None:
                return None
            codes, scale = out
            gs = None
        else:
            flat = xt.reshape((-1, n, k))
            parts = []
            for i in range(flat.shape[0]):
                parts.append(_nvfp4(flat[i], dt))
                if parts[-1] is None:
                    return None
            codes = np.stack([p[0] for p in parts]).reshape(lead + (n, k // 2))
            scale = np.stack([p[1] for p in parts]).reshape(lead + (n, k // 16))
            gs = np.stack([p[2] for p in parts]).reshape(lead + (1,))
    return QArray(jnp.asarray(codes), jnp.asarray(scale), None, None if gs is None else jnp.asarray(gs),
                  scheme=ws, shape=(k, n), dtype=dt, axis=0)


def quantize_weight(kernel, schemes: SchemeSet, weight_search: str = "rtn") -> QArray:
    """`qformats.algorithms.weight_search.quantize_weight(kernel, schemes, weight_search)`, computed on the host
    when `host_quantizable` (the same bits, no compilation), else by it."""
    if host_quantizable(kernel, schemes, weight_search):
        q = host_quantize_weight(kernel, schemes)
        if q is not None:
            return q
    from qformats.algorithms.weight_search import quantize_weight as jitted

    return jitted(kernel, schemes, weight_search)
