"""Autoregressive generation with a causal LM and its KV cache: one jit, prefill then a lax loop of decode steps."""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.errors import ModelError
from qformats.models.sampling import check_sampling, next_token


def generate(model: nnx.Module, prompt_ids, max_new_tokens: int, *, key: Optional[jax.Array] = None,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_id: Union[int, Sequence[int], None] = None) -> jax.Array:
    """The next `max_new_tokens` tokens after `prompt_ids`, greedy by default.

    Args:
      model: a causal LM with `init_cache(batch, max_len)` and `__call__(ids, cache, last_only=True) ->
        (logits, cache)` (`qformats.models.decoder.CausalLM`, dense or packed by `qformats.nn.quantize_model`).
      prompt_ids: [B, T] int token ids (or [T], then the result is [max_new_tokens]); every row has T tokens.
      max_new_tokens: how many tokens to produce (>= 1).
      key: a jax PRNG key, needed when temperature > 0; step i samples with `jax.random.fold_in(key, i)`.
      temperature, top_k, top_p: token choice per step (`qformats.models.sampling.next_token`): 0 is argmax.
      eos_id: an end token id (or several): a row that produced one is finished and its later places hold
        the first eos id; the loop stops once every row is finished.

    Returns [B, max_new_tokens] int32. Compiled once per (model graph, B, T, max_new_tokens, sampling settings):
    the prompt is run through the model into a cache of T + max_new_tokens positions (prefill), then a
    `lax.while_loop` feeds back one token per step (decode), all in one `jax.jit`.
    """
    ids = jnp.asarray(prompt_ids)
    single = ids.ndim == 1
    if single:
        ids = ids[None]
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] < 1:
        raise ModelError(f"generate: expected prompt token ids [batch, time >= 1] of an integer dtype, got "
                         f"shape {tuple(jnp.shape(prompt_ids))} dtype {ids.dtype}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ModelError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    if temperature > 0 and key is None:
        raise ModelError("generate: temperature > 0 needs a key (jax.random.key(seed))")
    eos = () if eos_id is None else tuple(int(e) for e in ((eos_id,) if isinstance(eos_id, int) else eos_id))
    graphdef, state = nnx.split(model)
    out = _generate(graphdef, state, ids.astype(jnp.int32), key if temperature > 0 else None,
                    max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                    top_k=None if top_k is None else int(top_k), top_p=None if top_p is None else float(top_p),
                    eos=eos)
    return out[0] if single else out


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("max_new_tokens", "temperature", "top_k", "top_p", "eos"))
def _generate(graphdef, state, ids, key, *, max_new_tokens, temperature, top_k, top_p, eos):
    model = nnx.merge(graphdef, state)
    b, t = ids.shape
    n = max_new_tokens

    def pick(logits, i):
        k = None if key is None else jax.random.fold_in(key, i)
        return next_token(logits[:, -1], k, temperature, top_k, top_p)

    def finished(tok):
        return jnp.isin(tok, jnp.asarray(eos, jnp.int32)) if eos else jnp.zeros(tok.shape, bool)

    pad = eos[0] if eos else 0
    logits, cache = model(ids, model.init_cache(b, t + n), last_only=True)
    tok = pick(logits, 0)
    out = jnp.full((b, n), pad, jnp.int32).at[:, 0].set(tok)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < n) & ~jnp.all(done)

    def body(carry):
        i, tok, cache, out, done = carry
        logits, cache = model(tok[:, None], cache, last_only=True)
        nxt = jnp.where(done, pad, pick(logits, i))
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        return i + 1, nxt, cache, out, done | finished(nxt)

    carry = (jnp.asarray(1, jnp.int32), tok, cache, out, finished(tok))
    return jax.lax.while_loop(cond, body, carry)[3]
