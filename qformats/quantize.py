"""quantize / dequantize / fake_quantize: pure, jit-able transforms between dense arrays and QArrays."""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from qformats import rounding as R
from qformats.codec import encode
from qformats.errors import SchemeError
from qformats.formats import FloatFormat, IntFormat
from qformats.packing import pack
from qformats.qarray import QArray
from qformats.scales import ScaleResult, compute_scales
from qformats.schemes import QuantScheme

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---- layout helpers ----------------------------------------------------------------------------------------
def check_input(x, scheme, where: str) -> jax.Array:
    """x as a jax array, after checking that scheme is a QuantScheme and x a float32/bfloat16/float16 array."""
    x = jnp.asarray(x)
    if not isinstance(scheme, QuantScheme):
        raise SchemeError(f"{where}: expected a QuantScheme, got {type(scheme).__name__} "
                          "(for a preset use qformats.presets[name].weights)")
    if x.dtype not in _FLOATS:
        raise SchemeError(f"{where}: expected a float32, bfloat16 or float16 array, got {x.dtype}")
    return x


def _norm_axis(axis: int, ndim: int, where: str) -> int:
    if ndim == 0:
        raise SchemeError(f"{where}: cannot quantize a 0-d array (no reduction axis)")
    if not -ndim <= axis < ndim:
        raise SchemeError(f"{where}: axis {axis} out of range for an array of {ndim} dims")
    return axis % ndim


def _tshape(shape, axis):
    s = list(shape)
    k = s.pop(axis)
    return tuple(s) + (k,)


def _check_fit(scheme: QuantScheme, tshape, where: str) -> None:
    k = tshape[-1]
    if scheme.strategy in ("group", "tensor_group") and k % scheme.group_size:
        raise SchemeError(f"{where}: {scheme.strategy} size {scheme.group_size} does not divide the reduction "
                          f"axis of length {k} (logical shape with that axis last: {tuple(tshape)})")
    if scheme.strategy == "block" and len(tshape) != 2:
        raise SchemeError(f"{where}: block strategy needs a 2-D tensor, got shape {tuple(tshape)}")


def _grouped(xt: jax.Array, scheme: QuantScheme) -> Tuple[jax.Array, Tuple[int, ...]]:
    """Reshape `xt` (reduction axis last) so that each scale's elements share reduced axes.

    Returns (view, reduce_axes); the scale has the view's shape with reduce_axes set to 1.
    """
    st = scheme.strategy
    if st == "tensor":
        return xt, tuple(range(xt.ndim))
    if st in ("channel", "token"):
        return xt, (xt.ndim - 1,)
    if st in ("group", "tensor_group"):
        g = scheme.group_size
        return xt.reshape(xt.shape[:-1] + (xt.shape[-1] // g, g)), (xt.ndim,)
    bh, bw = scheme.block
    o, k = xt.shape
    po, pk = -o % bh, -k % bw
    if po or pk:  # compressed-tensors pads blocks with zeros (maybe_pad_tensor_for_block_quant)
        xt = jnp.pad(xt, ((0, po), (0, pk)))
    return xt.reshape((o + po) // bh, bh, (k + pk) // bw, bw), (1, 3)


def _ungroup(v: jax.Array, scheme: QuantScheme, tshape) -> jax.Array:
    if scheme.strategy == "block":
        ob, bh, kb, bw = v.shape
        return v.reshape(ob * bh, kb * bw)[: tshape[0], : tshape[1]]
    return v.reshape(tshape)


def _contracted(s: jax.Array, scheme: QuantScheme) -> jax.Array:
    """Drop the broadcast axes of a keepdims scale to its stored (contracted) shape."""
    st = scheme.strategy
    if st == "tensor":
        return s.reshape(1)
    if st in ("group", "tensor_group"):
        return s.reshape(s.shape[:-1])
    if st == "block":
        return s.reshape(s.shape[0], s.shape[2])
    return s


def _keepdims(s: jax.Array, scheme: QuantScheme, ndim: int) -> jax.Array:
    """Inverse of `_contracted`: a stored scale reshaped to broadcast against the grouped view (`ndim`, the
    array's rank, matters only for "tensor": a scalar scale becomes (1,) * ndim, which broadcasts anyway)."""
    st = scheme.strategy
    if st == "tensor":
        return s.reshape((1,) * ndim)
    if st in ("group", "tensor_group"):
        return s[..., None]
    if st == "block":
        return s[:, None, :, None]
    return s


def _expand(s: jax.Array, scheme: QuantScheme, tshape) -> jax.Array:
    """Contracted scale -> broadcast to `tshape` (derived view for inspection and the XLA matmul path)."""
    if scheme.strategy == "block":
        bh, bw = scheme.block
        full = jnp.repeat(jnp.repeat(s, bh, axis=0), bw, axis=1)
        return full[: tshape[0], : tshape[1]]
    sk = _keepdims(s, scheme, len(tshape))
    if scheme.strategy in ("group", "tensor_group"):
        return jnp.broadcast_to(sk, tuple(tshape[:-1]) + (tshape[-1] // scheme.group_size,
                                                          scheme.group_size)).reshape(tshape)
    return jnp.broadcast_to(sk, tshape)


def expected_shapes(scheme: QuantScheme, shape, axis: int) -> Dict[str, Optional[tuple]]:
    """Shapes of codes / scale / zero_point / global_scale of a QArray of this scheme and logical shape."""
    axis = _norm_axis(axis, len(shape), "expected_shapes")
    ts = _tshape(shape, axis)
    k = ts[-1]
    bits = scheme.bits
    codes = ts[:-1] + ((k * bits + 7) // 8,)
    st = scheme.strategy
    if st == "tensor":
        scale = (1,)
    elif st in ("channel", "token"):
        scale = ts[:-1] + (1,)
    elif st in ("group", "tensor_group"):
        scale = ts[:-1] + (k // scheme.group_size,)
    else:
        scale = (-(-ts[0] // scheme.block[0]), -(-ts[1] // scheme.block[1]))
    return {"codes": codes, "scale": scale, "zero_point": None if scheme.symmetric else scale,
            "global_scale": (1,) if st == "tensor_group" else None}


# ---- element rounding ----------------------------------------------------------------------------------------
def _round_elements(scaled: jax.Array, scheme: QuantScheme) -> jax.Array:
    """Codes of already-scaled values: clamp to the format's range, round half to even (uint8 / int8)."""
    fmt = scheme.format
    if isinstance(fmt, IntFormat):
        q = jnp.round(jnp.clip(scaled, fmt.qmin, fmt.qmax))
        q = jnp.where(jnp.isnan(q), 0, q).astype(jnp.int32)
        if fmt.bits == 8 and fmt.signed:
            return q.astype(jnp.int8)
        return (q - fmt.qmin).astype(jnp.uint8)
    # An exact -0 input gives +0, as llm-compressor's oneshot writes it (compressed-tensors adds a zero point of
    # 0 to symmetric weights: -0 + 0 = +0); tiny negatives that round to zero keep their sign (-0 code).
    scaled = jnp.where(scaled == 0, jnp.float32(0), scaled)
    return encode(scaled, fmt, overflow="saturate")


# ---- public transforms ----------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scheme", "axis"))
def _quantize_jit(x: jax.Array, scheme: QuantScheme, axis: int, global_scale, scale, zero_point):
    # x stays in its dtype: reductions (exact in any dtype) read it directly and each elementwise op upcasts
    # inside its own fusion. A shared float32 copy would be materialised by XLA:CPU (2x slower on bf16).
    xt = jnp.moveaxis(x, axis, -1)
    view, red = _grouped(xt, scheme)
    sr: ScaleResult = compute_scales(view, red, scheme, dtype=x.dtype, global_scale=global_scale, scale=scale,
                                     zero_point=zero_point)
    codes = _round_elements(sr.apply(view), scheme)
    codes = _ungroup(codes, scheme, xt.shape)
    if scheme.bits < 8:
        codes = pack(codes, scheme.bits)
    zp = None if sr.zero_point is None else _contracted(sr.zero_point, scheme)
    return codes, _contracted(sr.stored, scheme), zp, sr.global_scale


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
    axis = _norm_axis(axis, x.ndim, "quantize")
    ts = _tshape(x.shape, axis)
    _check_fit(scheme, ts, "quantize")
    if ts[-1] == 0 or math.prod(ts) == 0:
        raise SchemeError(f"quantize: cannot quantize an empty array of shape {tuple(x.shape)}")
    if scale is not None:
        scale = _keepdims(jnp.asarray(scale), scheme, len(ts))
    if zero_point is not None:
        zero_point = _keepdims(jnp.asarray(zero_point), scheme, len(ts))
    codes, s, zp, g = _quantize_jit(x, scheme, axis, global_scale, scale, zero_point)
    return QArray(codes, s, zp, g, scheme=scheme, shape=x.shape, dtype=x.dtype, axis=axis)


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """x = (value(code) - zero_point) * scale / global_scale, scale broadcast over its group; axis moved back.

    Follows compressed-tensors' `_dequantize`: values are cast to the scale's dtype (float32 for fp8/E8M0
    scales), the zero point subtracted, multiplied by scale / global_scale, then cast to `dtype` (default:
    the dtype the array had before quantization).
    """
    if not isinstance(q, QArray):
        raise SchemeError(f"dequantize: expected a QArray, got {type(q).__name__}")
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    return _dequantize_jit(q, dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_jit(q: QArray, dtype) -> jax.Array:
    scheme = q.scheme
    sdt = q.scale.dtype if q.scale.dtype in _FLOATS else jnp.dtype(jnp.float32)
    vals = q.element_values(sdt)
    view, _ = _grouped(vals, scheme)
    s = q.scale_values(sdt)
    if q.global_scale is not None:
        s = R.div(s, q.global_scale, sdt)
    s = _keepdims(s, scheme, view.ndim)
    if q.zero_point is not None:
        view = R.sub(view, _keepdims(q.zero_point, scheme, view.ndim), sdt)
    out = _ungroup(R.mul(view, s, sdt), scheme, q.tshape).astype(dtype)
    return jnp.moveaxis(out, -1, q.axis)


def fake_quantize(x, scheme: QuantScheme, axis: int = -1) -> jax.Array:
    """dequantize(quantize(x)) with a straight-through gradient: d/dx = 1 where x is inside the
    representable range (x / s + z within [-max, max] for floats, [qmin - 1/2, qmax + 1/2] for integers),
    0 where it was clipped."""
    x = jnp.asarray(x)
    axis = _norm_axis(axis, x.ndim, "fake_quantize")
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
        z = jnp.moveaxis(_expand(q.zero_point.astype(jnp.float32), scheme, q.tshape), -1, axis)
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


def quantized_like(q: QArray, x) -> QArray:
    """Quantize x with q's static scales (same scheme, scale, zero point, global scale)."""
    return quantize(x, q.scheme, q.axis, scale=q.scale, zero_point=q.zero_point, global_scale=q.global_scale)
