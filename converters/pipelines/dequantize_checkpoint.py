"""A quantized checkpoint (compressed-tensors, or another format `converters.formats.quantized` reads) -> dense HF
safetensors checkpoint (Linear weights dequantized), streaming for compressed-tensors."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, TextIO

import jax.numpy as jnp
import numpy as np

from converters.formats.compressed_tensors.read import QUANT_PARAM_NAMES, dense_weight, iter_modules, open_compressed
from converters.formats.compressed_tensors.write import config_with
from converters.formats.quantized import quant_method, read_quantized
from converters.formats.safe_files import read_json
from converters.formats.shard_writer import ShardedWriter
from qformats.errors import CheckpointError
from qformats.qarray import QArray

__all__ = ["DTYPES", "dequantize_checkpoint"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dequantize_checkpoint(src: "str | os.PathLike", dst: "str | os.PathLike", dtype: Optional[str] = "float32",
                          max_shard_size: "int | str" = "5GB", overwrite: bool = False,
                          progress: "bool | TextIO" = False, exact: bool = False) -> int:
    """Write a dense checkpoint at `dst`: each quantized module's `weight` =
    `converters.formats.compressed_tensors.read.dense_weight(q, dtype, exact)` in torch layout `[out, in]` -- by
    default the values transformers loads into a `dtype` model (compressed-tensors' decompression, then a cast to
    `dtype`; dtype None: the dtype that decompression gives); exact=True: the float32 product rounded once to
    `dtype`. Its quantization parameters (weight_scale, input_scale, ...) dropped; every other tensor and file
    copied; config.json without `quantization_config` (and `torch_dtype` set to `dtype`). Returns the number of
    weights dequantized."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype: expected one of {sorted(DTYPES)}, found {dtype!r}")
    src, dst = Path(src), Path(dst)
    cfg_path = (src if src.is_dir() else src.parent) / "config.json"
    method = quant_method(read_json(cfg_path) if os.path.lexists(cfg_path) else {})
    n = 0
    if method in ("dense", "compressed-tensors", "sparseml"):
        ck, cfg, qc = open_compressed(src)  # streamed, one module at a time
        modules = ((mod.name, mod.tensors) for mod in iter_modules(ck, qc))
    else:  # another format's reader (converters.formats.quantized): memory-mapped views, read whole
        cm = read_quantized(src)
        ck, cfg, modules = None, cm.config, iter(cm.modules.items())
        if method == "mxfp4":  # gpt-oss: the experts go back to their fused parameters, as transformers loads them
            from converters.formats.moe_layout import fused_gpt_oss_experts

            n = len(cm.qarrays())
            modules = iter(fused_gpt_oss_experts(cm.modules, lambda q: np.asarray(
                dense_weight(q, DTYPES[dtype] if dtype else None, exact=exact))).items())
    stream = sys.stderr if progress is True else (progress or None)
    try:
        with ShardedWriter(dst, max_shard_size, overwrite=overwrite, sources=(src,)) as w:
            for name, tensors in modules:
                prefix = f"{name}." if name else ""
                quantized = isinstance(tensors.get("weight"), QArray)
                for local, arr in tensors.items():
                    if isinstance(arr, QArray):
                        dense = dense_weight(arr, DTYPES[dtype] if dtype else None, exact=exact)
                        w.add(prefix + local, np.ascontiguousarray(np.asarray(dense).T))
                        n += 1
                        if stream is not None:
                            stream.write(f"\rdequantized {n} weights")
                            stream.flush()
                    elif quantized and local in QUANT_PARAM_NAMES:
                        continue
                    else:
                        w.add(prefix + local, arr)
            cfg = config_with(cfg, None)
            if dtype is not None:
                cfg["torch_dtype"] = dtype
            w.add_json("config.json", cfg)
            w.copy_extra_files(src if src.is_dir() else src.parent)
    finally:
        if ck is not None:
            ck.close()
    if stream is not None:
        stream.write(f"\rdequantized {n} weights -> {dst}\n")
    return n
