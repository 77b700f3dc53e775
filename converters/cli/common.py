"""What the `qformats` subcommands share: the usage error, the raising argument parser, text and scheme arguments."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

__all__ = ["Usage", "Parser", "read_text", "parse_schemes"]


class Usage(Exception):
    """A usage error: `main` prints its message on stderr and exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises `Usage` instead of exiting, so `main` returns 2."""

    def error(self, message: str):
        raise Usage(f"{self.prog}: error: {message}")


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
