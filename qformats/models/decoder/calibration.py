"""Calibration of the decoder family: the layer-by-layer driver and the AWQ / SmoothQuant mappings onto its modules.

The algorithms are pure functions in `qformats.algorithms` (weight searches, GPTQ, AWQ, SmoothQuant, shared
NVFP4 global scales, calibration batches); this module knows the decoder's module names and runs them on a
`CausalLM`, one decoder layer at a time.

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

Takes a `CausalLM` and token arrays, quantizes it in place; no file I/O (converters.pipelines.calibrate drives it).
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.algorithms import awq, smoothquant
from qformats.algorithms.gptq import GPTQOptions
from qformats.algorithms.sequential import Batches, input_groups, make_batches
from qformats.algorithms.shared_scales import fused_global_scales
from qformats.algorithms.weight_search import RTN, quantize_group, search_name
from qformats.errors import ModelError
from qformats.kv_cache import KVCacheScheme, amax_of, scale_from_amax
from qformats.models.decoder import CausalLM, attention_mask, enable_kv_cache_quantization, inv_freq, rope_tables
from qformats.matching import resolve_scheme
from qformats.nn import CalibStat, QLinear
from qformats.plan import check_fits
from qformats.observers import get_observer
from qformats.schemes import SchemeSet

__all__ = ["PROJECTIONS", "AWQ_MAPPINGS", "AWQMapping", "SMOOTHQUANT_MAPPINGS", "calibrate_decoder", "awq_transform",
           "smoothquant_transform"]

PROJECTIONS = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
               "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
"""The seven projections of a decoder layer, by path relative to the layer (HF's module names)."""
PROPAGATE = ("quantized", "float")
SHAPE_COST_PARAMS = 20_000_000_000
"""`calibrate_decoder`'s default shape_cost numerator: the cost of compiling the layer passes for one more batch
shape, as token positions times (layers * parameters per layer) run through them (measured on XLA:CPU, SmolLM2-135M:
~1.7 CPU s per shape, ~0.28 ms per position per layer of 3.3M parameters)."""


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
    """The submodule at `rel` ("self_attn/q_proj", "input_layernorm"), a path relative to the layer."""
    m = layer
    for part in rel.split("/"):
        m = getattr(m, part)
    return m


def _set(layer, rel: str, new) -> None:
    *head, last = rel.split("/")
    setattr(_get(layer, "/".join(head)) if head else layer, last, new)


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


@nnx.jit
def _embed(model, ids):
    return model.model.embed_tokens(ids)


_OBSERVERS: Dict = {}


def _observer(scheme):
    """One minmax observer per scheme: the calibrating layers of every decoder layer then share one graph (an
    observer is a static attribute, compared by identity), so the calibration pass compiles once."""
    if scheme not in _OBSERVERS:
        _OBSERVERS[scheme] = get_observer("minmax", scheme)
    return _OBSERVERS[scheme]


def _layer_inputs(config, t: int, window):
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(positions, inv_freq(config), config.rope.attention_scaling)
    return cos, sin, attention_mask(positions, t, window)


def calibrate_decoder(model: CausalLM, samples, scheme, *, weight_search: str = "gptq",
                      gptq: GPTQOptions = GPTQOptions(), propagate: str = "quantized", guard: bool = True,
                      transform: Optional[Callable] = None, kv_cache: Optional[KVCacheScheme] = None,
                      tokens_per_batch: int = 2048, bucket: int = 32, max_padding: float = 0.125,
                      shape_cost: Optional[int] = None,
                      embed: Optional[Callable] = None, load_layer: Optional[Callable] = None,
                      store_layer: Optional[Callable] = None, between_phases: Optional[Callable[[], None]] = None,
                      timings: Optional[Dict[str, float]] = None, log: Callable[[str], None] = lambda m: None) -> dict:
    """Quantize the seven projections of every decoder layer of `model` in place, layer by layer (module docstring).

    Args:
      model: a float `CausalLM` (its projections nnx.Linear; lm_head and embeddings stay dense).
      samples: calibration token arrays (a list of 1-D int arrays, e.g. `converters.evaluation.calibration_data`), or Batches.
      scheme: a scheme string ("W4A16:g64", ...) or SchemeSet for every projection.
      weight_search: "rtn", "mse", "gptq" or "mse+gptq" (`qformats.algorithms.weight_search.quantize_projection`).
      gptq: GPTQ's options (llm-compressor 0.14's defaults).
      propagate: "quantized" (layer i+1 calibrates on layer i's outputs with its quantized weights: llm-compressor's
        default) or "float" (on the float outputs: then the result equals `quantize_model` on the whole model).
      guard: keep round-to-nearest for a projection where the search does not lower tr(dW^T H dW).
      transform: optional `transform(layer, index, xs, valid, layer_inputs)` run on the float layer before its
        calibration pass (e.g. `smoothquant_transform` folding scales into the layer): `xs`
        the layer's input batches [B, T, d], `valid` their [B, T] real-token masks, `layer_inputs(T) -> (cos,
        sin, mask)` the layer's other arguments.
      kv_cache: quantize the KV cache too (`qformats.kv_cache`): static scales k_scale = max|keys| / 448 (per
        tensor or per KV head) over the real tokens of every layer's calibration pass, i.e. from that layer's
        float projections fed by the propagated (quantized-weight) outputs of the layers below, as
        llm-compressor 0.14 observes them; a dynamic scheme is enabled as is.
      tokens_per_batch, bucket, max_padding, shape_cost: batching (`make_batches`). shape_cost None: the
        layer passes' compilation cost in token positions, SHAPE_COST_PARAMS / (layers * parameters per layer)
        (one [B, T] shape's two compilations cost about what running that many positions through every layer
        does: measured on SmolLM2, ~200 positions); 0: bucket merging by max_padding only. A layer pass's temporaries grow with the
        batch ([B, heads, T, T] attention scores, [B, T, intermediate] MLP activations): 2048 tokens a batch keep
        them to a few tens of MiB on SmolLM2-sized layers.
      embed, load_layer, store_layer: streaming (the model need not be resident: `converters.pipelines.calibrate` reads
        one layer at a time from the checkpoint and writes it out when done). `embed(ids)` -> [B, T, d]
        embeddings of a batch's token ids (default: the model's embed_tokens); `load_layer(i, layer)` fills
        layer i's parameters just before its turn; `store_layer(i, layer)` receives layer i once quantized
        and propagated (full module paths set), after which calibration never touches it again.
      between_phases: optional `between_phases()` called after each layer's calibration pass, the weight search of
        each of its input groups (q/k/v, o, gate/up, down) and its propagation (e.g.
        `converters.process.trim_malloc`: the temporaries of one phase, its first compilation included, handed back
        before the next).
      timings: optional dict; the wall seconds of each phase are added to it under "embed", "load layer",
        "transform", "calibration pass", "weight search", "propagation", "store layer", and the process's CPU
        seconds under the same name + " cpu" (compilations included: each phase waits for its results before
        the clock is read, so the figures add up to the call's time).
      log: progress messages.

    Returns {"layers": L, "searched": projections whose search won, "projections": 7 L, "tokens": n}.

    Raises:
      ModelError: a scheme that does not fit a projection, a bad weight_search / propagate, no samples, or a
        model whose projections are already quantized. Static activation scales (W8A8 static, FP8 static)
        come from each projection's minmax observer over the real tokens of the calibration pass (NVFP4's input
        global scale = 448 * 6 / max|x|, compressed-tensors' generate_gparam).
    """
    if model.config.mla is not None:
        raise ModelError(f"calibrate_decoder: the {model.config.model_type} model's multi-head latent attention "
                         "projections are not calibrated by this driver yet; quantize it data-free "
                         "(qformats.nn.quantize_model)")
    if model.config.moe is not None:
        raise ModelError(f"calibrate_decoder: layer-by-layer calibration of mixture-of-experts decoders "
                         f"({model.config.model_type}) is not supported yet; quantize them round-to-nearest "
                         "(qformats.nn.quantize_model with quantization_rules)")
    weight_search = search_name(weight_search)
    if propagate not in PROPAGATE:
        raise ModelError(f"calibrate_decoder: propagate must be one of {PROPAGATE}, got {propagate!r}")
    ss = resolve_scheme(scheme)
    if ss is None or ss.weights is None:
        raise ModelError(f"calibrate_decoder: scheme {scheme!r} quantizes no weights")
    if shape_cost is None:
        per_layer = sum(int(np.prod(_get(model.model.layers[0], rel).kernel.get_value().shape)) for rel in PROJECTIONS)
        shape_cost = SHAPE_COST_PARAMS // max(1, len(model.model.layers) * per_layer)
    batches = samples if isinstance(samples, Batches) else make_batches(samples, tokens_per_batch=tokens_per_batch,
                                                                      bucket=bucket, max_padding=max_padding,
                                                                      shape_cost=shape_cost)
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

    clock = _Clock(timings)
    xs = [_embed(model, jnp.asarray(ids)) if embed is None else jnp.asarray(embed(ids)) for ids in batches.ids]
    valid = [jnp.asarray(v) for v in batches.valid]
    clock("embed", xs)
    searched = 0
    groups = input_groups(PROJECTIONS)
    kv_static = kv_cache is not None and not kv_cache.dynamic
    kv_scales = []
    for i, layer in enumerate(layers):
        window = cfg.sliding_windows[i]
        if load_layer is not None:
            load_layer(i, layer)
            clock("load layer")
        if transform is not None:
            transform(layer, i, xs, valid, lambda t: layer_inputs(t, window))
            clock("transform", nnx.state(layer))
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
        clock("calibration pass", (nnx.state(layer), xs))
        if between_phases is not None:
            between_phases()
        shared = fused_global_scales(floats, ss.weights) if weight_search in (RTN, "gptq") else {}
        results = {}
        for group in groups:
            first = _get(layer, group[0]).inner
            total, _ = first.input_moments
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
                inner.finalize("ptq", q, method)  # static activation scales from the observer
            else:
                bias = inner.bias
                inner = QLinear(q, None if bias is None else bias.get_value(), ss, mode="ptq", dtype=inner.dtype,
                                path=rel)
            inner.weight_method = method
            searched += method != RTN
            _set(layer, rel, inner)
        clock("weight search", nnx.state(layer))
        if propagate == "quantized":
            _propagate(layer, xs, lambda t: layer_inputs(t, window))
            clock("propagation", xs)
            if between_phases is not None:
                between_phases()
        for rel in PROJECTIONS:  # full paths for messages and exports, now that layer i runs no more
            _get(layer, rel).path = f"model/layers/{i}/{rel}"
        if store_layer is not None:
            store_layer(i, layer)
            clock("store layer")
        log(f"layer {i + 1}/{len(layers)}: {weight_search}")
    if kv_cache is not None:
        enable_kv_cache_quantization(model, kv_cache, kv_scales if kv_static else None)
    return {"layers": len(layers), "searched": searched, "projections": len(layers) * len(PROJECTIONS),
            "tokens": batches.tokens}


class _Clock:
    """Adds the wall seconds since its last reading to `timings[phase]` and the process's CPU seconds (all threads)
    to `timings[phase + " cpu"]`, after waiting for `arrays`; a no-op when `timings` is None."""

    def __init__(self, timings: Optional[Dict[str, float]]):
        self.timings = timings
        self.t, self.c = time.perf_counter(), time.process_time()

    def __call__(self, phase: str, arrays=None) -> None:
        if self.timings is None:
            return
        if arrays is not None:
            jax.block_until_ready(arrays)
        now, cpu = time.perf_counter(), time.process_time()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.t
        self.timings[phase + " cpu"] = self.timings.get(phase + " cpu", 0.0) + cpu - self.c
        self.t, self.c = now, cpu


# ---- AWQ on the decoder's modules --------------------------------------------------------------------------
class AWQMapping(tuple):
    """(smooth, balances, parent): paths relative to a decoder layer ("self_attn/v_proj", "input_layernorm")."""

    __slots__ = ()

    def __new__(cls, smooth: str, balances: Tuple[str, ...], parent: str):
        return super().__new__(cls, (smooth, tuple(balances), parent))

    smooth = property(lambda self: self[0])
    balances = property(lambda self: self[1])
    parent = property(lambda self: self[2])


AWQ_MAPPINGS: Tuple[AWQMapping, ...] = (
    AWQMapping("input_layernorm", ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj"), "self_attn"),
    AWQMapping("self_attn/v_proj", ("self_attn/o_proj",), "self_attn/o_proj"),
    AWQMapping("post_attention_layernorm", ("mlp/gate_proj", "mlp/up_proj"), "mlp"),
    AWQMapping("mlp/up_proj", ("mlp/down_proj",), "mlp/down_proj"),
)
"""llm-compressor 0.14's AWQ default_mappings for the decoder family; the parent is the balance projections'
lowest common ancestor (the projection itself when there is one). v_proj -> o_proj is skipped when v_proj's outputs
differ from o_proj's inputs, as under GQA (llm-compressor's exact rule)."""


class _Tap(nnx.Module):
    """Passes its input to the wrapped module and hands it to `sink` (used inside one trace only)."""

    def __init__(self, inner, rel: str, sink: dict):
        self.inner = inner
        self.rel = rel
        self.sink = nnx.data(sink)

    def __call__(self, x):
        self.sink[self.rel] = x
        return self.inner(x)


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def _capture(graphdef, state, x, cos, sin, mask, taps):
    layer = nnx.merge(graphdef, state)
    seen: dict = {}
    for rel in taps:
        _set(layer, rel, _Tap(_get(layer, rel), rel, seen))
    layer(x, cos, sin, mask)
    return {rel: seen[rel] for rel in taps}


def _run_parent(layer, parent: str, x, cos, sin, mask):
    y = _get(layer, parent)(x, cos, sin, mask) if parent == "self_attn" else _get(layer, parent)(x)
    return y[0] if isinstance(y, tuple) else y


@functools.partial(jax.jit, static_argnames=("graphdef", "parent"))
def _parent_out(graphdef, state, x, cos, sin, mask, parent):
    return _run_parent(nnx.merge(graphdef, state), parent, x, cos, sin, mask)


@functools.partial(jax.jit, static_argnames=("graphdef", "parent", "balances"))
def _parent_sse(graphdef, state, kernels, x, cos, sin, mask, ref, valid, parent, balances):
    layer = nnx.merge(graphdef, state)
    for rel, k in zip(balances, kernels):
        _get(layer, rel).kernel.set_value(k)
    d = (_run_parent(layer, parent, x, cos, sin, mask) - ref).astype(jnp.float32)
    return jnp.sum(jnp.where(valid[..., None], d * d, 0.0))


def _kernel(lin):
    return lin.kernel.get_value()


def _awq_mappings(layer, index: int) -> List[AWQMapping]:
    """The mappings that apply to this layer: v_proj -> o_proj is dropped when v_proj's output size differs from
    o_proj's input size (llm-compressor's `_check_layers_are_compatible`)."""
    where = f"model/layers/{index}"
    for mod in ("self_attn", "mlp"):
        if getattr(_get(layer, mod), "rotations", None) is not None:
            raise ModelError(f"{where}/{mod}: AWQ cannot scale projections that carry online rotations")
    out = []
    for m in AWQ_MAPPINGS:
        for rel in (m.smooth,) + m.balances:
            try:
                mod = _get(layer, rel)
            except AttributeError:
                raise ModelError(f"{where}/{rel}: AWQ mapping {m.smooth} -> {', '.join(m.balances)} needs this "
                                 "module; the layer has none") from None
            if rel.endswith("_proj"):
                if type(mod) is not nnx.Linear:
                    raise ModelError(f"{where}/{rel}: AWQ scales a float nnx.Linear, found {type(mod).__name__}")
            elif not hasattr(mod, "weight") or mod.weight.get_value().ndim != 1:
                raise ModelError(f"{where}/{rel}: AWQ divides a norm's 1-D weight by its scales, found "
                                 f"{type(mod).__name__}")
        if m.smooth == "self_attn/v_proj":
            if _kernel(_get(layer, m.smooth)).shape[1] != _kernel(_get(layer, m.balances[0])).shape[0]:
                continue
        out.append(m)
    return out


def awq_transform(scheme, *, n_grid: int = 20, duo_scaling: awq.DuoScaling = True,
                  record: Optional[list] = None) -> Callable:
    """A `calibrate_decoder` transform: per decoder layer, one float pass over the calibration batches records each
    mapping's input (`AWQ_MAPPINGS`), then, mapping by mapping, the grid search (`qformats.algorithms.awq`) picks
    the scales s that minimise the parent's output error under the weight scheme's fake quantization, and s is
    folded into the smooth module (norm weight / s, or a linear's rows / s) and the balance projections
    (columns * s).

    Args:
      scheme: the weight scheme of the projections (a preset string such as "W4A16:g64", a SchemeSet or a
        QuantScheme), the one `calibrate_decoder` then quantizes with.
      n_grid, duo_scaling: llm-compressor's AWQModifier options (`qformats.algorithms.awq.grid`).
      record: optional list; one dict per applied mapping is appended ({"layer", "smooth", "balances", "ratio",
        "duo", "scales", "x_mean", "errors" (the loss at each grid point), "initial_error", "best_error"}).

    Raises:
      ModelError: a scheme without weights, duo scaling with per-tensor weights (llm-compressor refuses it), bad
        grid options; per layer (naming it): a missing or non-float module, online rotations, no finite loss.
    """
    ss = resolve_scheme(scheme)
    if ss is None or ss.weights is None:
        raise ModelError(f"AWQ: scheme {scheme!r} quantizes no weights; AWQ scales need a weight scheme")
    ws = ss.weights
    points = awq.grid(n_grid, duo_scaling)
    if duo_scaling is not False and ws.strategy == "tensor":
        raise ModelError(f"AWQ: duo_scaling needs per-channel, group or block weight scales, but {ss.name} has one "
                         "scale per tensor; pass duo_scaling=False")

    def transform(layer, index: int, xs, valid, layer_inputs) -> None:
        mappings = _awq_mappings(layer, index)
        taps = tuple(dict.fromkeys(m.balances[0] for m in mappings))
        graphdef, state = nnx.split(layer)
        extras = [layer_inputs(x.shape[1]) for x in xs]
        seen = [_capture(graphdef, state, x, *e, taps) for x, e in zip(xs, extras)]
        tokens = int(sum(int(np.sum(np.asarray(v))) for v in valid))
        for m in mappings:
            where = f"model/layers/{index}/{m.smooth}"
            inputs = [s[m.balances[0]] for s in seen]
            x_mean = awq.activation_means(inputs, valid)
            lins = [_get(layer, rel) for rel in m.balances]
            origs = [_kernel(lin) for lin in lins]
            w_mean = awq.weight_means(origs, ws, where) if duo_scaling is not False else None
            graphdef, state = nnx.split(layer)
            refs = [_parent_out(graphdef, state, x, *e, m.parent) for x, e in zip(inputs, extras)]
            count = tokens * int(refs[0].shape[-1])

            def loss(ks, m=m, graphdef=graphdef, state=state, inputs=inputs, refs=refs, count=count):
                sse = sum(float(_parent_sse(graphdef, state, ks, x, *e, r, v, m.parent, m.balances))
                          for x, e, r, v in zip(inputs, extras, refs, valid))
                return sse / count

            found = awq.search_scales(x_mean, w_mean, origs, ws, points, loss, where=where, parent=m.parent)
            best = found.scales
            for lin, k in zip(lins, origs):
                lin.kernel.set_value(awq.scale_rows(k, best))
            sm = _get(layer, m.smooth)
            if isinstance(sm, nnx.Linear):
                sm.kernel.set_value(awq.unscale_cols(_kernel(sm), best))
                if sm.bias is not None:
                    sm.bias.set_value(awq.unscale(sm.bias.get_value(), best))
            else:
                sm.weight.set_value(awq.unscale(sm.weight.get_value(), best))
            if record is not None:
                record.append({"layer": index, "smooth": m.smooth, "balances": m.balances, "ratio": found.ratio,
                               "duo": found.duo, "scales": np.asarray(best), "x_mean": x_mean,
                               "errors": found.errors, "initial_error": found.initial_error,
                               "best_error": found.best_error})

    return transform


# ---- SmoothQuant on the decoder's modules ------------------------------------------------------------------
SMOOTHQUANT_MAPPINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("input_layernorm", ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj")),
    ("post_attention_layernorm", ("mlp/gate_proj", "mlp/up_proj")),
)
"""(norm, projections reading its output) of a decoder layer: llm-compressor's DEFAULT_SMOOTHQUANT_MAPPINGS."""


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
    for norm, _ in SMOOTHQUANT_MAPPINGS:
        getattr(layer, norm).valid.set_value(valid)
    layer(x, cos, sin, mask)


def smoothquant_transform(alpha: float) -> Callable:
    """A `calibrate_decoder` transform: per decoder layer, one float pass over the calibration batches records each
    mapped norm's output range (`SMOOTHQUANT_MAPPINGS`), then the SmoothQuant factors
    (`qformats.algorithms.smoothquant.smoothing_scales`) are folded into the norm and its projections (float
    nnx.Linear kernels and the norm's weight: `smoothquant.fold_scales`)."""
    alpha = smoothquant.check_alpha(alpha)

    def transform(layer, index: int, xs, valid, layer_inputs) -> None:
        norms = {}
        for norm, _ in SMOOTHQUANT_MAPPINGS:
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
        for norm, projs in SMOOTHQUANT_MAPPINGS:
            lins = [_get(layer, p) for p in projs]
            for p, lin in zip(projs, lins):
                if not isinstance(lin, nnx.Linear):
                    raise ModelError(f"model/layers/{index}/{p}: SmoothQuant folds scales into a float nnx.Linear, "
                                     f"found {type(lin).__name__}")
            kernels = [lin.kernel.get_value() for lin in lins]
            s = smoothquant.smoothing_scales(ranges[norm], kernels, alpha)
            nw = norms[norm].weight
            w, folded = smoothquant.fold_scales(nw.get_value(), kernels, s)
            nw.set_value(w)
            for lin, k in zip(lins, folded):
                lin.kernel.set_value(k)

    return transform
