"""compressed-tensors / HF safetensors checkpoint I/O, whole-checkpoint quantization and the qformats CLI.

Public entry points (imported lazily, so `import converters.safetensors_io` stays light):
  read_compressed(path) -> CompressedModel       converters.ct_read
  write_compressed(dst, tensors, schemes, ...)   converters.ct_write
  quantize_checkpoint(src, dst, scheme, ...)     converters.quantize_checkpoint
  dequantize_checkpoint(src, dst, dtype, ...)    converters.dequantize_checkpoint
  inspect_checkpoint(path) -> rows               converters.inspect_checkpoint
  load_compressed(path, model) / save_compressed(model, dst)   converters.flax_io (Flax NNX models)
  parse_quantization_config / serialize_quantization_config   converters.ct_config
"""

import importlib

_EXPORTS = {
    "read_compressed": "converters.ct_read",
    "CompressedModel": "converters.ct_read",
    "to_flax_params": "converters.ct_read",
    "write_compressed": "converters.ct_write",
    "CompressedWriter": "converters.ct_write",
    "quantize_checkpoint": "converters.quantize_checkpoint",
    "dequantize_checkpoint": "converters.dequantize_checkpoint",
    "inspect_checkpoint": "converters.inspect_checkpoint",
    "load_compressed": "converters.flax_io",
    "save_compressed": "converters.flax_io",
    "parse_quantization_config": "converters.ct_config",
    "serialize_quantization_config": "converters.ct_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'converters' has no attribute {name!r}")
