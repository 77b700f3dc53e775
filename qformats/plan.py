"""The quantization plan: for every candidate module, the scheme it takes or why it stays dense, checked whole."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

from qformats.errors import ModelError, QFormatsError
from qformats.algorithms.shared_scales import selected_groups
from qformats.matching import Matcher, Selector
from qformats.schemes import QuantScheme, SchemeSet

__all__ = ["Candidate", "Decision", "Plan", "check_fit", "check_fits", "divisible_group_scheme", "group_indivisible",
           "group_paths", "misfits", "natural_key", "paths_text", "plan_quantization", "warn_unused_rules", "wrap_list"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A module that holds a matmul weight: its `path` as the caller spells it ("/"-joined in Flax, "."-joined
    in checkpoints), `in_features` K of the [K, N] matrix its weight is contracted as (None where the
    caller measures it only for the modules the plan quantizes), its `kind` (the class a
    compressed-tensors target names: "Linear", "Embedding") and `how` the kind was known ("model" when the
    model definition says so, "name heuristic" when guessed from names and shapes)."""

    path: str
    in_features: Optional[int] = None
    kind: str = "Linear"
    how: str = "model"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the plan does with one candidate: `scheme` (None: left dense), `why` in words, and the `selector`
    that decided (None when nothing matched)."""

    candidate: Candidate
    scheme: Optional[SchemeSet]
    why: str
    selector: Optional[Selector] = None

    @property
    def path(self) -> str:
        return self.candidate.path


@dataclasses.dataclass
class Plan:
    """Every candidate's decision, in candidate order, and the matcher's selectors that matched nothing."""

    decisions: List[Decision]
    unused: List[Selector]

    @property
    def quantized(self) -> List[Decision]:
        return [d for d in self.decisions if d.scheme is not None]

    @property
    def dense(self) -> List[Decision]:
        return [d for d in self.decisions if d.scheme is None]

    def leave_dense(self, why: Dict[str, str]) -> "Plan":
        """A copy in which the candidates named in `why` (path -> reason) stay dense for that reason."""
        return Plan([Decision(d.candidate, None, why[d.path], d.selector) if d.path in why else d
                     for d in self.decisions], self.unused)

    def schemes(self) -> Dict[str, SchemeSet]:
        """path -> scheme set of every quantized candidate."""
        return {d.path: d.scheme for d in self.quantized}

    def fused_groups(self, sep: str, partial: Optional[Callable[[Tuple[str, ...], List[str]], None]] = None
                     ) -> List[Tuple[str, ...]]:
        """The fused sibling groups among the candidates (`qformats.algorithms.shared_scales.selected_groups`)
        whose members all take a TENSOR_GROUP (NVFP4) weight scheme: they share one global scale. A group only
        some of whose members do goes to `partial(group, those members)` (callers warn or refuse)."""
        tg = [d.path for d in self.quantized if d.scheme.weights.strategy == "tensor_group"]
        return selected_groups([d.path for d in self.decisions], tg, sep=sep, partial=partial)

    def summary(self, width: int = 100) -> str:
        """Lines a person reads: how many weights take each scheme, each group of dense ones with the reason,
        and any kind guessed from names (never silent)."""
        lines = []
        by_scheme: Dict[str, int] = {}
        for d in self.quantized:
            by_scheme[d.scheme.name] = by_scheme.get(d.scheme.name, 0) + 1
        for name, n in by_scheme.items():
            lines.append(f"quantized with {name}: {n}")
        by_why: Dict[str, List[str]] = {}
        for d in self.dense:
            by_why.setdefault(d.why, []).append(d.path)
        for why, paths in by_why.items():
            lines.append(wrap_list(f"left dense ({why}): {len(paths)}: ", paths, width))
        guessed = [d.path for d in self.decisions if d.candidate.how != "model"]
        if guessed:
            lines.append(wrap_list(f"kind taken from names and shapes (2-D, no 'embed' / 'norm' in the path): "
                               f"{len(guessed)}: ", guessed, width))
        for u in self.unused:
            lines.append(f"{u.label} matched nothing")
        return "\n".join(lines)


def wrap_list(head: str, items: Sequence[str], width: int = 100) -> str:
    """`head` followed by `items` joined with ", ", broken into lines of at most `width` characters (an item
    longer than that gets a line of its own); continuation lines are indented by four spaces."""
    out, line = [], head
    for i, it in enumerate(items):
        piece = it + (", " if i < len(items) - 1 else "")
        if len(line) + len(piece) > width and line.strip():
            out.append(line.rstrip())
            line = "    "
        line += piece
    out.append(line.rstrip())
    return "\n".join(out)


def natural_key(path: str) -> Tuple:
    """A sort key that orders the digit runs of `path` as numbers: "layers.2" before "layers.10"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", path) if p)


def _ranges(values: Sequence[int]) -> str:
    """Sorted distinct ints as "0..29" or "0,2,5..9"."""
    vs, parts, i = sorted(set(values)), [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        parts.append(str(vs[i]) if j == i else f"{vs[i]},{vs[j]}" if j == i + 1 else f"{vs[i]}..{vs[j]}")
        i = j + 1
    return ",".join(parts)


def group_paths(paths: Sequence[str], sep: str = ".") -> List[Tuple[str, List[str]]]:
    """(pattern, its paths) for the module paths that differ only in their numeric components, in natural order: the
    numeric components (split on `sep`) that vary are written as "{0..29}" (ranges of their values; with several
    numeric components each one's values are listed apart), the ones that do not stay as they are.
    E.g. model.layers.0.mlp.up_proj ... model.layers.29.mlp.up_proj -> ("model.layers.{0..29}.mlp.up_proj",
    [those 30 paths])."""
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for p in sorted(dict.fromkeys(paths), key=natural_key):
        groups.setdefault(tuple("#" if c.isdigit() else c for c in p.split(sep)), []).append(p)
    out = []
    for shape, members in groups.items():
        nums = [tuple(int(c) for c in p.split(sep) if c.isdigit()) for p in members]
        cols = list(zip(*nums)) if nums and nums[0] else []
        it = iter(cols)
        comps = []
        for c in shape:
            if c != "#":
                comps.append(c)
                continue
            vals = next(it)
            comps.append(str(vals[0]) if len(set(vals)) == 1 else "{" + _ranges(vals) + "}")
        out.append((sep.join(comps), members))
    return out


def plan_quantization(candidates: Iterable[Candidate], matcher: Matcher, *, unmatched: str = "matched no rule"
                      ) -> Plan:
    """Decide every candidate: the first matching selector's scheme, or dense with the reason ("rule #0 'x'
    says so", "ignore 'lm_head'", `unmatched`). Fit checks are separate (`check_fits`, `misfits`): a caller
    decides whether a misfit is an error or a skip."""
    decisions = []
    for c in candidates:
        i, ss = matcher.match(c.path, c.kind)
        if i is None:
            decisions.append(Decision(c, None, unmatched))
        elif ss is None:
            decisions.append(Decision(c, None, f"{matcher.selectors[i].label} says so", matcher.selectors[i]))
        else:
            decisions.append(Decision(c, ss, matcher.selectors[i].label, matcher.selectors[i]))
    return Plan(decisions, matcher.unused())


def warn_unused_rules(plan: Plan, what: str = "Linear / LinearGeneral / Einsum module (or Dense, in linen)",
                      stacklevel: int = 3) -> None:
    """A warning per rule of `plan` that matched no module (`what` names the modules rules apply to)."""
    for sel in plan.unused:
        warnings.warn(f"qformats.nn: {sel.label} matched no {what}", stacklevel=stacklevel + 1)


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


def misfits(layers: Iterable[Tuple[str, int, SchemeSet]]) -> List[Tuple[str, int, str, QuantScheme, SchemeSet, str]]:
    """(path, in_features, "weight" | "activation", scheme, scheme set, why) for every (path, in_features, scheme
    set) whose weight or activation groups do not divide in_features (`group_indivisible`)."""
    bad = []
    for path, k, ss in layers:
        for what, s in (("weight", ss.weights), ("activation", ss.input_activations)):
            why = group_indivisible(k, s)
            if why is not None:
                bad.append((path, k, what, s, ss, why))
    return bad


def paths_text(paths: Sequence[str], sep: str = ".") -> List[str]:
    """`paths` as `group_paths` patterns, each with its count when it stands for several: "model.layers.{0..29}.
    self_attn.q_proj (30)" (for `wrap_list`)."""
    return [p if len(m) == 1 else f"{p} ({len(m)})" for p, m in group_paths(paths, sep)]


def check_fits(layers: Sequence[Tuple[str, int, SchemeSet]], *, static_acts: bool,
               error: Type[QFormatsError] = ModelError) -> None:
    """`check_fit` over (path, in_features, scheme set) for every selected layer, the group-size ones first and
    all at once: `error` with the ways out first, then EVERY layer whose weight (or activation) groups do not
    divide its in_features (`group_indivisible`), layers that differ only in their numeric path components on
    one line (`group_paths`); then the other checks per layer."""
    bad = misfits(layers)
    if bad:
        sep = "/" if any("/" in path for path, *_ in bad) else "."
        by: Dict[Tuple, List[str]] = {}
        for path, k, what, s, ss, why in bad:
            by.setdefault((what, k, s.group_size, ss.name, s.describe(), why), []).append(path)
        lines = []
        for (what, k, g, name, desc, why), paths in by.items():
            for pattern, members in group_paths(paths, sep):
                n = len(members)
                lines.append(f"  {pattern}{f' ({n} layers)' if n > 1 else ''}: {what} group size {g} of {name} "
                             f"({desc}) does not divide in_features = {k} ({why})")
        fit = divisible_group_scheme([(k, s, ss) for _, k, _, s, ss, _ in bad])
        raise error(f"{len(bad)} layer(s) do not fit their scheme's groups (GROUP / TENSOR_GROUP need "
                    f"in_features % group_size == 0, as llm-compressor and compressed-tensors require).\n"
                    f"Ways out: a group size that divides their in_features"
                    + (f" (e.g. '{fit}')" if fit else "") + ", or leave them dense with a rule (Rule(path, None) "
                    "before the quantizing rule). The layers:\n" + "\n".join(lines))
    for path, k, ss in layers:
        check_fit(path, k, ss, static_acts=static_acts, error=error)


def divisible_group_scheme(bad: Sequence[Tuple[int, QuantScheme, SchemeSet]]) -> Optional[str]:
    """For misfit layers (in_features, weight or activation scheme, scheme set), all of one scheme set: the scheme
    string with the largest power-of-two group size below the scheme's that divides every in_features ("W4A16:g64"),
    or None (several scheme sets, no such size, or a format whose group size is fixed: MX 32, NVFP4 16)."""
    names = {ss.name for _, _, ss in bad}
    sizes = {s.group_size for _, s, _ in bad}
    if len(names) != 1 or len(sizes) != 1 or any(s.scale_format == "e8m0" or s.strategy == "tensor_group"
                                                 for _, s, _ in bad):
        return None
    g0 = next(iter(sizes))
    g = next((g for g in (256, 128, 64, 32, 16, 8) if g < g0 and all(k % g == 0 for k, _, _ in bad)), None)
    if g is None:
        return None
    base, *suffixes = next(iter(names)).split(":")
    return ":".join([base, f"g{g}"] + [x for x in suffixes if not re.fullmatch(r"[gG][0-9]+", x)])


def check_fit(path: str, in_features: int, ss: SchemeSet, *, static_acts: bool,
              error: Type[QFormatsError] = ModelError) -> None:
    """`error` naming `path` when the layer's shape or the activation scheme does not fit: weight and
    activation groups must divide in_features (`group_indivisible`), weights cannot take 'token' scales,
    activations cannot take 'block' ones, and calibrated static activation scales must be per-tensor."""
    w = ss.weights
    if w.strategy == "token":
        raise error(f"{path}: weight scheme {w.describe()} uses strategy 'token', which is for activations")
    for what, s in (("weight", w), ("activation", ss.input_activations)):
        why = group_indivisible(in_features, s)
        if why is not None:
            raise error(f"{path}: {what} group size {s.group_size} of {ss.name} ({s.describe()}) does not "
                        f"divide in_features = {in_features} ({why})")
    a = ss.input_activations
    if a is not None and a.strategy == "block":
        raise error(f"{path}: activation scheme {a.describe()} uses 'block', which needs a 2-D weight")
    if static_acts and a is not None and a.dynamic is not True and a.strategy not in ("tensor", "tensor_group"):
        raise error(f"{path}: static activation scheme {a.describe()} must be per-tensor to be calibrated")
