"""Layer-by-layer (sequential) calibration of the decoder family: GPTQ / MSE weight searches one decoder layer at a time.

As llm-compressor's sequential pipeline does it, with the decoder layer as the unit:

    x_0 = embed(ids)                                  (every calibration sample, padded into batches)
    for layer i = 0 .. L-1:
        [transforms: SmoothQuant / AWQ scales folded into the layer, from a float pass over x_i]
        calibration pass: layer_i(x_i) in float, recording H_p = E[x x^T] over real tokens for each projection p,
                          the range of each projection's input (static activation scales: NVFP4's input
                          global scale 448*6 / max|x|) and of the keys / values entering the cache (kv_cache)
        each projection p: W_p -> Q_p by the weight search with H_p (GPTQ, llm-compressor 0.14's arithmetic);
                          NVFP4 weight global scales shared by q/k/v and by gate/up (as vLLM fuses them)
        propagation pass: x_{i+1} = layer_i(x_i) with the quantized weights and float activations
                                                                                        (propagate="quantized")
                          or the calibration pass's float outputs                       (propagate="float")

This is llm-compressor 0.14's order: its sequential pipeline runs both passes under `DisableQuantization`, so
the calibration pass sees the layer in float and the propagation pass sees the weights GPTQ has written back
(fake-quantized) with activations, keys and values unquantized; its QuantizationModifier (round-to-nearest)
leaves the weights float until saving, which is propagate="float" here. Static activation ranges use its
NVFP4 input observer `static_minmax` (max |x| over every calibration token); the KV-cache ranges too (its own
default for `kv_cache_scheme` is the moving-average `minmax`, which depends on the sample order).

So only one layer's activations (its inputs and outputs for every sample) and its seven Hessians are alive at
once: peak memory grows with one layer, not with the model. Samples of different lengths are right-padded to
a bucket length and padding rows are zeroed at every projection's input, so they add nothing to H (causal
attention: a real position never sees a padded one, so the real tokens' activations are those of the
unpadded sample). Each layer's projections are built with paths relative to the layer, so every layer has
the same graph and each (batch, length) shape compiles once for the whole model.

Pure: takes a `CausalLM` and token arrays, quantizes it in place; no file I/O (converters.calibrate drives it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.fused import group_amax, shared_global_scale, sibling_groups
from qformats.gptq import DAMPENING_FRAC, gptq_quantize, gptq_quantize_shared
from qformats.kv_cache import KVCacheScheme, amax_of, scale_from_amax
from qformats.models.decoder import CausalLM, attention_mask, enable_kv_cache_quantization, inv_freq, rope_tables
from qformats.nn import CalibStat, QLinear, resolve_scheme
from qformats.nn.rules import check_fits
from qformats.nn.weight_search import RTN, output_error, search_name
from qformats.observers import get_observer, mse_quantize
from qformats.quantize import quantize
from qformats.schemes import SchemeSet

__all__ = ["PROJECTIONS", "GPTQOptions", "Batches", "calibrate_decoder", "fused_global_scales", "make_batches",
           "quantize_group", "quantize_projection"]

PROJECTIONS = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
               "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
"""The seven projections of a decoder layer, by path relative to the layer (HF's module names)."""
PROPAGATE = ("quantized", "float")


@dataclasses.dataclass(frozen=True)
class GPTQOptions:
    """llm-compressor 0.14 GPTQModifier's options: `block_size` (columns per lazy batch), `dampening_frac`
    (H += dampening_frac * mean(diag H) * I), `actorder` ("static", its alias "weight", or None: column order;
    "group" was removed from llm-compressor and is refused by `qformats.gptq`)."""

    block_size: int = 128
    dampening_frac: float = DAMPENING_FRAC
    actorder: Optional[str] = "static"


@dataclasses.dataclass(frozen=True)
class Batches:
    """Calibration samples padded into batches: `ids[b]` [B, T_b] int32, `valid[b]` [B, T_b] bool (True = a real
    token; real tokens come first in each row). `tokens` = the number of real tokens."""

    ids: Tuple[np.ndarray, ...]
    valid: Tuple[np.ndarray, ...]
    tokens: int


def make_batches(samples: Sequence[np.ndarray], *, tokens_per_batch: int = 8192, bucket: int = 32,
                 max_padding: float = 0.0) -> Batches:
    """Samples (1-D int token arrays) -> Batches: each sample right-padded (with id 0) to its bucket length
    T = bucket * ceil(len / bucket); samples of one bucket batched B = max(1, tokens_per_batch // T) rows at a
    time, in order, the last batch of a bucket filled with all-padding rows (so each bucket has one shape).

    `max_padding` > 0 merges buckets, shortest first, into the next longer one while the padding of all the
    batches stays <= max_padding * (real tokens): fewer shapes, so fewer compilations of the layer passes (each
    distinct [B, T] compiles once), for a little padded compute (masked out of every statistic)."""
    if not samples:
        raise ModelError("calibration needs at least one sample")
    if bucket < 1 or tokens_per_batch < 1:
        raise ModelError(f"make_batches: bucket and tokens_per_batch must be >= 1, got {bucket}, {tokens_per_batch}")
    groups: Dict[int, List[np.ndarray]] = {}
    for i, s in enumerate(samples):
        s = np.asarray(s)
        if s.ndim != 1 or s.size == 0 or not np.issubdtype(s.dtype, np.integer):
            raise ModelError(f"calibration sample {i}: expected a non-empty 1-D integer token array, got "
                             f"{s.dtype} of shape {s.shape}")
        groups.setdefault(bucket * -(-s.size // bucket), []).append(s)
    if max_padding > 0:
        real = sum(r.size for rows in groups.values() for r in rows)
        pad = sum(t * len(rows) for t, rows in groups.items()) - real
        lengths = sorted(groups)
        for short, long in zip(lengths, lengths[1:]):
            extra = (long - short) * len(groups[short])
            if pad + extra <= max_padding * real:
                pad += extra
                groups[long] = groups.pop(short) + groups[long]
    ids, valid = [], []
    for t in sorted(groups):
        rows = groups[t]
        b = max(1, min(len(rows), tokens_per_batch // t))
        for j in range(0, len(rows), b):
            chunk = rows[j:j + b]
            a = np.zeros((b, t), np.int32)
            v = np.zeros((b, t), bool)
            for r, s in enumerate(chunk):
                a[r, :s.size] = s
                v[r, :s.size] = True
            ids.append(a)
            valid.append(v)
    return Batches(tuple(ids), tuple(valid), int(sum(np.asarray(s).size for s in samples)))


class _Masked(nnx.Module):
    """Calibration wrapper of one projection: the calibrating QLinear inside sees its input with padding rows
    zeroed (`valid` is set before each batch), so they add nothing to its sum of x x^T or activation range."""

    def __init__(self, inner: QLinear):
        self.inner = inner
        self.valid = CalibStat(jnp.ones((1, 1), jnp.float32))

    def __call__(self, x):
        v = self.valid.get_value()
        return self.inner(x * v[..., None].astype(x.dtype))


def _get(layer, rel: str):
    a, b = rel.split("/")
    return getattr(getattr(layer, a), b)


def _set(layer, rel: str, new) -> None:
    a, b = rel.split("/")
    setattr(getattr(layer, a), b, new)


@functools.partial(nnx.jit, static_argnames=("keep_output",))
def _calibration_pass(layer, x, valid, cos, sin, mask, keep_output):
    """Runs the calibrating layer (its projections record their statistics); returns its output only with
    `keep_output`: otherwise XLA drops what no statistic needs (down_proj's product and the residual after it)."""
    for rel in PROJECTIONS:
        _get(layer, rel).valid.set_value(valid.astype(jnp.float32))
    out = layer(x, cos, sin, mask)[0]
    return out if keep_output else None


@functools.partial(nnx.jit, static_argnames=("kv_scheme", "keep_output"))
def _calibration_pass_kv(layer, x, valid, cos, sin, mask, kv_scheme, keep_output):
    """The calibration pass, plus max |state| of the keys / values this batch's real tokens put into the cache
    (shapes `kv_scheme.scale_shape`: per tensor or per KV head)."""
    for rel in PROJECTIONS:
        _get(layer, rel).valid.set_value(valid.astype(jnp.float32))
    out, (k, v) = layer(x, cos, sin, mask)
    real = valid[:, None, :, None]
    amax = tuple(amax_of(jnp.where(real, s, jnp.zeros((), s.dtype)), kv_scheme) for s in (k, v))
    return (out if keep_output else None), amax


@nnx.jit
def _forward(layer, x, cos, sin, mask):
    return layer(x, cos, sin, mask)[0]


def _propagate(layer, xs, layer_inputs) -> None:
    """Replaces each batch of `xs` by the layer's output with the quantized weights and float activations (each
    projection runs with its weight scheme alone while propagating: llm-compressor's propagation pass is under
    DisableQuantization, the weights GPTQ wrote back, unquantized inputs). In place, so a batch's input is freed
    as its output is made."""
    saved = {}
    for rel in PROJECTIONS:
        lin = _get(layer, rel)
        if lin.schemes.input_activations is not None or lin.schemes.output_activations is not None:
            saved[rel] = lin.schemes
            lin.schemes = SchemeSet(lin.schemes.name, lin.schemes.weights)
    try:
        for j in range(len(xs)):
            xs[j] = _forward(layer, xs[j], *layer_inputs(xs[j].shape[1]))
    finally:
        for rel, schemes in saved.items():
            _get(layer, rel).schemes = schemes


def fused_global_scales(kernels: Dict[str, jax.Array], scheme) -> Dict[str, jax.Array]:
    """projection (path relative to the layer) -> the NVFP4 (tensor_group) weight global scale its fused group
    shares (`qformats.fused`: q/k/v_proj, gate/up_proj; g = 448 * 6 / max over the group of max |W|, as
    llm-compressor 0.14's fused weight observers give it). {} for other strategies."""
    if scheme.strategy != "tensor_group":
        return {}
    out = {}
    for group in sibling_groups(list(kernels), sep="/"):
        g = shared_global_scale(group_amax([kernels[r] for r in group]), scheme, kernels[group[0]].dtype)
        out.update((r, g) for r in group)
    return out


@nnx.jit
def _embed(model, ids):
    return model.model.embed_tokens(ids)


_quantize_jit = jax.jit(quantize, static_argnames=("scheme", "axis"))
_OBSERVERS: Dict = {}


def _observer(scheme):
    """One minmax observer per scheme: the calibrating layers of every decoder layer then share one graph (an
    observer is a static attribute, compared by identity), so the calibration pass compiles once."""
    if scheme not in _OBSERVERS:
        _OBSERVERS[scheme] = get_observer("minmax", scheme)
    return _OBSERVERS[scheme]


def quantize_projection(w, schemes: SchemeSet, h, weight_search: str, gptq: GPTQOptions = GPTQOptions(),
                        guard: bool = True, global_scale=None):
    """(QArray, method): the kernel `w` [K, N] quantized along K by `weight_search` for input moments `h` [K, K]:

      "rtn": quantize(w); "mse": observers.mse_quantize with importance diag(H);
      "gptq": gptq_quantize(w, H, block_size, dampening_frac, actorder) on round-to-nearest scales;
      "mse+gptq": the same on the MSE search's scales.

    `global_scale`: an NVFP4 weight global scale to use instead of w's own (a fused group's, `fused_global_scales`)
    for "rtn" and "gptq"; the MSE searches keep w's own.

    With `guard`, the search's result is kept only when its output error tr(dW^T H dW) is below
    round-to-nearest's (method "rtn" otherwise), as `qformats.nn.quantize_model` does per layer.
    """
    ws = schemes.weights
    rtn = _quantize_jit(w, ws, 0) if global_scale is None else _quantize_jit(w, ws, 0, global_scale=global_scale)
    if weight_search == RTN or h is None:
        return rtn, RTN
    diag = jnp.diagonal(h)
    if weight_search == "mse":
        q = mse_quantize(w, ws, 0, importance=diag)
    else:
        qp = mse_quantize(w, ws, 0, importance=diag) if weight_search == "mse+gptq" else \
            (None if global_scale is None else rtn)
        q = gptq_quantize(w, ws, h, block_size=gptq.block_size, dampening_frac=gptq.dampening_frac,
                          actorder=gptq.actorder, qparams=qp)
    if guard and not output_error(q, w, h) < output_error(rtn, w, h):
        return rtn, RTN
    return q, weight_search


def quantize_group(kernels: Dict[str, jax.Array], schemes: SchemeSet, h, weight_search: str,
                   gptq: GPTQOptions = GPTQOptions(), guard: bool = True,
                   global_scales: Optional[Dict[str, jax.Array]] = None) -> Dict[str, Tuple]:
    """name -> (QArray, method) for projections that read the same input (one H, e.g. q/k/v or gate/up):
    `quantize_projection` of each, except that the GPTQ searches run as one problem
    (`qformats.gptq.gptq_quantize_shared`: the same codes, one column loop for the group)."""
    global_scales = global_scales or {}
    if weight_search not in ("gptq", "mse+gptq") or h is None or len(kernels) == 1:
        return {r: quantize_projection(w, schemes, h, weight_search, gptq, guard, global_scales.get(r))
                for r, w in kernels.items()}
    ws = schemes.weights
    rtn, qps = {}, []
    diag = jnp.diagonal(h)
    for r, w in kernels.items():
        g = global_scales.get(r)
        rtn[r] = _quantize_jit(w, ws, 0) if g is None else _quantize_jit(w, ws, 0, global_scale=g)
        qps.append(mse_quantize(w, ws, 0, importance=diag) if weight_search == "mse+gptq" else
                   (None if g is None else rtn[r]))
    qs = gptq_quantize_shared(list(kernels.values()), ws, h, block_size=gptq.block_size,
                              dampening_frac=gptq.dampening_frac, actorder=gptq.actorder, qparams=qps)
    out = {}
    for (r, w), q in zip(kernels.items(), qs):
        if guard and not output_error(q, w, h) < output_error(rtn[r], w, h):
            out[r] = (rtn[r], RTN)
        else:
            out[r] = (q, weight_search)
    return out


def _input_groups() -> List[Tuple[str, ...]]:
    """The projections of a decoder layer grouped by the input they read: q/k/v (the input norm's output),
    o_proj, gate/up (the post-attention norm's output), down_proj, in PROJECTIONS order of first member."""
    fused = {g[0]: g for g in sibling_groups(PROJECTIONS, sep="/")}
    member = {r for g in fused.values() for r in g}
    return [fused.get(r, (r,)) for r in PROJECTIONS if r in fused or r not in member]


def _layer_inputs(config, t: int, window):
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(positions, inv_freq(config))
    return cos, sin, attention_mask(positions, t, window)


def calibrate_decoder(model: CausalLM, samples, scheme, *, weight_search: str = "gptq",
                      gptq: GPTQOptions = GPTQOptions(), propagate: str = "quantized", guard: bool = True,
                      transform: Optional[Callable] = None, kv_cache: Optional[KVCacheScheme] = None,
                      tokens_per_batch: int = 2048, bucket: int = 32, max_padding: float = 0.125,
                      embed: Optional[Callable] = None, load_layer: Optional[Callable] = None,
                      store_layer: Optional[Callable] = None, between_phases: Optional[Callable[[], None]] = None,
                      log: Callable[[str], None] = lambda m: None) -> dict:
    """Quantize the seven projections of every decoder layer of `model` in place, layer by layer (module docstring).

    Args:
      model: a float `CausalLM` (its projections nnx.Linear; lm_head and embeddings stay dense).
      samples: calibration token arrays (a list of 1-D int arrays, e.g. `converters.calibration_data`), or Batches.
      scheme: a scheme string ("W4A16:g64", ...) or SchemeSet for every projection.
      weight_search: "rtn", "mse", "gptq" or "mse+gptq" (`quantize_projection`).
      gptq: GPTQ's options (llm-compressor 0.14's defaults).
      propagate: "quantized" (layer i+1 calibrates on layer i's outputs with its quantized weights: llm-compressor's
        default) or "float" (on the float outputs: then the result equals `quantize_model` on the whole model).
      guard: keep round-to-nearest for a projection where the search does not lower tr(dW^T H dW).
      transform: optional `transform(layer, index, xs, valid, layer_inputs)` run on the float layer before its
        calibration pass (e.g. `qformats.smoothquant.smoothquant_transform` folding scales into the layer): `xs`
        the layer's input batches [B, T, d], `valid` their [B, T] real-token masks, `layer_inputs(T) -> (cos,
        sin, mask)` the layer's other arguments.
      kv_cache: quantize the KV cache too (`qformats.kv_cache`): static scales k_scale = max|keys| / 448 (per
        tensor or per KV head) over the real tokens of every layer's calibration pass, i.e. from that layer's
        float projections fed by the propagated (quantized-weight) outputs of the layers below, as
        llm-compressor 0.14 observes them; a dynamic scheme is enabled as is.
      tokens_per_batch, bucket, max_padding: batching (`make_batches`). A layer pass's temporaries grow with the
        batch ([B, heads, T, T] attention scores, [B, T, intermediate] MLP activations): 2048 tokens a batch keep
        them to a few tens of MiB on SmolLM2-sized layers.
      embed, load_layer, store_layer: streaming (the model need not be resident: `converters.calibrate` reads
        one layer at a time from the checkpoint and writes it out when done). `embed(ids)` -> [B, T, d]
        embeddings of a batch's token ids (default: the model's embed_tokens); `load_layer(i, layer)` fills
        layer i's parameters just before its turn; `store_layer(i, layer)` receives layer i once quantized
        and propagated (full module paths set), after which calibration never touches it again.
      between_phases: optional `between_phases()` called after each layer's calibration pass, the weight search of
        each of its input groups (q/k/v, o, gate/up, down) and its propagation (e.g.
        `converters.calibrate.trim_malloc`: the temporaries of one phase, its first compilation included, handed
        back before the next).
      log: progress messages.

    Returns {"layers": L, "searched": projections whose search won, "projections": 7 L, "tokens": n}.

    Raises:
      ModelError: a scheme that does not fit a projection, a bad weight_search / propagate, no samples, or a
        model whose projections are already quantized. Static activation scales (W8A8 static, FP8 static)
        come from each projection's minmax observer over the real tokens of the calibration pass (NVFP4's input
        global scale = 448 * 6 / max|x|, compressed-tensors' generate_gparam).
    """
    weight_search = search_name(weight_search)
    if propagate not in PROPAGATE:
        raise ModelError(f"calibrate_decoder: propagate must be one of {PROPAGATE}, got {propagate!r}")
    ss = resolve_scheme(scheme)
    if ss is None or ss.weights is None:
        raise ModelError(f"calibrate_decoder: scheme {scheme!r} quantizes no weights")
    batches = samples if isinstance(samples, Batches) else make_batches(samples, tokens_per_batch=tokens_per_batch,
                                                                      bucket=bucket, max_padding=max_padding)
    cfg = model.config
    layers = model.model.layers
    fits = []
    for i, layer in enumerate(layers):
        for rel in PROJECTIONS:
            lin = _get(layer, rel)
            if type(lin) is not nnx.Linear:
                raise ModelError(f"model/layers/{i}/{rel}: expected a float nnx.Linear to calibrate, found "
                                 f"{type(lin).__name__}")
            fits.append((f"model/layers/{i}/{rel}", int(lin.kernel.get_value().shape[0]), ss))
    a = ss.input_activations
    static = a is not None and a.dynamic is not True
    check_fits(fits, static_acts=static)

    tables = {}

    def layer_inputs(t: int, window):
        if (t, window) not in tables:
            tables[(t, window)] = _layer_inputs(cfg, t, window)
        return tables[(t, window)]

    xs = [_embed(model, jnp.asarray(ids)) if embed is None else jnp.asarray(embed(ids)) for ids in batches.ids]
    valid = [jnp.asarray(v) for v in batches.valid]
    searched = 0
    groups = _input_groups()
    kv_static = kv_cache is not None and not kv_cache.dynamic
    kv_scales = []
    for i, layer in enumerate(layers):
        window = cfg.sliding_windows[i]
        if load_layer is not None:
            load_layer(i, layer)
        if transform is not None:
            transform(layer, i, xs, valid, lambda t: layer_inputs(t, window))
        floats = {}
        for group in groups:
            for rel in group:
                lin = _get(layer, rel)
                floats[rel] = lin.kernel.get_value()
                obs = _observer(a if a is not None else ss.weights)
                cal = QLinear.from_module(lin, ss, mode="calibrate", path=rel, observer=obs,
                                          full_moments=weight_search != RTN and rel == group[0])
                # the group's members read the same input: its first member records H and the input range
                cal.record_inputs = rel == group[0]
                _set(layer, rel, _Masked(cal))
        # the calibration pass's outputs are the next layer's inputs only with float propagation; otherwise
        # the propagation pass makes them, and this pass keeps none (nor computes what only they need)
        keep = propagate == "float"
        amax = None
        for j, (x, v) in enumerate(zip(xs, valid)):
            args = (layer, x, v, *layer_inputs(x.shape[1], window))
            if kv_static:
                out, cur = _calibration_pass_kv(*args, kv_cache, keep)
                amax = cur if amax is None else tuple(jnp.maximum(a, c) for a, c in zip(amax, cur))
            else:
                out = _calibration_pass(*args, keep)
            if keep:
                xs[j] = out
        if kv_static:
            kv_scales.append(tuple(scale_from_amax(a) for a in amax))
        if between_phases is not None:
            between_phases()
        shared = fused_global_scales(floats, ss.weights) if weight_search in (RTN, "gptq") else {}
        results = {}
        for group in groups:
            first = _get(layer, group[0]).inner
            total, _ = first.calib_sq.get_value()
            h = total / batches.tokens if total.ndim == 2 else None
            results.update(quantize_group({r: floats[r] for r in group}, ss, h, weight_search, gptq, guard, shared))
            for rel in group[1:]:  # the input range the first member observed is theirs too
                _get(layer, rel).inner.calib_amax.set_value(first.calib_amax.get_value())
            del h
            if between_phases is not None:
                between_phases()
        for rel in PROJECTIONS:
            inner = _get(layer, rel).inner
            q, method = results[rel]
            if static:
                inner.finalize("ptq", weight_search=RTN)  # static activation scales from the observer
                inner.set_weight(q)
            else:
                bias = inner.bias
                inner = QLinear(q, None if bias is None else bias.get_value(), ss, mode="ptq", dtype=inner.dtype,
                                path=rel)
            inner.weight_method = method
            searched += method != RTN
            _set(layer, rel, inner)
        if propagate == "quantized":
            _propagate(layer, xs, lambda t: layer_inputs(t, window))
            if between_phases is not None:
                between_phases()
        for rel in PROJECTIONS:  # full paths for messages and exports, now that layer i runs no more
            _get(layer, rel).path = f"model/layers/{i}/{rel}"
        if store_layer is not None:
            store_layer(i, layer)
        log(f"layer {i + 1}/{len(layers)}: {weight_search}")
    if kv_cache is not None:
        enable_kv_cache_quantization(model, kv_cache, kv_scales if kv_static else None)
    return {"layers": len(layers), "searched": searched, "projections": len(layers) * len(PROJECTIONS),
            "tokens": batches.tokens}
