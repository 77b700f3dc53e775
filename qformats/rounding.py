"""Explicitly rounded float arithmetic: compute in float32, round once to bf16/f16, as torch does per op.

XLA allows excess precision by default (`xla_allow_excess_precision`): a bf16 division may stay in float32
through a fused computation. compressed-tensors rounds every intermediate to the tensor's dtype, so ops
whose result must match it bit for bit go through `rnd`, which `lax.reduce_precision` pins in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The float dtypes the library quantizes from and rounds to (inputs of encode/quantize, dtypes of `rnd`)."""

_F16_MIN_NORMAL = np.float32(2.0 ** -14)


def to_f32(x) -> jax.Array:
    """float32(x), exact for float32/bfloat16/float16 x; bf16 through a 16-bit shift of its bits, which XLA:CPU
    vectorises inside fusions (its bf16 convert does not, and costs more than the rest of a quantization)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        u = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(u, jnp.float32)
    return x.astype(jnp.float32)


def rnd(v: jax.Array, dtype) -> jax.Array:
    """v rounded to nearest-even in `dtype` (float32, bfloat16 or float16), returned as float32 holding the
    rounded value (XLA:CPU is slow on bf16/f16 elementwise ops; casting the result to `dtype` is exact).

    bf16: reduce_precision(8, 7). f16: reduce_precision(5, 10) for normals; XLA's reduce_precision flushes
    f16 subnormals, so |v| < 2^-14 is rounded as round_half_even(v * 2^24) * 2^-24 (exact in float32).
    """
    dtype = jnp.dtype(dtype)
    v = to_f32(v)
    if dtype == jnp.float32:
        return v
    if dtype == jnp.bfloat16:
        return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
    if dtype == jnp.float16:
        normal = jax.lax.reduce_precision(v, exponent_bits=5, mantissa_bits=10)
        sub = jnp.round(v * np.float32(2.0 ** 24)) * np.float32(2.0 ** -24)
        return jnp.where(jnp.abs(v) < _F16_MIN_NORMAL, sub, normal)
    raise TypeError(f"rnd: unsupported dtype {dtype}")


def div(a, b, dtype) -> jax.Array:
    """a / b, correctly rounded in float32, then rounded once to `dtype` (torch's per-op semantics); f32 out.

    XLA:CPU rewrites `x / broadcast(s)` into `x * broadcast(1 / s)`, which is off by an ulp for about half
    of all inputs. The divisor is made full-shaped as `s + 0 * finite(x)` (XLA does not fold `0 * x` for
    floats), which keeps a true IEEE division and fuses without materialising a broadcast.

    Like all arithmetic on XLA:CPU, float32 subnormal operands and results of div/mul/add/sub are flushed to a
    zero of the same sign (`rnd` itself keeps bf16 subnormals).
    """
    a = to_f32(a)
    b = to_f32(b)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    if b.shape != shape:
        a = jnp.broadcast_to(a, shape)
        b = b + np.float32(0.0) * jnp.where(jnp.isfinite(a), a, np.float32(0.0))
    return rnd(a / b, dtype)


def mul(a, b, dtype) -> jax.Array:
    """a * b, correctly rounded in float32, then rounded once to `dtype` (torch's per-op semantics); f32 out."""
    return rnd(to_f32(a) * to_f32(b), dtype)


def add(a, b, dtype) -> jax.Array:
    """a + b, correctly rounded in float32, then rounded once to `dtype` (torch's per-op semantics); f32 out."""
    return rnd(to_f32(a) + to_f32(b), dtype)


def sub(a, b, dtype) -> jax.Array:
    """a - b, correctly rounded in float32, then rounded once to `dtype` (torch's per-op semantics); f32 out."""
    return rnd(to_f32(a) - to_f32(b), dtype)
