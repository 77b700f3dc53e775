"""W+A matmul on the codes: integer (int8 x int8 -> int32) or FP8 GEMM, with both scales applied after the K-sum.

When the activation scale is constant along K for each row (strategy "token" or "tensor") and the weight scale
constant along K for each output column ("channel" or "tensor"), both symmetric, the scales factor out of the
contraction:

    y[m, n] = sum_k (qx[m, k] sx[m]) (qw[k, n] sw[n]) = (sum_k qx[m, k] qw[k, n]) * sx[m] * sw[n]

so the matmul runs on the element values themselves — what vLLM's scaled-mm kernels do for W8A8 checkpoints:
  - integers (signed, <= 8 bits, as in W8A8 / W4A8): int8 x int8 with int32 accumulation, exact (|acc| <=
    K * 128^2 < 2^31 for K < 131072);
  - fp8 (e4m3fn, e5m2 on both sides, as in FP8 / FP8_DYNAMIC): float8 operands, float32 accumulation (every
    product is exact in float32; the sum is rounded in the order XLA picks).
Then y = (acc as float32 * sx) * sw, cast to the activation dtype. On XLA:CPU the fp8 operands are widened
to float32 inside the dot; on GPU XLA may lower both forms to integer / FP8 tensor-core GEMMs.

Anything else (groups along K, zero points, MX / NVFP4 scales, mixed int / float) is not eligible:
`scaled_dot_supported` says so and callers take the dequantize-then-dot path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qformats.errors import KernelError
from qformats.formats import FloatFormat, IntFormat
from qformats.qarray import QArray
from qformats.schemes import QuantScheme

_FP8 = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
_INT32_SAFE_K = 131072  # K * 128 * 128 < 2^31


def _kind(scheme: QuantScheme):
    fmt = scheme.format
    if isinstance(fmt, IntFormat) and fmt.signed and fmt.bits <= 8:
        return "int"
    if isinstance(fmt, FloatFormat) and fmt.ml_dtypes_name in _FP8:
        return "fp8"
    return None


def scaled_dot_supported(act: QuantScheme, weight: QuantScheme, k: int) -> bool:
    """Whether x [.., K] quantized by `act` (along K) times W [K, N] quantized by `weight` (along K) can run on
    the codes: symmetric, no global scale, scales constant along K on both sides, both int or both fp8."""
    if act is None or weight is None:
        return False
    kind = _kind(act)
    if kind is None or kind != _kind(weight) or (kind == "int" and k >= _INT32_SAFE_K):
        return False
    if not (act.symmetric and weight.symmetric) or "e8m0" in (act.scale_format, weight.scale_format):
        return False
    return act.strategy in ("token", "tensor") and weight.strategy in ("channel", "tensor")


def _operand(q: QArray):
    if _kind(q.scheme) == "int":
        return q.element_values(jnp.float32).astype(jnp.int8)  # exact: |value| <= 128
    return jax.lax.bitcast_convert_type(q.element_codes().astype(jnp.uint8), _FP8[q.scheme.format.ml_dtypes_name])


def scaled_dot(xq: QArray, wq: QArray, dtype=None) -> jax.Array:
    """y = dequantize(xq) @ dequantize(wq), computed as (sum_k qx qw) * sx * sw (module docstring).

    xq: activations quantized along their last axis (logical shape [..., K]); wq: a weight of logical shape
    [K, N] quantized along axis 0. Returns [..., N] in `dtype` (default: xq's original dtype).
    """
    k = wq.shape[0]
    if not (isinstance(xq, QArray) and isinstance(wq, QArray)) or wq.ndim != 2 or wq.axis != 0:
        raise KernelError("scaled_dot: expected activations quantized along their last axis and a [K, N] weight "
                          "quantized along axis 0")
    if xq.shape[-1] != k or xq.axis not in (-1, xq.ndim - 1):
        raise KernelError(f"scaled_dot: activations of shape {xq.shape} (axis {xq.axis}) do not contract with a "
                          f"weight of shape {wq.shape}")
    if not scaled_dot_supported(xq.scheme, wq.scheme, k):
        raise KernelError(f"scaled_dot: {xq.scheme.describe()} x {wq.scheme.describe()} cannot run on the codes "
                          "(see scaled_dot_supported); use qdot(dequantize(x), w)")
    dtype = xq.dtype if dtype is None else jnp.dtype(dtype)
    return _scaled_dot_jit(xq, wq, dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _scaled_dot_jit(xq: QArray, wq: QArray, dtype) -> jax.Array:
    a, b = _operand(xq), _operand(wq)  # [..., K], [N, K]
    acc_t = jnp.int32 if a.dtype == jnp.int8 else jnp.float32
    acc = jax.lax.dot_general(a, b, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc_t)
    sx = xq.scale_values(jnp.float32)          # [..., 1] (token) or [1] (tensor)
    sw = wq.scale_values(jnp.float32)[..., 0] if wq.scheme.strategy == "channel" else wq.scale_values(jnp.float32)
    return ((acc.astype(jnp.float32) * sx) * sw).astype(dtype)
