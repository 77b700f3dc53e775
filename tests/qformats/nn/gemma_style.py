"""Test models written in the style of third-party Flax code (nothing downloaded, random weights).

`Gemma` follows Google DeepMind's `gemma` package (gemma/gm/nn/_layers.py, _modules.py, version 3.3.0): its own
`Einsum` module calling `jnp.einsum(eqn, x, self.param(...))`, `nn.share_scope` for the MLP's einsums, a tied
`Embedder` (gather in `encode`, `jnp.dot(x, table.T)` in `decode`), q / kv / attn_vec einsums with gemma's
equations, RMSNorm with `1 + scale`, and blocks either as a Python list (as gemma does) or under `nn.scan`.
The `gemma` package itself needs kauldron (and grain, sentencepiece, einops, jaxtyping) to import, and
gemma >= 4 requires Python >= 3.12, so it is not a test dependency; these few modules reproduce its layer style.

`ParallelLinear` is EasyDeL's style (an `nnx.Module` with its own `kernel` and `lax.dot_general`); `NnxCustom`
mixes it with a gemma-style NNX einsum module, an `nnx.Linear`, a tied embedding and an `nnx.scan` stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx


# ---- linen: gemma -----------------------------------------------------------------------------------------------
class Einsum(nn.Module):
    shape: tuple
    weight_name: str = "w"

    @nn.compact
    def __call__(self, eqn, x):
        w = self.param(self.weight_name, nn.initializers.normal(), self.shape)
        return jnp.einsum(eqn, x, w)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-06) * (1 + scale)


class Embedder(nn.Module):
    vocab_size: int
    embed_dim: int

    def setup(self):
        self.input_embedding_table = self.param("input_embedding", nn.initializers.normal(),
                                                (self.vocab_size, self.embed_dim))

    def encode(self, x):
        return self.input_embedding_table[(x,)] * jnp.sqrt(self.embed_dim).astype(jnp.float32)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding_table.T)


class Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    features: int
    head_dim: int

    @nn.compact
    def __call__(self, x):
        q = Einsum((self.num_heads, self.features, self.head_dim), name="q_einsum")("BTD,NDH->BTNH", x)
        k, v = Einsum((2, self.num_kv_heads, self.features, self.head_dim), name="kv_einsum")("BSD,CKDH->CBSKH", x)
        g = self.num_heads // self.num_kv_heads
        q = q.reshape(q.shape[:2] + (self.num_kv_heads, g, self.head_dim)) * self.head_dim ** -0.5
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k)
        t = x.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool))[:, None, None, :], logits, -1e30)
        probs = jax.nn.softmax(logits, axis=-1)
        enc = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(q.shape[:2] + (self.num_heads, self.head_dim))
        return Einsum((self.num_heads, self.head_dim, self.features), name="attn_vec_einsum")("BTNH,NHD->BTD", enc)


class FeedForward(nn.Module):
    features: int
    hidden_dim: int

    @nn.compact
    def __call__(self, x):
        gating = Einsum(shape=(2, self.features, self.hidden_dim), weight_name="gating_einsum")
        nn.share_scope(self, gating)
        gate = gating("...F,NFH->...NH", x)
        act = nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
        linear = Einsum(shape=(self.hidden_dim, self.features), weight_name="linear")
        nn.share_scope(self, linear)
        return linear("...H,HF->...F", act)


class Block(nn.Module):
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    head_dim: int
    hidden_dim: int

    @nn.compact
    def __call__(self, x, _=None):
        x = x + Attention(self.num_heads, self.num_kv_heads, self.embed_dim, self.head_dim, name="attn")(
            RMSNorm(name="pre_attention_norm")(x))
        x = x + FeedForward(self.embed_dim, self.hidden_dim, name="mlp")(RMSNorm(name="pre_ffw_norm")(x))
        return x, None


class Gemma(nn.Module):
    """A small Gemma3-style decoder: tokens [B, T] -> logits [B, T, vocab]."""

    vocab_size: int = 256
    embed_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 128
    hidden_dim: int = 512
    scan: bool = False

    @nn.compact
    def __call__(self, tokens):
        emb = Embedder(self.vocab_size, self.embed_dim, name="embedder")
        x = emb.encode(tokens)
        args = (self.num_heads, self.num_kv_heads, self.embed_dim, self.head_dim, self.hidden_dim)
        if self.scan:
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.num_layers)(*args, name="layers")(x, None)
        else:
            for i in range(self.num_layers):
                x, _ = Block(*args, name=f"layer_{i}")(x)
        return emb.decode(RMSNorm(name="final_norm")(x))


# ---- NNX: EasyDeL-style custom layers -----------------------------------------------------------------------------
class ParallelLinear(nnx.Module):
    """EasyDeL's style: a module with its own `kernel` [in, out] and a `lax.dot_general`."""

    def __init__(self, din, dout, *, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) * din ** -0.5)

    def __call__(self, x):
        return jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))


class HeadsEinsum(nnx.Module):
    """Gemma's Einsum in NNX: the equation is a call argument, the weight a plain param `w`."""

    def __init__(self, shape, *, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), shape) * shape[-2] ** -0.5)

    def __call__(self, eqn, x):
        return jnp.einsum(eqn, x, self.w[...])


class CustomBlock(nnx.Module):
    def __init__(self, d, hidden, *, rngs):
        self.q = HeadsEinsum((2, d, 64), rngs=rngs)
        self.o = ParallelLinear(2 * 64, d, rngs=rngs)
        self.up = ParallelLinear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.q("btd,ndh->btnh", x)).reshape(x.shape[:2] + (-1,))
        x = x + self.o(h)
        return x + self.down(jax.nn.gelu(self.up(x)))


class NnxCustom(nnx.Module):
    """Tied embedding, an nnx.scan stack of CustomBlocks (built with nnx.vmap), a ParallelLinear head."""

    def __init__(self, vocab=64, d=128, hidden=256, layers=2, *, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, d)))
        keys = jax.random.split(rngs.params(), layers)
        self.blocks = nnx.vmap(lambda k: CustomBlock(d, hidden, rngs=nnx.Rngs(k)))(keys)
        self.proj = ParallelLinear(d, d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        x, _ = nnx.scan(lambda h, b: (b(h), None))(x, self.blocks)
        return self.proj(x) @ self.embed[...].T


class StackedMHA(nnx.Module):
    """flax's own nnx.MultiHeadAttention, stacked by nnx.vmap and run by nnx.scan (LinearGeneral kernels with a
    leading layer axis)."""

    def __init__(self, d=128, heads=2, layers=2, *, seed=0):
        keys = jax.random.split(jax.random.key(seed), layers)
        self.layers = nnx.vmap(lambda k: nnx.MultiHeadAttention(heads, d, decode=False,
                                                                 rngs=nnx.Rngs(k)))(keys)

    def __call__(self, x):
        x, _ = nnx.scan(lambda h, m: (h + m(h), None))(x, self.layers)
        return x
