"""Next-token choice from logits: greedy, or temperature / top-k / top-p (nucleus) sampling with a key."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qformats.errors import ModelError


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """Logits [..., V] with every value below the k-th largest set to -inf (ties with the k-th kept; k >= V keeps
    all), as transformers' TopKLogitsWarper."""
    k = min(int(k), logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
    """Logits [..., V] keeping the nucleus: with probabilities pi = softmax(logits) sorted ascending and their
    cumulative sums c, a token is dropped (-inf) when c <= 1 - p at its place; the most probable token is always
    kept (transformers' TopPLogitsWarper). Tokens tied with the least probable kept one are kept too."""
    s = jnp.sort(logits, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(s.astype(jnp.float32), axis=-1), axis=-1)
    drop = cum <= 1.0 - p
    drop = drop.at[..., -1].set(False)
    # the kept entries of the ascending sort are a suffix: its first value is the threshold
    threshold = jnp.min(jnp.where(drop, jnp.inf, s), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """ModelError unless temperature >= 0, top_k >= 1 and 0 < top_p <= 1; top_k / top_p need temperature > 0."""
    if not temperature >= 0:
        raise ModelError(f"sampling: temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise ModelError(f"sampling: top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ModelError(f"sampling: top_p must be in (0, 1], got {top_p!r}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ModelError("sampling: top_k / top_p apply to sampling; give a temperature > 0 (0 is greedy)")


def next_token(logits: jax.Array, key: Optional[jax.Array] = None, temperature: float = 0.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None) -> jax.Array:
    """Token ids [...] (int32) from logits [..., V].

    temperature 0: argmax (greedy). Otherwise a draw from softmax(mask(logits / temperature)), where mask applies
    top_k_mask then top_p_mask (transformers' order: temperature, top-k, top-p), with `jax.random.categorical`
    under `key` (the same key gives the same tokens).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ModelError("sampling: temperature > 0 needs a key (jax.random.key(seed))")
    x = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        x = top_k_mask(x, top_k)
    if top_p is not None and top_p < 1:
        x = top_p_mask(x, top_p)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
