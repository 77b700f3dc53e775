"""qformats: exact low-precision formats (FP8, FPx EyMz, MX, NVFP4, INT2-8) as pure JAX transforms."""

from qformats.errors import CheckpointError, FormatError, KernelError, ModelError, QFormatsError, SchemeError
from qformats.formats import E8M0, E8M0Format, FloatFormat, IntFormat, get_format
from qformats.codec import code_table, decode, encode, encode_e8m0
from qformats.schemes import QuantScheme, SchemeSet
from qformats.qarray import QArray
from qformats.quantize import dequantize, fake_quantize, quantize
from qformats.presets import presets
from qformats.dispatch import prepare_weight, qdot, register_kernel, set_kernels_enabled
from qformats.scaled_dot import scaled_dot

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "FormatError", "KernelError", "ModelError", "QFormatsError", "SchemeError",
    "E8M0", "E8M0Format", "FloatFormat", "IntFormat", "get_format",
    "code_table", "decode", "encode", "encode_e8m0",
    "QuantScheme", "SchemeSet", "QArray", "dequantize", "fake_quantize", "quantize", "presets",
    "prepare_weight", "qdot", "register_kernel", "scaled_dot", "set_kernels_enabled",
]
