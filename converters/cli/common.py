"""What the `qformats` subcommands share: the usage error, the raising argument parser, text and scheme arguments."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import List

__all__ = ["MAX_SHARD_SIZE_HELP", "Usage", "Parser", "cli_spelling", "read_text", "parse_schemes", "skipped_text"]

MAX_SHARD_SIZE_HELP = ("largest safetensors file written (default 5GB; units B, KB/MB/GB = powers of 1000, KiB/MiB/GiB "
                       "= powers of 1024); a bigger checkpoint is split into shards with a model.safetensors.index.json")

# The library's errors name its Python arguments; on the command line the same way out is an option.
_CLI_SPELLING = (
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bskip_indivisible=True\b"), "--skip-indivisible"),
    (re.compile(r"\bignore=\[\.\.\.\]"), "--ignore PATTERN"),
    (re.compile(r"\bscheme='([^']*)'"), r"--scheme \1"),
    (re.compile(r",? or leave them dense with a rule \(Rule\(path, None\) before the quantizing rule\)"), ""),
)


class Usage(Exception):
    """A usage error: `main` prints its message on stderr and exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises `Usage` instead of exiting, so `main` returns 2."""

    def error(self, message: str):
        raise Usage(f"{self.prog}: error: {message}")


def cli_spelling(message: str) -> str:
    """A library error message as the command line says it: `overwrite=True` -> `--overwrite`,
    `skip_indivisible=True` -> `--skip-indivisible`, `ignore=[...]` -> `--ignore PATTERN`, `scheme='X'` ->
    `--scheme X`; a way out that only the Python API has (a `Rule`) is dropped."""
    for pattern, cli in _CLI_SPELLING:
        message = pattern.sub(cli, message)
    return message


def skipped_text(head: str, skipped: List[str], width: int = 100) -> str:
    """"<head>left dense by --skip-indivisible (N): <paths>", layer numbers folded (`qformats.plan.paths_text`) and
    wrapped to `width` (`qformats.plan.wrap_list`)."""
    from qformats.plan import paths_text, wrap_list
    sep = "/" if any("/" in p for p in skipped) else "."
    return wrap_list(f"{head}left dense by --skip-indivisible ({len(skipped)}): ", paths_text(skipped, sep), width)


def read_text(flag: str, name: str) -> str:
    """The UTF-8 text of the file given to `flag`; a Usage error when it is missing, a CheckpointError naming the
    file when it is over the size cap or not strict UTF-8 (`converters.evaluation.calibration_data.read_text_file`)."""
    path = Path(name)
    if not path.is_file():
        raise Usage(f"qformats: error: {flag} {path}: no such file")
    from converters.evaluation.calibration_data import read_text_file
    return read_text_file(path, f"{flag} text")


def parse_schemes(text: str) -> List[str]:
    """A comma-separated --schemes / --scheme value -> its scheme strings ("stored" and "dense" kept as they are),
    every other one checked by `qformats.presets.parse_scheme` before any load (SchemeError: exit 1)."""
    from qformats.presets import parse_scheme
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise Usage(f"qformats: error: --schemes {text!r}: expected a comma-separated list of schemes")
    for s in out:
        if s.lower() not in ("stored", "dense"):
            parse_scheme(s)
    return out
