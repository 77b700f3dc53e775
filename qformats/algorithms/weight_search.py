"""Weight searches: how a layer's float weight becomes its packed QArray (round-to-nearest, MSE clipping, GPTQ)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qformats.errors import ModelError
from qformats.gptq import DAMPENING_FRAC, gptq_quantize
from qformats.observers import mse_quantize
from qformats.qarray import QArray
from qformats.quantize import dequantize, quantize
from qformats.schemes import SchemeSet

RTN = "rtn"
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
      "gptq": GPTQ with H = E[x x^T] `h` [K, K] (`qformats.gptq.gptq_quantize`, llm-compressor's arithmetic),
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
    return float(output_error_array(q, w, h))
