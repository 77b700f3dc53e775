"""Pallas GPU kernels for packed FPx, MX, NVFP4 and INT matmuls, registered with qformats dispatch.

Importing this package registers the kernels with `qformats.dispatch` for the GPU backend (see `register`):
the Mosaic GPU `qmatmul_mgpu` first, the Pallas Triton `qmatmul` second. `qformats.qdot`, and so the
`qformats.nn` layers, then use them on GPU for every weight they support; everything else takes the XLA
path. Direct use, with the weight repacked once::

    import kernels_pallas
    mw = kernels_pallas.prepare_mgpu(q)       # QArray [K, N] along K -> Mosaic GPU layout (layout_mgpu.py)
    y = kernels_pallas.qmatmul_mgpu(x, mw)    # x [..., K] bf16/f16 -> [..., N]; GPU interpret mode on CPU

Modules: `layout` (the Triton kernel's bit-plane layout and the exact decode arithmetic both kernels use),
`layout_mgpu` (the Mosaic GPU byte-plane layout), `qmatmul_mgpu` (the Mosaic GPU kernel: TMA, wgmma),
`qmatmul` (the Pallas Triton kernel), `register` (dispatch). NOTES.md: GPU status, roofline, next steps.
"""

from kernels_pallas.layout import PreparedWeight, dequantize_prepared, prepare, unsupported_reason
from kernels_pallas.layout_mgpu import MgpuWeight, dequantize_mgpu, mgpu_unsupported_reason, prepare_mgpu
from kernels_pallas.qmatmul import BlockSizes, default_block_sizes, qmatmul
from kernels_pallas.qmatmul_mgpu import MgpuBlockSizes, default_mgpu_block_sizes, qmatmul_mgpu
from kernels_pallas.register import set_interpret

__all__ = ["BlockSizes", "MgpuBlockSizes", "MgpuWeight", "PreparedWeight", "default_block_sizes",
           "default_mgpu_block_sizes", "dequantize_mgpu", "dequantize_prepared", "mgpu_unsupported_reason",
           "prepare", "prepare_mgpu", "qmatmul", "qmatmul_mgpu", "set_interpret", "unsupported_reason"]
