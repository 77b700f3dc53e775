"""Attention one sequence at a time (`SEQUENCE_LOOP_BACKENDS`, XLA:CPU) against the whole batch at once, and in causal
query blocks (`CAUSAL_BLOCK`) against all keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.models.decoder import model as M
from qformats.models.decoder.layers import rope_tables

B, T, HD = 3, 12, 16


def attention(sinks: bool):
    cfg = M.DecoderConfig(model_type="llama", vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
                          num_heads=6, num_kv_heads=2, head_dim=HD, attention_sinks=sinks)
    attn = M.Attention(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    if sinks:
        attn.sinks.set_value(jnp.linspace(-1.0, 1.0, 6))
    return attn


def inputs(per_row: bool):
    """x, cos, sin, mask: one causal mask [T, T] for all rows, or per row [B, T, T] (two packed samples a row)."""
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, 48))
    inv = 1.0 / (10000.0 ** (np.arange(0, HD, 2) / HD))
    causal = np.tril(np.ones((T, T), bool))
    if not per_row:
        cos, sin = rope_tables(jnp.arange(T), inv)
        return x, cos, sin, jnp.asarray(causal)
    cut = np.array([4, 7, 12])  # row b: samples [0, cut[b]) and [cut[b], T)
    seg = (np.arange(T)[None, :] >= cut[:, None]).astype(np.int32)
    pos = np.where(seg == 0, np.arange(T)[None, :], np.arange(T)[None, :] - cut[:, None])
    cos, sin = rope_tables(jnp.asarray(pos), inv)
    return x, cos, sin, jnp.asarray(causal[None] & (seg[:, :, None] == seg[:, None, :]))


def run(attn, backends, *args, **kw):
    old = M.SEQUENCE_LOOP_BACKENDS
    M.SEQUENCE_LOOP_BACKENDS = backends
    try:
        fn = nnx.jit(lambda m, *a: m(*a, **kw))
        jaxpr = str(jax.make_jaxpr(lambda *a: attn(*a, **kw))(*args))
        return fn(attn, *args), jaxpr
    finally:
        M.SEQUENCE_LOOP_BACKENDS = old


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_one_sequence_at_a_time_equals_the_whole_batch(sinks, per_row):
    attn, args = attention(sinks), inputs(per_row)
    (out, kv), loop_jaxpr = run(attn, ("cpu",), *args)
    (ref, kv_ref), batch_jaxpr = run(attn, (), *args)
    assert "scan" in loop_jaxpr and "scan" not in batch_jaxpr  # the loop is taken on CPU, and only when asked
    # float32 roundoff only: XLA compiles the loop body's products and softmax apart from the batch's
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=2e-6)
    for a, b in zip(kv, kv_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cached_prefill_loops_and_decode_does_not():
    attn, (x, cos, sin, _) = attention(False), inputs(False)
    cache = (jnp.zeros((B, 2, 16, HD)), jnp.zeros((B, 2, 16, HD)))
    mask = jnp.asarray(np.tril(np.ones((T, 16), bool)))
    (out, kv), jaxpr = run(attn, ("cpu",), x, cos, sin, mask, cache, 0)
    (ref, kv_ref), _ = run(attn, (), x, cos, sin, mask, cache, 0)
    assert "scan" in jaxpr
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(kv[0]), np.asarray(kv_ref[0]))
    step = (x[:, :1], cos[:1], sin[:1], mask[:1], cache, 0)  # one new token: nothing to loop over
    assert "scan" not in run(attn, ("cpu",), *step)[1]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("block", [4, 5, 64])  # T = 12: three blocks, a short last block, one block (all keys)
def test_causal_query_blocks_equal_all_keys(sinks, per_row, block):
    g, r = 2, 3
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(ks[0], (B, g, r * T, HD))
    k, v = (jax.random.normal(kk, (B, g, T, HD)) for kk in ks[1:3])
    mask = inputs(per_row)[3]
    mask = jnp.tile(mask, (r, 1)) if mask.ndim == 2 else jnp.tile(mask, (1, r, 1))[:, None]  # rows (r, t)
    sink = jax.random.normal(ks[3], (1, g, r * T, 1)) if sinks else None
    kw = dict(scale=HD ** -0.5, sink=sink, dtype=jnp.float32)
    got = jax.jit(lambda *a: M._attend(*a, **kw, block=block))(q, k, v, mask)
    ref = jax.jit(lambda *a: M._attend(*a, **kw))(q, k, v, mask)
    # the keys a block leaves out have probability exactly 0; the sums run over fewer terms: float32 roundoff
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-6)


def test_blocks_only_without_a_cache():
    attn, (x, cos, sin, mask) = attention(False), inputs(False)
    old = M.CAUSAL_BLOCK
    M.CAUSAL_BLOCK = 4
    try:
        dots = lambda *a: str(jax.make_jaxpr(lambda *b: attn(*b))(*a)).count("dot_general")
        assert dots(x, cos, sin, mask) == 4 + 2 * 3  # four projections, scores and values in 3 blocks of 4
        cache = (jnp.zeros((B, 2, 16, HD)), jnp.zeros((B, 2, 16, HD)))
        assert dots(x, cos, sin, jnp.asarray(np.tril(np.ones((T, 16), bool))), cache, 0) == 4 + 2
    finally:
        M.CAUSAL_BLOCK = old
