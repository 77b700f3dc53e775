"""The one matcher of module names: qformats rules (regex full match on "/" paths), compressed-tensors targets
(`re:` patterns matched from the start, class names, exact names) and ignore lists, in bounded time.

compressed-tensors matches a `re:P` target with `re.match(P, name)`; a qformats `Rule` matches with
`re.fullmatch(P, path)`. Patterns may come from an untrusted file, and Python's backtracking `re` takes
exponential time on patterns such as `(a|aa)+$`, so:
  - with the `google-re2` binding installed (the `re2` module), patterns are compiled by RE2, which
    matches in time linear in the name; a pattern RE2 cannot express (lookaround, backreferences) is a
    CheckpointError rather than a silent non-match;
  - without it, Python's `re` is used, but only for patterns of at most MAX_PATTERN_CHARS characters
    with no repeated group that itself repeats or alternates (the shape of every catastrophic
    pattern), against names of at most MAX_NAME_CHARS characters.
For the patterns configs contain (`.*lm_head`, `model.layers.\\d+.mlp.gate$`, `visual.*`) both give
`re.match`'s (or `re.fullmatch`'s) answer on module names (ASCII, no newline).

`Matcher` is an ordered list of selectors, each a test of a module (path, kind) and the scheme a match gives
(None: leave the module dense); the first selector that matches decides. `Matcher.from_rules` builds it from
qformats `Rule`s, `Matcher.from_targets` from a compressed-tensors config group (ignore entries first, then
targets), so `quantize_model`, `quantize_linen`, calibration and `quantize_checkpoint` select alike.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, List, Optional, Sequence, Tuple, Type, Union

from qformats.errors import CheckpointError, ModelError, QFormatsError, SchemeError
from qformats.presets import parse_scheme
from qformats.schemes import QuantScheme, SchemeSet

try:  # the linear-time matcher (PyPI: google-re2)
    import re2 as _re2
except ImportError:  # pragma: no cover - depends on the environment
    _re2 = None

__all__ = ["LINEAR_TIME", "MAX_NAME_CHARS", "MAX_PATTERN_CHARS", "Matcher", "Rule", "Selector", "compile_pattern",
           "pattern_matches", "resolve_scheme", "target_list"]

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


def _fail(error: Type[QFormatsError], where: str, pattern: str, why: str, prefix: str) -> QFormatsError:
    shown = pattern if len(pattern) <= 120 else pattern[:117] + "..."
    return error(f"{where}: pattern '{prefix}{shown}': {why}")


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str, full: bool) -> "tuple[Callable[[str], bool] | None, str]":
    if len(pattern) > MAX_PATTERN_CHARS:
        return None, f"expected at most {MAX_PATTERN_CHARS} characters, found {len(pattern)}"
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return None, f"expected a regular expression, found one that is not a valid regex ({e})"
    if _re2 is not None:
        opts = _re2.Options()
        opts.log_errors = False
        try:
            rx = _re2.compile(pattern, opts)
        except _re2.error as e:
            why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            return None, (f"expected a pattern a linear-time matcher accepts (no lookaround, no "
                          f"backreferences), found one it rejects ({why})")
    elif _nested_repeat(pattern):
        return None, ("expected no repeated group that repeats or alternates inside (it can take exponential "
                      "time); install google-re2 to match such patterns in linear time")
    else:
        rx = re.compile(pattern)
    if full:
        return (lambda name: rx.fullmatch(name) is not None), ""
    return (lambda name: rx.match(name) is not None), ""


def compile_pattern(pattern: str, where: str = "quantization_config", *, full: bool = False,
                    error: Type[QFormatsError] = CheckpointError) -> Callable[[str], bool]:
    """A predicate name -> bool equal to `re.match(pattern, name) is not None` (compressed-tensors' rule for a
    `re:` target), or to `re.fullmatch(pattern, name) is not None` with full=True (a qformats `Rule`), evaluated
    in bounded time; `error` (CheckpointError for a file's patterns, ModelError for rules) naming `where` and
    the pattern otherwise."""
    prefix = "" if full else "re:"
    if not isinstance(pattern, str):
        raise error(f"{where}: expected a pattern string, found {type(pattern).__name__}")
    fn, why = _compile(pattern, full)
    if fn is None:
        raise _fail(error, where, pattern, why, prefix)
    if LINEAR_TIME:
        return _checked(fn, pattern, where, error, prefix)

    def capped(name: str) -> bool:
        if len(name) > MAX_NAME_CHARS:
            raise error(f"{where}: module name of {len(name)} characters: expected at most "
                        f"{MAX_NAME_CHARS} to match against '{prefix}{pattern[:60]}'")
        return _checked(fn, pattern, where, error, prefix)(name)

    return capped


def _checked(fn, pattern, where, error, prefix):
    def match(name: str) -> bool:
        try:
            return fn(name)
        except UnicodeError:  # a lone surrogate: not a name any file can hold
            raise error(f"{where}: module name {name!r}: expected a valid Unicode string to match "
                        f"against '{prefix}{pattern[:60]}'") from None
    return match


def target_list(v, where: str, *, single: bool = True) -> Tuple[str, ...]:
    """A compressed-tensors `targets` / `ignore` entry checked: a list of strings (a lone string too when
    `single`), every `re:` pattern compiled for bounded-time matching; CheckpointError naming `where` otherwise."""
    if single and isinstance(v, str):
        v = [v]
    if not (isinstance(v, list) and all(isinstance(t, str) for t in v)):
        raise CheckpointError(f"{where}: expected a list of strings, found {v!r}")
    for i, t in enumerate(v):
        if t.startswith("re:"):
            compile_pattern(t[3:], f"{where}[{i}]")
    return tuple(v)


def pattern_matches(pattern: str, name: str, where: str = "quantization_config") -> bool:
    """re.match(pattern, name) is not None, in bounded time (see the module docstring).

    Without RE2, a name longer than MAX_NAME_CHARS is a CheckpointError naming `where`."""
    return compile_pattern(pattern, where)(name)


# ---- what a match means: selectors and the matcher ----------------------------------------------------------

SchemeLike = Union[str, SchemeSet, QuantScheme, None]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Quantize modules whose path fully matches `pattern` (`re.fullmatch` on e.g. "encoder/layers/0/
    attention/query") with `scheme`: a preset name ("FP8_DYNAMIC", "W4A16", ...), a SchemeSet, a
    QuantScheme (weight-only), or None to leave matching modules as they are."""

    pattern: str
    scheme: SchemeLike = None


def resolve_scheme(scheme: SchemeLike) -> Optional[SchemeSet]:
    """Scheme string ("W4A16", "W4A16:g64", "FP8_BLOCK:w": `qformats.presets.parse_scheme`) | SchemeSet |
    QuantScheme (weights only) | None → SchemeSet or None (SchemeError if unknown)."""
    if scheme is None or isinstance(scheme, SchemeSet):
        return scheme
    if isinstance(scheme, QuantScheme):
        return SchemeSet(scheme.describe(), weights=scheme)
    if isinstance(scheme, str):
        return parse_scheme(scheme)
    raise SchemeError(f"expected a preset name, SchemeSet, QuantScheme or None, got {type(scheme).__name__}")


@dataclasses.dataclass(frozen=True)
class Selector:
    """One entry of a `Matcher`: `label` says it as the user wrote it ("rule #0 '.*'", "target 'Linear'",
    "ignore 'lm_head'"), `test(path, kind)` whether it matches a module, `scheme` what a match gives (None:
    the module stays dense)."""

    label: str
    test: Callable[[str, str], bool]
    scheme: Optional[SchemeSet]
    role: str = "rule"   # "rule" | "target" | "ignore"
    entry: object = None  # the rule, target or ignore entry as given


class Matcher:
    """An ordered list of `Selector`s; the first that matches a module decides its scheme.

    `match(path, kind)` -> (index of the deciding selector or None, its scheme). `used` records which
    selectors decided something (with `count_all`, which matched something), so `unused()` can name the ones
    that matched nothing: a rule shadowed by an earlier one is unused; a compressed-tensors target is used
    whenever it matches, even a module an ignore entry then leaves dense."""

    def __init__(self, selectors: Sequence[Selector], count_all: bool = False):
        self.selectors: Tuple[Selector, ...] = tuple(selectors)
        self.count_all = count_all
        self.used: set = set()

    def match(self, path: str, kind: str = "Linear") -> Tuple[Optional[int], Optional[SchemeSet]]:
        first = None
        for i, s in enumerate(self.selectors):
            if (first is None or self.count_all) and s.test(path, kind):
                self.used.add(i)
                first = i if first is None else first
                if not self.count_all:
                    break
        return (None, None) if first is None else (first, self.selectors[first].scheme)

    def unused(self) -> List[Selector]:
        """The selectors that have decided no module so far."""
        return [s for i, s in enumerate(self.selectors) if i not in self.used]

    @classmethod
    def from_rules(cls, rules: Sequence) -> "Matcher":
        """qformats rules: each `Rule(pattern, scheme)` (a bare string or a (pattern, scheme) tuple is a Rule)
        matches a module when `re.fullmatch(pattern, path)`; every pattern and scheme is checked first
        (ModelError naming the rule), and a rule's scheme must quantize weights."""
        if isinstance(rules, (Rule, str)):
            rules = [rules]
        out = []
        for i, r in enumerate(rules):
            if isinstance(r, (tuple, str)):
                r = Rule(*r) if isinstance(r, tuple) else Rule(r)
            if not isinstance(r, Rule):
                raise ModelError(f"rule #{i}: expected a Rule(pattern, scheme), got {r!r}")
            where = f"rule #{i} {r.pattern!r}" if isinstance(r.pattern, str) else f"rule #{i}"
            fn = compile_pattern(r.pattern, where, full=True, error=ModelError)
            try:
                ss = resolve_scheme(r.scheme)
            except SchemeError as e:
                raise ModelError(f"{where}: {e}") from e
            if ss is not None and ss.weights is None:
                raise ModelError(f"{where}: scheme {ss.name!r} quantizes no weights")
            out.append(Selector(f"rule #{i} {r.pattern!r}", lambda path, kind, fn=fn: fn(path), ss, "rule", r))
        return cls(out)

    @classmethod
    def from_targets(cls, scheme: Optional[SchemeSet], targets: Sequence[str] = ("Linear",),
                     ignore: Sequence[str] = (), *, sep: str = ".", where: str = "quantization_config",
                     error: Type[QFormatsError] = CheckpointError) -> "Matcher":
        """A compressed-tensors config group: a module is quantized with `scheme` when a target matches it and
        no ignore entry does (compressed-tensors' rule); an ignore entry decides (scheme None) only modules a
        target matches, so an ignore entry that names no targeted module is reported unused.

        A target is `re:P` (re.match(P, path), as compressed-tensors matches), a module class name
        ("Linear", "Embedding": compared with the module's kind) or an exact module path. An ignore entry is
        `re:P`, an exact path, or a last part of the path ("lm_head" also ignores "model.lm_head")."""
        tests = {}
        for what, entries in (("target", targets), ("ignore", ignore)):
            tests[what] = []
            for i, t in enumerate(entries):
                if not isinstance(t, str):
                    raise error(f"{where}: {what} entries: expected strings, found {t!r}")
                key = "targets" if what == "target" else "ignore"  # the config's keys
                tests[what].append((t, _entry_test(t, what, sep, f"{where}: {key}[{i}]", error)))

        def targeted(path: str, kind: str) -> bool:
            return any(fn(path, kind) for _, fn in tests["target"])

        sels = [Selector(f"ignore {t!r}", lambda path, kind, fn=fn: fn(path, kind) and targeted(path, kind), None,
                         "ignore", t) for t, fn in tests["ignore"]]
        sels += [Selector(f"target {t!r}", fn, scheme, "target", t) for t, fn in tests["target"]]
        return cls(sels, count_all=True)


def _entry_test(entry: str, what: str, sep: str, where: str, error) -> Callable[[str, str], bool]:
    if entry.startswith("re:"):
        fn = compile_pattern(entry[3:], where, error=error)
        return lambda path, kind: fn(path)
    if what == "target" and entry[:1].isupper() and sep not in entry:
        return lambda path, kind: kind == entry
    if what == "ignore":
        return lambda path, kind: path == entry or path.endswith(sep + entry)
    return lambda path, kind: path == entry
