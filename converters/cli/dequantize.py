"""`qformats dequantize SRC DST [--dtype float32|bfloat16|float16]`: compressed-tensors -> dense checkpoint."""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    d = sub.add_parser("dequantize", help="compressed-tensors checkpoint -> dense safetensors checkpoint")
    d.add_argument("src")
    d.add_argument("dst")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    d.add_argument("--max-shard-size", default="5GB")
    d.add_argument("--overwrite", action="store_true")


def run(a) -> int:
    """Dequantizes a.src into a.dst (`converters.pipelines.dequantize_checkpoint`); returns the exit status."""
    from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint
    n = dequantize_checkpoint(a.src, a.dst, a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"dequantized {n} weights to {a.dtype} -> {a.dst}")
    return 0
