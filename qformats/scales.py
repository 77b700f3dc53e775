"""Scale rules: absmax, asymmetric min/max, NVFP4 two-level, and the power-of-two (E8M0) MX rules."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats import rounding as R
from qformats.formats import FloatFormat, IntFormat
from qformats.schemes import QuantScheme

_SCALE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FP8_MAX = 448.0
NVFP4_GLOBAL_NUMERATOR = 448.0 * 6.0  # compressed-tensors: global = 448 * 6 / amax


@dataclasses.dataclass
class ScaleResult:
    """Scales of one quantization, shaped to broadcast against the grouped view (keepdims).

    stored: the scale as stored (float dtype, float8_e4m3fn, or uint8 E8M0 codes).
    zero_point: int8 zero points or None. global_scale: float32 [1] or None.
    apply: grouped x -> x / s (+ z), in the dtype and operation order compressed-tensors/torchao use.
    """

    stored: jax.Array
    zero_point: Optional[jax.Array]
    global_scale: Optional[jax.Array]
    apply: Callable[[jax.Array], jax.Array]


def _eps(dtype) -> float:
    """compressed-tensors' replacement for a zero scale: 0.125 for fp8 e4m3, else the dtype's eps."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        return 0.125
    return float(jnp.finfo(dtype).eps)


def _f32_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(R.to_f32(x), jnp.uint32)


def _pow2(e: jax.Array) -> jax.Array:
    """2^e as float32 for integer e in [-126, 127], built from bits (exact; no subnormal arithmetic)."""
    return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def _times_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """x * 2^e for integer e in [-254, 254] in float32, exactly (two normal power-of-two factors).

    XLA:CPU flushes subnormal operands and results to zero, so 2^-127 can't be used as a divisor; splitting
    the exponent keeps every factor normal and the product is the exactly rounded x * 2^e.
    """
    e1 = jnp.clip(e, -126, 127)
    return R.to_f32(x) * _pow2(e1) * _pow2(jnp.clip(e - e1, -126, 127))


# ---- power-of-two (E8M0) rules --------------------------------------------------------------------------------
def e8m0_code(amax: jax.Array, fmt: FloatFormat, rule: str) -> jax.Array:
    """Biased E8M0 exponent (uint8) of the block scale for block max `amax`, by rule:

      floor: floor(log2 amax) - emax_elem            (OCP MX v1.0; torchao FLOOR)
      ceil:  ceil(log2 amax) - emax_elem              (torchao CEIL)
      even:  floor(log2 round_m(amax)) - emax_elem, round_m = amax rounded up at the element's mantissa
             width (torchao EVEN)
      rceil: ceil(log2(amax / max_elem))              (NVIDIA cuBLAS / torchao RCEIL), clamped to [-127, 127];
             a float32 quotient below 2^-126 gives -127 (torchao's eager fallback gives -126 on (2^-127, 2^-126))
      ct:    floor(log2 p2(amax)) - floor(log2 max_elem), p2 = amax rounded to a power of two by adding
             2^(22 - m) to its f32 bits (m = 3 for 6-bit elements, else 1) and masking the mantissa
             (compressed-tensors `generate_mx_scales`), clamped to [0, 255].
    All exponents are computed exactly from the float32 bit pattern. NaN amax -> 0xFF.
    """
    bits = _f32_bits(amax) & 0x7FFFFFFF
    ex = (bits >> 23).astype(jnp.int32)  # biased f32 exponent field
    mant = bits & 0x7FFFFF
    nan = bits > 0x7F800000
    if rule in ("floor", "ceil", "even"):
        if rule == "even":
            rounded = (bits + (1 << (23 - fmt.mbits - 1))) & jnp.uint32(0x7F800000)
            ex = (rounded >> 23).astype(jnp.int32)
        elif rule == "ceil":
            ex = ex + (mant > 0).astype(jnp.int32)
        unb = jnp.clip(ex - 127 - fmt.emax, -127, 128)
        code = unb + 127
    elif rule == "rceil":
        descale = R.div(jax.lax.bitcast_convert_type(bits, jnp.float32), np.float32(fmt.max), jnp.float32)
        db = _f32_bits(descale)
        dex = (db >> 23).astype(jnp.int32)
        dm = db & 0x7FFFFF
        normal_ceil = dex - 127 + (dm > 0).astype(jnp.int32)
        # XLA:CPU flushes a subnormal quotient to 0: both give ceil(log2) <= -126 -> clamp handles <= -127.
        ceil_log2 = jnp.where(dex == 0, -127, normal_ceil)
        code = jnp.clip(ceil_log2, -127, 127) + 127
        code = jnp.where(db == 0x7F800000, 254, code)
    elif rule == "ct":
        m = 3 if fmt.bits == 6 else 1
        offset = {4: 2, 6: 2, 8: 8}.get(fmt.bits, int(math.floor(math.log2(fmt.max))))
        p2 = (bits + (1 << (23 - m - 1))) & jnp.uint32(0x7F800000)
        pex = (p2 >> 23).astype(jnp.int32)
        code = jnp.where(pex == 0, 0, jnp.clip(pex - offset, 0, 255))
    else:  # pragma: no cover - QuantScheme validates rules
        raise ValueError(rule)
    return jnp.where(nan, 255, code).astype(jnp.uint8)


def _e8m0_apply(code: jax.Array, rule: str) -> Callable[[jax.Array], jax.Array]:
    """x -> x / 2^(e-127) in float32; exact (a power-of-two product), so no rounding to x's dtype is needed."""
    c = code.astype(jnp.int32)
    if rule == "rceil":
        # torchao: x * rcp with rcp = 2^(127 - e), and rcp = 1 when e == 0 (all-zero block)
        return lambda x: jnp.where(c == 0, R.to_f32(x), _times_pow2(x, 127 - c))
    if rule == "ct":
        return lambda x: _times_pow2(x, 127 - c)
    # torchao FLOOR/CEIL/EVEN: x / max(2^(e-127), 2^-126)
    return lambda x: _times_pow2(x, 127 - jnp.maximum(c, 1))


# ---- the dispatcher --------------------------------------------------------------------------------------------
def compute_scales(view: jax.Array, red: Tuple[int, ...], scheme: QuantScheme, *, dtype=None, global_scale=None,
                   scale=None, zero_point=None) -> ScaleResult:
    """Scales of `view` (grouped so each scale reduces over axes `red`), or the given static ones.

    Symmetric absmax: s = amax / ((qmax - qmin) / 2), computed in x's dtype for scale_format "input" and
    NVFP4 (as compressed-tensors computes it), else in float32; zero scales -> eps of the scale dtype.
    Asymmetric int: s = (max - min) / (qmax - qmin), z = round(clamp(qmin - min / s, qmin, qmax)).
    NVFP4: g = (1 / max(amax_tensor, tiny)) * 448 * 6 (torch's rounding; NaN/inf -> 1),
    s = fp8(clamp(g * amax / 6, +-448)).
    E8M0: see `e8m0_code`.
    """
    xd = jnp.dtype(dtype or view.dtype)  # the input's dtype: decides rounding; `view` may be upcast to f32
    fmt = scheme.format
    sf = scheme.scale_format
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    red_axes = tuple(red)

    # -- MX: power-of-two scales -----------------------------------------------------------------------------
    if sf == "e8m0":
        if scale is None:
            amax = jnp.max(jnp.abs(view), axis=red_axes, keepdims=True)
            code = e8m0_code(amax, fmt, scheme.scale_rule)
            if scheme.scale_rule == "ct" and xd == jnp.float16:
                # compressed-tensors holds 2^(e-127) in the input dtype; below f16's range it is 0, and a zero
                # scale is replaced by its uint8 scale dtype's "eps", 1 -> code 127.
                code = jnp.where(code.astype(jnp.int32) < 127 - 24, jnp.uint8(127), code)
        else:
            code = jnp.asarray(scale).astype(jnp.uint8)
        return ScaleResult(code, None, None, _e8m0_apply(code, scheme.scale_rule))

    sdt = xd if sf == "input" else (fp8 if sf == "fp8_e4m3fn" else jnp.dtype(_SCALE_DTYPES[sf]))
    cdt = xd if sf == "input" or scheme.strategy == "tensor_group" else jnp.dtype(jnp.float32)
    half = jnp.asarray(scheme.half_range, cdt)

    # -- asymmetric integers -----------------------------------------------------------------------------------
    if not scheme.symmetric:
        assert isinstance(fmt, IntFormat)
        if scale is None:
            mn = jnp.minimum(jnp.min(view, axis=red_axes, keepdims=True), 0).astype(cdt)
            mx = jnp.maximum(jnp.max(view, axis=red_axes, keepdims=True), 0).astype(cdt)
            s = R.div(R.sub(mx, mn, cdt), fmt.qmax - fmt.qmin, cdt)
            zf = jnp.clip(R.sub(fmt.qmin, R.div(mn, s, cdt), cdt), fmt.qmin, fmt.qmax)
            s = s.astype(sdt)
            s = jnp.where(s == 0, jnp.asarray(_eps(sdt), sdt), s)
            z = jnp.where(jnp.isnan(zf), 0, jnp.round(zf)).astype(jnp.int8)
        else:
            s = jnp.asarray(scale).astype(sdt)
            z = jnp.asarray(zero_point).astype(jnp.int8)
        pdt = jnp.promote_types(xd, sdt)
        return ScaleResult(s, z, None, lambda x: R.add(R.div(x, s, pdt), z, pdt))

    # -- NVFP4: fp8 group scales under a float32 global scale ------------------------------------------------------
    if scheme.strategy == "tensor_group" and scheme.scale_rule == "torchao":
        return _nvfp4_torchao(view, red_axes, global_scale, scale)
    if scheme.strategy == "tensor_group":
        if global_scale is None:
            amax_t = jnp.max(jnp.abs(view)).astype(xd)
            tiny = jnp.asarray(jnp.finfo(xd).tiny, xd)
            # torch evaluates `2688 / t` as t.reciprocal() * 2688, each op rounded to t's dtype
            g = R.mul(R.div(1.0, jnp.maximum(amax_t, tiny), xd), NVFP4_GLOBAL_NUMERATOR, xd).astype(jnp.float32)
            g = jnp.where(jnp.isfinite(g), g, 1.0).reshape(1)
        else:
            g = jnp.asarray(global_scale, jnp.float32).reshape(1)
        if scale is None:
            amax = jnp.max(jnp.abs(view), axis=red_axes, keepdims=True).astype(cdt)
            s32 = g * R.div(amax, half, cdt).astype(jnp.float32)
            s = jnp.clip(s32, -FP8_MAX, FP8_MAX).astype(fp8)
            s = jnp.where(s.astype(jnp.float32) == 0, jnp.asarray(0.125, fp8), s)
        else:
            s = jnp.asarray(scale).astype(fp8)
        eff = R.div(s, g, jnp.float32)
        return ScaleResult(s, None, g, lambda x: R.div(x, eff, jnp.float32))

    # -- symmetric absmax --------------------------------------------------------------------------------------
    if scale is None:
        amax = jnp.max(jnp.abs(view), axis=red_axes, keepdims=True).astype(cdt)
        s = R.div(amax, half, cdt)
        if sdt == fp8:
            s = jnp.clip(s.astype(jnp.float32), -FP8_MAX, FP8_MAX)
        s = s.astype(sdt)
        s = jnp.where(s.astype(jnp.float32) == 0, jnp.asarray(_eps(sdt), sdt), s)
    else:
        s = jnp.asarray(scale).astype(sdt)
    pdt = jnp.promote_types(xd, jnp.float32 if sdt == fp8 else sdt)
    return ScaleResult(s, None, None, lambda x: R.div(x, s, pdt))


def _nvfp4_torchao(view, red_axes, global_scale, scale) -> ScaleResult:
    """torchao `nvfp4_quantize(x, 16, per_tensor_scale=amax / 2688)`, in float32 throughout.

    pts = amax / (448 * 6); s = fp8(clamp((amax_G / 6) / pts, 2^-6, 448)); q = x * ((1 / pts) / s).
    The stored global scale is 1 / pts (compressed-tensors' convention: dequantize = q * s / g).
    """
    f32 = jnp.float32
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    if global_scale is None:
        pts = R.div(jnp.max(jnp.abs(view)), NVFP4_GLOBAL_NUMERATOR, f32)
        g = R.div(1.0, pts, f32).reshape(1)
    else:
        g = jnp.asarray(global_scale, f32).reshape(1)
        pts = R.div(1.0, g, f32)
    if scale is None:
        amax = jnp.max(jnp.abs(view), axis=red_axes, keepdims=True)
        sbs = R.div(R.div(amax, 6.0, f32), pts, f32)
        s = jnp.clip(sbs, float(jnp.finfo(fp8).smallest_normal), FP8_MAX).astype(fp8)
    else:
        s = jnp.asarray(scale).astype(fp8)
    rcp = R.div(R.div(1.0, pts, f32), s, f32)
    return ScaleResult(s, None, g, lambda x: R.to_f32(x) * rcp)
