"""Weight searches: how a float weight becomes its packed QArray (round-to-nearest, MSE clipping, GPTQ), and the
output error tr(dW^T H dW) that decides whether a search beats round-to-nearest."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from qformats.algorithms.gptq import DAMPENING_FRAC, GPTQOptions, gptq_quantize, gptq_quantize_shared
from qformats.errors import ModelError
from qformats.observers import mse_quantize
from qformats.qarray import QArray
from qformats.quantize import dequantize, quantize
from qformats.schemes import SchemeSet

RTN = "rtn"


def search_text(total: int, searched: int, search: str) -> str:
    """How `total` weights were quantized, in words: "round-to-nearest" when the search was RTN; otherwise
    "N by SEARCH, M round-to-nearest" (M: the weights where the search did not lower the error, kept at RTN)."""
    if search == RTN:
        return "round-to-nearest"
    return f"{searched} by {search}, {total - searched} round-to-nearest"
WEIGHT_SEARCHES = (RTN, "mse", "gptq", "mse+gptq")
"""Every weight search, by the one name the library, the CLI and the examples use."""
NEEDS_HESSIAN = ("gptq", "mse+gptq")
"""The searches that need the layer inputs' second moments H = E[x x^T] (calibration data)."""


def search_name(weight_search: Optional[str], allowed=WEIGHT_SEARCHES, where: str = "weight_search") -> str:
    """`weight_search` checked against `allowed` (ModelError naming `where` otherwise). None is accepted as an
    alias of "rtn" (round-to-nearest), as earlier releases spelled it."""
    name = RTN if weight_search is None else weight_search
    if name not in allowed:
        raise ModelError(f"{where} must be one of {tuple(allowed)}, got {weight_search!r}")
    return name


def quantize_weight(kernel, schemes: SchemeSet, weight_search: Optional[str] = RTN, importance=None,
                    h=None, actorder: Optional[str] = "static", dampening_frac: float = DAMPENING_FRAC) -> QArray:
    """A kernel `[..., K, N]` → QArray along K by `weight_search` (None: an alias of "rtn"):

      "rtn": round-to-nearest, `quantize(w, scheme, 0)`;
      "mse": per-group clipping search minimising sum_k importance_k (w - Q(w))^2 (`observers.mse_quantize`);
      "gptq": GPTQ with H = E[x x^T] `h` [K, K] (`qformats.algorithms.gptq.gptq_quantize`, llm-compressor's arithmetic),
        round-to-nearest scales, columns in `actorder` (default "static": descending diag(H), as
        llm-compressor's GPTQModifier; None: column order) and dampening H += dampening_frac * mean(diag H) * I
        (default 0.01, llm-compressor's);
      "mse+gptq": GPTQ with the scales of the "mse" search (llm-compressor's MSE observer + GPTQ).

    Leading axes (layers stacked by `nnx.vmap` for `nnx.scan`) are vmapped over, together with those of
    `importance` / `h` when they have them: every leaf of the result has them in front and the QArray's
    static shape is the per-layer `[K, N]`, so slicing the leaves (what `nnx.scan` does) gives a valid
    per-layer QArray.
    """
    weight_search = search_name(weight_search)
    if weight_search in NEEDS_HESSIAN and h is None:
        raise ModelError(f"weight_search={weight_search!r} needs the layer inputs' second moments H = E[x x^T]: "
                         "quantize with calibration_data")
    ws = schemes.weights

    def one(w, imp, hh):
        if weight_search == RTN:
            return quantize(w, ws, 0)
        if weight_search == "mse":
            return mse_quantize(w, ws, 0, importance=imp)
        qp = mse_quantize(w, ws, 0, importance=imp) if weight_search == "mse+gptq" else None
        return gptq_quantize(w, ws, hh, qparams=qp, actorder=actorder, dampening_frac=dampening_frac)

    lead = kernel.ndim - 2
    axes = [0]
    for name, a, base in (("importance", importance, 1), ("h", h, 2)):
        if a is not None and a.ndim not in (base, base + lead):
            raise ModelError(f"quantize_weight: {name} of shape {tuple(a.shape)} does not fit a kernel of shape "
                             f"{tuple(kernel.shape)} (expected {base} or {base + lead} dims)")
        axes.append(0 if a is not None and a.ndim == base + lead and lead else None)
    fn = one
    for _ in range(lead):
        fn = jax.vmap(fn, in_axes=tuple(axes))
    return fn(kernel, importance, h)


def output_error_array(q: QArray, w, h) -> jax.Array:
    """tr(dW^T H dW), dW = dequantize(q) - w, as a float32 array (traceable: usable under jit / vmap)."""
    d = dequantize(q, jnp.float32) - w.astype(jnp.float32)
    return jnp.sum(d * (h @ d))


def output_error(q: QArray, w, h) -> float:
    """tr(dW^T H dW), dW = dequantize(q) - w: the mean squared output error of x @ W for E[x x^T] = H."""
    return float(_output_error_jit(q, w, h))


_output_error_jit = jax.jit(output_error_array)


@jax.jit
def _search_wins(q: QArray, rtn: QArray, w, h) -> jax.Array:
    """The guard of `quantize_projection`: tr(dW^T H dW) of q < that of round-to-nearest's `rtn`, in one compiled
    call, with one product by H: for dq = Q - W and dr = R - W (dequantized q and rtn), H symmetric,
      tr(dq^T H dq) - tr(dr^T H dr) = tr((dq - dr)^T H (dq + dr)) = sum((Q - R) * (H (dq + dr)))
    so the search wins when that sum is negative (the same decision, up to rounding, at half the multiply-adds)."""
    wf = w.astype(jnp.float32)
    dq, dr = dequantize(q, jnp.float32) - wf, dequantize(rtn, jnp.float32) - wf
    return jnp.sum((dq - dr) * (h @ (dq + dr))) < 0


def calibrated_weight(w, schemes: SchemeSet, weight_search: Optional[str], moments, count, *,
                      actorder: Optional[str] = "static",
                      dampening_frac: float = DAMPENING_FRAC) -> Tuple[QArray, str]:
    """(QArray, method): a calibrated layer's kernel `w` [..., K, N] packed by `weight_search` from the statistics
    of its inputs, `moments` = sum over tokens of x x^T ([..., K, K]) or of x * x ([..., K]) and `count` tokens:

      H = moments / max(count, 1);   importance = diag(H) (1 where the layer saw no token)
      "rtn": quantize(w);  otherwise q = `quantize_weight(w, schemes, weight_search, importance, H)` (H only
      when full moments were tracked) and, with full moments, q is kept only where the layer saw tokens and
      tr(dW^T H dW) of q is below round-to-nearest's (round-to-nearest elsewhere).

    Leading axes of `w` (layers stacked for `nnx.scan`) are vmapped over with those of `moments` and `count`.
    `method` is `weight_search` when the search's result was kept in at least one stacked layer, else "rtn".
    """
    weight_search = search_name(weight_search)

    def one(w, total, n):
        seen = n > 0
        h = total / jnp.maximum(n, 1.0)
        diag = jnp.diagonal(h) if h.ndim == 2 else h
        if weight_search == RTN:
            return quantize_weight(w, schemes, RTN), None
        q = quantize_weight(w, schemes, weight_search, importance=jnp.where(seen, diag, 1.0),
                            h=h if h.ndim == 2 else None, actorder=actorder, dampening_frac=dampening_frac)
        if h.ndim == 2:  # keep round-to-nearest where the search does not lower tr(dW^T H dW)
            rtn = quantize_weight(w, schemes, RTN)
            keep = seen & (output_error_array(q, w, h) < output_error_array(rtn, w, h))
            q = jax.tree.map(lambda u, v: jnp.where(keep, u, v), q, rtn)
            return q, keep
        return q, None

    fn = one
    for _ in range(w.ndim - 2):
        fn = jax.vmap(fn)
    q, kept = fn(w, moments, count)
    searched = weight_search != RTN and (kept is None or bool(jnp.any(kept)))
    return q, weight_search if searched else RTN


_quantize_jit = jax.jit(quantize, static_argnames=("scheme", "axis"))


def quantize_projection(w, schemes: SchemeSet, h, weight_search: str, gptq: GPTQOptions = GPTQOptions(),
                        guard: bool = True, global_scale=None) -> Tuple[QArray, str]:
    """(QArray, method): the kernel `w` [K, N] quantized along K by `weight_search` for input moments `h` [K, K]:

      "rtn": quantize(w); "mse": observers.mse_quantize with importance diag(H);
      "gptq": gptq_quantize(w, H, block_size, dampening_frac, actorder) on round-to-nearest scales;
      "mse+gptq": the same on the MSE search's scales.

    `global_scale`: an NVFP4 weight global scale to use instead of w's own (a fused group's,
    `qformats.algorithms.shared_scales`) for "rtn" and "gptq"; the MSE searches keep w's own.

    With `guard`, the search's result is kept only when its output error tr(dW^T H dW) is below
    round-to-nearest's (method "rtn" otherwise), as `calibrated_weight` does per layer.
    """
    ws = schemes.weights
    if weight_search == "gptq" and h is not None and not guard and global_scale is None:  # RTN's scales made inside
        return gptq_quantize(w, ws, h, block_size=gptq.block_size, dampening_frac=gptq.dampening_frac,
                             actorder=gptq.actorder), weight_search
    rtn = _quantize_jit(w, ws, 0) if global_scale is None else _quantize_jit(w, ws, 0, global_scale=global_scale)
    if weight_search == RTN or h is None:
        return rtn, RTN
    if weight_search == "mse":
        q = mse_quantize(w, ws, 0, importance=jnp.diagonal(h))
    else:  # GPTQ on round-to-nearest's scales, or on the MSE search's
        qp = mse_quantize(w, ws, 0, importance=jnp.diagonal(h)) if weight_search == "mse+gptq" else rtn
        q = gptq_quantize(w, ws, h, block_size=gptq.block_size, dampening_frac=gptq.dampening_frac,
                          actorder=gptq.actorder, qparams=qp)
    if guard and not bool(_search_wins(q, rtn, w, h)):
        return rtn, RTN
    return q, weight_search


def quantize_group(kernels: Dict[str, jax.Array], schemes: SchemeSet, h, weight_search: str,
                   gptq: GPTQOptions = GPTQOptions(), guard: bool = True,
                   global_scales: Optional[Dict[str, jax.Array]] = None) -> Dict[str, Tuple[QArray, str]]:
    """name -> (QArray, method) for projections that read the same input (one H, e.g. q/k/v or gate/up):
    `quantize_projection` of each, except that the GPTQ searches run as one problem
    (`qformats.algorithms.gptq.gptq_quantize_shared`: the same codes, one column loop for the group)."""
    global_scales = global_scales or {}
    if weight_search not in ("gptq", "mse+gptq") or h is None or len(kernels) == 1:
        return {r: quantize_projection(w, schemes, h, weight_search, gptq, guard, global_scales.get(r))
                for r, w in kernels.items()}
    ws = schemes.weights
    rtn, qps = {}, []
    diag = jnp.diagonal(h) if weight_search == "mse+gptq" else None
    for r, w in kernels.items():
        g = global_scales.get(r)
        if weight_search == "gptq" and not guard and g is None:  # round-to-nearest's scales, made inside GPTQ
            qps.append(None)
            continue
        rtn[r] = _quantize_jit(w, ws, 0) if g is None else _quantize_jit(w, ws, 0, global_scale=g)
        qps.append(mse_quantize(w, ws, 0, importance=diag) if weight_search == "mse+gptq" else rtn[r])
    qs = gptq_quantize_shared(list(kernels.values()), ws, h, block_size=gptq.block_size,
                              dampening_frac=gptq.dampening_frac, actorder=gptq.actorder, qparams=qps)
    out = {}
    for (r, w), q in zip(kernels.items(), qs):
        if guard and not bool(_search_wins(q, rtn[r], w, h)):
            out[r] = (rtn[r], RTN)
        else:
            out[r] = (q, weight_search)
    return out
