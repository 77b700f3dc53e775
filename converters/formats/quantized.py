"""Quantized checkpoints of any format the readers know, by `quantization_config.quant_method`: one entry point
that returns what `converters.formats.compressed_tensors.read.read_compressed` returns.

compressed-tensors checkpoints (quant_method "compressed-tensors", or none) are read by
`compressed_tensors.read`. The torch ecosystem's other quantized formats each have a reader module in
`converters.formats` (listed in `READERS`) that gives the same `CompressedModel`: module path -> {"weight": QArray
of the Flax kernel's logical shape [in, out] along axis 0, "bias", "input_scale", ...}, with `quant` the
compressed-tensors `QuantConfig` that holds the same values (one config group per scheme). So every loader, the
CLI and the compressed-tensors writer take them without a detour through float.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable, Dict, Mapping

from qformats.errors import CheckpointError

__all__ = ["DESCRIPTIONS", "READERS", "quant_method", "read_quantized"]

#: quant_method -> "module:function" of its reader (a function of the checkpoint path -> CompressedModel).
READERS: Dict[str, str] = {
    "compressed-tensors": "converters.formats.compressed_tensors.read:read_compressed",
    "sparseml": "converters.formats.compressed_tensors.read:read_compressed",
    "fp8": "converters.formats.hf_fp8:read_hf_fp8",
    "mxfp4": "converters.formats.hf_mxfp4:read_hf_mxfp4",
    "modelopt": "converters.formats.modelopt:read_modelopt",
    "gptq": "converters.formats.gptq_awq:read_gptq",
    "awq": "converters.formats.gptq_awq:read_awq",
    "torchao": "converters.formats.torchao_st:read_torchao",
}

#: quant_method -> what the format is, for people (`qformats inspect`).
DESCRIPTIONS: Dict[str, str] = {
    "compressed-tensors": "compressed-tensors",
    "sparseml": "compressed-tensors (sparseml)",
    "fp8": "HF fine-grained FP8 blocks, transformers' FineGrainedFP8Config",
    "mxfp4": "gpt-oss MXFP4 experts, transformers' Mxfp4Config",
    "modelopt": "NVIDIA ModelOpt",
    "gptq": "GPTQ (AutoGPTQ / GPTQModel)",
    "awq": "AutoAWQ",
}


def quant_method(config: Mapping[str, Any]) -> str:
    """The quant_method of a config.json (a dict): "compressed-tensors" when the quantization_config names none,
    "dense" when there is no quantization_config."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not qc:
        return "dense"
    method = qc.get("quant_method", "compressed-tensors") if isinstance(qc, Mapping) else None
    return method if isinstance(method, str) else repr(method)


def reader_for(method: str, where: str) -> Callable[[Path], Any]:
    """The reader function of `method`; CheckpointError naming `where` and the methods read otherwise."""
    target = READERS.get(method)
    if target is None:
        raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not read by qformats; "
                              f"supported: {', '.join(sorted(READERS))}")
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


def read_quantized(path: "str | os.PathLike"):
    """Read a checkpoint directory (dense, compressed-tensors, or another quantized format of `READERS`) into a
    `CompressedModel` (see the module docstring). CheckpointError for an unknown quant_method or a malformed
    checkpoint, naming the file."""
    from converters.formats.safe_files import read_json

    path = Path(path)
    cfg_path = (path if path.is_dir() else path.parent) / "config.json"
    cfg = read_json(cfg_path) if os.path.lexists(cfg_path) else {}
    method = quant_method(cfg)
    if method == "dense":
        method = "compressed-tensors"
    return reader_for(method, str(cfg_path))(path)
