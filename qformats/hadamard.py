"""Hadamard transforms as compressed-tensors builds them: the fast Walsh–Hadamard transform in jnp (O(n log n)).

compressed-tensors (transform/utils/hadamard.py) defines two matrices of order n:

  deterministic_hadamard_matrix(n), n = 2^k:  Sylvester's H_n = [[H, H], [H, -H]] (H_1 = [1]);
  random_hadamard_matrix(n):                   diag(s) @ Had_n, s in {-1, +1}^n random signs, where
      Had_n = hadU(I_n) is the matrix of SpinQuant's `matmul_hadU`: for n = 2^k * K with a known Hadamard
      matrix B of order K (compressed-tensors ships them, hadamards.safetensors, K in 1, 2, 4, ..., 256;
      the largest K dividing n with n / K a power of two is used -- 576 = 4 * 144 uses K = 144), each row is
      put through k radix-2 butterflies (pairs (2i, 2i+1) -> (a + b, a - b), the pair index moved to the
      last axis each step) and then B applied to the remaining [K, n / K] block.

Both are applied as y = x @ M / sqrt(n) (TransformLocation input / output / q_attn / k_cache), or per head
for a head_dim smaller than the last axis (M block-diagonal). `hadamard_apply(x, base)` computes x @ Had_n
without forming Had_n: k butterfly passes (n log2(n / K) additions) and one [K, K] product per row block
(n K multiply-adds), exactly the operation order of matmul_hadU. With K = 1, Had_n = H_n (Sylvester).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import SchemeError

__all__ = ["base_order", "hadamard_apply", "hadamard_matrix", "is_pow2", "random_hadamard_signs", "reduce_base",
           "sylvester"]


def is_pow2(n: int) -> bool:
    """n > 0 and n = 2^k."""
    return n > 0 and n & (n - 1) == 0


def sylvester(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix H_n (float64, entries +-1): H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]."""
    if not is_pow2(n):
        raise SchemeError(f"sylvester: a deterministic Hadamard matrix needs a power-of-two order, found {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def base_order(n: int, known) -> int:
    """The order K of the known Hadamard matrix compressed-tensors uses for order n: the largest K in `known`
    with n % K == 0 and n / K a power of two. SchemeError when there is none."""
    for k in sorted(known, reverse=True):
        if n % k == 0 and is_pow2(n // k):
            return int(k)
    raise SchemeError(f"hadamard: no known Hadamard matrix of order K with {n} = 2^k * K (known orders: "
                      f"{sorted(known)[:8]}...)")


def reduce_base(base: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """None when `base` is Sylvester's matrix of its (power-of-two) order -- then Had_n is H_n and the transform
    is butterflies only, O(n log n) -- else `base` (compressed-tensors' stored orders 2..256 are Sylvester's
    except 32)."""
    if base is None:
        return None
    k = int(np.shape(base)[0])
    if is_pow2(k) and np.array_equal(np.asarray(base, np.float64), sylvester(k)):
        return None
    return base


def hadamard_apply(x, base: Optional[np.ndarray] = None):
    """x @ Had_n over the last axis of x (n = x.shape[-1] = 2^k * K, `base` the [K, K] known matrix; None:
    K = 1, so Had_n = H_n). Unnormalised: divide by sqrt(n) for the orthonormal transform.

    The butterflies: rows [B, n, 1] -> while the middle axis exceeds K: view [B, m / 2, 2, r] and write
    (a + b, a - b) of the pair, viewed back as [B, m / 2, 2 r]; then base @ [B, K, n / K]."""
    x = jnp.asarray(x)
    n = x.shape[-1]
    k = 1 if base is None else int(np.shape(base)[0])
    if n % k or not is_pow2(n // k):
        raise SchemeError(f"hadamard_apply: last axis {n} is not 2^k times the base order {k}")
    y = x.reshape(-1, n, 1)
    b = y.shape[0]
    while y.shape[1] > k:
        m, r = y.shape[1] // 2, y.shape[2]
        y = y.reshape(b, m, 2, r)
        y = jnp.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2).reshape(b, m, 2 * r)
    if base is not None:
        y = jnp.einsum("ij,bjr->bir", jnp.asarray(base, y.dtype), y, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape)


def hadamard_matrix(n: int, base: Optional[np.ndarray] = None) -> np.ndarray:
    """Had_n = hadamard_apply(I_n, base) as float64 numpy (computed in numpy, exact: entries +-1)."""
    k = 1 if base is None else int(np.shape(base)[0])
    if n % k or not is_pow2(n // k):
        raise SchemeError(f"hadamard_matrix: {n} is not 2^k times the base order {k}")
    y = np.eye(n).reshape(n, n, 1)
    while y.shape[1] > k:
        m, r = y.shape[1] // 2, y.shape[2]
        y = y.reshape(n, m, 2, r)
        y = np.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2).reshape(n, m, 2 * r)
    if base is not None:
        y = np.einsum("ij,bjr->bir", np.asarray(base, np.float64), y)
    return y.reshape(n, n)


def random_hadamard_signs(matrix: np.ndarray, base: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """The signs s with matrix == diag(s) @ Had_n exactly (compressed-tensors' random_hadamard_matrix), or None
    when the matrix is not of that form (then it can only be applied densely)."""
    m = np.asarray(matrix, np.float64)
    n = m.shape[0]
    if m.shape != (n, n):
        return None
    try:
        had = hadamard_matrix(n, base)
    except SchemeError:
        return None
    s = m[:, 0] / had[:, 0]
    if not np.all(np.abs(s) == 1) or not np.array_equal(s[:, None] * had, m):
        return None
    return s
