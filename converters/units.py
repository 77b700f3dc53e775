"""Sizes as a person reads them (the CLI's summaries and progress lines)."""

from __future__ import annotations

__all__ = ["size_text"]


def size_text(n: float) -> str:
    """Bytes in powers of 1000: "512 B", "538.1 MB"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"  # pragma: no cover
