"""Quantized matmul dispatch: x @ dequantize(q) through a registered kernel, or the XLA dequantize-then-dot path.

A kernel may read its own weight layout: it registers a `prepare(q) -> payload` function, `prepare_weight(q)`
runs it once (at load / quantize time) and the layers keep the returned `KernelWeight` (kernel name + payload
pytree) next to the QArray; `qdot(x, q, kernel_weight)` then hands the payload to that kernel instead of
repacking.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, List, Optional

import jax
import jax.numpy as jnp

from qformats.errors import KernelError
from qformats.packed_dot import packed_dot, packed_dot_supported, tie_to
from qformats.qarray import QArray
from qformats.quantize import dequantize


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """A registered kernel.

    `supports(x, q, backend) -> bool` uses static facts only (shapes, dtypes, scheme); x may be None, which
    asks whether the kernel takes the weight for some supported activation dtype. `fn(x, q, payload)` computes
    x @ dequantize(q); payload is None or what `prepare(q)` returned for this q. `takes_offset`: whether the
    kernel reads a QArray's additive `offset` (GGUF minima); a kernel that does not say so is never given one.
    """

    name: str
    supports: Callable[[Optional[jax.Array], QArray, str], bool]
    fn: Callable[[jax.Array, QArray, Any], jax.Array]
    priority: int = 0
    prepare: Optional[Callable[[QArray], Any]] = None
    takes_offset: bool = False


@jax.tree_util.register_pytree_node_class
class KernelWeight:
    """A weight repacked into one registered kernel's own layout: `name` (the kernel's, static) and `payload`
    (a pytree of arrays, what that kernel's `prepare(q)` returned)."""

    def __init__(self, name: str, payload: Any):
        self.name = name
        self.payload = payload

    def tree_flatten(self):
        return (self.payload,), self.name

    @classmethod
    def tree_unflatten(cls, name, children):
        return cls(name, children[0])

    def __repr__(self) -> str:
        return f"KernelWeight({self.name!r}, {self.payload!r})"


FUSED_GEMV_ROWS = 1
"""Most activation rows `xla_qdot` sends to `qformats.packed_dot` (which takes up to its MAX_ROWS = 8, one fused GEMV
per row). Kept at 1 (decode) because the packed layers' outputs for a few rows are compared bit for bit with
dequantize-then-dot references across qformats.nn."""

_REGISTRY: List[KernelEntry] = []
_ENABLED = {"kernels": os.environ.get("QFORMATS_DISABLE_KERNELS", "") in ("", "0")}


def register_kernel(name: str, supports, fn, priority: int = 0, prepare=None, takes_offset: bool = False) -> None:
    """Register (or replace, by name) a kernel for `qdot`; higher priority is tried first.

    `fn(x, q, payload)` must return x @ dequantize(q) (payload: None, or `prepare(q)`'s result when given), offset
    included when `takes_offset` (else QArrays with an offset never reach it).
    """
    global _REGISTRY
    _REGISTRY = [e for e in _REGISTRY if e.name != name] + [KernelEntry(name, supports, fn, priority, prepare,
                                                                        takes_offset)]
    _REGISTRY.sort(key=lambda e: -e.priority)


def registered_kernels() -> List[str]:
    """The names of the registered kernels, highest priority first."""
    return [e.name for e in _REGISTRY]


def set_kernels_enabled(enabled: bool) -> None:
    """Turn registered kernels, and the XLA path's fused GEMV (`qformats.packed_dot`), on or off globally (env
    QFORMATS_DISABLE_KERNELS=1 starts with them off); off, every packed matmul is dequantize-then-dot.

    The flag is read at trace time: `qdot`, `prepare_weight` and the layers' code-path choice consult it when a
    function is traced, so a function jit-compiled before the call keeps the path it was compiled with until
    it is traced again (a new jit, or new shapes / static arguments). Refresh cached kernel layouts with
    `qformats.nn.prepare_kernels(model)` after changing it.
    """
    _ENABLED["kernels"] = bool(enabled)


def kernels_enabled() -> bool:
    """Whether registered kernels are on (`set_kernels_enabled`; read at trace time)."""
    return _ENABLED["kernels"]


def select_kernel(x: Optional[jax.Array], q: QArray, backend: Optional[str] = None) -> Optional[KernelEntry]:
    """The first registered kernel that supports (x, q) on `backend` (default: jax's default backend);
    x None: any activation dtype the kernel takes."""
    if not _ENABLED["kernels"]:
        return None
    backend = backend or jax.default_backend()
    return next((e for e in _REGISTRY if _takes(e, x, q, backend)), None)


def _takes(e: KernelEntry, x, q, backend: str) -> bool:
    if getattr(q, "offset", None) is not None and not e.takes_offset:
        return False  # a kernel that does not read the additive offset (GGUF minima) never gets one: XLA does
    try:
        return bool(e.supports(x, q, backend))
    except Exception:  # a predicate bug must never give a wrong answer: fall back to XLA
        return False


def prepare_weight(q: QArray, backend: Optional[str] = None) -> Optional[KernelWeight]:
    """The kernel layout of q for the kernel `qdot` would pick on `backend`, or None (XLA path, kernels off,
    or a kernel that reads the QArray as it is). Run once per weight; pass the result to `qdot`."""
    if not isinstance(q, QArray) or q.ndim != 2:
        return None
    entry = select_kernel(None, q, backend)
    if entry is None or entry.prepare is None:
        return None
    return KernelWeight(entry.name, entry.prepare(q))


def xla_qdot(x: jax.Array, q: QArray) -> jax.Array:
    """y = x @ dequantize(q): dequantize inside jit, then dot_general, accumulating in float32.

    Up to `FUSED_GEMV_ROWS` activation rows times a 4- or 8-bit weight (decode) go through
    `qformats.packed_dot`: the same weight elements, decoded from the packed codes inside XLA's fused
    matrix-vector loops, never a dense copy (not even one XLA would hoist out of a decode loop). More rows
    (prefill), or kernels turned off (`set_kernels_enabled(False)`: every packed matmul dequantizes), dequantize
    the whole weight once and use XLA's dot; that dequantize is tied to x (`_tied_to`), so a model's dense weights
    are not all made at once: one layer's at a time.
    """
    if _ENABLED["kernels"] and math.prod(x.shape[:-1]) <= FUSED_GEMV_ROWS and packed_dot_supported(x.shape, q):
        return packed_dot(x, q)
    w = dequantize(_tied_to(q, x), dtype=x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


def _tied_to(q: QArray, x: jax.Array) -> QArray:
    """q with every array computed from x (`qformats.packed_dot.tie_to`): no bit changes, but the dequantize of q
    waits for the layer input x.

    Without it, the dequantize of every layer depends on the weights only, and XLA:CPU's scheduler ran all of
    them first: a packed model's prefill held every projection's dense float32 copy at once (the temporary
    buffer of a compiled SmolLM2 `generate` was the size of its 210 dense projections). An optimization barrier
    does not order them (none is left in the optimized module); a data dependency of the inputs of the
    dequantize (not of its last op: a format whose unpack or scale decode is a fusion of its own would still run
    early) does, so each dense weight lives from its layer's input to its dot."""
    leaves, aux = q.tree_flatten()
    return QArray.tree_unflatten(aux, tie_to(x, leaves))


def qdot(x: jax.Array, q: QArray, kernel_weight: Optional[KernelWeight] = None) -> jax.Array:
    """y[..., n] = sum_k x[..., k] * W[k, n] with W = dequantize(q), q of logical shape [K, N] quantized along
    K (axis 0, the Flax kernel layout). Uses a registered kernel when one supports (x, q) on this backend,
    else the XLA path. Accumulates in float32; the result has x's dtype.

    `kernel_weight` (from `prepare_weight(q)`) is handed to its kernel when that kernel is enabled and takes
    (x, q) here; otherwise it is ignored and the usual selection applies (never a wrong answer: a payload
    is only used by the kernel that made it)."""
    if q.ndim != 2:
        raise KernelError(f"qdot: expected a 2-D quantized weight [K, N], got shape {q.shape}")
    if x.shape[-1] != q.shape[0]:
        raise KernelError(f"qdot: x has K = {x.shape[-1]} (shape {tuple(x.shape)}) but the weight has "
                          f"K = {q.shape[0]} (shape {q.shape}, {q.scheme.describe()})")
    if kernel_weight is not None and _ENABLED["kernels"]:
        e = next((e for e in _REGISTRY if e.name == kernel_weight.name), None)
        if e is not None and _takes(e, x, q, jax.default_backend()):
            return e.fn(x, q, kernel_weight.payload)
    entry = select_kernel(x, q)
    if entry is not None:
        return entry.fn(x, q, None)
    return xla_qdot(x, q)
