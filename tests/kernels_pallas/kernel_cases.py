"""Shared helpers for the kernel tests: weights, references and the accumulation-order tolerance."""

import functools

import numpy as np
import jax
import jax.numpy as jnp

from qformats import dequantize, presets, quantize
from qformats.schemes import QuantScheme

# name -> scheme; the MXFP6 e3m2 variant is not a compressed-tensors preset (MXFP6A16 is e2m3).
SCHEMES = {name: presets[name].weights for name in (
    "FP6_E3M2", "FP6_E2M3", "FP5_E2M2", "FP5_E3M1", "FP4_E2M1", "FP8_E4M3",
    "FP6_E3M2_G32", "FP5_E3M1_G128", "FP4_E2M1_G32", "FP8_E4M3_G128",
    "MXFP8A16", "MXFP6A16", "MXFP4A16", "NVFP4A16",
    "W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W3A16", "FP8", "FP8_BLOCK")}
SCHEMES["MXFP6_E3M2"] = QuantScheme("fp6_e3m2", "group", group_size=32, scale_format="e8m0", scale_rule="ct")
SCHEMES["W8A16_ASYM"] = QuantScheme("int8", "group", group_size=128, symmetric=False, scale_format="input")


def awkward_k(scheme) -> int:
    """A K that is a multiple of the scheme's group but not of the kernel's block_k (128) where possible."""
    g = scheme.group_size or 1
    if g >= 128:
        return 384  # 3 tiles: not a power of two
    return 160 if g <= 32 else 192


@functools.lru_cache(maxsize=None)
def make_q(name, k, n, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w *= rng.uniform(0.1, 3.0, size=(1, n)).astype(np.float32)  # channels of different magnitude
    return quantize(jnp.asarray(w, dtype), SCHEMES[name], axis=0)


def make_x(shape, dtype, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@jax.jit
def _reference(x, q):
    w = dequantize(q, x.dtype)
    y = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    mag = jnp.dot(jnp.abs(x).astype(jnp.float32), jnp.abs(w).astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    return y, mag


def reference(x, q):
    """jnp.dot(x, dequantize(q, x.dtype)) accumulated in f32 at full precision, and |x| @ |w| (f32). One jitted
    program per weight and x shape (not an eager dispatch, and compile, of each operation)."""
    y, mag = _reference(jnp.asarray(x), q)
    return np.asarray(y), np.asarray(mag)


def assert_close(y, x, q):
    """|y - y_ref| <= eps(x.dtype) * |y_ref| + 2 K 2^-24 (|x| @ |w|): rounding the f32 sum to x.dtype may
    land on the neighbouring value (one ulp, at most eps relative) and the f32 sums differ by the order of
    accumulation only (each within K * 2^-24 * sum |x w|). The weights themselves are bit-identical."""
    ref, mag = reference(x, q)
    k = q.shape[0]
    eps = float(jnp.finfo(x.dtype).eps)
    tol = eps * np.abs(ref) + 2 * k * 2.0 ** -24 * mag + 1e-30
    got = np.asarray(y, np.float32)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref)
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} outside tolerance; worst err {err.max():.3g} at "
                           f"{np.unravel_index(np.argmax(err - tol), err.shape)}")

