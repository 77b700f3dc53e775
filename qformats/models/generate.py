"""Autoregressive generation with a causal LM and its KV cache: one jit, prefill then a lax loop of decode steps
(`generate`), or the same steps one at a time for streaming (`TokenStream`)."""

from __future__ import annotations

import functools
import time
from typing import Iterator, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
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

    Raises ModelError before any compute for bad arguments and for T + max_new_tokens over the model's
    `config.max_position_embeddings` (`check_context`).
    """
    ids, single, eos = _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p, eos_id)
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


def check_context(model: nnx.Module, prompt_len: int, max_new_tokens: int) -> None:
    """ModelError when a prompt of `prompt_len` tokens plus `max_new_tokens` does not fit the model's context
    (`model.config.max_position_embeddings`, where the model has one), with the numbers."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + max_new_tokens > limit:
        raise ModelError(f"generate: a prompt of {prompt_len} tokens with max_new_tokens={max_new_tokens} needs "
                         f"{prompt_len + max_new_tokens} positions, over the model's context of {limit} "
                         f"(max_position_embeddings); shorten the prompt to at most {max(limit - max_new_tokens, 0)} "
                         f"tokens or ask for at most {max(limit - prompt_len, 0)} new tokens")


def _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p, eos_id):
    """(ids [B, T] int32, whether the prompt was 1-D, eos ids tuple) after checking every argument."""
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
    check_context(model, int(ids.shape[1]), int(max_new_tokens))
    eos = () if eos_id is None else tuple(int(e) for e in ((eos_id,) if isinstance(eos_id, int) else eos_id))
    return ids.astype(jnp.int32), single, eos


class TokenStream:
    """`generate` one step at a time: iterating yields each step's new tokens (numpy, [B], or a scalar array for a
    1-D prompt) as soon as they are produced, for streaming and for timing prefill and decode apart.

    The steps are `generate`'s: a prefill program (the prompt into a cache of T + max_new_tokens positions, the
    first token chosen with `jax.random.fold_in(key, 0)`) and a decode program (one token through the cache, step
    i choosing with `fold_in(key, i)`), each jit-compiled once per (model graph, B, T, max_new_tokens, sampling
    settings) and free of host callbacks, so JAX's persistent compilation cache keeps them. A finished row (it
    produced an eos id) is fed and given the first eos id from then on; iteration ends once every row is
    finished or after max_new_tokens steps.

    `compile()` lowers and compiles both programs ahead of time (iteration does it otherwise);
    `compile_seconds`, `prefill_seconds` and `decode_seconds` hold the wall time of each phase so far.
    """

    def __init__(self, model: nnx.Module, prompt_ids, max_new_tokens: int, *, key: Optional[jax.Array] = None,
                 temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_id: Union[int, Sequence[int], None] = None):
        self.ids, self.single, self.eos = _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p,
                                                 eos_id)
        self.max_new_tokens = int(max_new_tokens)
        self.key = key if temperature > 0 else None
        self.sampling = dict(temperature=float(temperature), top_k=None if top_k is None else int(top_k),
                             top_p=None if top_p is None else float(top_p))
        self.graphdef, self.state = nnx.split(model)
        self._programs: Optional[Tuple] = None
        self.compile_seconds = self.prefill_seconds = self.decode_seconds = 0.0

    def compile(self) -> "TokenStream":
        """Lowers and compiles the prefill and decode programs (once); returns self."""
        if self._programs is None:
            t0 = time.perf_counter()
            pre = _prefill.lower(self.graphdef, self.state, self.ids, self.key, max_new_tokens=self.max_new_tokens,
                                 **self.sampling).compile()
            # the decode program takes the prefill's outputs as they come out of it, layout (mesh) included
            tok, cache = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                      pre.out_info, pre.output_shardings)
            dec = _decode.lower(self.graphdef, self.state, tok, cache, jnp.int32(1), self.key,
                                **self.sampling).compile()
            self._programs = (pre, dec)
            self.compile_seconds += time.perf_counter() - t0
        return self

    def __iter__(self) -> Iterator[np.ndarray]:
        pre, dec = self.compile()._programs
        pad = self.eos[0] if self.eos else 0
        t0 = time.perf_counter()
        tok, cache = pre(self.state, self.ids, self.key)
        host = np.asarray(tok)
        self.prefill_seconds += time.perf_counter() - t0
        done = np.isin(host, self.eos)
        yield host[0] if self.single else host
        for i in range(1, self.max_new_tokens):
            if done.all():
                return
            t0 = time.perf_counter()
            tok, cache = dec(self.state, jnp.asarray(host), cache, jnp.int32(i), self.key)
            host = np.where(done, pad, np.asarray(tok)).astype(np.int32)
            self.decode_seconds += time.perf_counter() - t0
            done |= np.isin(host, self.eos)
            yield host[0] if self.single else host


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_new_tokens", "temperature", "top_k", "top_p"))
def _prefill(graphdef, state, ids, key, *, max_new_tokens, temperature, top_k, top_p):
    model = nnx.merge(graphdef, state)
    b, t = ids.shape
    logits, cache = model(ids, model.init_cache(b, t + max_new_tokens), last_only=True)
    k = None if key is None else jax.random.fold_in(key, 0)
    return next_token(logits[:, -1], k, temperature, top_k, top_p), cache


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature", "top_k", "top_p"))
def _decode(graphdef, state, tok, cache, i, key, *, temperature, top_k, top_p):
    model = nnx.merge(graphdef, state)
    logits, cache = model(tok[:, None], cache, last_only=True)
    k = None if key is None else jax.random.fold_in(key, i)
    return next_token(logits[:, -1], k, temperature, top_k, top_p), cache
