"""Registers `qmatmul` with `qformats.dispatch` (on import of kernels_pallas) for the GPU backend.

`qformats.qdot` (and so every `qformats.nn` layer) then runs the Pallas kernel on GPU for each weight whose
scheme has a kernel layout (`layout.unsupported_reason`) and activations in bf16/f16/f32; anything else
takes qformats' XLA path, never a wrong answer. `qformats.set_kernels_enabled(False)` (or the env var
QFORMATS_DISABLE_KERNELS=1) turns the kernels off. `set_interpret(True)` (or QFORMATS_PALLAS_INTERPRET=1)
also accepts every other backend and runs the kernel with the Pallas interpreter: for CPU tests of the
dispatch path only (slow).

The kernel registers `prepare` as its weight-layout step: `qformats.dispatch.prepare_weight(q)` runs it once
and the `qformats.nn` layers keep the result (an `nnx.Cache` next to the packed param), so `qdot` hands the
kernel its layout without repacking. A bare `qdot(x, q)` without it repacks inside every call, which reads
and writes the packed codes once more.
"""

from __future__ import annotations

import os

import jax

from qformats.dispatch import register_kernel
from qformats.qarray import QArray

from kernels_pallas.layout import PreparedWeight, prepare, unsupported_reason
from kernels_pallas.qmatmul import X_DTYPES, qmatmul

KERNEL_NAME = "pallas_qmatmul"
_STATE = {"interpret": os.environ.get("QFORMATS_PALLAS_INTERPRET", "") not in ("", "0")}


def set_interpret(enabled: bool) -> None:
    """Accept every backend and run the kernel interpreted (True), or GPU only, compiled (False)."""
    _STATE["interpret"] = bool(enabled)


def supports(x, q, backend: str) -> bool:
    """Static check: a 2-D QArray [K, N] along axis 0 with a kernel layout, x [..., K] in bf16/f16/f32
    (x None: the weight alone)."""
    if backend != "gpu" and not _STATE["interpret"]:
        return False
    if not isinstance(q, QArray) or unsupported_reason(q) is not None:
        return False
    if x is None:
        return True
    return x.dtype in X_DTYPES and x.ndim >= 1 and x.shape[-1] == q.shape[0]


def _fn(x, q, payload=None):
    """x @ dequantize(q) by the Pallas kernel, from the cached layout when `payload` is one."""
    w = payload if isinstance(payload, PreparedWeight) else q
    return qmatmul(x, w, interpret=jax.default_backend() != "gpu")


def register() -> None:
    register_kernel(KERNEL_NAME, supports, _fn, priority=10, prepare=prepare)


register()
