"""Quantized matmul dispatch: x @ dequantize(q) through a registered kernel, or the XLA dequantize-then-dot path."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, List, Optional

import jax
import jax.numpy as jnp

from qformats.errors import KernelError
from qformats.qarray import QArray
from qformats.quantize import dequantize


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """A registered kernel: `supports(x, q, backend) -> bool` (static facts only) and `fn(x, q) -> y`."""

    name: str
    supports: Callable[[jax.Array, QArray, str], bool]
    fn: Callable[[jax.Array, QArray], jax.Array]
    priority: int = 0


_REGISTRY: List[KernelEntry] = []
_ENABLED = {"kernels": os.environ.get("QFORMATS_DISABLE_KERNELS", "") in ("", "0")}


def register_kernel(name: str, supports, fn, priority: int = 0) -> None:
    """Register (or replace, by name) a kernel for `qdot`; higher priority is tried first."""
    global _REGISTRY
    _REGISTRY = [e for e in _REGISTRY if e.name != name] + [KernelEntry(name, supports, fn, priority)]
    _REGISTRY.sort(key=lambda e: -e.priority)


def registered_kernels() -> List[str]:
    return [e.name for e in _REGISTRY]


def set_kernels_enabled(enabled: bool) -> None:
    """Turn registered kernels on or off globally (env QFORMATS_DISABLE_KERNELS=1 starts with them off)."""
    _ENABLED["kernels"] = bool(enabled)


def kernels_enabled() -> bool:
    return _ENABLED["kernels"]


def select_kernel(x: jax.Array, q: QArray, backend: Optional[str] = None) -> Optional[KernelEntry]:
    """The first registered kernel that supports (x, q) on `backend` (default: jax's default backend)."""
    if not _ENABLED["kernels"]:
        return None
    backend = backend or jax.default_backend()
    for e in _REGISTRY:
        try:
            ok = e.supports(x, q, backend)
        except Exception:  # a predicate bug must never give a wrong answer: fall back to XLA
            ok = False
        if ok:
            return e
    return None


def xla_qdot(x: jax.Array, q: QArray) -> jax.Array:
    """y = x @ dequantize(q): dequantize inside jit (XLA fuses it into the dot's operand), then dot_general."""
    w = dequantize(q, dtype=x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


def qdot(x: jax.Array, q: QArray) -> jax.Array:
    """y[..., n] = sum_k x[..., k] * W[k, n] with W = dequantize(q), q of logical shape [K, N] quantized along
    K (axis 0, the Flax kernel layout). Uses a registered kernel when one supports (x, q) on this backend,
    else the XLA path. Accumulates in float32; the result has x's dtype."""
    if q.ndim != 2:
        raise KernelError(f"qdot: expected a 2-D quantized weight [K, N], got shape {q.shape}")
    if x.shape[-1] != q.shape[0]:
        raise KernelError(f"qdot: x has K = {x.shape[-1]} (shape {tuple(x.shape)}) but the weight has "
                          f"K = {q.shape[0]} (shape {q.shape}, {q.scheme.describe()})")
    entry = select_kernel(x, q)
    if entry is not None:
        return entry.fn(x, q)
    return xla_qdot(x, q)
