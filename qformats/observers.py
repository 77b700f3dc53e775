"""Observers (pure functions over calibration batches) and MSE clipping search for static scales.

An observer is a record of three pure functions, optax style: `init() -> state`,
`update(state, x) -> state`, `result(state) -> amax`; the state is an explicit pytree the caller
carries (the Flax layers keep it in a variable while calibrating). `amax` is the clipping range
that a static scale is then computed from with the scheme's own rule (`static_scale`).

`mse_quantize` searches, per scale group, the clipping ratio r that minimises the (optionally
importance-weighted) squared error of the round trip — the weight-side "MSE observer".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import SchemeError
from qformats.grouping import contract, group, normalize_axis, ungroup
from qformats.qarray import QArray
from qformats.quantize import dequantize, quantize
from qformats.schemes import QuantScheme

DEFAULT_RATIOS = tuple(float(r) for r in np.linspace(0.5, 1.0, 26))


class Observer(NamedTuple):
    """init() -> state; update(state, x) -> state; result(state) -> amax (float32 scalar)."""

    init: Callable[[], Any]
    update: Callable[[Any, jax.Array], Any]
    result: Callable[[Any], jax.Array]


def _amax(x):
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def minmax() -> Observer:
    """amax = max over all batches of max |x|."""
    return Observer(lambda: jnp.zeros((), jnp.float32),
                    lambda s, x: jnp.maximum(s, _amax(x)),
                    lambda s: s)


def moving_average(momentum: float = 0.9) -> Observer:
    """Exponential moving average of per-batch amax: m_t = momentum m_{t-1} + (1 - momentum) amax_t,
    m_1 = amax_1 (the MovingAverageMinMax observer of torch.ao / llm-compressor)."""
    def update(s, x):
        m, n = s
        a = _amax(x)
        return jnp.where(n == 0, a, momentum * m + (1 - momentum) * a), n + 1
    return Observer(lambda: (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), update, lambda s: s[0])


def percentile(q: float = 99.99) -> Observer:
    """Mean over batches of the q-th percentile of |x| (clips rare outliers)."""
    def update(s, x):
        total, n = s
        return total + jnp.percentile(jnp.abs(x.astype(jnp.float32)), q), n + 1
    return Observer(lambda: (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), update,
                    lambda s: s[0] / jnp.maximum(s[1], 1))


def mse(scheme: QuantScheme, ratios: Sequence[float] = DEFAULT_RATIOS, bins: int = 2048) -> Observer:
    """Clipping amax c minimising the expected squared error of a static per-tensor scale over all batches.

    State: a histogram of |x| with `bins` equal bins over [0, R); when a batch exceeds R, R doubles and
    bins merge pairwise (exact), so the histogram covers every batch seen. Result: the c = r * amax
    (r in `ratios`, amax = the largest |x| seen) minimising
      sum_b n_b (m_b - Q_c(m_b))^2,   m_b the bin centre, Q_c the scheme's round trip with scale(c).
    For schemes whose static part is not a per-tensor scale (NVFP4's global scale) the result is amax.
    """
    if bins % 2:
        raise SchemeError(f"mse observer: bins must be even, got {bins}")
    rs = jnp.asarray(ratios, jnp.float32)

    def init():
        return jnp.zeros((bins,), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)

    def update(s, x):
        counts, rng, seen = s
        a = jnp.abs(x.astype(jnp.float32)).ravel()
        amax = jnp.max(a)
        rng = jnp.where(rng == 0, jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), rng)

        def grow(c):
            h, r = c
            return jnp.concatenate([h.reshape(-1, 2).sum(1), jnp.zeros((bins // 2,), h.dtype)]), r * 2

        counts, rng = jax.lax.while_loop(lambda c: c[1] < amax, grow, (counts, rng))
        idx = jnp.clip(jnp.floor(a / rng * bins).astype(jnp.int32), 0, bins - 1)
        return counts + jnp.zeros((bins,), jnp.float32).at[idx].add(1.0), rng, jnp.maximum(seen, amax)

    def result(s):
        counts, rng, amax = s
        if scheme.strategy != "tensor":
            return amax
        centers = (jnp.arange(bins, dtype=jnp.float32) + 0.5) * rng / bins

        def err(r):
            sc, _ = static_scale(r * amax, scheme)
            y = dequantize(quantize(centers, scheme, -1, scale=sc)).astype(jnp.float32)
            return jnp.sum(counts * (centers - y) ** 2)
        return rs[jnp.argmin(jax.vmap(err)(rs))] * amax

    return Observer(init, update, result)


OBSERVERS = {"minmax": minmax, "moving_average": moving_average, "percentile": percentile}


def get_observer(name_or_obs, scheme: QuantScheme) -> Observer:
    """An Observer from a name ("minmax", "moving_average", "percentile", "mse") or pass one through."""
    if isinstance(name_or_obs, Observer):
        return name_or_obs
    if name_or_obs == "mse":
        return mse(scheme)
    if name_or_obs in OBSERVERS:
        return OBSERVERS[name_or_obs]()
    raise SchemeError(f"unknown observer {name_or_obs!r}; expected one of "
                      f"{sorted(OBSERVERS) + ['mse']} or an Observer")


def static_scale(amax, scheme: QuantScheme, dtype=jnp.float32):
    """(scale, global_scale) a static activation scheme stores for clipping range `amax`.

    Computed by the scheme's own rule on a tensor whose absmax is amax, so the eps and rounding
    conventions are the library's: "tensor": scale = amax / half_range, shape [1], global None;
    "tensor_group" (NVFP4 activations, dynamic="local"): global = 448 * 6 / amax, scale None (the
    group scales stay dynamic).
    """
    a = jnp.asarray(amax, jnp.float32).reshape(())
    if scheme.strategy == "tensor":
        return quantize(a.reshape(1).astype(dtype), scheme, -1).scale, None
    if scheme.strategy == "tensor_group":
        g = scheme.group_size
        return None, quantize(jnp.full((g,), a, dtype), scheme, -1).global_scale
    raise SchemeError(f"static activation scales need strategy 'tensor' or 'tensor_group', got "
                      f"{scheme.strategy!r} ({scheme.describe()}); use a dynamic scheme")


# ---- weight-side MSE search -------------------------------------------------------------------------------
def mse_quantize(w, scheme: QuantScheme, axis: int = 0, ratios: Sequence[float] = DEFAULT_RATIOS,
                 importance: Optional[jax.Array] = None) -> QArray:
    """Quantize w with per-group clipping ratios chosen by search.

    For each r in `ratios` the scales are those of clip(w, r * lo_G, r * hi_G) (lo/hi: -amax/amax, or
    min/max for asymmetric integers; the NVFP4 global scale is kept from the unclipped tensor), and w
    itself is quantized with them; per scale group G the r minimising
      E_G(r) = sum_{i in G} h_k(i) (w_i - Q_r(w)_i)^2
    wins, h_k = `importance` along the reduction axis (e.g. E[x_k^2] from calibration, the diagonal of
    the GPTQ Hessian), 1 when None. r = 1 (round-to-nearest) is always a candidate when in `ratios`,
    so the chosen error is never larger than RTN's.

    Returns the QArray with the chosen scales (same layout as `quantize`).
    """
    w = jnp.asarray(w)
    axis = normalize_axis(axis, w.ndim, "mse_quantize")
    rs = jnp.asarray(sorted(set(float(r) for r in ratios) | {1.0}), jnp.float32)
    imp = None if importance is None else jnp.asarray(importance, jnp.float32)
    if imp is not None and imp.shape != (w.shape[axis],):
        raise SchemeError(f"mse_quantize: importance must have shape ({w.shape[axis]},), got {imp.shape}")
    scale, zp, g = _mse_search(w, scheme, axis, rs, imp)
    return quantize(w, scheme, axis, scale=scale, zero_point=zp, global_scale=g)


@functools.partial(jax.jit, static_argnames=("scheme", "axis"))
def _mse_search(w, scheme, axis, rs, imp):
    base = quantize(w, scheme, axis)
    g = base.global_scale
    wt = jnp.moveaxis(w, axis, -1)
    view, red = group(wt, scheme)
    if scheme.symmetric:
        hi = jnp.max(jnp.abs(view), axis=red, keepdims=True)
        lo = -hi
    else:
        lo = jnp.minimum(jnp.min(view, axis=red, keepdims=True), 0)
        hi = jnp.maximum(jnp.max(view, axis=red, keepdims=True), 0)
    wf = w.astype(jnp.float32)
    if imp is not None:
        shape = [1] * w.ndim
        shape[axis] = -1
        impw = imp.reshape(shape)

    def err_of(q):
        d2 = (dequantize(q, jnp.float32) - wf) ** 2
        if imp is not None:
            d2 = d2 * impw
        v, _ = group(jnp.moveaxis(d2, axis, -1), scheme)
        return contract(jnp.sum(v, axis=red, keepdims=True), scheme)

    def body(best, r):
        clipped = jnp.moveaxis(ungroup(jnp.clip(view, r * lo, r * hi), scheme, wt.shape), -1, axis)
        qc = quantize(clipped.astype(w.dtype), scheme, axis, global_scale=g)
        q = quantize(w, scheme, axis, scale=qc.scale, zero_point=qc.zero_point, global_scale=g)
        e = err_of(q)
        bs, bz, be = best
        better = e < be
        bs = jnp.where(better, qc.scale, bs)
        if bz is not None:
            bz = jnp.where(better, qc.zero_point, bz)
        return (bs, bz, jnp.where(better, e, be)), None

    init = (base.scale, base.zero_point, jnp.full(base.scale.shape, jnp.inf, jnp.float32))
    (s, z, _), _ = jax.lax.scan(body, init, rs)
    return s, z, g
