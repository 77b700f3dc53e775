"""Bounded-time matching of the `re:` patterns a checkpoint's quantization_config carries (targets, ignore).

compressed-tensors matches a `re:P` target with `re.match(P, name)`. The pattern comes from an untrusted
file, and Python's backtracking `re` takes exponential time on patterns such as `(a|aa)+$`, so:
  - with the `google-re2` binding installed (the `re2` module), patterns are compiled by RE2, which
    matches in time linear in the name; a pattern RE2 cannot express (lookaround, backreferences) is a
    CheckpointError rather than a silent non-match;
  - without it, Python's `re` is used, but only for patterns of at most MAX_PATTERN_CHARS characters
    with no repeated group that itself repeats or alternates (the shape of every catastrophic
    pattern), against names of at most MAX_NAME_CHARS characters.
For the patterns configs contain (`.*lm_head`, `model.layers.\\d+.mlp.gate$`, `visual.*`) both give
`re.match`'s answer on module names (ASCII, no newline).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from qformats.errors import CheckpointError

try:  # the linear-time matcher (PyPI: google-re2)
    import re2 as _re2
except ImportError:  # pragma: no cover - depends on the environment
    _re2 = None

__all__ = ["LINEAR_TIME", "MAX_NAME_CHARS", "MAX_PATTERN_CHARS", "compile_pattern", "pattern_matches"]

#: True when patterns are matched by RE2 (linear time); False: Python `re` under the caps below.
LINEAR_TIME = _re2 is not None
MAX_PATTERN_CHARS = 1000
MAX_NAME_CHARS = 1000

_UNBOUNDED = re.compile(r"[*+]|\{\d*,")


def _nested_repeat(pattern: str) -> bool:
    """True when a group repeated without bound (`(...)*`, `(...)+`, `(...){n,}`) holds a quantifier or an
    alternation -- the shape of every catastrophic-backtracking pattern."""
    stack, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class: skip to its closing bracket
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            stack.append(i)
        elif c == ")" and stack:
            body = pattern[stack.pop() + 1:i]
            body = body[2:] if body.startswith("?:") else body
            if _UNBOUNDED.match(pattern, i + 1) and re.search(r"[*+?|{]", body):
                return True
        i += 1
    return False


def _fail(where: str, pattern: str, why: str) -> CheckpointError:
    shown = pattern if len(pattern) <= 120 else pattern[:117] + "..."
    return CheckpointError(f"{where}: pattern 're:{shown}': {why}")


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str) -> "tuple[Callable[[str], bool] | None, str]":
    if len(pattern) > MAX_PATTERN_CHARS:
        return None, f"expected at most {MAX_PATTERN_CHARS} characters, found {len(pattern)}"
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return None, f"expected a Python regular expression, found an invalid one ({e})"
    if _re2 is not None:
        opts = _re2.Options()
        opts.log_errors = False
        try:
            rx = _re2.compile(pattern, opts)
        except _re2.error as e:
            why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            return None, (f"expected a pattern a linear-time matcher accepts (no lookaround, no "
                          f"backreferences), found one it rejects ({why})")
        return (lambda name: rx.match(name) is not None), ""
    if _nested_repeat(pattern):
        return None, ("expected no repeated group that repeats or alternates inside (it can take exponential "
                      "time); install google-re2 to match such patterns in linear time")
    rx = re.compile(pattern)
    return (lambda name: rx.match(name) is not None), ""


def compile_pattern(pattern: str, where: str = "quantization_config") -> Callable[[str], bool]:
    """A predicate name -> bool equal to `re.match(pattern, name) is not None` (compressed-tensors' rule for a
    `re:` target), evaluated in bounded time; CheckpointError naming `where` and the pattern otherwise."""
    if not isinstance(pattern, str):
        raise CheckpointError(f"{where}: expected a pattern string, found {type(pattern).__name__}")
    fn, why = _compile(pattern)
    if fn is None:
        raise _fail(where, pattern, why)
    return fn


def pattern_matches(pattern: str, name: str, where: str = "quantization_config") -> bool:
    """re.match(pattern, name) is not None, in bounded time (see the module docstring).

    Without RE2, a name longer than MAX_NAME_CHARS is a CheckpointError naming `where`."""
    fn = compile_pattern(pattern, where)
    if not LINEAR_TIME and len(name) > MAX_NAME_CHARS:
        raise CheckpointError(f"{where}: module name of {len(name)} characters: expected at most "
                              f"{MAX_NAME_CHARS} to match against 're:{pattern[:60]}'")
    try:
        return fn(name)
    except UnicodeError:  # a lone surrogate: not a name any file can hold
        raise CheckpointError(f"{where}: module name {name!r}: expected a valid Unicode string to match "
                              f"against 're:{pattern[:60]}'") from None
