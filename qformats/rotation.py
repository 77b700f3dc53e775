"""Orthogonal rotations fused into weights, as compressed-tensors fuses its offline (weight_input / weight_output) transforms.

A rotation of order k is an unnormalised matrix M [k, k] with M M^T = k I (a Hadamard matrix: Sylvester's H_k, or
diag(s) Had_k of `qformats.hadamard`); R = M / sqrt(k) is orthogonal. On an axis longer than k it acts per block of
k (block-diagonal, compressed-tensors' `head_dim`). For a torch Linear y = x W^T + b (W [out, in]):

  input side  (weight_input, inverse):  W' = W R            so that (x R) W'^T = x W^T
  output side (weight_output):          W' = R^T W, b' = R^T b  so that x W'^T + b' = (x W^T + b) R
  embedding   (weight_output):          E' = E R            (rows are the residual stream: e -> e R)

Everything here is float64 numpy (compressed-tensors fuses in float64 and casts back to the weight's dtype);
the caller casts.
"""

from __future__ import annotations

import numpy as np

from qformats.errors import SchemeError

__all__ = ["center_rows", "fuse_norm", "random_signs", "rotate_columns", "rotate_rows"]


def _check(m: np.ndarray, size: int, what: str) -> int:
    k = int(np.shape(m)[0])
    if np.shape(m) != (k, k) or k == 0 or size % k:
        raise SchemeError(f"{what}: a rotation of shape {list(np.shape(m))} does not divide an axis of {size}")
    return k


def rotate_columns(w, m) -> np.ndarray:
    """w @ blockdiag(M, ..., M) / sqrt(k) over the last axis of w (M [k, k], k dividing it): the input side of a
    Linear weight (compressed-tensors' weight_input with inverse=True) and the output of an embedding."""
    w = np.asarray(w, np.float64)
    m = np.asarray(m, np.float64)
    k = _check(m, w.shape[-1], "rotate_columns")
    lead = w.shape[:-1]
    return (w.reshape(*lead, w.shape[-1] // k, k) @ m).reshape(w.shape) / np.sqrt(k)


def rotate_rows(w, m) -> np.ndarray:
    """blockdiag(M, ..., M)^T @ w / sqrt(k) over the first axis of w (a Linear weight [out, in] or a bias [out]):
    the output side of a Linear (compressed-tensors' weight_output)."""
    w = np.asarray(w, np.float64)
    m = np.asarray(m, np.float64)
    k = _check(m, w.shape[0], "rotate_rows")
    blocks = w.reshape(w.shape[0] // k, k, -1)
    return np.einsum("ji,bjc->bic", m, blocks).reshape(w.shape) / np.sqrt(k)


def center_rows(e) -> np.ndarray:
    """e - mean(e, axis=-1): every embedding row shifted to mean zero (llm-compressor's `center_embeddings`)."""
    e = np.asarray(e, np.float64)
    return e - e.mean(axis=-1, keepdims=True)


def fuse_norm(w, gain) -> np.ndarray:
    """W * g: a norm's gain g [in] folded into the Linear weight W [out, in] that reads the norm's output
    (llm-compressor's `fuse_norm_linears`; the norm's gain becomes ones, so the norm commutes with a rotation)."""
    return np.asarray(w, np.float64) * np.asarray(gain, np.float64)


def random_signs(n: int, seed: int, stream: int = 0) -> np.ndarray:
    """n signs in {-1, +1} (float64), s_i = 2 b_i - 1 with b_i uniform bits from numpy's PCG64 seeded by
    (seed, stream): the diagonal of a random Hadamard matrix diag(s) Had_n."""
    rng = np.random.Generator(np.random.PCG64([int(seed), int(stream)]))
    return rng.integers(0, 2, size=int(n)).astype(np.float64) * 2 - 1
