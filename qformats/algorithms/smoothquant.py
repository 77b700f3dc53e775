"""SmoothQuant (Xiao et al., 2022): per-channel scales that move activation outliers into the weights, folded into norms.

For a norm followed by the projections that read its output (the decoder family: input_layernorm -> q/k/v,
post_attention_layernorm -> gate/up), with llm-compressor 0.14's arithmetic (`SmoothQuantModifier`):

    r_j = max_t y_tj - min_t y_tj                     (the norm output's range per channel j, calibration tokens)
    w_j = 2 * max_p max_o |W_p[o, j]|                 (over the balance projections p; torch layout [out, in])
    s_j = r_j^alpha / w_j^(1 - alpha)   (s_j = r_j where w_j = 0),   s_j <- max(s_j, 1e-5)
    norm.weight <- norm.weight / s,     W_p[:, j] <- W_p[:, j] * s_j     (Flax kernel: rows j scaled)

so every projection's float output is unchanged (y / s times s W), while the activations the projections
quantize (W8A8) have flatter channels. arXiv:2211.10438; alpha is the "migration strength".
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import jax.numpy as jnp
from flax import nnx

from qformats.errors import ModelError

__all__ = ["MAPPINGS", "MIN_SCALE", "smoothing_scales", "smoothquant_transform"]

MAPPINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("input_layernorm", ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj")),
    ("post_attention_layernorm", ("mlp/gate_proj", "mlp/up_proj")),
)
"""(norm, projections reading its output) of a decoder layer: llm-compressor's DEFAULT_SMOOTHQUANT_MAPPINGS."""
MIN_SCALE = 1e-5


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


class _RangeTap(nnx.Module):
    """Wraps a norm: its output passes unchanged; the per-channel min and max over valid tokens are recorded."""

    def __init__(self, inner, dim: int):
        self.inner = inner
        self.valid = nnx.Variable(jnp.ones((1, 1), bool))
        self.lo = nnx.Variable(jnp.full((dim,), jnp.inf, jnp.float32))
        self.hi = nnx.Variable(jnp.full((dim,), -jnp.inf, jnp.float32))

    def __call__(self, x):
        y = self.inner(x)
        v = self.valid.get_value()[..., None]
        yf = y.astype(jnp.float32)
        self.lo.set_value(jnp.minimum(self.lo.get_value(), jnp.min(jnp.where(v, yf, jnp.inf), axis=(0, 1))))
        self.hi.set_value(jnp.maximum(self.hi.get_value(), jnp.max(jnp.where(v, yf, -jnp.inf), axis=(0, 1))))
        return y


@nnx.jit
def _range_pass(layer, x, valid, cos, sin, mask):
    """Records the mapped norms' output ranges; returns nothing, so XLA drops what they do not need (the MLP)."""
    for norm, _ in MAPPINGS:
        getattr(layer, norm).valid.set_value(valid)
    layer(x, cos, sin, mask)


def _get(layer, rel: str):
    a, b = rel.split("/")
    return getattr(getattr(layer, a), b)


def smoothquant_transform(alpha: float) -> Callable:
    """A `qformats.models.sequential.calibrate_decoder` transform: per decoder layer, one float pass over the
    calibration batches records each mapped norm's output range, then the SmoothQuant scales (module docstring)
    are folded into the norm and its projections (float nnx.Linear kernels and the norm's weight)."""
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= float(alpha) <= 1.0:
        raise ModelError(f"SmoothQuant: alpha (migration strength) must be a number in [0, 1], got {alpha!r}")
    alpha = float(alpha)

    def transform(layer, index: int, xs, valid, layer_inputs) -> None:
        norms = {}
        for norm, _ in MAPPINGS:
            inner = getattr(layer, norm)
            norms[norm] = inner
            setattr(layer, norm, _RangeTap(inner, int(inner.weight.get_value().shape[0])))
        try:
            for x, v in zip(xs, valid):
                _range_pass(layer, x, v, *layer_inputs(x.shape[1]))
            ranges = {n: getattr(layer, n).hi.get_value() - getattr(layer, n).lo.get_value() for n in norms}
        finally:
            for n, inner in norms.items():
                setattr(layer, n, inner)
        for norm, projs in MAPPINGS:
            lins = [_get(layer, p) for p in projs]
            for p, lin in zip(projs, lins):
                if not isinstance(lin, nnx.Linear):
                    raise ModelError(f"model/layers/{index}/{p}: SmoothQuant folds scales into a float nnx.Linear, "
                                     f"found {type(lin).__name__}")
            s = smoothing_scales(ranges[norm], [lin.kernel.get_value() for lin in lins], alpha)
            nw = norms[norm].weight
            nw.set_value((nw.get_value().astype(jnp.float32) / s).astype(nw.get_value().dtype))
            for lin in lins:
                k = lin.kernel.get_value()
                lin.kernel.set_value((k.astype(jnp.float32) * s[:, None]).astype(k.dtype))

    return transform
