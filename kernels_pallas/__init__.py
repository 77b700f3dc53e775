"""Pallas GPU kernels for packed FPx, MX, NVFP4 and INT matmuls, registered with qformats dispatch.

Importing this package registers `qmatmul` with `qformats.dispatch` for the GPU backend (see `register`):
`qformats.qdot`, and so the `qformats.nn` layers, then use it on GPU for every weight it supports;
everything else takes the XLA path. Direct use, with the weight repacked once::

    import kernels_pallas
    pw = kernels_pallas.prepare(q)            # QArray [K, N] along K -> kernel layout (layout.py)
    y = kernels_pallas.qmatmul(x, pw)         # x [..., K] bf16/f16/f32 -> [..., N]; interpret=True on CPU

Modules: `layout` (the bit-plane layout, `prepare`, the exact in-register decode), `qmatmul` (the
Pallas/Triton kernel, tilings), `register` (dispatch). NOTES.md: GPU status, roofline, next steps.
"""

from kernels_pallas.layout import PreparedWeight, dequantize_prepared, prepare, unsupported_reason
from kernels_pallas.qmatmul import BlockSizes, default_block_sizes, qmatmul
from kernels_pallas.register import set_interpret

__all__ = ["BlockSizes", "PreparedWeight", "default_block_sizes", "dequantize_prepared", "prepare",
           "qmatmul", "set_interpret", "unsupported_reason"]
