"""The decoder family's shared building blocks: RoPE (default, llama3, YaRN), RMSNorm, online rotations around a
projection, and per-row KV-cache writes; used by the dense / MoE attention in `model` and by `mla`."""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError

@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of HF's "default", "llama3" and "yarn" rope types.

    default: inv_freq_j = theta^(-2j / D), j = 0 .. D/2 - 1 (D: the rotary head dim).
    llama3 (Llama 3.1): with wavelen_j = 2 pi / inv_freq_j, L = original_max_position_embeddings,
      inv_freq_j / factor                            if wavelen_j > L / low_freq_factor,
      inv_freq_j                                     if wavelen_j < L / high_freq_factor,
      (1 - s) inv_freq_j / factor + s inv_freq_j     otherwise, s = (L / wavelen_j - low) / (high - low).
    yarn (YaRN, transformers' `_compute_yarn_parameters`): with p_j = theta^(2j / D),
      inv_freq_j = (1 / (factor p_j)) (1 - e_j) + (1 / p_j) e_j,  e_j = 1 - clamp((j - lo) / (hi - lo), 0, 1),
      lo, hi = max(d(beta_fast), 0), min(d(beta_slow), D - 1), d(n) = D ln(L / (2 pi n)) / (2 ln theta)
      (floor / ceil of lo / hi when `truncate`; hi += 0.001 when lo == hi); and cos, sin are multiplied by
      `attention_scaling` = attention_factor, or if None m(factor, mscale) / m(factor, mscale_all_dim) when both
      mscale and mscale_all_dim are set, else m(factor, 1), m(s, k) = 0.1 k ln(s) + 1 for s > 1 (1 otherwise).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The [head_dim / 2] float32 inverse frequencies (computed in float32, as transformers does)."""
        exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        pos_freqs = np.power(np.float32(self.theta), exponent).astype(np.float32)
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.rope_type == "default":
            return inv
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(head_dim, pos_freqs, inv)
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
        smooth = ((self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn_inv_freq(self, dim: int, pos_freqs: np.ndarray, extrapolation: np.ndarray) -> np.ndarray:
        f32 = np.float32
        interpolation = (f32(1.0) / (f32(self.factor) * pos_freqs)).astype(f32)

        def correction_dim(num_rotations):
            return (dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))

        lo, hi = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(lo)) / f32(hi - lo), f32(0), f32(1)).astype(f32)
        extrapolation_factor = (f32(1) - ramp).astype(f32)
        return (interpolation * (f32(1) - extrapolation_factor)
                + extrapolation * extrapolation_factor).astype(f32)

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (YaRN's attention factor; 1.0 for the other rope types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction m(s, k) = 0.1 k ln(s) + 1 for s > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RMSNorm(nnx.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)), the normalisation in float32 and cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return self.weight.get_value().astype(x.dtype) * y


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> Tuple[jax.Array, jax.Array]:
    """cos, sin [T, head_dim] (or [B, T, head_dim] for per-row positions [B, T]) of angles positions_t * inv_freq_j,
    the half-table repeated (HF's layout), times `scale` (the rope's `attention_scaling`: YaRN's attention factor,
    1 otherwise)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    ang = jnp.concatenate([ang, ang], axis=-1)
    if scale == 1.0:
        return jnp.cos(ang), jnp.sin(ang)
    return jnp.cos(ang) * jnp.float32(scale), jnp.sin(ang) * jnp.float32(scale)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin for x [B, T, H, D], rotate_half(x) = [-x2, x1] (HF's rotate-half convention);
    cos, sin [T, D] (shared by the rows) or [B, T, D] (per-row positions)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    return (x.astype(jnp.float32) * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


class Rotation(nnx.Variable):
    """An online rotation matrix M [n, n]: values v become v @ M, per block of n along the last axis
    (block-diagonal M). For compressed-tensors' Hadamard kinds M = W / sqrt(n), W its stored transform weight
    permuted / transposed as its args say; for random-matrix M = W (see converters.formats.compressed_tensors.transforms)."""


def rotate(x: jax.Array, m: jax.Array) -> jax.Array:
    """x @ M over the last axis of x in blocks of n = M.shape[0] (compressed-tensors' online transform,
    `_multihead_matmul(value, weight)`), computed in M's dtype at full precision and cast back to x's dtype."""
    n, d = m.shape[0], x.shape[-1]
    if d % n:
        raise ModelError(f"rotate: a rotation of order {n} does not divide the last axis {d}")
    xs = x.astype(m.dtype).reshape(*x.shape[:-1], d // n, n)
    y = jnp.matmul(xs, m, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape).astype(x.dtype)


class HadamardRotation(nnx.Module):
    """v -> v @ M with M = diag(s) Had_n / sqrt(n) (or its transpose M^T = Had_n diag(s) / sqrt(n) when Had_n is
    Sylvester's, hence symmetric), per block of n along the last axis, by the fast transform of
    `qformats.hadamard.hadamard_apply` (O(n log n) butterflies, plus a [K, K] product for n = 2^k K) instead of a
    dense [n, n] product. s: signs (all ones for compressed-tensors' deterministic "hadamard")."""

    def __init__(self, signs, base=None, transpose: bool = False):
        self.signs = Rotation(jnp.asarray(signs, jnp.float32))
        self.base = None if base is None else Rotation(jnp.asarray(base, jnp.float32))
        if transpose and base is not None:
            raise ModelError("HadamardRotation: the transposed fast transform needs a symmetric (Sylvester) Had_n")
        self.transpose = transpose

    def __call__(self, x: jax.Array) -> jax.Array:
        from qformats.hadamard import hadamard_apply

        s = self.signs.get_value()
        n, d = s.shape[0], x.shape[-1]
        if d % n:
            raise ModelError(f"HadamardRotation: a rotation of order {n} does not divide the last axis {d}")
        xs = x.astype(jnp.float32).reshape(*x.shape[:-1], d // n, n)
        base = None if self.base is None else self.base.get_value()
        y = hadamard_apply(xs, base) * s if self.transpose else hadamard_apply(xs * s, base)
        return (y / jnp.sqrt(jnp.float32(n))).reshape(x.shape).astype(x.dtype)


def _rotate(r, x: jax.Array) -> jax.Array:
    return r(x) if isinstance(r, HadamardRotation) else rotate(x, r.get_value())


def _project(module: nnx.Module, name: str, x: jax.Array) -> jax.Array:
    """module.<name>(x) with the online rotations set on it by `set_rotation` ("<name>/input", "<name>/output")."""
    rots = module.rotations
    if rots is not None and f"{name}/input" in rots:
        x = _rotate(rots[f"{name}/input"], x)
    y = getattr(module, name)(x)
    if rots is not None and f"{name}/output" in rots:
        y = _rotate(rots[f"{name}/output"], y)
    return y


def write_cache(buf: jax.Array, new: jax.Array, start) -> jax.Array:
    """buf [B, G, S, D] with new [B, G, T, D] written at places start .. start + T - 1: one dynamic_update_slice for
    a scalar start, one per row (vmapped) for start [B]."""
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice(buf, new, (0, 0, start, 0))
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (0, s, 0)))(buf, new, start)
