"""Autoregressive generation with a causal LM and its KV cache: one jit, prefill then a lax loop of decode steps
(`generate`), or the same steps one at a time for streaming (`TokenStream`); ragged batches, shapes padded to
buckets (`plan_shapes`); many requests through a number of batch rows, a finished row refilled with the next
pending request, refills prefilled together, the batch shrunk once nothing is pending (`ContinuousBatch`)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.models.sampling import check_sampling, next_token


MIN_BUCKET = 16


def bucket_length(n: int, limit: Optional[int] = None, minimum: int = MIN_BUCKET) -> int:
    """The compiled size for n positions: the next power of two >= max(n, minimum), capped at `limit` (the model's
    context) when n <= limit. Prompt lengths 1..16 share one program, 17..32 the next, and so on."""
    b = max(int(minimum), 1 << max(int(n) - 1, 0).bit_length())
    return max(int(n), min(b, limit)) if limit is not None else b


def plan_shapes(lengths: Sequence[int], max_new_tokens: Sequence[int], limit: Optional[int] = None,
                buckets: bool = True) -> Tuple[int, int]:
    """(T, S): the padded prompt length and the cache size a batch of prompts of `lengths` generating up to
    `max_new_tokens` each compiles for. T = bucket_length(max lengths); S = bucket_length(max(T, max_b(lengths_b +
    max_new_tokens_b))), both capped at the context `limit`. Without `buckets`: T = max lengths and S =
    max(T, max_b(lengths_b + max_new_tokens_b)) exactly."""
    need = max(int(t) + int(n) for t, n in zip(lengths, max_new_tokens))
    if not buckets:
        t = max(int(x) for x in lengths)
        return t, max(t, need)
    t = bucket_length(max(int(x) for x in lengths), limit)
    return t, bucket_length(max(t, need), limit)


def generate(model: nnx.Module, prompt_ids, max_new_tokens: Union[int, Sequence[int]], *,
             key: Optional[jax.Array] = None, temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_id: Union[int, Sequence[int], None] = None,
             buckets: bool = True) -> jax.Array:
    """The next `max_new_tokens` tokens after each prompt, greedy by default.

    Args:
      model: a causal LM with `init_cache(batch, max_len, per_row=...)` and `__call__(ids, cache, last_only=...,
        logit_index=...) -> (logits, cache)` (`qformats.models.decoder.CausalLM`, dense or packed by
        `qformats.nn.quantize_model`, per-layer or grouped by `scan_layers`).
      prompt_ids: [B, T] int token ids, or [T] (then the result is 1-D), or a list of B 1-D prompts of different
        lengths (a ragged batch).
      max_new_tokens: how many tokens to produce (>= 1), for every row or one count per row.
      key: a jax PRNG key, needed when temperature > 0; step i samples with `jax.random.fold_in(key, i)`.
      temperature, top_k, top_p: token choice per step (`qformats.models.sampling.next_token`): 0 is argmax.
      eos_id: an end token id (or several): a row that produced one is finished and its later places hold the
        first eos id; the loop stops once every row is finished.
      buckets: pad the prompt length and the cache size to `plan_shapes`' buckets (default), so prompts of other
        lengths and other max_new_tokens reuse the compiled program; False compiles for the exact shapes.

    Returns [B, max(max_new_tokens)] int32; a row's places past its own max_new_tokens hold the pad (the first eos
    id, else 0).

    Ragged batches are right-padded: row b's prompt fills positions 0 .. len_b - 1 of its cache rows, the cache
    keeps one length per row (`KVCache.length` [B]) and each decode step writes row b's token at its own next
    place, so a row's keys sit where they would sit alone and its greedy tokens are the ones it gets alone
    (padding positions are masked by causality: no real query sees a later place). A dynamic fp8 KV-cache scheme
    shares one scale per written block across rows, so there rows must have equal lengths (and no bucket padding
    of the prompt is applied).

    One `jax.jit` per (model graph, B, padded T, cache size S, output bucket, sampling settings): the prompts run
    into a cache of S positions (prefill), then a `lax.while_loop` feeds back one token per step (decode).

    Raises ModelError before any compute for bad arguments and for a prompt + max_new_tokens over the model's
    `config.max_position_embeddings` (`check_context`).
    """
    req = _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p, eos_id, buckets)
    graphdef, state = nnx.split(model)
    out_len = bucket_length(max(req.limits)) if buckets else max(req.limits)
    out = _generate(graphdef, state, req.ids, req.lens, req.limit_array, key if temperature > 0 else None,
                    max_len=req.max_len, out_len=out_len, per_row=req.per_row, eos=req.eos, **req.sampling)
    out = np.asarray(out)[:, :max(req.limits)]  # on the host: no program per output length
    return jax.device_put(out[0] if req.single else out)


def lower_generate(model: nnx.Module, prompt_ids, max_new_tokens: Union[int, Sequence[int]], *,
                   key: Optional[jax.Array] = None, temperature: float = 0.0, top_k: Optional[int] = None,
                   top_p: Optional[float] = None, eos_id: Union[int, Sequence[int], None] = None,
                   buckets: bool = True) -> "jax.stages.Lowered":
    """The lowered program `generate` runs for these arguments (`.compile()` it for its `memory_analysis()` or
    `cost_analysis()`, `.as_text()` for its HLO)."""
    req = _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p, eos_id, buckets)
    graphdef, state = nnx.split(model)
    out_len = bucket_length(max(req.limits)) if buckets else max(req.limits)
    return _generate.lower(graphdef, state, req.ids, req.lens, req.limit_array, key if temperature > 0 else None,
                           max_len=req.max_len, out_len=out_len, per_row=req.per_row, eos=req.eos, **req.sampling)


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("max_len", "out_len", "per_row", "temperature", "top_k", "top_p", "eos"))
def _generate(graphdef, state, ids, lens, limits, key, *, max_len, out_len, per_row, temperature, top_k, top_p,
              eos):
    model = nnx.merge(graphdef, state)
    b = ids.shape[0]
    pad = eos[0] if eos else 0

    def pick(logits, i):
        k = None if key is None else jax.random.fold_in(key, i)
        return next_token(logits[:, -1], k, temperature, top_k, top_p)

    def finished(tok, i):
        hit = jnp.isin(tok, jnp.asarray(eos, jnp.int32)) if eos else jnp.zeros(tok.shape, bool)
        return hit | (i + 1 >= limits)

    tok, cache = _prefill_step(model, ids, lens, max_len, per_row, key, temperature, top_k, top_p)
    out = jnp.full((b, out_len), pad, jnp.int32).at[:, 0].set(tok)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < jnp.max(limits)) & ~jnp.all(done)

    def body(carry):
        i, tok, cache, out, done = carry
        logits, new = model(tok[:, None], cache, last_only=True)
        cache = _advance(new, cache, done, per_row)
        nxt = jnp.where(done, pad, pick(logits, i))
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        return i + 1, nxt, cache, out, done | finished(nxt, i)

    carry = (jnp.asarray(1, jnp.int32), tok, cache, out, finished(tok, 0))
    return jax.lax.while_loop(cond, body, carry)[3]


def _prefill_step(model, ids, lens, max_len, per_row, key, temperature, top_k, top_p):
    """The first token of each row and the cache after the (right-padded) prompts: every row starts at position 0,
    so the prompt runs with a scalar cache length; the length is then set to each row's own (`per_row`)."""
    b = ids.shape[0]
    logits, cache = model(ids, model.init_cache(b, max_len), logit_index=lens - 1)
    if per_row:
        cache = dataclasses.replace(cache, length=lens)
    k = None if key is None else jax.random.fold_in(key, 0)
    return next_token(logits[:, -1], k, temperature, top_k, top_p), cache


def _advance(new, old, done, per_row):
    """The cache after a decode step, where finished rows keep their length (their places are not written on)."""
    if not per_row:
        return new
    return dataclasses.replace(new, length=jnp.where(done, old.length, new.length))


def check_context(model: nnx.Module, prompt_len: int, max_new_tokens: int) -> None:
    """ModelError when a prompt of `prompt_len` tokens plus `max_new_tokens` does not fit the model's context
    (`model.config.max_position_embeddings`, where the model has one), with the numbers."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + max_new_tokens > limit:
        raise ModelError(f"generate: a prompt of {prompt_len} tokens with max_new_tokens={max_new_tokens} needs "
                         f"{prompt_len + max_new_tokens} positions, over the model's context of {limit} "
                         f"(max_position_embeddings); shorten the prompt to at most {max(limit - max_new_tokens, 0)} "
                         f"tokens or ask for at most {max(limit - prompt_len, 0)} new tokens")


@dataclasses.dataclass
class _Request:
    """A checked generation request: padded ids [B, T] int32, lengths [B], per-row limits, the cache size."""

    ids: jax.Array
    lens: jax.Array
    limits: Tuple[int, ...]
    limit_array: jax.Array
    max_len: int
    per_row: bool
    single: bool
    eos: Tuple[int, ...]
    sampling: dict


def _rows(prompt_ids) -> Tuple[List[np.ndarray], bool]:
    """The prompts as a list of 1-D integer arrays, and whether a single 1-D prompt was given."""
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not np.isscalar(prompt_ids[0]):
        rows = [np.asarray(r) for r in prompt_ids]
        single = False
    else:
        a = np.asarray(prompt_ids)
        single = a.ndim == 1
        rows = [a] if single else list(a) if a.ndim == 2 else [a]
    for r in rows:
        if r.ndim != 1 or not np.issubdtype(r.dtype, np.integer) or r.shape[0] < 1:
            raise ModelError(f"generate: expected prompt token ids [batch, time >= 1] (or a list of 1-D prompts) of "
                             f"an integer dtype, got shape {tuple(np.shape(prompt_ids))} dtype "
                             f"{np.asarray(r).dtype}")
    return rows, single


def _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p, eos_id, buckets=True) -> _Request:
    """The request after checking every argument (ModelError before any compute)."""
    rows, single = _rows(prompt_ids)
    counts = [max_new_tokens] * len(rows) if np.isscalar(max_new_tokens) else list(max_new_tokens)
    if len(counts) != len(rows):
        raise ModelError(f"generate: {len(counts)} max_new_tokens for {len(rows)} prompts")
    for m in counts:
        if isinstance(m, bool) or int(m) != m or m < 1:
            raise ModelError(f"generate: max_new_tokens must be a positive integer, got {m!r}")
    check_sampling(temperature, top_k, top_p)
    if temperature > 0 and key is None:
        raise ModelError("generate: temperature > 0 needs a key (jax.random.key(seed))")
    lens = [int(r.shape[0]) for r in rows]
    for t, m in zip(lens, counts):
        check_context(model, t, int(m))
    eos = () if eos_id is None else tuple(int(e) for e in ((eos_id,) if isinstance(eos_id, int) else eos_id))
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    per_row = not _dynamic_kv(model)
    if not per_row and len(set(lens)) > 1:
        raise ModelError(f"generate: a dynamic fp8 KV-cache scheme shares one scale per written block across the "
                         f"rows, so a batch must have prompts of one length; got lengths {sorted(set(lens))}: run "
                         f"them one at a time")
    t, s = plan_shapes(lens, counts, limit if isinstance(limit, int) else None, buckets and per_row)
    if not per_row and buckets:  # the prompt is not padded, the cache still is
        s = bucket_length(s, limit if isinstance(limit, int) else None)
    ids = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    sampling = dict(temperature=float(temperature), top_k=None if top_k is None else int(top_k),
                    top_p=None if top_p is None else float(top_p))
    return _Request(jnp.asarray(ids), jnp.asarray(lens, jnp.int32), tuple(int(m) for m in counts),
                    jnp.asarray(counts, jnp.int32), s, per_row, single, eos, sampling)


def supports_ragged(model: nnx.Module) -> bool:
    """Whether `model`'s KV cache keeps one length per row (ragged batches, `ContinuousBatch`): every cache but one
    quantized with a dynamic fp8 scheme, whose per-block scale is shared by the rows."""
    return not _dynamic_kv(model)


def _dynamic_kv(model) -> bool:
    """Whether `model` quantizes its KV cache with a dynamic (per written block) scheme."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return False
    first = layers.runs[0].layer if hasattr(layers, "runs") else (layers[0] if len(layers) else None)
    scheme = getattr(getattr(first, "self_attn", None), "kv_scheme", None)
    return bool(scheme is not None and scheme.dynamic)


class TokenStream:
    """`generate` one step at a time: iterating yields each step's new tokens (numpy, [B], or a scalar array for a
    1-D prompt) as soon as they are produced, for streaming and for timing prefill and decode apart.

    Takes `generate`'s arguments (ragged batches, per-row max_new_tokens, `buckets`). The steps are `generate`'s: a
    prefill program (the right-padded prompts into a cache of S positions, the first token chosen with
    `jax.random.fold_in(key, 0)`) and a decode program (one token per row through the cache, step i choosing with
    `fold_in(key, i)`), compiled once per (model graph, B, padded T, S, sampling settings) — `plan_shapes`' buckets,
    so other prompt lengths and max_new_tokens in the same buckets reuse them — and free of host callbacks, so
    JAX's persistent compilation cache keeps them. A finished row (it produced an eos id or its max_new_tokens) is
    given the pad (the first eos id, else 0) from then on and its cache row is not advanced; iteration ends once
    every row is finished.

    `compile()` lowers and compiles both programs ahead of time (iteration does it otherwise);
    `compile_seconds`, `prefill_seconds` and `decode_seconds` hold the wall time of each phase so far; `shapes`
    is (B, padded T, S).
    """

    def __init__(self, model: nnx.Module, prompt_ids, max_new_tokens: Union[int, Sequence[int]], *,
                 key: Optional[jax.Array] = None, temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, eos_id: Union[int, Sequence[int], None] = None, buckets: bool = True):
        self.req = _check(model, prompt_ids, max_new_tokens, key, temperature, top_k, top_p, eos_id, buckets)
        self.single, self.eos = self.req.single, self.req.eos
        self.max_new_tokens = max(self.req.limits)
        self.key = key if temperature > 0 else None
        self.graphdef, self.state = nnx.split(model)
        self._programs: Optional[Tuple] = None
        self.compile_seconds = self.prefill_seconds = self.decode_seconds = 0.0

    @property
    def shapes(self) -> Tuple[int, int, int]:
        return (int(self.req.ids.shape[0]), int(self.req.ids.shape[1]), self.req.max_len)

    def compile(self) -> "TokenStream":
        """Lowers and compiles the prefill and decode programs (once); returns self."""
        if self._programs is None:
            r = self.req
            t0 = time.perf_counter()
            pre = _prefill.lower(self.graphdef, self.state, r.ids, r.lens, self.key, max_len=r.max_len,
                                 per_row=r.per_row, **r.sampling).compile()
            # the decode program takes the prefill's outputs as they come out of it, layout (mesh) included
            tok, cache = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                      pre.out_info, pre.output_shardings)
            done = jax.ShapeDtypeStruct(tok.shape, jnp.bool_)
            dec = _decode.lower(self.graphdef, self.state, tok, cache, done, jnp.int32(1), self.key,
                                per_row=r.per_row, **r.sampling).compile()
            self._programs = (pre, dec)
            self.compile_seconds += time.perf_counter() - t0
        return self

    def __iter__(self) -> Iterator[np.ndarray]:
        pre, dec = self.compile()._programs
        r = self.req
        pad = self.eos[0] if self.eos else 0
        limits = np.asarray(r.limits)
        t0 = time.perf_counter()
        tok, cache = pre(self.state, r.ids, r.lens, self.key)
        host = np.asarray(tok)
        self.prefill_seconds += time.perf_counter() - t0
        done = np.isin(host, self.eos) | (limits <= 1)
        yield host[0] if self.single else host
        for i in range(1, self.max_new_tokens):
            if done.all():
                return
            t0 = time.perf_counter()
            tok, cache = dec(self.state, jnp.asarray(host), cache, jnp.asarray(done), jnp.int32(i), self.key)
            host = np.where(done, pad, np.asarray(tok)).astype(np.int32)
            self.decode_seconds += time.perf_counter() - t0
            done |= np.isin(host, self.eos) | (limits <= i + 1)
            yield host[0] if self.single else host


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("max_len", "per_row", "temperature", "top_k", "top_p"))
def _prefill(graphdef, state, ids, lens, key, *, max_len, per_row, temperature, top_k, top_p):
    model = nnx.merge(graphdef, state)
    return _prefill_step(model, ids, lens, max_len, per_row, key, temperature, top_k, top_p)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("per_row", "temperature", "top_k", "top_p"),
                   donate_argnames=("cache",))
def _decode(graphdef, state, tok, cache, done, i, key, *, per_row, temperature, top_k, top_p):
    model = nnx.merge(graphdef, state)
    logits, new = model(tok[:, None], cache, last_only=True)
    k = None if key is None else jax.random.fold_in(key, i)
    return next_token(logits[:, -1], k, temperature, top_k, top_p), _advance(new, cache, done, per_row)


class ContinuousBatch:
    """Many generation requests through up to `batch_size` rows of one decode program: when a row finishes (an eos
    id or its own max_new_tokens) the next pending request is prefilled into that row's cache (continuous batching
    inside a fixed batch shape); iterating yields (request index, its new tokens as numpy int32) as each request
    finishes.

    Refills: when more than half of the rows are free (the first fill, or many rows finishing at once) the next
    pending requests, one per free row, are prefilled together in one [batch_size, W] call (W: the largest
    `bucket_length` among them; unused rows compute padding and write nowhere); otherwise each request is prefilled
    alone, [1, bucket_length(its length)], as `generate` of that prompt alone does. Each request's cache rows then
    replace its row's (every position of the row, so nothing of the previous request is left) and the row's
    length is set to the request's (`KVCache.length` [B]).

    Shrinking (`shrink=True`): once no request is pending and at most half of the rows are live, the live rows'
    cache rows are gathered into a batch of the next power of two >= their count and decoding goes on there, so
    finished rows stop costing decode compute; each smaller batch is one more decode program to compile. Off by
    default: where a decode step costs about the same for 1 and 8 rows (reading the weights dominates, XLA:CPU) it
    saves row-steps, not time (BENCHMARKS.md).

    The decode step is `TokenStream`'s: every row at its own position, a finished or empty row masked (its length
    is not advanced, its token is the pad). So a request's greedy tokens are the ones it gets alone, whatever
    shares the batch (up to the float32 summation order of a one-row product against a several-row one, where the
    backend computes them differently: `qformats.models.decoder.scan.RowLinear`). Sampling (temperature > 0)
    chooses request r's first token with fold_in(fold_in(key, r), 0) and every decode step n (counted over the
    whole run, from 1) with fold_in(key, n) for the batch.

    Programs: prefills per (rows 1 or batch_size, prompt-length bucket) and a decode per batch size, all with the
    cache size S = `plan_shapes` over every request (so a long request sets S for all). `compile()` builds the
    one-row prefill of every bucket, the batch prefill of the first fill and the full-batch decode ahead; a program
    first needed later (a batch refill of another width, a shrunk decode) is compiled then, its time counted in
    `compile_seconds`. `compile_seconds`, `prefill_seconds`, `decode_seconds`, `prefill_tokens`, `decode_tokens`
    (real tokens of unfinished rows) and `decode_row_steps` (rows computed, live or not) hold the totals so far;
    `shapes` is (batch_size, S).

    Raises ModelError before any compute for bad arguments (`generate`'s checks, per request) and for a model whose
    KV cache cannot keep one length per row (a dynamic fp8 KV-cache scheme: run such requests with `generate`, one
    length per batch).
    """

    def __init__(self, model: nnx.Module, prompts: Sequence, max_new_tokens: Union[int, Sequence[int]], *,
                 batch_size: int, key: Optional[jax.Array] = None, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_id: Union[int, Sequence[int], None] = None, buckets: bool = True, shrink: bool = False):
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ModelError(f"ContinuousBatch: batch_size must be a positive integer, got {batch_size!r}")
        rows, _ = _rows(list(prompts) if not isinstance(prompts, np.ndarray) else prompts)
        req = _check(model, rows, max_new_tokens, key, temperature, top_k, top_p, eos_id, buckets)
        if not req.per_row:
            raise ModelError("ContinuousBatch: a dynamic fp8 KV-cache scheme shares one scale per written block "
                             "across the rows, so rows cannot hold requests at different positions; run the "
                             "requests with generate (prompts of one length per batch)")
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        limit = limit if isinstance(limit, int) else None
        self.rows = [r.astype(np.int32) for r in rows]
        self.limits = req.limits
        self.eos, self.sampling = req.eos, req.sampling
        self.key = key if temperature > 0 else None
        self.batch_size = min(int(batch_size), len(rows))
        self.shrink = bool(shrink)
        self.max_len = req.max_len
        self.widths = [bucket_length(len(r), limit) if buckets else len(r) for r in self.rows]
        self.graphdef, self.state = nnx.split(model)
        self._prefills: dict = {}
        self._decodes: dict = {}
        self._gathers: dict = {}
        self._cache_info = None
        self.compile_seconds = self.prefill_seconds = self.decode_seconds = 0.0
        self.prefill_tokens = self.decode_tokens = self.decode_row_steps = 0

    @property
    def shapes(self) -> Tuple[int, int]:
        return (self.batch_size, self.max_len)

    def _group(self, free: int, pending: int) -> int:
        """How many pending requests one refill call takes with `free` rows free: all that fit when more than half
        of the rows are free (one batch_size-row prefill), else one."""
        n = min(free, pending)
        return n if n > 1 and 2 * free > self.batch_size else min(n, 1)

    def _cache_spec(self, rows: int):
        """The batch cache with `rows` rows as shapes and layouts (what the programs take)."""
        def spec(x, sharding):
            shape = list(x.shape)
            shape[x.ndim - 4 if x.ndim >= 4 else 0] = rows  # a buffer's batch axis, or the lengths [B]
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=sharding)

        return jax.tree.map(spec, *self._cache_info)

    def _keys(self, requests: Sequence[int], rows: int):
        """Per prefill row the key of its request (fold_in(key, r)), padding rows repeating the first; None when
        greedy."""
        if self.key is None:
            return None
        ks = [jax.random.fold_in(self.key, r) for r in requests]
        return jnp.stack(ks + [ks[0]] * (rows - len(ks)))

    def _prefill_program(self, rows: int, width: int):
        if (rows, width) not in self._prefills:
            t0 = time.perf_counter()
            keys = self._keys([0] * rows, rows)
            self._prefills[rows, width] = _prefill_rows.lower(
                self.graphdef, self.state, self._cache_spec(self.batch_size),
                jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows,), jnp.int32), keys, **self.sampling).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._prefills[rows, width]

    def _decode_program(self, rows: int):
        if rows not in self._decodes:
            t0 = time.perf_counter()
            tok, done = jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.bool_)
            self._decodes[rows] = _decode.lower(self.graphdef, self.state, tok, self._cache_spec(rows), done,
                                                jnp.int32(1), self.key, per_row=True, **self.sampling).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._decodes[rows]

    def _gather_program(self, rows: int, into: int):
        if (rows, into) not in self._gathers:
            t0 = time.perf_counter()
            self._gathers[rows, into] = _gather_rows.lower(
                self._cache_spec(rows), jax.ShapeDtypeStruct((into,), jnp.int32)).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._gathers[rows, into]

    def compile(self) -> "ContinuousBatch":
        """Lowers and compiles the empty batch cache, the one-row prefill of every prompt-length bucket, the batch
        prefill of the first fill and the full-batch decode program (once); returns self."""
        if self._cache_info is None:
            t0 = time.perf_counter()
            self._empty = _empty_cache.lower(self.graphdef, self.state, self.batch_size, self.max_len).compile()
            # the programs take the cache as it comes out of the one before, layout (mesh) included
            self._cache_info = (self._empty.out_info, self._empty.output_shardings)
            self.compile_seconds += time.perf_counter() - t0
            first = self._group(self.batch_size, len(self.rows))
            if first > 1:
                self._prefill_program(self.batch_size, max(self.widths[:first]))
            for width in sorted(set(self.widths[first:] if first > 1 else self.widths)):
                self._prefill_program(1, width)
            self._decode_program(self.batch_size)
        return self

    def _finished(self, r: int, tokens: List[int]) -> bool:
        return tokens[-1] in self.eos or len(tokens) >= self.limits[r]

    def __iter__(self) -> Iterator[Tuple[int, np.ndarray]]:
        self.compile()
        b = self.batch_size
        pad = self.eos[0] if self.eos else 0
        pending = deque(range(len(self.rows)))
        slot: List[Optional[int]] = [None] * b
        out = {r: [] for r in range(len(self.rows))}
        tok = np.full((b,), pad, np.int32)
        cache = self._empty(self.state)
        step = 0
        while True:
            free = [s for s in range(b) if slot[s] is None]
            while free and pending:  # refill the free rows
                group = [pending.popleft() for _ in range(self._group(len(free), len(pending)))]
                rows = b if len(group) > 1 else 1
                width = max(self.widths[r] for r in group)
                ids = np.zeros((rows, width), np.int32)
                lens = np.ones((rows,), np.int32)
                where = np.full((rows,), b, np.int32)  # padding rows write out of bounds: dropped
                for i, r in enumerate(group):
                    ids[i, :len(self.rows[r])] = self.rows[r]
                    lens[i], where[i] = len(self.rows[r]), free[i]
                program = self._prefill_program(rows, width)
                t0 = time.perf_counter()
                first, cache = program(self.state, cache, jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(where),
                                       self._keys(group, rows))
                first = np.asarray(first)
                self.prefill_seconds += time.perf_counter() - t0
                for i, r in enumerate(group):
                    out[r].append(int(first[i]))
                    self.prefill_tokens += len(self.rows[r])
                    if self._finished(r, out[r]):
                        yield r, np.asarray(out.pop(r), np.int32)
                    else:
                        slot[free[i]], tok[free[i]] = r, out[r][-1]
                free = [s for s in range(b) if slot[s] is None]
            active = [s for s in range(b) if slot[s] is not None]
            if not active:
                return
            if self.shrink and not pending and 2 * len(active) <= b:  # compact the live rows into a smaller batch
                into = 1 << (len(active) - 1).bit_length()
                t0 = time.perf_counter()
                program = self._gather_program(b, into)
                keep = np.asarray(active + [active[0]] * (into - len(active)), np.int32)
                cache = program(cache, jnp.asarray(keep))
                tok = tok[keep]
                slot = [slot[s] for s in active] + [None] * (into - len(active))
                tok[len(active):] = pad
                b = into
                self.decode_seconds += time.perf_counter() - t0
                continue
            step += 1
            done = np.asarray([slot[s] is None for s in range(b)])
            program = self._decode_program(b)
            t0 = time.perf_counter()
            nxt, cache = program(self.state, jnp.asarray(tok), cache, jnp.asarray(done), jnp.int32(step), self.key)
            nxt = np.asarray(nxt)
            self.decode_seconds += time.perf_counter() - t0
            self.decode_tokens += len(active)
            self.decode_row_steps += b
            for s in active:
                r = slot[s]
                out[r].append(int(nxt[s]))
                tok[s] = nxt[s]
                if self._finished(r, out[r]):
                    yield r, np.asarray(out.pop(r), np.int32)
                    slot[s], tok[s] = None, pad


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _empty_cache(graphdef, state, batch, max_len):
    return nnx.merge(graphdef, state).init_cache(batch, max_len, per_row=True)


def _batch_axis(x) -> int:
    """The batch axis of a cache buffer: 0 of a per-layer [B, G, S, D], 1 of a stacked [L, B, G, S, D]."""
    return x.ndim - 4


@jax.jit
def _gather_rows(cache, keep):
    """The batch cache reduced to rows `keep` [m] (in that order): every buffer and the lengths."""
    return dataclasses.replace(cache, keys=tuple(jnp.take(k, keep, axis=_batch_axis(k)) for k in cache.keys),
                               values=tuple(jnp.take(v, keep, axis=_batch_axis(v)) for v in cache.values),
                               length=cache.length[keep])


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature", "top_k", "top_p"),
                   donate_argnames=("cache",))
def _prefill_rows(graphdef, state, cache, ids, lengths, rows, keys, *, temperature, top_k, top_p):
    """Prompts ids [n, T] (lengths [n] real tokens each) prefilled together into a fresh cache of the batch cache's
    size, their cache rows then written over rows `rows` [n] of the batch cache (batch axis: 0 of a per-layer
    buffer, 1 of a stacked one; a row index out of range writes nothing) with their lengths. Prompt i's first token
    is chosen with fold_in(keys[i], 0). Returns (the first tokens [n], the batch cache)."""
    model = nnx.merge(graphdef, state)
    n = ids.shape[0]
    logits, own = model(ids, model.init_cache(n, cache.max_len), logit_index=lengths - 1)
    if keys is None:
        first = next_token(logits[:, -1], None, temperature, top_k, top_p)
    else:
        first = jax.vmap(lambda lg, k: next_token(lg[None], jax.random.fold_in(k, 0), temperature, top_k,
                                                  top_p)[0])(logits[:, -1], keys)

    def put(big, small):
        index = (slice(None),) * _batch_axis(big) + (rows,)
        return big.at[index].set(small.astype(big.dtype), mode="drop")

    return first, dataclasses.replace(cache, keys=tuple(map(put, cache.keys, own.keys)),
                                      values=tuple(map(put, cache.values, own.values)),
                                      length=cache.length.at[rows].set(lengths, mode="drop"))
