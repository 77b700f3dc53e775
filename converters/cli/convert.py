"""`qformats convert SRC DST`: a GGUF causal LM -> a dense HF checkpoint, as transformers reads it; a quantized
checkpoint of another format (HF FP8, ModelOpt NVFP4, AutoGPTQ, AutoAWQ) -> the compressed-tensors checkpoint holding
the same values."""

from __future__ import annotations

import sys

from converters.cli.common import MAX_SHARD_SIZE_HELP

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    c = sub.add_parser("convert", help="GGUF causal LM (llama, qwen2, qwen3) -> dense HF checkpoint "
                                       "(config.json, safetensors, tokenizer.json), as transformers reads the file; "
                                       "or a quantized checkpoint directory of another format (quant_method fp8, "
                                       "modelopt, gptq, awq) -> compressed-tensors, losslessly")
    c.add_argument("src", metavar="SRC", help="GGUF file of a llama / qwen2 / qwen3 causal LM, or a quantized "
                                              "checkpoint directory (HF FP8, ModelOpt NVFP4, AutoGPTQ, AutoAWQ)")
    c.add_argument("dst", metavar="DST", help="new directory for the HF checkpoint")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="GGUF: tensor dtype (default float32: transformers' GGUF loader, bit for bit)")
    c.add_argument("--max-shard-size", default="5GB", help=MAX_SHARD_SIZE_HELP)
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")


def run(a) -> int:
    """Converts a.src into a.dst (`converters.formats.gguf_convert.convert_gguf`); returns the exit status."""
    import time

    from pathlib import Path

    from converters.formats.gguf_convert import convert_gguf
    from qformats.errors import CheckpointError
    if Path(a.dst).exists() and not a.overwrite:  # before reading the file (seconds for a large one)
        raise CheckpointError(f"{a.dst}: expected a new path for the checkpoint, found it exists (pass --overwrite "
                              f"to replace it)")
    t0 = time.monotonic()
    if Path(a.src).is_dir():
        from converters.pipelines.convert_quantized import convert_quantized

        print(f"converting {a.src} -> {a.dst} (compressed-tensors) ...", file=sys.stderr, flush=True)
        out = convert_quantized(a.src, a.dst, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
        print(f"converted {a.src} -> {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return 0
    print(f"converting {a.src} -> {a.dst} ({a.dtype}) ...", file=sys.stderr, flush=True)
    out = convert_gguf(a.src, a.dst, dtype=a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"converted {a.src} -> {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0
