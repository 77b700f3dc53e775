"""Registers the Mosaic GPU and Triton qmatmul kernels with `qformats.dispatch` (on import of kernels_pallas).

`qformats.qdot` (and so every `qformats.nn` layer) then runs, on GPU:
  1. `mosaic_qmatmul` (`qmatmul_mgpu`, priority 20, the default): every weight with a Mosaic GPU layout
     (`layout_mgpu.mgpu_unsupported_reason`) and bf16/f16 activations;
  2. `pallas_qmatmul` (`qmatmul`, Pallas Triton, priority 10): the second choice, for what the Mosaic kernel
     does not take (f32 activations, groups along K other than 16, 32 or a multiple of 64, ...). The Pallas
     Triton backend is deprecated in jax 0.11; this entry goes once the Mosaic kernel is measured on the
     device;
anything else takes qformats' XLA path, never a wrong answer. `qformats.set_kernels_enabled(False)` (or the
env var QFORMATS_DISABLE_KERNELS=1) turns the kernels off. `set_interpret(True)` (or
QFORMATS_PALLAS_INTERPRET=1) also accepts every other backend and runs the kernels interpreted (GPU interpret
mode / the Pallas interpreter): for CPU tests of the dispatch path only (slow).

Each kernel registers its weight-layout step (`prepare_mgpu`, `prepare`): `qformats.dispatch.prepare_weight(q)`
runs the chosen kernel's once and the `qformats.nn` layers keep the result (an `nnx.Cache` next to the packed
param), so `qdot` hands the kernel its layout without repacking. A bare `qdot(x, q)` repacks inside every
call, which reads and writes the packed codes once more.
"""

from __future__ import annotations

import os

import jax

from qformats.dispatch import register_kernel
from qformats.qarray import QArray

from kernels_pallas.layout import PreparedWeight, prepare, unsupported_reason
from kernels_pallas.layout_mgpu import MgpuWeight, mgpu_unsupported_reason, prepare_mgpu
from kernels_pallas.qmatmul import X_DTYPES, qmatmul
from kernels_pallas.qmatmul_mgpu import MGPU_X_DTYPES, qmatmul_mgpu

KERNEL_NAME = "pallas_qmatmul"
MGPU_KERNEL_NAME = "mosaic_qmatmul"
_STATE = {"interpret": os.environ.get("QFORMATS_PALLAS_INTERPRET", "") not in ("", "0")}


def set_interpret(enabled: bool) -> None:
    """Accept every backend and run the kernels interpreted (True), or GPU only, compiled (False)."""
    _STATE["interpret"] = bool(enabled)


def _takes(x, q, backend: str, why, dtypes) -> bool:
    if backend != "gpu" and not _STATE["interpret"]:
        return False
    if not isinstance(q, QArray) or why(q) is not None:
        return False
    if x is None:
        return True
    return x.dtype in dtypes and x.ndim >= 1 and x.shape[-1] == q.shape[0]


def supports_mgpu(x, q, backend: str) -> bool:
    """Static check: a 2-D QArray [K, N] along axis 0 with a Mosaic GPU layout, x [..., K] in bf16/f16
    (x None: the weight alone)."""
    return _takes(x, q, backend, mgpu_unsupported_reason, MGPU_X_DTYPES)


def supports(x, q, backend: str) -> bool:
    """Static check: a 2-D QArray [K, N] along axis 0 with a Triton kernel layout, x [..., K] in bf16/f16/f32
    (x None: the weight alone)."""
    return _takes(x, q, backend, unsupported_reason, X_DTYPES)


def _fn_mgpu(x, q, payload=None):
    """x @ dequantize(q) by the Mosaic GPU kernel, from the cached layout when `payload` is one."""
    w = payload if isinstance(payload, MgpuWeight) else q
    return qmatmul_mgpu(x, w, interpret=jax.default_backend() != "gpu")


def _fn(x, q, payload=None):
    """x @ dequantize(q) by the Pallas Triton kernel, from the cached layout when `payload` is one."""
    w = payload if isinstance(payload, PreparedWeight) else q
    return qmatmul(x, w, interpret=jax.default_backend() != "gpu")


def register() -> None:
    register_kernel(MGPU_KERNEL_NAME, supports_mgpu, _fn_mgpu, priority=20, prepare=prepare_mgpu, takes_offset=True)
    register_kernel(KERNEL_NAME, supports, _fn, priority=10, prepare=prepare, takes_offset=True)


register()
