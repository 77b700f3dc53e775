"""`qformats dequantize SRC DST [--dtype float32|bfloat16|float16]`: compressed-tensors -> dense checkpoint."""

from __future__ import annotations

from converters.cli.common import MAX_SHARD_SIZE_HELP

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    d = sub.add_parser("dequantize", help="compressed-tensors checkpoint -> dense safetensors checkpoint (every "
                                          "quantized weight replaced by its dequantized values; config.json without "
                                          "quantization_config; other files copied)")
    d.add_argument("src", metavar="SRC", help="compressed-tensors checkpoint directory (or one .safetensors file)")
    d.add_argument("dst", metavar="DST", help="new directory for the dense checkpoint")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the dequantized weights (default float32); other tensors keep theirs")
    d.add_argument("--max-shard-size", default="5GB", help=MAX_SHARD_SIZE_HELP)
    d.add_argument("--overwrite", action="store_true", help="replace DST if it exists")


def run(a) -> int:
    """Dequantizes a.src into a.dst (`converters.pipelines.dequantize_checkpoint`); returns the exit status."""
    from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint
    n = dequantize_checkpoint(a.src, a.dst, a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"dequantized {n} weights to {a.dtype} -> {a.dst}")
    return 0
