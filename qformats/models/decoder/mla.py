"""Multi-head latent attention (MLA) of DeepSeek-V2/V3, as transformers' `DeepseekV3Attention` computes it.

Per token x (hidden d), with H heads, nope / rope / v head dims n, p, v and the LoRA ranks r_q, r_kv:

    q           = q_b(norm_q(q_a(x)))                 [H, n + p]   (q = q_proj(x) when q_lora_rank is null)
    q_nope, q_r = split(q, [n, p])
    c, k_r      = split(kv_a_proj_with_mqa(x), [r_kv, p]);  c = norm_kv(c)       (c: the latent, k_r: one head)
    q_r, k_r    = rope(q_r), rope(k_r)                 (DeepSeek's interleaved pairs when rope_interleave)
    k_nope, val = split(kv_b(c), [n, v])               per head
    k           = [k_nope, k_r broadcast to H heads]
    out         = o_proj(softmax(q k^T * scale + mask) val),   scale = (n + p)^-1/2 * m^2

with m = 0.1 mscale_all_dim ln(factor) + 1 under a YaRN rope that sets mscale_all_dim (else m = 1): DeepSeek's
softmax correction (`yarn_apply_mscale`), on top of YaRN's attention factor on cos / sin. The interleaved rope
rotates pairs (x_2i, x_2i+1) and lays the result out as [rotated evens, rotated odds]; it is the rotate-half rope
of the de-interleaved vector [x_0, x_2, ..., x_1, x_3, ...], which is how it is computed here.

The KV cache holds, per layer, what transformers caches: the normed latent c in `KVCache.keys[i]`
[B, 1, S, r_kv] and the post-RoPE shared key k_r in `KVCache.values[i]` [B, 1, S, p] — (r_kv + p) numbers per
position instead of H (n + p + v) for the expanded keys and values (576 against 40960 for DeepSeek-V3). Keys and
values are expanded from the cached latent by kv_b at every step (transformers' order of operations, so float32
logits match it), not absorbed into q_b / o_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder.layers import RMSNorm, RopeConfig, _project, apply_rope, write_cache, yarn_mscale

#: eps of MLA's q_a_layernorm / kv_a_layernorm: transformers builds them with RMSNorm's default, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The attention hyper-parameters of a DeepSeek-V3 model (frozen, hashable).

    q_lora_rank: rank r_q of the query down-projection (None: one q_proj); kv_lora_rank: rank r_kv of the latent;
    qk_nope_head_dim / qk_rope_head_dim: the per-head query/key dims without / with RoPE; v_head_dim: the value
    head dim; rope_interleave: DeepSeek's interleaved rotary pairs; bias: `attention_bias` (q_a_proj,
    kv_a_proj_with_mqa and o_proj have biases); scale: the softmax scale (see the module docstring).
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    bias: bool = False
    scale: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], rope: RopeConfig) -> "MLAConfig":
        """The MLA part of a deepseek_v3 config.json (transformers' DeepseekV3Config defaults for absent keys)."""
        def dim(key, default):
            v = cfg.get(key, default)
            if v is None or int(v) <= 0:
                raise ModelError(f"config.json (deepseek_v3): {key} must be a positive integer, got {v!r}")
            return int(v)

        q_lora = cfg.get("q_lora_rank", 1536)
        nope, rope_dim = dim("qk_nope_head_dim", 128), dim("qk_rope_head_dim", 64)
        if rope_dim % 2:
            raise ModelError(f"config.json (deepseek_v3): qk_rope_head_dim = {rope_dim} must be even for RoPE")
        return cls(q_lora_rank=None if q_lora is None else dim("q_lora_rank", 1536),
                   kv_lora_rank=dim("kv_lora_rank", 512), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                   v_head_dim=dim("v_head_dim", 128), rope_interleave=bool(cfg.get("rope_interleave", True)),
                   bias=bool(cfg.get("attention_bias", False)), scale=softmax_scale(nope + rope_dim, rope))


def softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """DeepSeek's attention scale qk_head_dim^-1/2 * m^2, m = yarn_mscale(factor, mscale_all_dim) when the rope is
    not "default" and sets a non-zero mscale_all_dim, else m = 1 (transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** (-0.5)
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def deinterleave(x: jax.Array) -> jax.Array:
    """[x_0, x_2, ..., x_1, x_3, ...] along the last axis (DeepSeek's interleaved rotary pairs to rotate-half)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLAttention(nnx.Module):
    """Multi-head latent attention (see the module docstring); modules at transformers' paths: q_proj or
    q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, cfg, *, dtype, param_dtype, rngs: nnx.Rngs):
        m: MLAConfig = cfg.mla

        def lin(i, o, bias=False):
            return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        h, d = cfg.num_heads, cfg.hidden_size
        if m.q_lora_rank is None:
            self.q_proj = lin(d, h * m.qk_head_dim)
        else:
            self.q_a_proj = lin(d, m.q_lora_rank, m.bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, param_dtype=param_dtype)
            self.q_b_proj = lin(m.q_lora_rank, h * m.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(d, m.kv_lora_rank + m.qk_rope_head_dim, m.bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, param_dtype=param_dtype)
        self.kv_b_proj = lin(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = lin(h * m.v_head_dim, d, m.bias)
        self.mla = m
        self.num_heads = h
        # the dense Attention's hooks, unused here: KV-cache quantization and online rotations refuse MLA models
        self.kv_scheme = None
        self.rotations = nnx.data(None)

    def __call__(self, x, cos, sin, mask, kv=None, start=0):
        """x [B, T, d]; cos/sin [T, qk_rope_head_dim] ([B, T, ...] per row); mask [T, S] or [B, T, S] (True =
        visible); kv: this layer's cache buffers
        (latent [B, 1, S, kv_lora_rank], rope key [B, 1, S, qk_rope_head_dim]), written at `start` (an int32 scalar, or [B] per row), or None
        (S = T). Returns (output [B, T, d], (latent, rope key) — the buffers, or this call's states)."""
        m, h = self.mla, self.num_heads
        b, t, _ = x.shape
        if m.q_lora_rank is None:
            q = _project(self, "q_proj", x)
        else:
            q = _project(self, "q_b_proj", self.q_a_layernorm(_project(self, "q_a_proj", x)))
        q = q.reshape(b, t, h, m.qk_head_dim)
        q_pass, q_rot = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        ckv = _project(self, "kv_a_proj_with_mqa", x)
        latent = self.kv_a_layernorm(ckv[..., :m.kv_lora_rank])[:, None]      # [B, 1, T, r_kv]
        k_rot = ckv[..., m.kv_lora_rank:].reshape(b, t, 1, m.qk_rope_head_dim)
        if m.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        k_rot = k_rot.transpose(0, 2, 1, 3)                                    # [B, 1, T, p]
        if kv is not None:
            latent = write_cache(kv[0], latent.astype(kv[0].dtype), start)
            k_rot = write_cache(kv[1], k_rot.astype(kv[1].dtype), start)
        s = latent.shape[2]
        expanded = _project(self, "kv_b_proj", latent[:, 0].astype(x.dtype))
        expanded = expanded.reshape(b, s, h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = expanded[..., :m.qk_nope_head_dim], expanded[..., m.qk_nope_head_dim:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, 0, :, None].astype(x.dtype),
                                                      (b, s, h, m.qk_rope_head_dim))], axis=-1)
        q = jnp.concatenate([q_pass, q_rot], axis=-1)
        scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None]  # [T, S], or [B, T, S] per row
        scores = jnp.where(mask, scores * jnp.float32(m.scale), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, h * m.v_head_dim)
        return _project(self, "o_proj", out), (latent, k_rot)
