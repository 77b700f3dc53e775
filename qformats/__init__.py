"""qformats: exact low-precision formats (FP8, FPx EyMz, MX, NVFP4, INT1-8) as pure JAX transforms."""

import importlib
from qformats.errors import CheckpointError, FormatError, KernelError, ModelError, QFormatsError, SchemeError
from qformats.formats import E8M0, IQ4_NL, E8M0Format, FloatFormat, IntFormat, TableFormat, get_format
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
    "E8M0", "E8M0Format", "FloatFormat", "IntFormat", "TableFormat", "IQ4_NL", "get_format",
    "code_table", "decode", "encode", "encode_e8m0",
    "QuantScheme", "SchemeSet", "QArray", "dequantize", "fake_quantize", "quantize", "presets",
    "prepare_weight", "qdot", "register_kernel", "scaled_dot", "set_kernels_enabled",
]

# Flax integration and model definitions import flax: loaded on first attribute access (`qformats.nn`), so that
# `import qformats` stays free of flax.
_LAZY_SUBMODULES = ("nn", "models")


def __getattr__(name):
    """`qformats.nn` / `qformats.models` without an explicit import: the submodule, imported on first use."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
