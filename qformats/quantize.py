"""quantize / dequantize / fake_quantize: pure, jit-able transforms between dense arrays and QArrays."""

from __future__ import annotations

import functools
import math
from typing import Tuple

import jax
import jax.numpy as jnp

from qformats import rounding as R
from qformats.errors import SchemeError
from qformats.formats import FloatFormat, IntFormat
from qformats.grouping import (check_fit, contract, expand, group, keepdims, normalize_axis, transposed_shape,
                               ungroup)
from qformats.packing import pack
from qformats.qarray import QArray, round_elements
from qformats.scales import ScaleResult, compute_scales
from qformats.schemes import QuantScheme


def check_input(x, scheme, where: str) -> jax.Array:
    """x as a jax array, after checking that scheme is a QuantScheme and x a float32/bfloat16/float16 array
    (`rounding.FLOAT_DTYPES`); raises SchemeError naming `where` otherwise."""
    x = jnp.asarray(x)
    if not isinstance(scheme, QuantScheme):
        raise SchemeError(f"{where}: expected a QuantScheme, got {type(scheme).__name__} "
                          "(for a preset use qformats.presets[name].weights)")
    if x.dtype not in R.FLOAT_DTYPES:
        raise SchemeError(f"{where}: expected a float32, bfloat16 or float16 array, got {x.dtype}")
    return x


# ---- public transforms ----------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scheme", "axis"))
def _quantize_jit(x: jax.Array, scheme: QuantScheme, axis: int, global_scale, scale, zero_point):
    # x stays in its dtype: reductions (exact in any dtype) read it directly and each elementwise op upcasts
    # inside its own fusion. A shared float32 copy would be materialised by XLA:CPU (an extra pass over memory).
    xt = jnp.moveaxis(x, axis, -1)
    view, red = group(xt, scheme)
    sr: ScaleResult = compute_scales(view, red, scheme, dtype=x.dtype, global_scale=global_scale, scale=scale,
                                     zero_point=zero_point)
    codes = round_elements(sr.apply(view), scheme.format)
    codes = ungroup(codes, scheme, xt.shape)
    if scheme.bits < 8:
        codes = pack(codes, scheme.bits)
    zp = None if sr.zero_point is None else contract(sr.zero_point, scheme)
    return codes, contract(sr.stored, scheme), zp, sr.global_scale


def quantize(x, scheme: QuantScheme, axis: int = -1, *, scale=None, zero_point=None,
             global_scale=None) -> QArray:
    """Quantize x along `axis` (the reduction/contraction axis; 0 for a Flax kernel `[in, out]`).

    Per scale group G (see QuantScheme): s_G from the scheme's rule (absmax: s = amax_G / ((qmax-qmin)/2));
    asymmetric int: s = (max - min) / (qmax - qmin), z = clamp(round(qmin - min / s)); NVFP4
    (tensor_group): g = 448 * 6 / amax, s_G = fp8(g * amax_G / 6), element scale s_G / g; MX: s = 2^e by
    the power-of-two rule. Zero scales are replaced by the scale type's eps. Then
      q = round_half_even(clamp(x / s + z, qmin, qmax))   (floats: the nearest code, saturating).
    Arithmetic follows compressed-tensors' order and dtypes (x / s in the promoted dtype of x and s), so
    codes and scales are bit-identical to its quantization for its presets.

    `scale`, `zero_point` and `global_scale` (contracted shapes) may be given to use static, calibrated
    parameters instead of computing them from x.

    Returns a QArray whose codes are packed and whose scale is contracted.
    """
    x = check_input(x, scheme, "quantize")
    axis = normalize_axis(axis, x.ndim, "quantize")
    ts = transposed_shape(x.shape, axis)
    check_fit(scheme, ts, "quantize")
    if ts[-1] == 0 or math.prod(ts) == 0:
        raise SchemeError(f"quantize: cannot quantize an empty array of shape {tuple(x.shape)}")
    if scale is not None:
        scale = keepdims(jnp.asarray(scale), scheme, len(ts))
    if zero_point is not None:
        zero_point = keepdims(jnp.asarray(zero_point), scheme, len(ts))
    codes, s, zp, g = _quantize_jit(x, scheme, axis, global_scale, scale, zero_point)
    return QArray(codes, s, zp, g, scheme=scheme, shape=x.shape, dtype=x.dtype, axis=axis)


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """x = (value(code) - zero_point) * scale / global_scale + offset, scale (and offset) broadcast over its
    group; axis moved back.

    Follows compressed-tensors' `_dequantize`: values are cast to the scale's dtype (float32 for fp8/E8M0
    scales; the QArray's `compute_dtype` when it has one: `QArray.work_dtype`), the zero point subtracted,
    multiplied by scale / global_scale, then cast to `dtype` (default: the dtype the array had before
    quantization). An array with an additive `offset` (GGUF's per-group minimum) has it added in that dtype
    after the product, before the cast: with float32 compute, round(round(v * s) + m), the order of gguf's
    `d * q + m` (float16 d and m widened to float32 exactly first).
    """
    if not isinstance(q, QArray):
        raise SchemeError(f"dequantize: expected a QArray, got {type(q).__name__}")
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    return _dequantize_jit(q, dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_jit(q: QArray, dtype) -> jax.Array:
    scheme = q.scheme
    sdt = q.work_dtype
    vals = q.element_values(sdt)
    view, _ = group(vals, scheme)
    s = q.scale_values(sdt)
    if q.global_scale is not None:
        s = R.div(s, q.global_scale, sdt)
    s = keepdims(s, scheme, view.ndim)
    if q.zero_point is not None:
        view = R.sub(view, keepdims(q.zero_point, scheme, view.ndim), sdt)
    out = R.mul(view, s, sdt)
    if q.offset is not None:
        out = R.add(out, keepdims(q.offset.astype(sdt), scheme, view.ndim), sdt)
    out = ungroup(out, scheme, q.tshape).astype(dtype)
    return jnp.moveaxis(out, -1, q.axis)


def fake_quantize(x, scheme: QuantScheme, axis: int = -1) -> jax.Array:
    """dequantize(quantize(x)) with a straight-through gradient: d/dx = 1 where x is inside the
    representable range (x / s + z within [-max, max] for floats, [qmin - 1/2, qmax + 1/2] for integers),
    0 where it was clipped."""
    x = jnp.asarray(x)
    axis = normalize_axis(axis, x.ndim, "fake_quantize")
    return _fake_quantize(x, scheme, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quantize(x, scheme, axis):
    return dequantize(quantize(x, scheme, axis))


def _fq_fwd(x, scheme, axis):
    q = quantize(x, scheme, axis)
    y = dequantize(q)
    s = jnp.moveaxis(q.expanded_scale(jnp.float32), -1, axis)
    lo, hi = _value_range(scheme)
    z = 0.0
    if q.zero_point is not None:
        z = jnp.moveaxis(expand(q.zero_point.astype(jnp.float32), scheme, q.tshape), -1, axis)
    r = x.astype(jnp.float32) / s + z
    inside = (r >= lo) & (r <= hi)
    return y, inside


def _fq_bwd(scheme, axis, inside, g):
    return (jnp.where(inside, g, jnp.zeros_like(g)),)


_fake_quantize.defvjp(_fq_fwd, _fq_bwd)


def _value_range(scheme: QuantScheme) -> Tuple[float, float]:
    f = scheme.format
    if isinstance(f, IntFormat):  # values that round into [qmin, qmax] are inside
        return f.qmin - 0.5, f.qmax + 0.5
    assert isinstance(f, FloatFormat)
    return -f.max, f.max

