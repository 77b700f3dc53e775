"""SmoothQuant (Xiao et al., 2022): per-channel smoothing factors that move activation outliers into the weights.

For a norm followed by the projections that read its output (the decoder family's mappings and the model glue
are `qformats.models.decoder.calibration`), with llm-compressor 0.14's arithmetic (`SmoothQuantModifier`):

    r_j = max_t y_tj - min_t y_tj                     (the norm output's range per channel j, calibration tokens)
    w_j = 2 * max_p max_o |W_p[o, j]|                 (over the balance projections p; torch layout [out, in])
    s_j = r_j^alpha / w_j^(1 - alpha)   (s_j = r_j where w_j = 0),   s_j <- max(s_j, 1e-5)
    norm.weight <- norm.weight / s,     W_p[:, j] <- W_p[:, j] * s_j     (Flax kernel: rows j scaled)

so every projection's float output is unchanged (y / s times s W), while the activations the projections
quantize (W8A8) have flatter channels. arXiv:2211.10438; alpha is the "migration strength".
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import jax
import jax.numpy as jnp

from qformats.errors import ModelError

__all__ = ["MIN_SCALE", "check_alpha", "smoothing_scales", "fold_scales"]

MIN_SCALE = 1e-5


def check_alpha(alpha) -> float:
    """alpha (the migration strength) as a float; ModelError unless a number in [0, 1]."""
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= float(alpha) <= 1.0:
        raise ModelError(f"SmoothQuant: alpha (migration strength) must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def smoothing_scales(act_range, kernels: Sequence, alpha: float):
    """s [K] = max(r^alpha / w^(1 - alpha), 1e-5), w_j = 2 max over the kernels [K, N_p] of |row j| (r where w = 0).

    Args:
      act_range: [K] per-channel range (max - min) of the activations the kernels read.
      kernels: the Flax kernels [K, N_p] of the balance projections.
      alpha: migration strength in [0, 1].
    """
    w = 2.0 * jnp.max(jnp.stack([jnp.max(jnp.abs(k.astype(jnp.float32)), axis=1) for k in kernels]), axis=0)
    r = act_range.astype(jnp.float32)
    s = jnp.where(w > 0, r ** alpha / w ** (1.0 - alpha), r)
    return jnp.maximum(s, MIN_SCALE)


def fold_scales(norm_weight, kernels: Sequence, s) -> Tuple[jax.Array, List[jax.Array]]:
    """(norm_weight / s, [W_p diag(s) ...]): the smoothing factors s [K] folded into the norm's 1-D weight and
    into every balance projection's Flax kernel [K, N_p] (row j times s_j), in float32, each rounded back to its
    own dtype. The float output of every projection is unchanged up to that rounding."""
    nw = (norm_weight.astype(jnp.float32) / s).astype(norm_weight.dtype)
    return nw, [(k.astype(jnp.float32) * s[:, None]).astype(k.dtype) for k in kernels]
