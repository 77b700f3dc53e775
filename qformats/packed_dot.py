"""Packed matrix-vector product for decode on the XLA path: a 4-bit weight decoded inside XLA's fused GEMV loop.

Why a path of its own. XLA:CPU does not fuse a dequantize into a library dot, but for a matrix-vector product
(one activation row, a rank-1 vector operand) it fuses the weight's producer into an elemental dot loop: each
weight element is computed where the loop reads it, from the packed codes, and no dense weight is written. How
fast that loop runs is set by what each element costs. The generic `dequantize` unpacks nibbles with a
concatenate (a branch per element), and decodes and divides the group scale (fp8 -> f32, `/ global_scale`)
once per *element*. Here, for one row:

  - nibble j of byte b is `(b >> 4 j) & 15`, a shift by a broadcast constant (no concatenate);
  - the per-group factor s' = s / c (c: the global scale, NVFP4) and the zero point are computed once per group
    [N, G] and kept out of the loop (an optimization barrier stops XLA from recomputing them per element);
  - the loop then does decode(code) (integer + offset, or the float format's bit decode), minus the zero point,
    times s', and the multiply-add.

The weight element is bit-identical to `dequantize(q, x.dtype)`'s (same operations, same per-op rounding in the
scale's dtype, `qformats.rounding`), so the result equals the dequantize-then-dot one up to the order XLA sums in:

    W[k, n] = (v[n, k] - z[n, G(k)]) * (s[n, G(k)] / c)          (k along the packed axis, G(k) = k // g)
    y[n]    = sum_k x[k] W[k, n];    |y - y_ref| <= 2 K eps_f32 sum_k |x[k]| |W[k, n]|

Several rows (prefill, batches) amortise one dense dequantize over the rows and stay on `xla_qdot`'s path; 8-bit
weights need no unpacking and are already fast there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qformats import rounding as R
from qformats.errors import KernelError
from qformats.grouping import group, keepdims, ungroup
from qformats.qarray import QArray, element_values

__all__ = ["packed_dot", "packed_dot_supported"]

_STRATEGIES = ("tensor", "channel", "group", "tensor_group")


def packed_dot_supported(x_shape, q: QArray) -> bool:
    """Whether `packed_dot` takes activations of shape `x_shape` [..., K] times q: one activation row (every
    leading dimension 1), and q a 2-D [K, N] weight of a 4-bit format quantized along K (axis 0) with tensor,
    channel, group or tensor_group scales."""
    if not isinstance(q, QArray) or q.ndim != 2 or q.axis != 0:
        return False
    if q.scheme.bits != 4 or q.scheme.strategy not in _STRATEGIES:
        return False
    x_shape = tuple(x_shape)
    return len(x_shape) >= 1 and x_shape[-1] == q.shape[0] and math.prod(x_shape[:-1]) == 1


def _nibbles(codes: jax.Array, k: int) -> jax.Array:
    """uint8 [N, ceil(K/2)] -> [N, K] codes: code 2i + j = (byte i >> 4 j) & 15 (`qformats.packing`'s layout)."""
    shift = jnp.arange(2, dtype=jnp.uint8) * jnp.uint8(4)
    u = (codes[..., None] >> shift) & jnp.uint8(15)
    return u.reshape(codes.shape[:-1] + (-1,))[..., :k]


def packed_dot(x: jax.Array, q: QArray) -> jax.Array:
    """y[n] = sum_k x[k] W[k, n] with W = dequantize(q, x.dtype), for one activation row, as one fused GEMV:

        W[k, n] = (v[n, k] - z[n, G(k)]) * (s[n, G(k)] / c)

    (v: the 4-bit element values, z: zero point, s: scale, c: global scale; each op rounded as `dequantize`
    rounds it), with s / c and z prepared per group outside the loop (module docstring).

    Args:
      x: activations [..., K] with every leading dimension 1 (float).
      q: a 4-bit weight of logical shape [K, N] quantized along axis 0 (`packed_dot_supported`).

    Returns:
      [..., N] in x's dtype, accumulated in float32.

    Raises:
      KernelError: (x, q) outside `packed_dot_supported`.
    """
    if not packed_dot_supported(x.shape, q):
        raise KernelError(f"packed_dot: expected one activation row [..., K] (leading dimensions 1) and a 4-bit "
                          f"[K, N] weight quantized along K with tensor, channel, group or tensor_group scales; "
                          f"got x {tuple(x.shape)} and {q!r}")
    scheme = q.scheme
    k, n = q.shape
    sdt = q.scale.dtype if q.scale.dtype in R.FLOAT_DTYPES else jnp.dtype(jnp.float32)
    view, _ = group(element_values(_nibbles(q.codes, k), scheme.format, sdt), scheme)
    s = q.scale_values(sdt)
    if q.global_scale is not None:
        s = R.div(s, q.global_scale, sdt)
    parts = [s]
    if q.zero_point is not None:
        parts.append(q.zero_point)
    parts = jax.lax.optimization_barrier(parts)  # per group, once: not recomputed inside the GEMV loop
    if q.zero_point is not None:
        view = R.sub(view, keepdims(parts[1], scheme, view.ndim), sdt)
    w = ungroup(R.mul(view, keepdims(parts[0], scheme, view.ndim), sdt), scheme, q.tshape).astype(x.dtype)
    # [K, N] as the GEMV operand (measured faster in XLA:CPU's fused loop than contracting [N, K] on its K).
    y = jax.lax.dot_general(x.reshape(k), w.T, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(x.shape[:-1] + (n,))
