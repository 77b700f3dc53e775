"""`qformats convert SRC DST`: a GGUF causal LM -> the compressed-tensors checkpoint holding its values exactly
(`--dequantize`: the types it cannot hold written dense; `--dense`: every tensor dense, as transformers' GGUF loader
reads the file); a quantized checkpoint of another format (HF FP8, ModelOpt NVFP4, AutoGPTQ, AutoAWQ) -> the
compressed-tensors checkpoint holding the same values."""

from __future__ import annotations

import sys

from converters.cli.common import MAX_SHARD_SIZE_HELP

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    c = sub.add_parser("convert", help="GGUF causal LM (llama, qwen2, qwen3) -> compressed-tensors checkpoint "
                                       "(config.json, safetensors, tokenizer.json) holding the file's block types "
                                       "exactly (Q8_0, Q4_0, Q5_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4), or with --dense "
                                       "a dense HF checkpoint as transformers reads the file; or a quantized "
                                       "checkpoint directory of another format (quant_method fp8, modelopt, gptq, "
                                       "awq) -> compressed-tensors, losslessly")
    c.add_argument("src", metavar="SRC", help="GGUF file of a llama / qwen2 / qwen3 causal LM, or a quantized "
                                              "checkpoint directory (HF FP8, ModelOpt NVFP4, AutoGPTQ, AutoAWQ)")
    c.add_argument("dst", metavar="DST", help="new directory for the HF checkpoint")
    c.add_argument("--dequantize", action="store_true",
                   help="GGUF: write the Linear weights whose type compressed-tensors cannot hold exactly (Q4_1, Q5_1, "
                        "Q4_K, Q5_K, Q2_K: a float offset) dense in float32, keeping the others quantized")
    c.add_argument("--dense", action="store_true",
                   help="GGUF: write every tensor dense (gguf's dequantization), as transformers' GGUF loader reads "
                        "the file")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="GGUF with --dense: tensor dtype (default float32: transformers' GGUF loader, bit for bit)")
    c.add_argument("--widen", action="store_true",
                   help="GGUF: write the 3/5/6-bit symmetric types (Q3_K, Q5_0, Q6_K) as 8-bit pack-quantized (the same "
                        "integers and scales, exact; 8 bits per weight), the widths vLLM's WNA16 scheme serves")
    c.add_argument("--max-shard-size", default="5GB", help=MAX_SHARD_SIZE_HELP)
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")


def run(a) -> int:
    """Converts a.src into a.dst (`converters.pipelines.convert_quantized.convert_gguf_compressed`, with --dense
    `converters.formats.gguf_convert.convert_gguf`; a directory: `convert_quantized`); returns the exit status."""
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

        if a.dequantize or a.dense or a.widen or a.dtype != "float32":
            raise CheckpointError(f"{a.src}: --dequantize, --dense, --widen and --dtype apply to GGUF files; a quantized "
                                  f"checkpoint directory converts to compressed-tensors as it is")
        print(f"converting {a.src} -> {a.dst} (compressed-tensors) ...", file=sys.stderr, flush=True)
        out = convert_quantized(a.src, a.dst, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
        print(f"converted {a.src} -> {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return 0
    if a.dense:
        if a.widen or a.dequantize:
            raise CheckpointError(f"{a.src}: --widen and --dequantize apply to the compressed-tensors output; --dense "
                                  f"writes every tensor dense already")
        print(f"converting {a.src} -> {a.dst} (dense {a.dtype}) ...", file=sys.stderr, flush=True)
        out = convert_gguf(a.src, a.dst, dtype=a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
        print(f"converted {a.src} -> {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return 0
    if a.dtype != "float32":
        raise CheckpointError(f"{a.src}: --dtype {a.dtype} applies to --dense output; the compressed-tensors "
                              f"checkpoint keeps float32 scales and dense tensors, which hold the file's values exactly")
    from converters.pipelines.convert_quantized import convert_gguf_compressed

    print(f"converting {a.src} -> {a.dst} (compressed-tensors) ...", file=sys.stderr, flush=True)
    r = convert_gguf_compressed(a.src, a.dst, dequantize=a.dequantize, max_shard_size=a.max_shard_size,
                                overwrite=a.overwrite, progress=sys.stderr.isatty(), widen=a.widen)
    for line in r.summary():
        print(f"  {line}", file=sys.stderr)
    print(f"converted {a.src} -> {r.path} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0
