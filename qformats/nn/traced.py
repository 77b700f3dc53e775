"""Matmul weights of any layer class: found by tracing the model once, run packed by a jaxpr interpreter.

Why this mechanism. A third-party model (Gemma's own `Einsum` module, EasyDeL's `ParallelLinear`, a bare
`jnp.dot(x, self.table.T)`) computes its matmuls with `jnp.einsum` / `jnp.dot` / `@` / `lax.dot_general` on its
params; no layer class to swap. Two ways reach them: intercept the matmul functions during the forward (qwix:
it patches `jax.lax` / `jax.numpy` for the duration of a call, which also rewrites matmuls inside Pallas kernels
and in other threads, and it clones the model to quantize it), or look at what the model computes. We do the
latter, with jax's own representation of it:

1. `find_matmul_weights`: the forward is traced once to a jaxpr (`jax.make_jaxpr`, shapes only: no FLOPs, no
   device memory) with the params as inputs. Each param is followed through layout-only ops (transpose, dtype
   casts, copies, sharding constraints), into `jit` / `remat` / `custom_jvp` bodies, and through `scan` (each
   scan over a param's leading axis is one stacked axis: `nnx.scan` / `nn.scan` layer stacks) to the
   `dot_general`s it feeds, giving its contracted, batch and free axes per layer (`WeightUsage`). A param
   also used by anything else (a gather: a tied embedding) is reported as such and left dense.
2. Each selected param is replaced, where it lives, by a `MatmulWeight`: a pytree holding the packed QArray of
   the param as the 2-D matrix W [K, N] (contracted axes first and flattened, quantized along K, exactly as the
   flax-layer path stores an `Einsum` kernel) plus its original shape and axis order as static data.
3. `run_packed` runs the same function on a jaxpr made with the dense shapes in place of the MatmulWeights and
   evaluated by a small interpreter: a `dot_general` with a packed operand is computed by
   `qformats.nn.projection.packed_project` (the Pallas kernels through `qdot`, W+A schemes with their activation
   quantization, codes GEMMs) when its contraction is x's last axis against W's K, else by dequantizing W in the
   jitted graph (XLA fuses it) and the original `dot_general`; layout ops are deferred; `scan` / `cond` / `jit`
   bodies that receive a packed weight are interpreted in turn (the scan slices the packed leaves per layer).

What this keeps: nothing is cloned (the params are replaced one at a time; the packed and dense copies of one
weight coexist only while it is packed), nothing global is patched (the interpreter only evaluates jaxprs that
our own wrapper traced), everything is an ordinary traced jax computation (jit, sharding of the QArray leaves,
grad of the other params), and the packed kernels are reached wherever the contraction allows.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from qformats.errors import ModelError
from qformats.nn.host_quantize import host_quantizable, host_quantize, layer_by_layer, one_device
from qformats.plan import check_fit
from qformats.nn.projection import packed_project
from qformats.qarray import QArray
from qformats.quantize import dequantize
from qformats.schemes import SchemeSet

# layout-only primitives a weight may pass through on its way to a dot_general: (name, is a transpose)
_IDENTITY_PRIMS = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint", "reduce_precision",
                             "optimization_barrier_p"})
_CALL_PRIMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
               "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
               "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}


# ---- analysis ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DotUse:
    """One dot_general a param reaches: `contracted` (per-layer param axes, in the order the dot pairs them with
    the other operand's ascending axes), `batch` (the param's full axes the dot batches over: layers stacked
    by a vmap over a stack, experts), `depth` (leading axes scans sliced off before), and whether the other
    operand contracts its trailing axes (`x_trailing`) and batches over its leading ones (`x_batch_leading`)."""

    contracted: Tuple[int, ...]
    batch: Tuple[int, ...]
    depth: int
    x_trailing: bool
    x_batch_leading: bool


@dataclasses.dataclass
class WeightUsage:
    """How the traced forward uses one param: `path`, full `shape` and `dtype`, its `dots`, and `other` uses
    (names of the other primitives it reaches, or why a dot does not count). `stacked` leading axes are layers
    (sliced by scans, or batched over by a vmapped dot); `reason()` says why it cannot be quantized as a
    matmul weight, if so."""

    path: Any
    shape: Tuple[int, ...]
    dtype: Any
    dots: List[DotUse] = dataclasses.field(default_factory=list)
    other: List[str] = dataclasses.field(default_factory=list)

    @property
    def stacked(self) -> int:
        d = self.dots[0] if self.dots else None
        return 0 if d is None else d.depth + len(d.batch)

    @property
    def per_layer(self) -> Tuple[int, ...]:
        return self.shape[self.stacked:]

    def reason(self) -> Optional[str]:
        """None when quantizable, else why not (in words)."""
        if not self.dots:
            return ("used outside a matmul (" + ", ".join(sorted(set(self.other))) + ")") if self.other else \
                "not used by the traced forward"
        if self.other:
            return "used in a matmul and outside one (" + ", ".join(sorted(set(self.other))) + ")"
        first = self.dots[0]
        if any(d.batch != tuple(range(d.depth, d.depth + len(d.batch))) for d in self.dots):
            return "a batched matmul over axes that are not the leading ones"
        if any((d.depth + len(d.batch), set(d.contracted)) != (self.stacked, set(first.contracted))
               for d in self.dots):
            return "used in matmuls that contract or stack different axes"
        if not first.contracted:
            return "no contracted axis (an outer product)"
        return None

    def layout(self) -> Tuple[Tuple[int, ...], int]:
        """(perm, n_contracted): W = transpose(per-layer param, perm).reshape(K, N), the contracted axes first
        (in the first dot's pairing order), then the free ones; K, N = the products of their sizes."""
        c = self.dots[0].contracted
        return tuple(c) + tuple(a for a in range(len(self.per_layer)) if a not in c), len(c)

    def plain(self) -> bool:
        """Whether every dot contracts the other operand's trailing axes against W's K in order (batched over
        the leading axes of both, if at all): then the packed matmul and activation quantization apply."""
        perm, nc = self.layout()
        return all(d.x_trailing and d.x_batch_leading and tuple(d.contracted) == perm[:nc] for d in self.dots)


class _Tracked:
    """Analysis value: a param (index) seen through layout ops: `amap[i]` = the param axis that axis i of this
    value is (None once a reshape mixes axes); `depth`: param axes sliced off by scans so far."""

    __slots__ = ("idx", "amap", "depth")

    def __init__(self, idx, amap, depth):
        self.idx, self.amap, self.depth = idx, amap, depth


def _is_lit(v) -> bool:
    return isinstance(v, jcore.Literal)


def _analyse(jaxpr, env: Dict[Any, _Tracked], usages: List[WeightUsage]) -> Dict[Any, _Tracked]:
    """Walk `jaxpr` (an open Jaxpr) with tracked invars in `env`; record uses; return env (outvars included)."""
    def note_other(t: _Tracked, what: str):
        usages[t.idx].other.append(what)

    for eqn in jaxpr.eqns:
        ins = [None if _is_lit(v) else env.get(v) for v in eqn.invars]
        if not any(ins):
            continue
        name = eqn.primitive.name
        if name in _IDENTITY_PRIMS and len(eqn.outvars) == len(eqn.invars):
            for t, o in zip(ins, eqn.outvars):
                if t is not None:
                    env[o] = t
        elif name == "transpose":
            t = ins[0]
            env[eqn.outvars[0]] = _Tracked(t.idx, tuple(t.amap[p] for p in eqn.params["permutation"]), t.depth)
        elif name == "dot_general":
            (cl, cr), (bl, br) = eqn.params["dimension_numbers"]
            for side, t in enumerate(ins[:2]):
                if t is None:
                    continue
                if ins[1 - side] is not None:
                    note_other(t, "dot_general of two params")
                    continue
                mine, theirs = ((cl, cr), (bl, br)) if side == 0 else ((cr, cl), (br, bl))
                other_nd = len(eqn.invars[1 - side].aval.shape)
                if any(t.amap[a] is None for a in tuple(mine[0]) + tuple(theirs[0])):
                    note_other(t, "a dot_general through a reshape")
                    continue
                order = sorted(range(len(mine[1])), key=lambda j: mine[1][j])  # pair by the other's axis order
                per0 = t.depth + len(theirs[0])
                contracted = tuple(t.amap[mine[0][j]] - per0 for j in order)
                batch = tuple(t.amap[a] for a in theirs[0])
                usages[t.idx].dots.append(DotUse(
                    contracted, batch, t.depth,
                    tuple(sorted(mine[1])) == tuple(range(other_nd - len(mine[1]), other_nd)),
                    tuple(theirs[1]) == tuple(range(len(theirs[1])))))
        elif name in _CALL_PRIMS and eqn.params.get(_CALL_PRIMS[name]) is not None:
            sub = eqn.params[_CALL_PRIMS[name]]
            sj = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            off = len(eqn.invars) - len(sj.invars)  # custom_vjp may carry extra leading operands
            senv = {sj.invars[i - off]: t for i, t in enumerate(ins) if t is not None and i >= off}
            senv = _analyse(sj, senv, usages)
            for so, o in zip(sj.outvars, eqn.outvars):
                if not _is_lit(so) and so in senv:
                    env[o] = senv[so]
        elif name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
            senv = {}
            for i, t in enumerate(ins):
                if t is None:
                    continue
                if nc <= i < nc + ncar:
                    note_other(t, "a scan carry")
                elif i < nc:
                    senv[body.invars[i]] = t
                elif t.amap[0] != t.depth:
                    note_other(t, f"scanned along param axis {t.amap[0]} (only leading axes stack layers)")
                else:
                    senv[body.invars[i]] = _Tracked(t.idx, t.amap[1:], t.depth + 1)
            _analyse(body, senv, usages)
        elif name == "cond":
            for br in eqn.params["branches"]:
                bj = br.jaxpr
                _analyse(bj, {bj.invars[i - 1]: t for i, t in enumerate(ins) if t is not None and i >= 1}, usages)
        else:
            for t in ins:
                if t is not None:
                    note_other(t, name)
    return env


def find_matmul_weights(fn: Callable, params, *args, is_leaf=None, **kwargs) -> Dict[Tuple, WeightUsage]:
    """{key path of each array leaf of `params`: WeightUsage} for `fn(params, *args, **kwargs)`, traced once
    with `jax.make_jaxpr` (abstract: nothing is computed). Leaves that are not arrays (None, QArray parts, ...)
    are traced as they are and not reported."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
    leaves = [leaf for _, leaf in flat]
    closed = jax.make_jaxpr(lambda ls, a, k: fn(jax.tree_util.tree_unflatten(treedef, ls), *a, **k))(
        leaves, args, kwargs)
    n = len(jax.tree_util.tree_leaves(leaves))
    usages = []
    for kp, leaf in flat:
        usages.append(WeightUsage(kp, tuple(int(d) for d in jnp.shape(leaf)), jnp.result_type(leaf)))
    # leaves flatten to themselves (arrays): invars [0, n) are the params, in order
    if n != len(flat):
        raise ModelError("find_matmul_weights: the params must flatten to array leaves")
    env = {closed.jaxpr.invars[i]: _Tracked(i, tuple(range(len(u.shape))), 0) for i, u in enumerate(usages)}
    _analyse(closed.jaxpr, env, usages)
    return {kp: u for (kp, _), u in zip(flat, usages)}


# ---- the packed weight -------------------------------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class MatmulWeight:
    """A param packed as the matrix its matmuls contract: `q` is a QArray W [K, N] along K with
    W = transpose(param, perm).reshape(K, N) per layer (`perm`: the contracted axes of the per-layer param, then
    the free ones; K, N the products of their sizes). Leading axes of q's leaves are stacked layers (scans slice
    them, vmaps map over them). Static: `shape` (per layer), `perm`, `n_contracted`, `dtype` (the param's),
    `schemes` (W+A schemes quantize the other operand of each matmul: only where the matmul contracts the
    other operand's last axis against K, else `run_packed` raises ModelError)."""

    def __init__(self, q: QArray, *, shape, perm, n_contracted: int, dtype, schemes: SchemeSet):
        self.q = q
        self.shape = tuple(int(d) for d in shape)
        self.perm = tuple(int(p) for p in perm)
        self.n_contracted = int(n_contracted)
        self.dtype = jnp.dtype(dtype)
        self.schemes = schemes

    def tree_flatten(self):
        return (self.q,), (self.shape, self.perm, self.n_contracted, self.dtype.name, self.schemes)

    @classmethod
    def tree_unflatten(cls, aux, children):
        shape, perm, nc, dtype, schemes = aux
        return cls(children[0], shape=shape, perm=perm, n_contracted=nc, dtype=dtype, schemes=schemes)

    @property
    def stacked(self) -> Tuple[int, ...]:
        """Leading axes of the packed leaves: stacked layers."""
        return tuple(self.q.codes.shape[:-2])

    @property
    def full_shape(self) -> Tuple[int, ...]:
        """The dense param's shape (stacked axes first)."""
        return self.stacked + self.shape

    @property
    def k(self) -> int:
        return math.prod(self.shape[a] for a in self.perm[:self.n_contracted])

    @property
    def nbytes(self) -> int:
        return sum(int(math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(self.q))

    def dense(self, dtype=None) -> jax.Array:
        """The param as the model had it, [*stacked, *shape], dequantized (in `dtype`, default the param's)."""
        fn = lambda q: dequantize(q, dtype or self.dtype)  # noqa: E731
        for _ in self.stacked:
            fn = jax.vmap(fn)
        w = fn(self.q)
        ns = len(self.stacked)
        w = w.reshape(self.stacked + tuple(self.shape[a] for a in self.perm))
        inv = sorted(range(len(self.perm)), key=lambda i: self.perm[i])
        return jnp.transpose(w, tuple(range(ns)) + tuple(ns + i for i in inv))

    def __repr__(self) -> str:
        k_axes = self.perm[:self.n_contracted]
        return (f"MatmulWeight(shape={self.full_shape}, K axes={k_axes}, scheme={self.schemes.name!r}, "
                f"nbytes={self.nbytes})")


def matrix_of(value, usage: WeightUsage) -> jax.Array:
    """The param `value` [*stacked, *per_layer] as W [*stacked, K, N] (`WeightUsage.layout`)."""
    perm, nc = usage.layout()
    ns = usage.stacked
    w = jnp.transpose(value, tuple(range(ns)) + tuple(ns + p for p in perm))
    return w.reshape(tuple(value.shape[:ns]) + (contracted_size(usage), -1))


PACK_BUDGET_BYTES = 64 * 2**20
"""Dense bytes `pack_many` packs in one jitted call at most (more weights per call: fewer compilations; fewer:
less memory in flight)."""


def _pack_key(value, usage: WeightUsage, schemes: SchemeSet, weight_search: str) -> Tuple:
    perm, nc = usage.layout()
    return (perm, nc, usage.stacked, tuple(jnp.shape(value)), jnp.result_type(value).name, schemes, weight_search,
            one_device(value))


def _packer(keys: Tuple[Tuple, ...]) -> Callable:
    """The jitted function (cached by `keys`) packing one weight of each key: [value] -> [QArray]."""
    fn = _PACKERS.get(keys)
    if fn is None:
        from qformats.algorithms.weight_search import quantize_weight

        def one(v, key):
            perm, nc, ns, _, _, schemes, search, single = key
            if not single:  # a sharded stack: vmapped (quantize_weight), the sharding propagated as it is
                w = jnp.transpose(v, tuple(range(ns)) + tuple(ns + p for p in perm))
                return quantize_weight(w.reshape(tuple(v.shape[:ns]) + (math.prod(w.shape[ns:ns + nc]), -1)),
                                       schemes, search)
            # one layer at a time, its transpose included: one layer's temporaries live, not the stack's
            return layer_by_layer(lambda lv: quantize_weight(
                jnp.transpose(lv, perm).reshape(math.prod(lv.shape[a] for a in perm[:nc]), -1), schemes, search),
                v, ns)

        # LLVM -O1 on XLA:CPU: a third less compile time for these elementwise + reduce loops, equal run time,
        # the same bits (no fast-math at any level)
        opts = {"xla_backend_optimization_level": 1} if jax.default_backend() == "cpu" else None
        fn = jax.jit(lambda vs: [one(v, k) for v, k in zip(vs, keys)], compiler_options=opts)
        if len(_PACKERS) > 256:
            _PACKERS.clear()
        _PACKERS[keys] = fn
    return fn


def pack(value, usage: WeightUsage, schemes: SchemeSet, weight_search: str = "rtn") -> MatmulWeight:
    """`value` packed as a MatmulWeight: W [*stacked, K, N] (`matrix_of`) quantized along K by
    `qformats.algorithms.weight_search.quantize_weight(W, schemes, weight_search)`, the stacked layers of a value
    on one device one at a time (`host_quantize.layer_by_layer`: the same bits as vmapping them, one layer's
    temporaries live), a sharded stack's vmapped. The transpose and the quantization run as one jitted function
    (`pack_many`), so the transposed float copy is never materialised on its own."""
    return pack_many([(value, usage, schemes)], weight_search)[0]


def pack_many(items: Sequence[Tuple[Any, WeightUsage, SchemeSet]], weight_search: str = "rtn",
              budget_bytes: Optional[int] = None, done: Optional[Callable[[int, MatmulWeight], None]] = None,
              release: bool = False) -> List[MatmulWeight]:
    """[pack(value, usage, schemes) for each item], bit for bit, with fewer compilations: the items are grouped
    by key (layout, shape, dtype, scheme), and round r packs the r-th item of every key in one jitted function
    (cached by its tuple of keys), cut into chunks of at most `budget_bytes` (default `PACK_BUDGET_BYTES`) of
    dense input (a single larger weight is a chunk of its own); what `qformats.nn.host_quantize` covers (integer
    channel / group, FP8 / FP6 channel, NVFP4 round-to-nearest on the CPU backend) is packed on the host instead,
    the same bits without a compilation. A model of L equal layers thus compiles one function, called L times,
    instead of one per key: XLA's fixed cost per compilation dominates the quantization of small weights. Only
    one chunk's weights are being packed at a time. `done(i, mw)` is called as item i is packed (e.g. to put
    it in place of the dense param); `release=True` sets `items[i]` (a list) to None then, so that the dense
    value can be freed before the other chunks are packed."""
    budget_bytes = PACK_BUDGET_BYTES if budget_bytes is None else budget_bytes
    by_key: Dict[Tuple, List[int]] = {}
    meta = []
    out: List[Optional[MatmulWeight]] = [None] * len(items)

    def put(i, q):
        usage, schemes, _ = meta[i]
        perm, nc = usage.layout()
        out[i] = MatmulWeight(q, shape=usage.per_layer, perm=perm, n_contracted=nc, dtype=usage.dtype,
                              schemes=schemes)
        if release:
            items[i] = None
        if done is not None:
            done(i, out[i])

    for i, (value, usage, schemes) in enumerate(items):
        meta.append((usage, schemes, int(math.prod(jnp.shape(value))) * jnp.dtype(jnp.result_type(value)).itemsize))
        q = _host_pack(value, usage, schemes, weight_search)
        if q is not None:
            put(i, q)
            continue
        by_key.setdefault(_pack_key(value, usage, schemes, weight_search), []).append(i)
    for r in range(max((len(v) for v in by_key.values()), default=0)):
        chunks, cur, size = [], [], 0
        for key, idx in by_key.items():
            if r >= len(idx):
                continue
            nb = meta[idx[r]][2]
            if cur and size + nb > budget_bytes:
                chunks.append(cur)
                cur, size = [], 0
            cur.append((key, idx[r]))
            size += nb
        if cur:
            chunks.append(cur)
        for chunk in chunks:
            qs = _packer(tuple(k for k, _ in chunk))([items[i][0] for _, i in chunk])
            for (_, i), q in zip(chunk, qs):
                put(i, q)
    return out


def _host_pack(value, usage: WeightUsage, schemes: SchemeSet, weight_search: str) -> Optional[QArray]:
    """The QArray of `value` computed on the host (`qformats.nn.host_quantize`: integer channel / group, FP8 / FP6
    channel, NVFP4 round to nearest on the CPU backend, bit for bit the jitted packer's), or None (then the jitted
    packer runs)."""
    perm, nc = usage.layout()
    if not host_quantizable(value, schemes, weight_search, k=contracted_size(usage)):
        return None
    return host_quantize(value, perm, nc, usage.stacked, schemes)


_PACKERS: Dict[Tuple, Callable] = {}


def contracted_size(usage: WeightUsage) -> int:
    """K of the [K, N] matrix the param is quantized as."""
    perm, nc = usage.layout()
    return math.prod(usage.per_layer[a] for a in perm[:nc])


# ---- planning ------------------------------------------------------------------------------------------------
def weight_name(param_path: str) -> str:
    """The name rules and checkpoints use for a matmul weight: its owner module's path for a param named
    `kernel` ("blocks/0/mlp/up/kernel" -> "blocks/0/mlp/up", as flax's layers are named), else the param's
    own path ("embedder/input_embedding")."""
    head, _, leaf = param_path.rpartition("/")
    return head if leaf == "kernel" and head else param_path


def deciding_rule(matcher, name: str):
    """The selector of `matcher` that decides `name` (None when none matches)."""
    i, _ = matcher.match(name)
    return None if i is None else matcher.selectors[i]


def traced_candidates(usages: Mapping[str, traced.WeightUsage], taken) -> Tuple[dict, dict]:
    """({weight name: (param path, WeightUsage)} of the params that reach a matmul and can be packed, {weight name:
    why dense} of those that reach one but cannot), over the float params of 2 or more dims not in `taken`."""
    generic, dense = {}, {}
    for ppath, u in usages.items():
        if ppath in taken or not u.dots or len(u.shape) < 2 or not jnp.issubdtype(u.dtype, jnp.floating):
            continue
        name = weight_name(ppath)
        why = u.reason()
        if why is None:
            generic[name] = (ppath, u)
        else:
            dense[name] = why
    return generic, dense


def plan_traced(generic, schemes, *, calibrating: bool = False, mode: str = "ptq"):
    """([(name, param path, usage, SchemeSet)] of the traced matmul weights the rules quantize, {name: why dense}
    for shape misfits). ModelError for a W+A scheme on a weight whose matmuls do not contract the input's last
    axis alone, and (calibrating / QAT) for any selected one: those reach flax's layer classes only."""
    out, misfit = [], {}
    for name, (ppath, u) in generic.items():
        ss = schemes.get(name)
        if ss is None:
            continue
        if calibrating or mode != "ptq":
            raise ModelError(f"{name}: calibration_data and mode='qat' reach flax's layer classes only; leave this "
                             "matmul weight out with Rule(path, None) or quantize it in a call without them")
        if ss.input_activations is not None and not (u.plain() and u.layout()[1] == 1):
            raise ModelError(f"{name}: a matmul of this weight does not contract the input's last axis alone, so "
                             f"its activations cannot be quantized ({ss.name}); use a weight-only scheme")
        if u.stacked and ss.weights.strategy == "block":
            misfit[name] = f"block scales ({ss.name}) need a 2-D weight; this one is stacked {u.shape}"
            continue
        try:
            check_fit(name, contracted_size(u), ss, static_acts=False)
        except ModelError as e:
            misfit[name] = f"shape does not fit: {e}"
            continue
        out.append((name, ppath, u, ss))
    return out, misfit


def warn_partial(chosen, strict: bool, where: str, stacklevel: int = 4) -> None:
    """A warning per rule whose selected matmul weights are only partly quantized, naming the dense ones and
    why (strict: a ModelError)."""
    by_rule: Dict[str, list] = {}
    for d in chosen.decisions:
        if d.selector is not None and d.selector.scheme is not None:
            by_rule.setdefault(d.selector.label, []).append(d)
    for label, ds in by_rule.items():
        dense = [d for d in ds if d.scheme is None]
        if not dense:
            continue
        lines = "; ".join(f"{d.path} ({d.why})" for d in dense[:6]) + (" ..." if len(dense) > 6 else "")
        msg = f"{label} selects {len(ds)} matmul weights; {len(dense)} stay dense: {lines}"
        if strict:
            raise ModelError(f"{where}(strict=True): {msg}")
        warnings.warn(f"qformats.nn: {msg}", stacklevel=stacklevel)



# ---- running with packed weights -------------------------------------------------------------------------------
class _Packed:
    """Interpreter value: a MatmulWeight `mw` seen through layout ops: `amap[i]` = the per-layer param axis of
    this value's axis i (None: not a permutation any more), `ops` = the (primitive, params) to apply to the
    dense weight when it must be materialized."""

    __slots__ = ("mw", "amap", "ops")

    def __init__(self, mw, amap, ops):
        self.mw, self.amap, self.ops = mw, amap, ops

    def materialize(self):
        w = self.mw.dense()
        for prim, params in self.ops:
            w = prim.bind(w, **params)
        return w


def _bind(eqn, invals):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _eval(jaxpr, consts, args) -> list:
    """Evaluate an open `jaxpr` on `args` (arrays or _Packed); the jaxpr's outvars' values (maybe _Packed)."""
    env: Dict[Any, Any] = {}

    def read(v):
        return v.val if _is_lit(v) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if not any(isinstance(x, _Packed) for x in ins):
            outs = _bind(eqn, ins)
        else:
            outs = _eval_packed(eqn, ins)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _dense(x):
    return x.materialize() if isinstance(x, _Packed) else x


def _eval_packed(eqn, ins) -> list:
    name = eqn.primitive.name
    if name in _IDENTITY_PRIMS and len(ins) == 1 and name != "convert_element_type":
        return [ins[0]]
    if name == "convert_element_type" and len(ins) == 1:
        p = ins[0]
        return [_Packed(p.mw, p.amap, p.ops + ((eqn.primitive, dict(eqn.params)),))]
    if name == "transpose":
        p = ins[0]
        amap = None if p.amap is None else tuple(p.amap[i] for i in eqn.params["permutation"])
        return [_Packed(p.mw, amap, p.ops + ((eqn.primitive, dict(eqn.params)),))]
    if name == "dot_general":
        out = _packed_dot(eqn, ins)
        if out is not None:
            return [out]
    elif name in _CALL_PRIMS and eqn.params.get(_CALL_PRIMS[name]) is not None:
        sub = eqn.params[_CALL_PRIMS[name]]
        sj, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "jaxpr") else (sub, ())
        off = len(ins) - len(sj.invars)
        return _eval(sj, consts, ins[off:])
    elif name == "scan":
        return _scan(eqn, ins)
    elif name == "cond":
        idx, ops = ins[0], ins[1:]
        branches = [lambda *a, br=br: [_dense(o) for o in _eval(br.jaxpr, br.consts, list(a))]
                    for br in eqn.params["branches"]]
        dyn = [i for i, o in enumerate(ops) if not isinstance(o, _Packed)]

        def call(b):
            def f(*d):
                full = list(ops)
                for i, v in zip(dyn, d):
                    full[i] = v
                return b(*full)
            return f
        return jax.lax.switch(idx, [call(b) for b in branches], *[ops[i] for i in dyn])
    return _bind(eqn, [_dense(x) for x in ins])


def _scan(eqn, ins) -> list:
    body = eqn.params["jaxpr"]
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = ins[:nc], [_dense(c) for c in ins[nc:nc + ncar]], ins[nc + ncar:]
    # a packed xs is sliced per step as a pytree (its leaves' leading axis); with pending ops it is materialized
    xs = [x.mw if isinstance(x, _Packed) and not x.ops and x.amap == tuple(range(len(x.mw.full_shape)))
          and x.mw.stacked else _dense(x) for x in xs]

    def step(c, x):
        x = [_Packed(v, tuple(range(len(v.full_shape))), ()) if isinstance(v, MatmulWeight) else v for v in x]
        outs = _eval(body.jaxpr, body.consts, list(consts) + list(c) + list(x))
        return [_dense(o) for o in outs[:ncar]], [_dense(o) for o in outs[ncar:]]

    c, ys = jax.lax.scan(step, carry, xs, length=eqn.params["length"], reverse=eqn.params["reverse"],
                         unroll=eqn.params["unroll"])
    return list(c) + list(ys)


def _packed_dot(eqn, ins):
    """A dot_general with one packed operand on the packed path (`packed_project`, vmapped over batch axes that
    are stacked layers), or None (then: dequantize + the original dot_general)."""
    (cl, cr), (bl, br) = eqn.params["dimension_numbers"]
    side = 0 if isinstance(ins[0], _Packed) else 1
    p, x = ins[side], ins[1 - side]
    if isinstance(x, _Packed) or p.amap is None:
        return _refuse_acts(eqn, p)
    mw = p.mw
    (mc, xc), (mb, xb) = ((cl, cr), (bl, br)) if side == 0 else ((cr, cl), (br, bl))
    ns, nb = len(mw.stacked), len(mb)
    if (nb != ns or tuple(mb) != tuple(range(nb)) or tuple(xb) != tuple(range(nb))
            or tuple(p.amap[:nb]) != tuple(range(nb))
            or tuple(sorted(xc)) != tuple(range(x.ndim - len(xc), x.ndim))):
        return _refuse_acts(eqn, p)
    order = sorted(range(len(xc)), key=lambda j: xc[j])
    if tuple(p.amap[mc[j]] - ns for j in order) != mw.perm[:mw.n_contracted]:
        return _refuse_acts(eqn, p)
    if mw.schemes.input_activations is not None and mw.n_contracted != 1:
        return _refuse_acts(eqn, p)
    wdt = mw.dtype
    for prim, params in p.ops:
        if prim.name == "convert_element_type":
            wdt = jnp.dtype(params["new_dtype"])
    cdt = jnp.result_type(x.dtype, wdt)
    lead = x.shape[nb:x.ndim - len(xc)]
    free = mw.perm[mw.n_contracted:]  # per-layer param axes in W's N order

    def one(xx, q):
        y = packed_project(xx.reshape(lead + (mw.k,)).astype(cdt), q, mw.schemes)
        return y.reshape(lead + tuple(mw.shape[a] for a in free))

    fn = one
    for _ in range(nb):
        fn = jax.vmap(fn)
    y = fn(x, mw.q)
    # dot_general's order: batch, lhs free, rhs free; p's free axes ascending in p's (post-transpose) axes
    want = [p.amap[i] - ns for i in range(nb, len(p.amap)) if i not in mc]
    pos = [nb + len(lead) + free.index(a) for a in want]
    xpos = list(range(nb, nb + len(lead)))
    y = jnp.transpose(y, list(range(nb)) + ((xpos + pos) if side == 1 else (pos + xpos)))
    return y.astype(eqn.outvars[0].aval.dtype)


def _refuse_acts(eqn, p: _Packed) -> None:
    """None (dequantize + the original dot_general) for a weight-only packed weight; ModelError when its
    scheme quantizes activations, which this matmul's contraction does not allow."""
    ss = p.mw.schemes
    if ss.input_activations is not None:
        raise ModelError(f"a packed weight {p.mw.full_shape} with W+A scheme {ss.name} reaches a dot_general "
                         f"{eqn.params['dimension_numbers']} that does not contract the input's last axis against "
                         "its K alone, so its activations cannot be quantized; quantize it with a weight-only scheme")
    return None


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jnp.ndarray)) or hasattr(x, "aval") or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (QArray, MatmulWeight)))


def run_packed(fn: Callable, tree, *args, **kwargs):
    """fn(tree, *args, **kwargs) where `tree` may hold MatmulWeights: traced with their dense shapes in their
    place, then evaluated with each matmul on the packed weight (see the module docstring). Array leaves of
    args / kwargs are traced; other leaves (Python numbers, strings, None) are static. Outputs that are
    untouched MatmulWeights come back as such."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda v: isinstance(v, MatmulWeight))
    aleaves, atree = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, v in enumerate(aleaves) if _is_array(v)]
    static = {i: v for i, v in enumerate(aleaves) if i not in dyn}

    def avals(v):
        if isinstance(v, MatmulWeight):
            return jax.ShapeDtypeStruct(v.full_shape, v.dtype)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), v)

    def traced(ls, dargs):
        full = [None] * len(aleaves)
        for i, v in static.items():
            full[i] = v
        for i, v in zip(dyn, dargs):
            full[i] = v
        a, k = jax.tree_util.tree_unflatten(atree, full)
        return fn(jax.tree_util.tree_unflatten(treedef, ls), *a, **k)

    closed, shape = jax.make_jaxpr(traced, return_shape=True)([avals(v) for v in leaves],
                                                             [avals(aleaves[i]) for i in dyn])
    inputs = []
    for v in leaves:
        if isinstance(v, MatmulWeight):
            inputs.append(_Packed(v, tuple(range(len(v.full_shape))), ()))
        else:
            inputs.extend(jax.tree_util.tree_leaves(v))
    inputs.extend(jax.tree_util.tree_leaves([aleaves[i] for i in dyn]))
    outs = _eval(closed.jaxpr, closed.consts, inputs)
    outs = [o.mw if isinstance(o, _Packed) and not o.ops else _dense(o) for o in outs]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)
