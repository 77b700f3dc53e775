"""AWQ (Lin et al., 2023): activation-aware per-channel weight scales chosen by a grid search, folded into the layer.

For each mapping (smooth module, balance projections reading its output, parent module whose output is compared)
of a decoder layer, with llm-compressor 0.14's arithmetic (`AWQModifier`, modifiers/transform/awq):

    MAPPINGS (the decoder family: llm-compressor's default_mappings)
      input_layernorm          -> q_proj, k_proj, v_proj     parent self_attn
      v_proj                   -> o_proj                     parent o_proj   (skipped when v_proj's outputs != o_proj's
                                                                              inputs, as under GQA: its exact rule)
      post_attention_layernorm -> gate_proj, up_proj         parent mlp
      up_proj                  -> down_proj                  parent down_proj

    x_mean_j = mean over calibration tokens of |X_tj|      (X: the balance projections' input, float32)
    w_mean_j = sum_p sum_o |W_p[o, j]| / (amax of W_p[o, j]'s quantization chunk + 1e-6) / sum_p N_p   (float64;
               torch layout W_p [N_p, K]; chunk: the row (channel), group_size elements (group, tensor_group),
               the whole tensor (tensor), a block)
    grid (duo_scaling=True, n_grid=20): (0, plain) then ratios r = i / (n_grid - 2), i = 0 .. n_grid - 2, duo;
               duo_scaling=False: r = i / (n_grid - 1), plain; "both": n = n_grid // 2, r = i / (n - 1), plain and duo
    s(r)     = max(x_mean^r / (w_mean^(1-r) + 1e-4), 1e-4)     (duo; x_mean^r in float32, the rest float64)
             = max(x_mean^r, 1e-4)                              (plain; float32)
    s       <- s / sqrt(max(s) min(s));   s_j <- 1 where s_j is inf or nan
    loss(r)  = sum over tokens and outputs of (parent(X; W_p <- Q(W_p diag(s)) diag(s)^-1) - parent(X))^2 / count
    best     = the first r of the grid with the smallest finite loss (strict <)

where Q is the weight scheme's round-to-nearest fake quantization (min-max scales of W diag(s), as llm-compressor's
memoryless_minmax observer), W diag(s) and Q(.) diag(s)^-1 are formed in the scales' dtype and rounded to the
weight's. The chosen s is folded so the float model's function is unchanged:

    W_p[:, j] <- W_p[:, j] * s_j        (every balance projection; a Flax kernel's row j)
    norm.weight <- norm.weight / s      (a norm smooth module)   or   W_smooth[j, :] <- W_smooth[j, :] / s_j,
                                                                      b_smooth <- b_smooth / s (a linear one)

so the result is an ordinary float checkpoint whose projections then go through the weight search (RTN by
default, GPTQ, ...). arXiv:2306.00978. Tensor-group (NVFP4) weights take a global scale per projection here (as
`qformats.models.sequential` quantizes them), where llm-compressor shares it among q/k/v and gate/up.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.nn import resolve_scheme
from qformats.quantize import dequantize, quantize
from qformats.schemes import QuantScheme

__all__ = ["MAPPINGS", "Mapping", "grid", "weight_means", "activation_means", "candidate_scales",
           "fake_quantize_scaled", "awq_transform"]


class Mapping(tuple):
    """(smooth, balances, parent): paths relative to a decoder layer ("self_attn/v_proj", "input_layernorm")."""

    __slots__ = ()

    def __new__(cls, smooth: str, balances: Tuple[str, ...], parent: str):
        return super().__new__(cls, (smooth, tuple(balances), parent))

    smooth = property(lambda self: self[0])
    balances = property(lambda self: self[1])
    parent = property(lambda self: self[2])


MAPPINGS: Tuple[Mapping, ...] = (
    Mapping("input_layernorm", ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj"), "self_attn"),
    Mapping("self_attn/v_proj", ("self_attn/o_proj",), "self_attn/o_proj"),
    Mapping("post_attention_layernorm", ("mlp/gate_proj", "mlp/up_proj"), "mlp"),
    Mapping("mlp/up_proj", ("mlp/down_proj",), "mlp/down_proj"),
)
"""llm-compressor 0.14's AWQ default_mappings for the decoder family; the parent is the balance projections'
lowest common ancestor (the projection itself when there is one)."""

SCALE_FLOOR = 1e-4
WEIGHT_EPS = 1e-6
DuoScaling = Union[bool, str]


def grid(n_grid: int = 20, duo_scaling: DuoScaling = True) -> List[Tuple[float, bool]]:
    """The (ratio, duo) points of the search, in llm-compressor's order:

      duo_scaling=True:   [(0, False)] + [(i / (n_grid - 2), True) for i in 0 .. n_grid - 2]
      duo_scaling=False:  [(i / (n_grid - 1), False) for i in 0 .. n_grid - 1]
      "both":             n = n_grid // 2; [(i / (n - 1), d) for i in 0 .. n - 1 for d in (False, True)]

    Raises ModelError for a duo_scaling other than True / False / "both" or an n_grid too small for its grid.
    """
    if duo_scaling not in (True, False, "both") or (isinstance(duo_scaling, str) and duo_scaling != "both"):
        raise ModelError(f"AWQ: duo_scaling must be True, False or 'both', got {duo_scaling!r}")
    least = {True: 3, False: 2, "both": 4}[duo_scaling]
    if not isinstance(n_grid, int) or isinstance(n_grid, bool) or n_grid < least:
        raise ModelError(f"AWQ: n_grid must be an int >= {least} with duo_scaling={duo_scaling!r}, got {n_grid!r}")
    if duo_scaling == "both":
        n = n_grid // 2
        return [(i / (n - 1), d) for i in range(n) for d in (False, True)]
    if duo_scaling is False:
        return [(i / (n_grid - 1), False) for i in range(n_grid)]
    return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]


def _chunks(w: np.ndarray, scheme: QuantScheme, where: str) -> np.ndarray:
    """|w| / (amax of its quantization chunk + 1e-6) for a torch-layout weight w [N, K], float32."""
    n, k = w.shape
    a = np.abs(w.astype(np.float32))
    st = scheme.strategy
    if st == "tensor":
        v = a.reshape(1, -1)
    elif st == "channel":
        v = a.reshape(-1, k)
    elif st in ("group", "tensor_group"):
        if k % scheme.group_size:
            raise ModelError(f"{where}: AWQ needs in_features {k} divisible by the group size {scheme.group_size}")
        v = a.reshape(-1, scheme.group_size)
    elif st == "block":
        bh, bw = scheme.block
        if n % bh or k % bw:
            raise ModelError(f"{where}: AWQ needs the weight [{n}, {k}] divisible into blocks {bh}x{bw}")
        v = a.reshape(n // bh, bh, k // bw, bw).transpose(0, 2, 1, 3).reshape(-1, bh * bw)
    else:
        raise ModelError(f"{where}: AWQ cannot weigh a weight quantized per {st!r}")
    v = v / (v.max(axis=1, keepdims=True) + np.float32(WEIGHT_EPS))
    if st == "block":
        bh, bw = scheme.block
        return v.reshape(n // bh, k // bw, bh, bw).transpose(0, 2, 1, 3).reshape(n, k)
    return v.reshape(n, k)


def weight_means(kernels: Sequence, scheme: QuantScheme, where: str = "AWQ") -> np.ndarray:
    """w_mean [K] float64: the mean over every output row of the balance projections of |W[o, j]| normalised by
    its quantization chunk's amax + 1e-6 (module docstring). `kernels`: Flax kernels [K, N_p]."""
    total, count = 0.0, 0
    for k in kernels:
        w = np.asarray(k).T
        total = total + _chunks(w, scheme, where).sum(axis=0, dtype=np.float64)
        count += w.shape[0]
    return total / count


@jax.jit
def _abs_sum(x, valid):
    v = valid[..., None]
    return jnp.sum(jnp.where(v, jnp.abs(x.astype(jnp.float32)), 0.0), axis=(0, 1)), jnp.sum(valid)


def activation_means(xs: Sequence, valid: Sequence) -> np.ndarray:
    """x_mean [K] float32 = sum over real tokens of |x_t| / their count, for batches xs [B, T, K] and masks
    valid [B, T] (True = a real token)."""
    total, count = None, 0
    for x, v in zip(xs, valid):
        s, c = _abs_sum(x, v)
        total = s if total is None else total + s
        count += int(c)
    if count == 0:
        raise ModelError("AWQ: no real calibration tokens")
    return np.asarray(total, np.float32) / np.float32(count)


def candidate_scales(x_mean, w_mean, ratio: float, duo: bool) -> np.ndarray:
    """s [K] of one grid point (module docstring): duo: max(x^r / (w^(1-r) + 1e-4), 1e-4) in float64 (x^r in float32);
    plain: max(x^r, 1e-4) in float32; then s / sqrt(max(s) min(s)), with inf / nan entries set to 1."""
    x = np.asarray(x_mean, np.float32)
    with np.errstate(all="ignore"):
        xr = np.power(x, np.float32(ratio)).astype(np.float32)
        if duo:
            s = np.maximum(xr.astype(np.float64) / (np.power(np.asarray(w_mean, np.float64), 1.0 - ratio) + 1e-4),
                           SCALE_FLOOR)
        else:
            s = np.maximum(xr, np.float32(SCALE_FLOOR))
        s = s / np.sqrt(s.max() * s.min())
    s[~np.isfinite(s)] = 1
    return s


@jax.jit
def _scale_rows(k, s):
    return (k.astype(s.dtype) * s[:, None]).astype(k.dtype)


@jax.jit
def _unscale_rows(k, s):
    return (k.astype(s.dtype) / s[:, None]).astype(k.dtype)


@jax.jit
def _unscale_cols(k, s):
    return (k.astype(s.dtype) / s[None, :]).astype(k.dtype)


@jax.jit
def _unscale(v, s):
    return (v.astype(s.dtype) / s).astype(v.dtype)


def _in_dtype(fn, *args):
    """fn(*args) with 64-bit types enabled for this call, so float64 scales act in float64 (as torch promotes)."""
    with jax.enable_x64(True):
        return fn(*args)


@functools.partial(jax.jit, static_argnames=("scheme",))
def _fake_quantize(w, scheme):
    return dequantize(quantize(w, scheme, 0))


def fake_quantize_scaled(kernel, s, scheme: QuantScheme):
    """Q(W diag(s)) diag(s)^-1 for a Flax kernel [K, N] (rows scaled): fl(fl(k_j s_j) quantized-dequantized / s_j),
    each product and quotient in s's dtype (float64 scales: as torch promotes a float32 weight times float64
    scales) and rounded to the kernel's dtype; Q is round-to-nearest along K with min-max scales."""
    s = np.asarray(s)
    ws = _in_dtype(_scale_rows, kernel, s)
    return _in_dtype(_unscale_rows, _fake_quantize(ws, scheme), s)


def _get(layer, rel: str):
    m = layer
    for part in rel.split("/"):
        m = getattr(m, part)
    return m


def _set(layer, rel: str, new) -> None:
    *head, last = rel.split("/")
    setattr(_get(layer, "/".join(head)) if head else layer, last, new)


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


def _resolve(layer, index: int) -> List[Mapping]:
    """The mappings that apply to this layer: v_proj -> o_proj is dropped when v_proj's output size differs from
    o_proj's input size (llm-compressor's `_check_layers_are_compatible`)."""
    where = f"model/layers/{index}"
    for mod in ("self_attn", "mlp"):
        if getattr(_get(layer, mod), "rotations", None) is not None:
            raise ModelError(f"{where}/{mod}: AWQ cannot scale projections that carry online rotations")
    out = []
    for m in MAPPINGS:
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


def awq_transform(scheme, *, n_grid: int = 20, duo_scaling: DuoScaling = True,
                  record: Optional[list] = None) -> Callable:
    """A `qformats.models.sequential.calibrate_decoder` transform: per decoder layer, one float pass over the
    calibration batches records each mapping's input (module docstring), then, mapping by mapping, the grid search
    picks the scales s that minimise the parent's output error under the weight scheme's fake quantization, and
    s is folded into the smooth module (norm weight / s, or a linear's rows / s) and the balance projections
    (columns * s).

    Args:
      scheme: the weight scheme of the projections (a preset string such as "W4A16:g64", a SchemeSet or a
        QuantScheme), the one `calibrate_decoder` then quantizes with.
      n_grid, duo_scaling: llm-compressor's AWQModifier options (`grid`).
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
    points = grid(n_grid, duo_scaling)
    if duo_scaling is not False and ws.strategy == "tensor":
        raise ModelError(f"AWQ: duo_scaling needs per-channel, group or block weight scales, but {ss.name} has one "
                         "scale per tensor; pass duo_scaling=False")

    def transform(layer, index: int, xs, valid, layer_inputs) -> None:
        mappings = _resolve(layer, index)
        taps = tuple(dict.fromkeys(m.balances[0] for m in mappings))
        graphdef, state = nnx.split(layer)
        extras = [layer_inputs(x.shape[1]) for x in xs]
        seen = [_capture(graphdef, state, x, *e, taps) for x, e in zip(xs, extras)]
        tokens = int(sum(int(np.sum(np.asarray(v))) for v in valid))
        for m in mappings:
            where = f"model/layers/{index}/{m.smooth}"
            inputs = [s[m.balances[0]] for s in seen]
            x_mean = activation_means(inputs, valid)
            lins = [_get(layer, rel) for rel in m.balances]
            origs = [_kernel(lin) for lin in lins]
            w_mean = weight_means(origs, ws, where) if duo_scaling is not False else None
            graphdef, state = nnx.split(layer)
            refs = [_parent_out(graphdef, state, x, *e, m.parent) for x, e in zip(inputs, extras)]
            count = tokens * int(refs[0].shape[-1])
            best, best_err, best_point, first, errors = None, math.inf, None, None, []
            for ratio, duo in points:
                s = candidate_scales(x_mean, w_mean, ratio, duo)
                ks = tuple(fake_quantize_scaled(k, s, ws) for k in origs)
                sse = sum(float(_parent_sse(graphdef, state, ks, x, *e, r, v, m.parent, m.balances))
                          for x, e, r, v in zip(inputs, extras, refs, valid))
                err = sse / count
                errors.append(err)
                if first is None:
                    first = err
                if err < best_err:
                    best, best_err, best_point = s, err, (ratio, duo)
            if best is None:
                raise ModelError(f"{where}: AWQ found no finite loss on the grid (NaN or inf in the outputs of "
                                 f"{m.parent} under the scaled weights)")
            for lin, k in zip(lins, origs):
                lin.kernel.set_value(_in_dtype(_scale_rows, k, best))
            sm = _get(layer, m.smooth)
            if isinstance(sm, nnx.Linear):
                sm.kernel.set_value(_in_dtype(_unscale_cols, _kernel(sm), best))
                if sm.bias is not None:
                    sm.bias.set_value(_in_dtype(_unscale, sm.bias.get_value(), best))
            else:
                sm.weight.set_value(_in_dtype(_unscale, sm.weight.get_value(), best))
            if record is not None:
                record.append({"layer": index, "smooth": m.smooth, "balances": m.balances, "ratio": best_point[0],
                               "duo": best_point[1], "scales": np.asarray(best), "x_mean": x_mean, "errors": errors,
                               "initial_error": first,
                               "best_error": best_err})

    return transform
