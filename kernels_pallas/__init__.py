"""Pallas GPU kernels for packed FPx, MX, NVFP4 and INT matmuls, registered with qformats dispatch.

Importing this package registers `qmatmul` with `qformats.dispatch` for the GPU backend (see `register`).
"""

from kernels_pallas.layout import PreparedWeight, dequantize_prepared, prepare, unsupported_reason
from kernels_pallas.qmatmul import BlockSizes, default_block_sizes, qmatmul
from kernels_pallas.register import set_interpret

__all__ = ["BlockSizes", "PreparedWeight", "default_block_sizes", "dequantize_prepared", "prepare",
           "qmatmul", "set_interpret", "unsupported_reason"]
