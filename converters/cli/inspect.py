"""`qformats inspect PATH`: a checkpoint's quantization summary, then its per-tensor table (module, format, scheme,
shape, bytes, ratio), in natural order."""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    i = sub.add_parser("inspect", help="a checkpoint's quantization summary (format, scheme per config group, ignore "
                                       "list) and its per-tensor table: module, format, scheme, shape, bytes, ratio")
    i.add_argument("path", metavar="PATH", help="checkpoint directory (compressed-tensors or dense) or a "
                                                ".safetensors file")


def run(a) -> int:
    """Prints the quantization summary and the table of `converters.pipelines.inspect_checkpoint`; returns the exit
    status."""
    from converters.pipelines.inspect_checkpoint import format_table, inspect_checkpoint, quantization_summary
    print(quantization_summary(a.path))
    print()
    print(format_table(inspect_checkpoint(a.path)))
    return 0
