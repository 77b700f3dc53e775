"""The mixture-of-experts block of the decoder family: router, experts, shared experts."""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from qformats.errors import ModelError


def deepseek_route(logits: jax.Array, bias: jax.Array, *, top_k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, routed_scaling_factor: float) -> Tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's group-limited sigmoid routing (transformers' `DeepseekV3TopkRouter`), all in float32.

    s = sigmoid(logits) [M, E]; c = s + bias (`e_score_correction_bias`, used for choosing only);
    group score_g = sum of the two largest c in group g (E / n_group consecutive experts per group);
    the topk_group best groups stay, the other experts' c become -inf; experts e = top_k(c);
    w = s[e], w /= sum(w) + 1e-20 when norm_topk_prob; w *= routed_scaling_factor.
    Returns (w [M, k] float32, e [M, k] int32).
    """
    m, n = logits.shape
    if n % n_group or n // n_group < 2 or not 0 < topk_group <= n_group or top_k > topk_group * (n // n_group):
        raise ModelError(f"deepseek_route: {n} experts in n_group = {n_group} groups (>= 2 experts each), "
                         f"topk_group = {topk_group}, top_k = {top_k} cannot be routed")
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(m, n_group, n // n_group), 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, topk_group)
    keep = jnp.zeros((m, n_group), bool).at[jnp.arange(m)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(keep, n // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    w = jnp.take_along_axis(scores, experts, axis=1)
    if norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * jnp.float32(routed_scaling_factor), experts.astype(jnp.int32)
