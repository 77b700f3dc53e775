"""compressed-tensors / HF safetensors / GGUF checkpoint I/O, whole-checkpoint jobs, evaluation and the qformats CLI.

Subpackages, by concept:
  converters.formats      safetensors I/O, compressed-tensors (config, read, write, patterns, transforms), GGUF
  converters.pipelines    whole-checkpoint jobs: quantize, calibrate, rotate, dequantize, inspect, causal-LM loading
  converters.evaluation   perplexity, MiniLM embedding fidelity, calibration data, the embedded demo models
  converters.cli          the `qformats` command line, one module per subcommand

Public entry points (imported lazily, so `import converters.formats.safetensors_io` stays light):
  read_compressed(path) -> CompressedModel       converters.formats.compressed_tensors.read
  write_compressed(dst, tensors, schemes, ...)   converters.formats.compressed_tensors.write
  parse_quantization_config / serialize_quantization_config   converters.formats.compressed_tensors.config
  quantize_checkpoint(src, dst, scheme, ...)     converters.pipelines.quantize_checkpoint
  dequantize_checkpoint(src, dst, dtype, ...)    converters.pipelines.dequantize_checkpoint
  inspect_checkpoint(path) -> rows               converters.pipelines.inspect_checkpoint
  load_compressed(path, model) / save_compressed(model, dst)   converters.pipelines.flax_io (Flax NNX models)
"""

import importlib

_EXPORTS = {
    "read_compressed": "converters.formats.compressed_tensors.read",
    "CompressedModel": "converters.formats.compressed_tensors.read",
    "to_flax_params": "converters.formats.compressed_tensors.read",
    "write_compressed": "converters.formats.compressed_tensors.write",
    "CompressedWriter": "converters.formats.compressed_tensors.write",
    "quantize_checkpoint": "converters.pipelines.quantize_checkpoint",
    "dequantize_checkpoint": "converters.pipelines.dequantize_checkpoint",
    "inspect_checkpoint": "converters.pipelines.inspect_checkpoint",
    "load_compressed": "converters.pipelines.flax_io",
    "save_compressed": "converters.pipelines.flax_io",
    "parse_quantization_config": "converters.formats.compressed_tensors.config",
    "serialize_quantization_config": "converters.formats.compressed_tensors.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'converters' has no attribute {name!r}")
