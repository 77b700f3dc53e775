"""`qformats inspect PATH`: the per-tensor table of a checkpoint (module, format, scheme, shape, bytes, ratio)."""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    i = sub.add_parser("inspect", help="per-tensor table: module, format, scheme, shape, bytes, ratio")
    i.add_argument("path")


def run(a) -> int:
    """Prints the table of `converters.pipelines.inspect_checkpoint`; returns the exit status."""
    from converters.pipelines.inspect_checkpoint import format_table, inspect_checkpoint
    print(format_table(inspect_checkpoint(a.path)))
    return 0
