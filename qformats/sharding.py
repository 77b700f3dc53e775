"""Sharding on a jax Mesh: logical-axis rules as data, partition specs of a QArray's leaves (NNX models:
`qformats.nn.sharding`).

Sharding is data, as with Flax's partitioning metadata: a `ShardingRules` table names the logical axes of
each parameter by a regex on its module path (e.g. `.*/mlp/(gate|up)_proj/kernel` -> ("embed", "mlp")), and
maps logical axes to mesh axes (`("mlp", "tp")`, `("embed", None)`) by Flax's priority rule
(`logical_spec`, as `flax.linen.logical_to_mesh_axes` maps them). The logical axes always describe the *logical* (float) parameter, so a
packed `QArray` inherits the layout of the float weight it replaced: `qarray_specs` translates the
logical spec into one spec per stored leaf.

For a QArray of logical shape `shape` quantized along `axis` (tshape = shape with `axis` moved last, K its
last entry), with `s` the logical spec moved the same way (`ts`):

  codes         [..., ceil(K bits / 8)]   spec ts                 (K cut at whole bytes: K/n * bits % 8 == 0)
  scale, zp     tensor  [1]               replicated
                channel [..., 1]          ts[:-1] + (None,)
                group   [..., K / g]      ts                      (K cut at whole groups: K/n % g == 0)
                block   [O / bh, K / bw]  ts                      (O/n0 % bh == 0, K/n1 % bw == 0)
  global_scale  [1]                       replicated
  offset        as scale (when present)

so column-parallel (output channels) and row-parallel (the contraction axis) layouts both keep every scale
group and every packed byte on one device, and a jit forward needs no weight on any other device: XLA's
SPMD partitioner inserts collectives on activations only (all-reduce after a row-parallel matmul).

JAX's SPMD does the rest (`jax.sharding.Mesh`, `NamedSharding`, `jax.device_put`, `jax.jit`); nothing here
moves data by hand.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qformats.errors import ModelError
from qformats.qarray import QArray

__all__ = ["ShardingRules", "logical_spec", "spec_for", "qarray_specs", "qarray_shardings", "mesh_axis_size"]

LogicalAxes = Tuple[Optional[str], ...]
MeshAxes = Union[None, str, Tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """How a model's parameters lie on a mesh (frozen, hashable: usable as static data under jit).

    Attributes:
      params: (path regex, logical axes) pairs; a parameter whose "/"-joined path (e.g.
        "model/layers/0/mlp/up_proj/kernel") fully matches a regex has those logical axes, one per dimension
        of the logical (float) parameter; the first matching entry wins; an unmatched parameter is
        replicated (as a Flax parameter without partitioning metadata).
      mesh_axes: (logical axis, mesh axis or None) pairs, Flax's logical axis rules
        (`flax.linen.logical_to_mesh_axes`); a logical axis listed nowhere is replicated.
      units: logical axis -> the granule it may be cut at (e.g. "heads" -> head_dim): a dimension of size
        d split n ways needs d / n % unit == 0, else a ModelError naming the parameter.
    """

    params: Tuple[Tuple[str, LogicalAxes], ...]
    mesh_axes: Tuple[Tuple[str, MeshAxes], ...]
    units: Tuple[Tuple[str, int], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "params", tuple((str(r), tuple(a)) for r, a in self.params))
        object.__setattr__(self, "mesh_axes", tuple((str(k), v if v is None or isinstance(v, str) else tuple(v))
                                                    for k, v in self.mesh_axes))
        object.__setattr__(self, "units", tuple((str(k), int(v)) for k, v in dict(self.units).items()))
        for r, _ in self.params:
            try:
                re.compile(r)
            except re.error as e:
                raise ModelError(f"ShardingRules: parameter pattern {r!r} is not a valid regex: {e}") from None

    def logical_axes(self, path: str) -> Optional[LogicalAxes]:
        """The logical axes of the parameter at `path` (the first full match), None when no entry matches."""
        for r, axes in self.params:
            if re.fullmatch(r, path):
                return axes
        return None

    def unit(self, logical: Optional[str]) -> int:
        """The granule `logical` may be cut at (1 when `units` does not name it)."""
        return dict(self.units).get(logical, 1) if logical is not None else 1


_UNASSIGNED = object()


def logical_spec(axes: Sequence[Optional[str]], rules: ShardingRules) -> PartitionSpec:
    """The PartitionSpec of an array whose dimensions have logical names `axes`, by the rules `rules.mesh_axes`
    ((logical name, mesh axes) pairs) in order: a rule gives its mesh axes to the dimension of that logical name
    when the dimension has none yet and no other dimension holds any of those mesh axes; a dimension no rule
    gives (or None) stays None, replicated. This is `flax.linen.logical_to_mesh_axes`'s priority rule.

    Raises:
      ModelError: a logical name given to two dimensions."""
    names = tuple(axes)
    dups = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if dups:
        raise ModelError(f"logical axes {names}: {dups} name more than one dimension")
    out = [_UNASSIGNED if isinstance(n, str) else n for n in names]

    def used(entry):
        return set() if entry is None or entry is _UNASSIGNED else ({entry} if isinstance(entry, str) else set(entry))

    for logical, mesh in rules.mesh_axes:
        if logical in names:
            pos = names.index(logical)
            taken = set().union(*(used(e) for e in out))
            if out[pos] is _UNASSIGNED and not (used(mesh) & taken):
                out[pos] = mesh
    return PartitionSpec(*(None if e is _UNASSIGNED else e for e in out))


def mesh_axis_size(mesh: Mesh, entry: MeshAxes) -> int:
    """Number of devices a spec entry splits a dimension into: prod of its mesh axes' sizes (1 for None)."""
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ModelError(f"mesh axes {missing} are not axes of the mesh (axes: {dict(mesh.shape)})")
    return math.prod(mesh.shape[n] for n in names)


def _pad(spec: PartitionSpec, ndim: int, where: str) -> Tuple[MeshAxes, ...]:
    s = tuple(spec)
    if len(s) > ndim:
        raise ModelError(f"{where}: a partition spec of {len(s)} entries {spec} for an array of {ndim} dims")
    return s + (None,) * (ndim - len(s))


def _check_split(where: str, what: str, size: int, n: int, unit: int, entry: MeshAxes) -> None:
    if n > 1 and (size % n or (size // n) % unit):
        cut = f" into whole units of {unit}" if unit > 1 else ""
        raise ModelError(f"{where}: {what} of size {size} cannot be split {n} ways{cut} (mesh axis {entry!r}); "
                         f"expected a size divisible by {n * unit}")


def spec_for(path: str, shape: Sequence[int], mesh: Mesh, rules: ShardingRules) -> PartitionSpec:
    """The PartitionSpec of the logical parameter at `path` with logical `shape` (replicated when no rule
    matches), after checking that every sharded dimension splits into equal parts of whole units.

    Raises ModelError naming `path` for a rule with the wrong number of axes or a dimension that the mesh
    cannot divide."""
    axes = rules.logical_axes(path)
    if axes is None:
        return PartitionSpec()
    if len(axes) != len(shape):
        raise ModelError(f"{path}: sharding rule gives {len(axes)} logical axes {axes} for a parameter of shape "
                         f"{tuple(shape)}")
    spec = logical_spec(axes, rules)
    for d, (size, entry, name) in enumerate(zip(shape, _pad(spec, len(shape), path), axes)):
        _check_split(path, f"dimension {d} ({name!r})", int(size), mesh_axis_size(mesh, entry), rules.unit(name),
                     entry)
    return spec


def qarray_specs(q: QArray, spec: PartitionSpec, mesh: Mesh, where: str = "QArray") -> QArray:
    """The PartitionSpecs of q's leaves (a QArray of specs, None where q has no such leaf) for the layout
    `spec` of its logical (float) array (see the module table).

    Raises ModelError (prefixed with `where`) when a split would cut a packed byte, a scale group or a
    block, or a dimension is not divisible."""
    s = _pad(spec, q.ndim, where)
    ts = list(s[:q.axis] + s[q.axis + 1:] + (s[q.axis],))  # the spec with the reduction axis moved last
    tshape = q.tshape
    sizes = [mesh_axis_size(mesh, e) for e in ts]
    sch, bits = q.scheme, q.scheme.bits
    k, nk = tshape[-1], sizes[-1]
    red = f"the reduction axis (axis {q.axis} of shape {q.shape})"
    _check_split(where, red, k, nk, 1, ts[-1])
    if nk > 1 and (k // nk) * bits % 8:
        raise ModelError(f"{where}: splitting {red} {nk} ways gives {k // nk} codes of {bits} bits per device, "
                         f"which is not a whole number of packed bytes ({sch.describe()})")
    for d, (size, n, e) in enumerate(zip(tshape[:-1], sizes[:-1], ts[:-1])):
        _check_split(where, f"output dimension {d} of {q.shape}", size, n, 1, e)
    st = sch.strategy
    if st == "tensor":
        scale = PartitionSpec(None)
    elif st in ("channel", "token"):
        scale = PartitionSpec(*ts[:-1], None)
    elif st in ("group", "tensor_group"):
        if nk > 1 and (k // nk) % sch.group_size:
            raise ModelError(f"{where}: splitting {red} {nk} ways gives {k // nk} elements per device, not a "
                             f"whole number of groups of {sch.group_size} ({sch.describe()})")
        scale = PartitionSpec(*ts)
    else:
        bh, bw = sch.block
        for size, n, b, e, what in ((tshape[0], sizes[0], bh, ts[0], "output rows"), (k, nk, bw, ts[1], red)):
            _check_split(where, f"{what} (blocks of {b})", size, n, b, e)
        scale = PartitionSpec(*ts)
    codes = PartitionSpec(*ts)
    return QArray(codes, scale, None if q.zero_point is None else scale,
                  None if q.global_scale is None else PartitionSpec(None),
                  scheme=sch, shape=q.shape, dtype=q.dtype, axis=q.axis,
                  offset=None if q.offset is None else scale, compute_dtype=q.compute_dtype)


def stacked_qarray_specs(q: QArray, spec: PartitionSpec, mesh: Mesh, where: str = "QArray") -> QArray:
    """`qarray_specs` for a QArray whose leaves carry leading stacked axes (expert stacks, `qformats.nn.QExperts`:
    static shape [K, N], leaves [E, ...]): `spec` describes the stacked logical array [*lead, *shape]; its lead
    entries lead every leaf's spec, the rest is the per-matrix layout."""
    lead = q.codes.ndim - len(q.tshape)
    s = _pad(spec, lead + q.ndim, where)
    inner = qarray_specs(q, PartitionSpec(*s[lead:]), mesh, where)
    for size, e in zip(q.codes.shape[:lead], s[:lead]):
        _check_split(where, "a stacked axis", int(size), mesh_axis_size(mesh, e), 1, e)
    return jax.tree.map(lambda p: PartitionSpec(*s[:lead], *p), inner, is_leaf=lambda x: isinstance(x, PartitionSpec))


def qarray_shardings(q: QArray, spec: PartitionSpec, mesh: Mesh, where: str = "QArray") -> QArray:
    """`qarray_specs` as NamedShardings on `mesh` (a QArray of shardings: `jax.device_put(q, this)` places q); a
    QArray with stacked leaves (`stacked_qarray_specs`) takes the spec of its stacked logical array."""
    stacked = q.codes.ndim > len(q.tshape)
    p = (stacked_qarray_specs if stacked else qarray_specs)(q, spec, mesh, where)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), p, is_leaf=lambda x: isinstance(x, PartitionSpec))
