"""Pallas GPU kernels for packed FPx, MX, NVFP4 and INT matmuls, registered with qformats dispatch."""
