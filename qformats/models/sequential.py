"""Layer-by-layer (sequential) calibration of the decoder family: GPTQ / MSE weight searches one decoder layer at a time.

As llm-compressor's sequential pipeline does it, with the decoder layer as the unit:

    x_0 = embed(ids)                                  (every calibration sample, padded into batches)
    for layer i = 0 .. L-1:
        [transforms: SmoothQuant / AWQ scales folded into the layer, from a float pass over x_i]
        calibration pass: layer_i(x_i) in float, recording H_p = E[x x^T] over real tokens for each projection p
        each projection p: W_p -> Q_p by the weight search with H_p (GPTQ, llm-compressor 0.14's arithmetic)
        propagation pass: x_{i+1} = layer_i(x_i) with the quantized projections      (propagate="quantized")
                          or the calibration pass's float outputs                       (propagate="float")

so only one layer's activations (its inputs and outputs for every sample) and its seven Hessians are alive at
once: peak memory grows with one layer, not with the model. Samples of different lengths are right-padded to
a bucket length and padding rows are zeroed at every projection's input, so they add nothing to H (causal
attention: a real position never sees a padded one, so the real tokens' activations are those of the
unpadded sample). Each layer's projections are built with paths relative to the layer, so every layer has
the same graph and each (batch, length) shape compiles once for the whole model.

Pure: takes a `CausalLM` and token arrays, quantizes it in place; no file I/O (converters.calibrate drives it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.gptq import gptq_quantize
from qformats.models.decoder import CausalLM, attention_mask, inv_freq, rope_tables
from qformats.nn import CalibStat, QLinear, resolve_scheme
from qformats.nn.rules import check_fits
from qformats.nn.weight_search import NEEDS_HESSIAN, RTN, output_error, search_name
from qformats.observers import get_observer, mse_quantize
from qformats.quantize import quantize
from qformats.schemes import SchemeSet

__all__ = ["PROJECTIONS", "GPTQOptions", "Batches", "make_batches", "calibrate_decoder", "quantize_projection"]

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
    dampening_frac: float = 0.01
    actorder: Optional[str] = "static"


@dataclasses.dataclass(frozen=True)
class Batches:
    """Calibration samples padded into batches: `ids[b]` [B, T_b] int32, `valid[b]` [B, T_b] bool (True = a real
    token; real tokens come first in each row). `tokens` = the number of real tokens."""

    ids: Tuple[np.ndarray, ...]
    valid: Tuple[np.ndarray, ...]
    tokens: int


def make_batches(samples: Sequence[np.ndarray], *, tokens_per_batch: int = 8192, bucket: int = 32) -> Batches:
    """Samples (1-D int token arrays) -> Batches: each sample right-padded (with id 0) to its bucket length
    T = bucket * ceil(len / bucket); samples of one bucket batched B = max(1, tokens_per_batch // T) rows at a
    time, in order, the last batch of a bucket filled with all-padding rows (so each bucket has one shape)."""
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


@nnx.jit
def _calibration_pass(layer, x, valid, cos, sin, mask):
    for rel in PROJECTIONS:
        _get(layer, rel).valid.set_value(valid.astype(jnp.float32))
    return layer(x, cos, sin, mask)[0]


@nnx.jit
def _forward(layer, x, cos, sin, mask):
    return layer(x, cos, sin, mask)[0]


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
                        guard: bool = True):
    """(QArray, method): the kernel `w` [K, N] quantized along K by `weight_search` for input moments `h` [K, K]:

      "rtn": quantize(w); "mse": observers.mse_quantize with importance diag(H);
      "gptq": gptq_quantize(w, H, block_size, dampening_frac, actorder) on round-to-nearest scales;
      "mse+gptq": the same on the MSE search's scales.

    With `guard`, the search's result is kept only when its output error tr(dW^T H dW) is below
    round-to-nearest's (method "rtn" otherwise), as `qformats.nn.quantize_model` does per layer.
    """
    ws = schemes.weights
    rtn = _quantize_jit(w, ws, 0)
    if weight_search == RTN or h is None:
        return rtn, RTN
    diag = jnp.diagonal(h)
    if weight_search == "mse":
        q = mse_quantize(w, ws, 0, importance=diag)
    else:
        qp = mse_quantize(w, ws, 0, importance=diag) if weight_search == "mse+gptq" else None
        q = gptq_quantize(w, ws, h, block_size=gptq.block_size, dampening_frac=gptq.dampening_frac,
                          actorder=gptq.actorder, qparams=qp)
    if guard and not output_error(q, w, h) < output_error(rtn, w, h):
        return rtn, RTN
    return q, weight_search


def _layer_inputs(config, t: int, window):
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(positions, inv_freq(config))
    return cos, sin, attention_mask(positions, t, window)


def calibrate_decoder(model: CausalLM, samples, scheme, *, weight_search: str = "gptq",
                      gptq: GPTQOptions = GPTQOptions(), propagate: str = "quantized", guard: bool = True,
                      transform: Optional[Callable] = None, tokens_per_batch: int = 8192, bucket: int = 32,
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
      tokens_per_batch, bucket: batching (`make_batches`).
      log: progress messages.

    Returns {"layers": L, "searched": projections whose search won, "projections": 7 L, "tokens": n}.

    Raises:
      ModelError: a scheme that does not fit a projection, a bad weight_search / propagate, no samples, or a
        model whose projections are already quantized. Static activation scales (W8A8 static, FP8 static)
        come from each projection's minmax observer over the real tokens of the calibration pass.
    """
    weight_search = search_name(weight_search)
    if propagate not in PROPAGATE:
        raise ModelError(f"calibrate_decoder: propagate must be one of {PROPAGATE}, got {propagate!r}")
    ss = resolve_scheme(scheme)
    if ss is None or ss.weights is None:
        raise ModelError(f"calibrate_decoder: scheme {scheme!r} quantizes no weights")
    batches = samples if isinstance(samples, Batches) else make_batches(samples, tokens_per_batch=tokens_per_batch,
                                                                      bucket=bucket)
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

    xs = [_embed(model, jnp.asarray(ids)) for ids in batches.ids]
    valid = [jnp.asarray(v) for v in batches.valid]
    searched = 0
    for i, layer in enumerate(layers):
        window = cfg.sliding_windows[i]
        if transform is not None:
            transform(layer, i, xs, valid, lambda t: layer_inputs(t, window))
        floats = {}
        for rel in PROJECTIONS:
            lin = _get(layer, rel)
            floats[rel] = lin.kernel.get_value()
            obs = _observer(a if a is not None else ss.weights)
            _set(layer, rel, _Masked(QLinear.from_module(lin, ss, mode="calibrate", path=rel, observer=obs,
                                                         full_moments=weight_search != RTN)))
        outs = [_calibration_pass(layer, x, v, *layer_inputs(x.shape[1], window)) for x, v in zip(xs, valid)]
        for rel in PROJECTIONS:
            inner = _get(layer, rel).inner
            total, _ = inner.calib_sq.get_value()
            h = total / batches.tokens if total.ndim == 2 else None
            q, method = quantize_projection(floats[rel], ss, h, weight_search, gptq, guard)
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
            outs = [_forward(layer, x, *layer_inputs(x.shape[1], window)) for x in xs]
        xs = outs
        log(f"layer {i + 1}/{len(layers)}: {weight_search}")
    for i, layer in enumerate(layers):  # full paths for messages and exports once the graphs are no longer shared
        for rel in PROJECTIONS:
            _get(layer, rel).path = f"model/layers/{i}/{rel}"
    return {"layers": len(layers), "searched": searched, "projections": len(layers) * len(PROJECTIONS),
            "tokens": batches.tokens}
