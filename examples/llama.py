"""A small LLaMA-style decoder in Flax NNX (RMSNorm, RoPE, GQA attention, SwiGLU) with jit `generate()`.

Random weights at TinyLlama-like proportions scaled down for the CPU (default: 4 layers, d=256, 8 query
heads sharing 2 KV heads, SwiGLU 768, vocab 2048). Every projection is an `nnx.Linear` at a path named
like the HF tensors, so `qformats.nn.quantize_model` quantizes it by rule:

    layers/{i}/self_attn/{q,k,v,o}_proj    layers/{i}/mlp/{gate,up,down}_proj    lm_head

The KV cache is an explicit pytree passed in and out of `__call__` (no hidden state), so prefill and
each decode step are the same function and `generate` is a single jit with a `lax.scan` over steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

Cache = List[Tuple[jax.Array, jax.Array]]  # per layer: k, v of shape [B, max_seq_len, n_kv_heads, head_dim]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 768
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight.get_value()).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary embedding (rotate-half convention of HF LLaMA): x [B, T, H, D], positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rot * sin).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        hd = cfg.head_dim
        lin = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.q_proj = lin(cfg.dim, cfg.n_heads * hd)
        self.k_proj = lin(cfg.dim, cfg.n_kv_heads * hd)
        self.v_proj = lin(cfg.dim, cfg.n_kv_heads * hd)
        self.o_proj = lin(cfg.n_heads * hd, cfg.dim)
        self.cfg = cfg

    def __call__(self, x, start, kv):
        cfg = self.cfg
        b, t, _ = x.shape
        hd, g = cfg.head_dim, cfg.n_kv_heads
        pos = start + jnp.arange(t)
        q = rope(self.q_proj(x).reshape(b, t, cfg.n_heads, hd), pos, cfg.rope_theta)
        k = rope(self.k_proj(x).reshape(b, t, g, hd), pos, cfg.rope_theta)
        v = self.v_proj(x).reshape(b, t, g, hd)
        ck, cv = kv
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, start, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, start, 0, 0))
        q = q.reshape(b, t, g, cfg.n_heads // g, hd)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, ck).astype(jnp.float32) / math.sqrt(hd)
        mask = jnp.arange(ck.shape[1])[None, :] <= pos[:, None]  # [T, S] causal over the cache
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(cv.dtype)
        out = jnp.einsum("bgrts,bsgd->btgrd", probs, cv).reshape(b, t, cfg.n_heads * hd)
        return self.o_proj(out.astype(x.dtype)), (ck, cv)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        lin = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.gate_proj = lin(cfg.dim, cfg.ffn_dim)
        self.up_proj = lin(cfg.dim, cfg.ffn_dim)
        self.down_proj = lin(cfg.ffn_dim, cfg.dim)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, start, kv):
        h, kv = self.self_attn(self.input_layernorm(x), start, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Llama(nnx.Module):
    """tokens [B, T] at positions start..start+T-1, KV cache → logits [B, T, vocab] (float32), new cache."""

    def __init__(self, cfg: LlamaConfig | None = None, *, rngs: nnx.Rngs):
        self.cfg = cfg = cfg if cfg is not None else LlamaConfig()
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.dim, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nnx.Linear(cfg.dim, cfg.vocab_size, use_bias=False, rngs=rngs)

    def init_cache(self, batch: int, dtype=jnp.float32) -> Cache:
        c = self.cfg
        shape = (batch, c.max_seq_len, c.n_kv_heads, c.head_dim)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(c.n_layers)]

    def __call__(self, tokens, start=0, cache: Cache | None = None):
        if cache is None:
            cache = self.init_cache(tokens.shape[0])
        x = self.embed_tokens(tokens)
        new = []
        for layer, kv in zip(self.layers, cache):
            x, kv = layer(x, start, kv)
            new.append(kv)
        return self.lm_head(self.norm(x)).astype(jnp.float32), new


@functools.partial(nnx.jit, static_argnames=("max_new_tokens",))
def generate(model: Llama, prompt: jax.Array, max_new_tokens: int) -> jax.Array:
    """Greedy decoding: prompt [B, T] int32 → the next `max_new_tokens` tokens [B, max_new_tokens].

    One jit: prefill the cache with the prompt, then a `lax.scan` of single-token steps. Needs
    T + max_new_tokens <= cfg.max_seq_len.
    """
    b, t = prompt.shape
    if t + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"generate: prompt {t} + {max_new_tokens} new tokens exceed max_seq_len "
                         f"{model.cfg.max_seq_len}")
    logits, cache = model(prompt, 0, model.init_cache(b))
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def step(carry, _):
        tok, pos, cache = carry
        logits, cache = model(tok[:, None], pos, cache)
        return (jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), pos + 1, cache), tok

    _, toks = jax.lax.scan(step, (first, jnp.asarray(t, jnp.int32), cache), None, length=max_new_tokens)
    return toks.T


def small_llama(seed: int = 0, cfg: LlamaConfig | None = None) -> Llama:
    """A randomly initialised Llama (default config)."""
    return Llama(cfg, rngs=nnx.Rngs(seed))
