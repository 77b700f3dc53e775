"""A quantized checkpoint of another format (HF FP8, gpt-oss MXFP4, ModelOpt NVFP4, AutoGPTQ, AutoAWQ:
`converters.formats.quantized`) written as the compressed-tensors checkpoint that holds the same values, without a
detour through float."""

from __future__ import annotations

import os
from pathlib import Path

from qformats.errors import CheckpointError

__all__ = ["convert_quantized"]


def convert_quantized(src: "str | os.PathLike", dst: "str | os.PathLike", *, max_shard_size: "int | str" = "5GB",
                      overwrite: bool = False) -> Path:
    """Read `src` with its format's reader (`converters.formats.quantized.read_quantized`: codes and scales as
    stored, in QArrays of the equivalent compressed-tensors schemes) and write them with the compressed-tensors
    writer: each quantized module under its config group's scheme, every other tensor as is, the other files
    copied, config.json with the compressed-tensors quantization_config in place of the source's. Returns `dst`.

    Raises:
      CheckpointError: `src` is dense or already compressed-tensors, its quant_method has no reader, or the
        reader refuses something it cannot hold exactly (naming the tensor)."""
    from converters.formats.compressed_tensors.write import write_compressed
    from converters.formats.quantized import quant_method, read_quantized
    from converters.formats.safe_files import read_json

    src = Path(src)
    cfg_path = (src if src.is_dir() else src.parent) / "config.json"
    method = quant_method(read_json(cfg_path)) if os.path.lexists(cfg_path) else "dense"
    if method in ("dense", "compressed-tensors", "sparseml"):
        raise CheckpointError(f"{cfg_path}: expected a quantized checkpoint of another format to convert "
                              f"(quant_method fp8, mxfp4, modelopt, gptq, awq), found {method}")
    if method == "mxfp4":  # bytes copied, never decoded: subnormal groups are held exactly too
        from converters.formats.hf_mxfp4 import read_hf_mxfp4

        cm = read_hf_mxfp4(src, computed=False)
    else:
        cm = read_quantized(src)
    tensors = {f"{m}.{local}" if m else local: a for m, t in cm.modules.items() for local, a in t.items()}
    by_name = {g.name: g for g in cm.quant.groups}
    schemes = {m: by_name[name].scheme_set for m, name in cm.groups.items()}  # targets may be regexes
    config = {k: v for k, v in cm.config.items() if k != "quantization_config"}
    return write_compressed(dst, tensors, schemes, ignore=list(cm.quant.ignore), config=config,
                            copy_from=src if src.is_dir() else src.parent, max_shard_size=max_shard_size,
                            overwrite=overwrite)
