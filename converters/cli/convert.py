"""`qformats convert SRC.gguf DST [--dtype ...]`: a GGUF causal LM -> a dense HF checkpoint, as transformers reads it."""

from __future__ import annotations

import sys

from converters.cli.common import MAX_SHARD_SIZE_HELP

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    c = sub.add_parser("convert", help="GGUF causal LM (llama, qwen2, qwen3) -> dense HF checkpoint "
                                       "(config.json, safetensors, tokenizer.json), as transformers reads the file")
    c.add_argument("src", metavar="SRC.gguf", help="GGUF file of a llama / qwen2 / qwen3 causal LM")
    c.add_argument("dst", metavar="DST", help="new directory for the HF checkpoint")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="tensor dtype (default float32: transformers' GGUF loader, bit for bit)")
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
    print(f"converting {a.src} -> {a.dst} ({a.dtype}) ...", file=sys.stderr, flush=True)
    out = convert_gguf(a.src, a.dst, dtype=a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"converted {a.src} -> {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0
