"""quantize_linen: the NNX rules applied to an existing linen model (params transform + method interceptor).

A linen model's structure lives in its code, not in objects, so it cannot be edited in place. Instead
`quantize_linen(module, params, rules, *example_args)` returns the params with each matching `Dense` /
`DenseGeneral` / `Einsum` kernel replaced by a packed QArray, and a thin wrapper whose `apply` runs the
unchanged module under `flax.linen.intercept_methods`: a call of one of these modules whose kernel is a
QArray is computed like the NNX layer (`QLinear` / `QLinearGeneral` / `QEinsum`), bit for bit. Only those
calls are intercepted — nothing global (no `jax.lax` patching), and only inside that `apply`.

Params alone do not say which module a kernel belongs to or which of its axes are contracted, so
`record_layouts` runs `module.apply` once under `jax.eval_shape` (no FLOPs, no memory) and `jax.disable_jit`
(so no cached trace of an earlier run of an `nn.jit` method stands in for its code) on example inputs with an
interceptor that notes, per scope path, the module type and its attributes (`WeightLayout`).
Without example inputs only 2-D kernels can be quantized (taken as Dense [K, N]).
"""


from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from qformats.errors import ModelError
from qformats.nn.linen import as_shape
from qformats.nn.projection import (check_einsum_acts, einsum_layout, einsum_matrix, norm_axes, packed_einsum,
                                    packed_linear, packed_linear_general)
from qformats.algorithms.weight_search import RTN, search_name
from qformats.matching import Matcher
from qformats.nn import host_quantize, traced
from qformats.plan import Candidate, Decision, Plan, check_fit, plan_quantization, warn_unused_rules
from qformats.qarray import QArray
from qformats.schemes import SchemeSet


# ---- layouts: what a kernel in the params tree is ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How one linen layer's kernel becomes the [K, N] matrix it is quantized as.

    The matrix is `transpose(kernel, perm).reshape(K, N)` (per layer; `kernel_shape` excludes axes that
    `nn.scan` / `nn.vmap` stack in front). `kind` is "Dense", "DenseGeneral" or "Einsum"; DenseGeneral
    records `axis` (normalized against the recorded input's ndim), `features` and `batch_dims`, Einsum
    `einsum_str` and whether x's last axis is its only contraction (`contracts_last`). `error` says why the
    layer cannot be quantized (raised, with its path, only if a rule selects it).
    """

    kind: str
    kernel_shape: Tuple[int, ...]
    perm: Tuple[int, ...]
    k: int
    n: int
    axis: Tuple[int, ...] = ()
    features: Tuple[int, ...] = ()
    batch_dims: Tuple[int, ...] = ()
    einsum_str: Optional[str] = None
    contracts_last: bool = True
    error: Optional[str] = None


def _dense_layout(kernel_shape) -> WeightLayout:
    k, n = (int(d) for d in kernel_shape)
    return WeightLayout("Dense", (k, n), (0, 1), k, n)


def _call_input(args, kwargs):
    return args[0] if args else kwargs.get("inputs")


def _einsum_str(mod: nn.Einsum, args, kwargs) -> Optional[str]:
    s = args[1] if len(args) > 1 else kwargs.get("einsum_str")
    s = s if s is not None else mod.einsum_str
    return None if s is None else s.replace(" ", "")


def _layout_of(mod: nn.Module, kernel_shape, args, kwargs) -> WeightLayout:
    """The layout of a Dense / DenseGeneral / Einsum call (`kernel_shape`: the per-layer kernel's)."""
    kernel_shape = tuple(int(d) for d in kernel_shape)
    if isinstance(mod, nn.Dense):
        return _dense_layout(kernel_shape)
    if isinstance(mod, nn.DenseGeneral):
        x = _call_input(args, kwargs)
        axis, features = norm_axes(mod.axis, x.ndim), as_shape(mod.features)
        batch = norm_axes(mod.batch_dims, x.ndim)
        nb, na = len(batch), len(axis)
        k, n = math.prod(kernel_shape[nb:nb + na]), math.prod(kernel_shape[nb + na:])
        err = None
        if batch:
            err = (f"DenseGeneral with batch_dims {batch} is not supported (a quantized weight is one [K, N] "
                   "matrix); leave it out with Rule(path, None)")
        return WeightLayout("DenseGeneral", kernel_shape, tuple(range(len(kernel_shape))), k, n, axis=axis,
                            features=features, batch_dims=batch, error=err)
    s = _einsum_str(mod, args, kwargs)
    try:
        if s is None:
            raise ModelError("Einsum without an einsum_str")
        perm, k, last = einsum_layout(s, kernel_shape)
    except ModelError as e:
        return WeightLayout("Einsum", kernel_shape, tuple(range(len(kernel_shape))), 0, 0, einsum_str=s,
                            contracts_last=False, error=str(e))
    return WeightLayout("Einsum", kernel_shape, perm, k, math.prod(kernel_shape) // k, einsum_str=s,
                        contracts_last=last)


_FLOAT_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum)

# Why interception and jax's jit caches need care. An interceptor (`nn.intercept_methods`) only sees the module
# calls whose Python runs, and a method lifted with `nn.jit` (`@nn.jit` on a `__call__`, as gemma's linen
# Transformer has, or a class `nn.jit(Block)`) is one `jax.jit`-ed function per class, whose trace cache is keyed
# by (module fingerprint: its attributes, not its name or scope path; scope mutability; the variables' and
# arguments' pytree structure and avals; jax's trace context) -- not by the interceptors on flax's thread-local
# stack. So a trace is reused (the body does not run) once the model has run on inputs of these shapes (any call,
# `jax.jit(module.apply)`, an earlier discovery), and, within one trace, for a second instance of the same lifted
# class (`b1` reuses `b0`'s). Hence:
# - discovery (`record_layouts`) runs under `jax.disable_jit()`: every jitted body is traced inline by eval_shape,
#   each call of each instance intercepted;
# - an apply must compute nothing that the jit key does not contain: `QuantizedLinen.apply` passes each packed
#   kernel as a `_Bound` node whose pytree structure holds its SchemeSet and layout, so the interceptor reads them
#   from the variables (not from its path), and a trace made for another path, scheme or wrapper is never reused
#   where it would compute something else.
class _Bound:
    """A packed kernel with what its call computes: `q` (the QArray, the only pytree child), `ss` (SchemeSet) and
    `layout` (WeightLayout or None) as static pytree data, hence part of every jit cache key."""

    __slots__ = ("q", "ss", "layout")

    def __init__(self, q: QArray, ss: SchemeSet, layout: Optional[WeightLayout]):
        self.q, self.ss, self.layout = q, ss, layout


jax.tree_util.register_pytree_node(_Bound, lambda b: ((b.q,), (b.ss, b.layout)),
                                   lambda aux, children: _Bound(children[0], *aux))


def _root(variables):
    return variables["params"] if isinstance(variables.get("params"), Mapping) else variables


def _scope_path(mod: nn.Module) -> str:
    return "/".join(mod.scope.path) if mod.scope is not None else ""


def record_layouts(module: nn.Module, variables: Mapping, *example_args, **example_kwargs) -> Dict[str, WeightLayout]:
    """{"/"-joined scope path: WeightLayout} for every `Dense` / `DenseGeneral` / `Einsum` that
    `module.apply(variables, *example_args, **example_kwargs)` calls (the first call of each, inside
    `nn.scan` / `nn.vmap` too). Runs under `jax.eval_shape`: shapes only, nothing is computed.

    `variables` may be the params dict itself (no "params" key); `example_kwargs` go to `module.apply`
    (method arguments, `rngs=`, `mutable=`, ...). ModelError if the module cannot run on them. The module's code
    is traced anew on every call, however often the model has run before (no jitted trace is reused, also under
    `nn.jit`), so the same layers are found each time.
    """
    found: Dict[str, WeightLayout] = {}

    def record(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name == "__call__" and isinstance(mod, _FLOAT_LAYERS):
            path = _scope_path(mod)
            kernel = mod.get_variable("params", "kernel") if mod.has_variable("params", "kernel") else None
            if path not in found and kernel is not None and not isinstance(kernel, QArray):
                found[path] = _layout_of(mod, jnp.shape(nn.meta.unbox(kernel)), args, kwargs)
        return next_fun(*args, **kwargs)

    v = variables if isinstance(variables.get("params"), Mapping) else {"params": variables}
    try:
        # disable_jit: no cached trace stands in for a module call (see _Bound). It also unrolls an
        # `nn.scan` into per-layer calls and runs only the taken branch of a concrete `nn.cond`; under
        # eval_shape all of it is abstract (no FLOPs, nothing compiled).
        with nn.intercept_methods(record), jax.disable_jit():
            jax.eval_shape(lambda v: module.apply(v, *example_args, **example_kwargs), v)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"{type(module).__name__}: running module.apply on the example inputs (to record which "
                         f"kernels belong to Dense / DenseGeneral / Einsum) failed: {type(e).__name__}: {e}") from e
    return found


# ---- params transform ----------------------------------------------------------------------------------
def _kernel_nodes(tree, prefix=()):
    """(path tuple, params dict) for each dict in the tree holding a 'kernel' leaf."""
    if not isinstance(tree, Mapping):
        return
    k = tree.get("kernel")
    if k is not None and not isinstance(k, Mapping):
        yield prefix, tree
    for name, sub in tree.items():
        if isinstance(sub, Mapping):
            yield from _kernel_nodes(sub, prefix + (name,))


def _plan(root, matcher, layouts, traced_found=None):
    """Select and validate every kernel a rule quantizes → ({path: (layout, stacked axes, schemes)}, the Plan,
    [(weight name, param path, WeightUsage, SchemeSet)] of the traced matmul weights to pack)."""
    generic, usage_dense = traced_found or ({}, {})
    items = []
    for p, node in _kernel_nodes(root):
        path = "/".join(p)
        if isinstance(node["kernel"], QArray) or (layouts is not None and path not in layouts):
            continue  # already packed, or not a Dense / DenseGeneral / Einsum kernel
        items.append((path, node["kernel"]))
    chosen = plan_quantization([Candidate(path) for path, _ in items] + [Candidate(n) for n in generic], matcher)
    chosen.decisions.extend(Decision(Candidate(n), None, why, traced.deciding_rule(matcher, n))
                            for n, why in usage_dense.items())
    chosen.unused = matcher.unused()
    warn_unused_rules(chosen, stacklevel=4)
    schemes = chosen.schemes()
    traced_items, misfit = traced.plan_traced(generic, schemes)
    chosen = chosen.leave_dense(misfit)
    plan = {}
    for path, kernel in items:
        if path not in schemes:
            continue
        ss = schemes[path]
        if isinstance(kernel, nn.meta.AxisMetadata):
            raise ModelError(f"{path}: the kernel is boxed ({type(kernel).__name__}); unbox the params "
                             "(flax.linen.meta.unbox) before quantizing")
        shape = tuple(int(d) for d in jnp.shape(kernel))
        if layouts is None:
            if len(shape) != 2:
                raise ModelError(f"{path}: kernel of shape {shape} is not a 2-D Dense kernel; pass example inputs "
                                 "(quantize_linen(module, params, rules, *example_args, **example_kwargs)) so its "
                                 "layer type and contracted axes can be recorded, or leave it out with "
                                 "Rule(path, None)")
            layout = _dense_layout(shape)
        else:
            layout = layouts[path]
        if layout.error is not None:
            raise ModelError(f"{path}: {layout.error}")
        per = layout.kernel_shape
        lead = shape[: max(len(shape) - len(per), 0)]
        if shape[len(lead):] != per:
            raise ModelError(f"{path}: the kernel in the params has shape {shape}, the {layout.kind} call sees "
                             f"{per}; only layers stacked in front (nn.scan / nn.vmap with variable_axes "
                             "{'params': 0}) are supported")
        if lead and ss.weights.strategy == "block":
            raise ModelError(f"{path}: block scales ({ss.name}) need a 2-D kernel; this one is stacked {shape}")
        if layout.kind == "Einsum":
            check_einsum_acts(path, layout.einsum_str, layout.contracts_last, ss)
        check_fit(path, layout.k, ss, static_acts=False)
        plan[path] = (layout, lead, ss)
    return plan, chosen, traced_items


LINEN_SEARCHES = (RTN, "mse")
"""The weight searches `quantize_linen` runs (linen has no calibration pass: no GPTQ)."""


def _quantize(params: Mapping, rules: Sequence, weight_search, layouts, traced_found=None, strict: bool = False):
    weight_search = search_name(weight_search, LINEN_SEARCHES)
    root = _root(params)
    plan, chosen, traced_items = _plan(root, Matcher.from_rules(rules), layouts, traced_found)
    traced.warn_partial(chosen, strict, "quantize_linen", stacklevel=5)
    packs = {ppath: (u, ss) for _, ppath, u, ss in traced_items}
    packed = _pack_traced(root, packs, weight_search)

    def rebuild(tree, prefix=()):
        out = {}
        for name, sub in tree.items():
            here = prefix + (name,)
            path = "/".join(prefix)
            if isinstance(sub, Mapping):
                out[name] = rebuild(sub, here)
            elif name == "kernel" and path in plan:
                layout, lead, ss = plan[path]
                out[name] = host_quantize.quantize_weight(einsum_matrix(sub, layout.perm, layout.k, lead), ss,
                                                          weight_search)
            elif "/".join(here) in packed:
                out[name] = packed["/".join(here)]
            else:
                out[name] = sub
        return out

    new_root = rebuild(root)
    new = dict(params, params=new_root) if root is not params else new_root
    return new, plan, chosen


def _pack_traced(root: Mapping, packs: Mapping, weight_search: str) -> Dict[str, traced.MatmulWeight]:
    """{param path: MatmulWeight} of the traced matmul weights `packs` ({param path: (usage, SchemeSet)}) of the
    params tree `root`, packed together (`traced.pack_many`: one compilation per distinct set of layouts)."""
    paths = list(packs)
    values = []
    for ppath in paths:
        node = root
        for part in ppath.split("/"):
            node = node[part]
        values.append(node)
    mws = traced.pack_many([(v, *packs[p]) for p, v in zip(paths, values)], weight_search)
    return dict(zip(paths, mws))


def quantize_params(params: Mapping, rules: Sequence, *, weight_search: Optional[str] = RTN,
                    layouts: Optional[Mapping[str, WeightLayout]] = None):
    """Params tree (with or without the top "params" key) → (new tree with each selected kernel a QArray
    W [K, N] along K, {path: SchemeSet}).

    `layouts` (from `record_layouts`) says which kernels are Dense / DenseGeneral / Einsum and how they
    flatten: W = transpose(kernel, perm).reshape(K, N), per layer (kernels stacked by `nn.scan` are
    quantized layer by layer). Without it every 2-D 'kernel' is taken as a Dense [K, N], and a rule
    selecting a kernel of another rank is a ModelError (pass layouts). Rules: first full match of the
    "/"-joined path wins, scheme None leaves the layer float. Every rule and shape is validated before
    anything is quantized; the input tree is not modified.
    """
    new, plan, _ = _quantize(params, rules, weight_search, layouts)
    return new, {path: ss for path, (_, _, ss) in plan.items()}


# ---- the wrapper ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizedLinen:
    """`module` run with packed kernels: `apply(variables, *args, **kwargs)` as `module.apply`.

    A `Dense` / `DenseGeneral` / `Einsum` call whose kernel param is a QArray W [K, N] (from
    `quantize_params`) computes, as the NNX layers do:
      Dense:        y = Qa(x) @ dequantize(W) + b
      DenseGeneral: y = (Qa(x_t.reshape(..., K)) @ dequantize(W)).reshape(..., *features) + b
      Einsum:       y = einsum(eq, Qa(x), W') + b, W' = dequantize(W) back in the kernel's layout
    with Qa the rule's input-activation quantization along the contracted axis (identity when weight-only).
    `layouts` (path → WeightLayout as quantized; `quantize_linen` fills them) are checked against each call; a
    path without one must have a kernel whose contracted axes come first (then [K, N] is a plain reshape), else
    ModelError. `apply` hands each packed kernel to the module together with its SchemeSet and layout (as static
    pytree data), so jitted traces (`nn.jit` methods) are keyed by what each call computes.
    """

    module: nn.Module
    schemes: Dict[str, SchemeSet]
    layouts: Optional[Dict[str, WeightLayout]] = None
    summary: Optional[Plan] = dataclasses.field(default=None, compare=False)

    def _interceptor(self, next_fun, args, kwargs, context):
        # reads the scheme and layout from the kernel node, never from the path: see _Bound
        mod = context.module
        if context.method_name != "__call__" or not isinstance(mod, _FLOAT_LAYERS):
            return next_fun(*args, **kwargs)
        bound = mod.get_variable("params", "kernel")
        path = _scope_path(mod)
        if isinstance(bound, QArray):
            raise ModelError(f"{path}: packed kernel without a scheme (params and rules differ)")
        if not isinstance(bound, _Bound):
            return next_fun(*args, **kwargs)
        kernel, ss, known = bound.q, bound.ss, bound.layout
        if isinstance(mod, nn.Dense):
            layout = _dense_layout(kernel.shape)
        else:
            layout = _call_layout(mod, path, kernel, args, kwargs)
        if known is not None and (known.perm, known.k, known.n) != (layout.perm, layout.k, layout.n):
            raise ModelError(f"{path}: this {layout.kind} call flattens its kernel {layout.kernel_shape} with axes "
                             f"{layout.perm} to [{layout.k}, {layout.n}], but it was quantized as {known.perm} → "
                             f"[{known.k}, {known.n}]")
        if known is None and layout.perm != tuple(range(len(layout.perm))):
            raise ModelError(f"{path}: the {layout.kind} kernel's contracted axes are not its first ones and no "
                             "layout was recorded for it; quantize with example inputs (quantize_linen(module, "
                             "params, rules, *example_args))")
        if (layout.k, layout.n) != tuple(kernel.shape):
            raise ModelError(f"{path}: the {layout.kind} call needs a [{layout.k}, {layout.n}] weight, the packed "
                             f"kernel is {kernel.shape}")
        x = _call_input(args, kwargs)
        bias = mod.get_variable("params", "bias") if mod.use_bias else None
        if isinstance(mod, nn.Dense):
            return packed_linear(x, kernel, bias, ss, dtype=mod.dtype)
        if isinstance(mod, nn.DenseGeneral):
            return packed_linear_general(x, kernel, bias, ss, axis=mod.axis, out_shape=layout.features,
                                         dtype=mod.dtype)
        return packed_einsum(x, kernel, bias, ss, einsum_str=layout.einsum_str, kernel_shape=layout.kernel_shape,
                             perm=layout.perm, contracts_last=layout.contracts_last, where=path, dtype=mod.dtype)

    def apply(self, variables, *args, **kwargs):
        bound = _bind(variables, self.schemes, self.layouts or {})

        def run(v, *a, **k):
            with nn.intercept_methods(self._interceptor):
                return self.module.apply(v, *a, **k)

        if any(isinstance(v, traced.MatmulWeight) for v in jax.tree_util.tree_leaves(
                bound, is_leaf=lambda v: isinstance(v, traced.MatmulWeight))):
            out = traced.run_packed(run, bound, *args, **kwargs)  # params packed outside flax's layer classes
        else:
            out = run(bound, *args, **kwargs)
        if not kwargs.get("mutable"):
            return out
        return jax.tree.map(lambda t: t.q if isinstance(t, _Bound) else t, out,  # mutated collections: QArrays
                            is_leaf=lambda t: isinstance(t, _Bound))


def _bind(tree, schemes: Mapping[str, SchemeSet], layouts: Mapping[str, WeightLayout], prefix=()):
    """`tree` with each QArray 'kernel' whose path has a scheme as a `_Bound` (a copy; the rest shared)."""
    out = {}
    for name, sub in tree.items():
        path = "/".join(prefix[1:])  # prefix[0]: the collection ("params")
        if isinstance(sub, Mapping):
            out[name] = _bind(sub, schemes, layouts, prefix + (name,))
        elif name == "kernel" and prefix[:1] == ("params",) and isinstance(sub, QArray) and path in schemes:
            out[name] = _Bound(sub, schemes[path], layouts.get(path))
        else:
            out[name] = sub
    return out


def _call_layout(mod, path: str, kernel: QArray, args, kwargs) -> WeightLayout:
    """The layout a DenseGeneral / Einsum call implies (its float kernel shape from the module's attributes)."""
    x = _call_input(args, kwargs)
    if isinstance(mod, nn.DenseGeneral):
        if tuple(mod.batch_dims):
            raise ModelError(f"{path}: DenseGeneral with batch_dims {tuple(mod.batch_dims)} is not supported")
        axes = norm_axes(mod.axis, x.ndim)
        shape = tuple(int(x.shape[a]) for a in axes) + as_shape(mod.features)
        return _layout_of(mod, shape, args, kwargs)
    layout = _layout_of(mod, as_shape(mod.shape), args, kwargs)
    if layout.error is not None:
        raise ModelError(f"{path}: {layout.error}")
    return layout


def _check_reached(module: nn.Module, root: Mapping, matcher: Matcher, layouts: Mapping[str, WeightLayout],
                   traced_paths=frozenset()) -> None:
    """Say loudly when discovery reached fewer layers than the params suggest, never quantize nothing quietly.

    No Dense / DenseGeneral / Einsum call recorded and no param reaching a matmul (`traced_paths`) while a rule
    quantizes something and the params hold arrays: ModelError (how many arrays and 'kernel's, which of them
    the rules select). Otherwise a warning naming the rule-selected 'kernel's that no matmul reached (they stay
    float, e.g. Conv kernels).
    """
    selected = []
    for p, node in _kernel_nodes(root):
        path = "/".join(p)
        if (path not in layouts and "/".join(p + ("kernel",)) not in traced_paths
                and not isinstance(node["kernel"], QArray) and matcher.match(path)[1] is not None):
            selected.append(path)
    names = [f"{p}/kernel" if p else "kernel" for p in selected]
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    if not layouts and not traced_paths:
        n_arrays = len(jax.tree.leaves(root))
        if n_arrays and any(s.scheme is not None for s in matcher.selectors):
            kernels = sum(1 for _ in _kernel_nodes(root))
            raise ModelError(
                f"{type(module).__name__}: module.apply on the example inputs reached no matmul on a param, but its "
                f"params hold {n_arrays} arrays ({kernels} 'kernel' params"
                + (f"; the rules select {shown}" if selected else "") + "): nothing would be quantized")
    elif selected:
        warnings.warn(f"qformats.nn: {type(module).__name__}: no matmul reached the rule-selected params {shown}; "
                      "they stay float", stacklevel=3)


def trace_params(module: nn.Module, variables: Mapping, *example_args, **example_kwargs
                 ) -> Dict[str, traced.WeightUsage]:
    """{"/"-joined param path: WeightUsage} of every array in the "params" collection, from one abstract trace of
    `module.apply(variables, *example_args, **example_kwargs)` (`qformats.nn.traced.find_matmul_weights`)."""
    v = variables if isinstance(variables.get("params"), Mapping) else {"params": variables}
    try:
        found = traced.find_matmul_weights(lambda vs, *a, **k: module.apply(vs, *a, **k), v, *example_args,
                                           **example_kwargs)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"{type(module).__name__}: tracing module.apply on the example inputs (to find which "
                         f"params its matmuls use) failed: {type(e).__name__}: {e}") from e
    out = {}
    for kp, u in found.items():
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in kp]
        if keys[:1] == ["params"]:
            out["/".join(keys[1:])] = u
    return out


def quantize_linen(module: nn.Module, params: Mapping, rules: Sequence, *example_args,
                   weight_search: Optional[str] = RTN, strict: bool = False, **example_kwargs):
    """(module, params) → (QuantizedLinen wrapper, quantized params), under the same Rule semantics as NNX.

    Every `Dense` / `DenseGeneral` / `Einsum` whose "/"-joined scope path a rule selects gets its kernel
    packed as W [K, N] quantized along the contracted size K; `wrapper.apply(qparams, ...)` computes
    y = Qa(x) @ dequantize(W) + b (see QuantizedLinen), equal to the NNX layers.

    Args:
      module, params: the linen module and its variables (or the params dict itself).
      rules: `Rule(pattern, scheme)`s; first full match wins, scheme None leaves the layer float.
      *example_args, **example_kwargs: inputs for `module.apply(params, *example_args, **example_kwargs)`
        (shapes matter, values do not: it runs under `jax.eval_shape`), used to learn each kernel's layer
        type and contracted axes (`record_layouts`). Needed for DenseGeneral / Einsum / stacked kernels;
        without them only 2-D kernels are quantized (as Dense) and a rule selecting another is a ModelError.
      weight_search: "rtn" (round-to-nearest; None is accepted as its alias) or "mse" (per-group clipping
        search); `LINEN_SEARCHES`.
      strict: ModelError (before anything is quantized) when a weight a rule selects with a scheme would stay
        dense (used outside a matmul too, shape misfit).

    With example inputs, `module.apply` is also traced once (abstractly, `trace_params`), and every other param
    fed to a matmul, whatever module holds it (a third-party layer's `jnp.einsum` / `jnp.dot` / `@` /
    `lax.dot_general` on `self.param(...)`, also under `nn.scan`), is a candidate named by its param path (by
    its module's path when the param is a `kernel`): packed as a `qformats.nn.traced.MatmulWeight` (W [K, N]
    along its contracted axes) that `wrapper.apply` consumes through `traced.run_packed`. Weight-only schemes
    fit every such weight, W+A ones those whose every matmul contracts the input's last axis alone (ModelError
    otherwise). A rule's selected weights that stay dense are named in a warning; `wrapper.summary` is the
    `qformats.plan.Plan`: one decision per matmul weight (quantized with which scheme, or dense and why).

    Everything (regexes, scheme names, shapes against schemes) is validated before any weight is quantized;
    errors are ModelErrors naming the rule or the module path. `params` is not modified. The same kernels are
    found however often the model has run (also with `nn.jit` methods). With example inputs, a run that reaches
    no Dense / DenseGeneral / Einsum call while the params hold arrays (and a rule quantizes) is a ModelError,
    and rule-selected 'kernel' params that no such call reached are named in a warning (they stay float).

    Kernels stacked by `nn.scan` / `nn.vmap` ([L, *kernel] in the params) are quantized layer by layer
    (`quantize_weight` vmaps the leading axes; the scanned call then sees a per-layer QArray). The stacking
    axes must lead (variable_axes={"params": 0}); another axis is refused when the shapes show it, which they
    cannot when that axis happens to have the per-layer shape's sizes (e.g. axis 1 with L == K).
    DenseGeneral `batch_dims` and block scales (FP8_BLOCK) on stacked kernels are refused.
    """
    matcher = Matcher.from_rules(rules)  # a bad rule is reported before the model is run
    layouts = None
    if example_args or example_kwargs:
        # Dense / DenseGeneral / Einsum hold a float 'kernel': without one in the params there is none to record
        floats = any(not isinstance(node["kernel"], QArray) for _, node in _kernel_nodes(_root(params)))
        layouts = record_layouts(module, params, *example_args, **example_kwargs) if floats else {}
    found = None
    if layouts is not None:
        usages = trace_params(module, params, *example_args, **example_kwargs)
        found = traced.traced_candidates(usages, {f"{p}/kernel" for p in layouts})
        _check_reached(module, _root(params), matcher, layouts, {p for p, u in usages.items() if u.dots})
    qparams, plan, chosen = _quantize(params, rules, weight_search, layouts, found, strict)
    schemes = {p: ss for p, (_, _, ss) in plan.items()}
    return QuantizedLinen(module, schemes, {p: lay for p, (lay, _, _) in plan.items()}, summary=chosen), qparams
