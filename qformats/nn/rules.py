"""Rules: regex on "/"-joined module paths → scheme set; first match wins; all validated before use."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import List, Optional, Sequence, Tuple, Union

from qformats.errors import ModelError, SchemeError
from qformats.presets import parse_scheme
from qformats.schemes import QuantScheme, SchemeSet

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


def compile_rules(rules: Sequence) -> List[Tuple[Rule, "re.Pattern", Optional[SchemeSet]]]:
    """Check every rule (regex compiles, scheme exists) → [(rule, compiled, scheme set)]; ModelError otherwise.

    A bare string or (pattern, scheme) tuple is accepted as a Rule.
    """
    if isinstance(rules, (Rule, str)):
        rules = [rules]
    out = []
    for i, r in enumerate(rules):
        if isinstance(r, tuple):
            r = Rule(*r)
        if not isinstance(r, Rule):
            raise ModelError(f"rule #{i}: expected a Rule(pattern, scheme), got {r!r}")
        try:
            rx = re.compile(r.pattern)
        except re.error as e:
            raise ModelError(f"rule #{i} {r.pattern!r}: the pattern is not a valid regex ({e})") from e
        try:
            ss = resolve_scheme(r.scheme)
        except SchemeError as e:
            raise ModelError(f"rule #{i} {r.pattern!r}: {e}") from e
        if ss is not None and ss.weights is None:
            raise ModelError(f"rule #{i} {r.pattern!r}: scheme {ss.name!r} quantizes no weights")
        out.append((r, rx, ss))
    return out


def match(compiled, path: str):
    """Index and scheme set of the first rule matching `path`, or (None, None)."""
    for i, (_, rx, ss) in enumerate(compiled):
        if rx.fullmatch(path):
            return i, ss
    return None, None


def select(compiled, items):
    """[(path, item, SchemeSet)] for each (path, item) whose first matching rule quantizes it (rules with
    scheme None match but leave the module alone); warns about rules that matched nothing."""
    chosen, used = [], set()
    for path, item in items:
        i, ss = match(compiled, path)
        if i is None:
            continue
        used.add(i)
        if ss is not None:
            chosen.append((path, item, ss))
    warn_unused(compiled, used)
    return chosen


def warn_unused(compiled, used: set) -> None:
    for i, (r, _, _) in enumerate(compiled):
        if i not in used:
            warnings.warn(f"qformats.nn: rule #{i} {r.pattern!r} matched no Linear / LinearGeneral / Einsum module "
                          "(or Dense, in linen)", stacklevel=4)


def group_indivisible(columns: int, scheme: Optional[QuantScheme]) -> Optional[str]:
    """Why a weight with `columns` input columns cannot take `scheme`'s scale groups, or None when it can.

    GROUP and TENSOR_GROUP weights need columns % group_size == 0. llm-compressor 0.14 refuses
    `columns >= group_size and columns % group_size != 0` up front (group_size_validation.py); with
    columns < group_size its check passes but compressed-tensors' quantize then raises ("tensor column shape
    must be divisible by the given group_size"), as `qformats.quantize` does: both are refused here. BLOCK
    weights are never refused: a partial last block is legal (scales by ceiling division), as for both.
    """
    if scheme is None or scheme.strategy not in ("group", "tensor_group") or columns % scheme.group_size == 0:
        return None
    g = scheme.group_size
    if columns >= g:
        return f"columns={columns} not divisible by group_size={g}"
    return (f"columns={columns} < group_size={g} (llm-compressor's early check lets this through; "
            f"compressed-tensors' quantize refuses it)")


def check_fits(layers: Sequence[Tuple[str, int, SchemeSet]], *, static_acts: bool) -> None:
    """`check_fit` over (path, in_features, scheme set) for every selected layer, the group-size ones first and
    all at once: ModelError listing EVERY layer whose weight (or activation) groups do not divide its
    in_features (`group_indivisible`), with its size and the ways out; then the other checks per layer."""
    bad = []
    for path, k, ss in layers:
        for what, s in (("weight", ss.weights), ("activation", ss.input_activations)):
            why = group_indivisible(k, s)
            if why is not None:
                bad.append(f"  {path}: {what} group size {s.group_size} of {ss.name} ({s.describe()}) does not "
                           f"divide in_features = {k} ({why})")
    if bad:
        raise ModelError(f"{len(bad)} layer(s) do not fit their scheme's groups (GROUP / TENSOR_GROUP need "
                         f"in_features % group_size == 0, as llm-compressor and compressed-tensors require):\n"
                         + "\n".join(bad) + "\nWays out: leave them dense with a rule (Rule(path, None) before "
                         "the quantizing rule), or pick a group size that divides in_features (e.g. 'W4A16:g64').")
    for path, k, ss in layers:
        check_fit(path, k, ss, static_acts=static_acts)


def check_fit(path: str, in_features: int, ss: SchemeSet, *, static_acts: bool) -> None:
    """ModelError naming `path` when the layer's shape or the activation scheme does not fit: weight and
    activation groups must divide in_features (`group_indivisible`), weights cannot take 'token' scales,
    activations cannot take 'block' ones, and calibrated static activation scales must be per-tensor."""
    w = ss.weights
    if w.strategy == "token":
        raise ModelError(f"{path}: weight scheme {w.describe()} uses strategy 'token', which is for activations")
    for what, s in (("weight", w), ("activation", ss.input_activations)):
        why = group_indivisible(in_features, s)
        if why is not None:
            raise ModelError(f"{path}: {what} group size {s.group_size} of {ss.name} ({s.describe()}) does not "
                             f"divide in_features = {in_features} ({why})")
    a = ss.input_activations
    if a is not None and a.strategy == "block":
        raise ModelError(f"{path}: activation scheme {a.describe()} uses 'block', which needs a 2-D weight")
    if static_acts and a is not None and a.dynamic is not True and a.strategy not in ("tensor", "tensor_group"):
        raise ModelError(f"{path}: static activation scheme {a.describe()} must be per-tensor to be calibrated")
