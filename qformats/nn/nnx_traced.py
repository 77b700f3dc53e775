"""NNX glue of `qformats.nn.traced`: find the matmul weights of any module class, pack them in place, run them.

A selected param's Variable is replaced (at every place that refers to it) by a `PackedParam` holding a
`traced.MatmulWeight`. The modules whose code must consume it get their methods run through
`traced.run_packed`: the model's root and each module that holds such a param have their class swapped, for
that instance only, to a subclass (`packed_class`) whose public methods and `__call__` trace the original
method once per call (with the dense shapes) and evaluate it with the packed weights. Nested calls inside one
such run are traced as they are, so one interpreter sees each forward. Nothing global is patched and nothing
is cloned; `nnx.split` / `nnx.merge` / `nnx.jit` / `nnx.scan` see an ordinary module of the subclass.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.errors import ModelError
from qformats.nn.nnx_layers import PackedParam
from qformats.nn.traced import MatmulWeight, WeightUsage, find_matmul_weights, run_packed, weight_name  # noqa: F401

_LOCAL = threading.local()


def _active() -> int:
    return getattr(_LOCAL, "depth", 0)


def _path_str(keys) -> str:
    parts = []
    for k in keys:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def float_params(model: nnx.Module, skip: Tuple[type, ...] = ()) -> Dict[str, nnx.Variable]:
    """param path -> nnx.Param for every floating-point Param of 2 or more dims (first path of a shared one),
    outside the modules of the types in `skip`."""
    out, seen, skipped = {}, set(), []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and skip and isinstance(node, skip):
            skipped.append(tuple(str(p) for p in path))
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param) or isinstance(node, PackedParam) or id(node) in seen:
            continue
        sp = tuple(str(p) for p in path)
        if any(sp[:len(s)] == s for s in skipped):
            continue
        v = node.get_value()
        if getattr(v, "ndim", 0) >= 2 and jnp.issubdtype(jnp.result_type(v), jnp.floating):
            seen.add(id(node))
            out["/".join(sp)] = node
    return out


def analyse(model: nnx.Module, forward: Callable, batch) -> Dict[str, WeightUsage]:
    """param path -> WeightUsage of every floating Param, from one abstract trace of `forward(model, batch)`."""
    graphdef, state = nnx.split(model)

    def run(st, b):
        return forward(nnx.merge(graphdef, st), b)

    try:
        found = find_matmul_weights(run, state, batch)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"{type(model).__name__}: tracing the model on the example inputs (to find which params "
                         f"its matmuls use) failed: {type(e).__name__}: {e}") from e
    return {_path_str(kp): u for kp, u in found.items()}


# ---- running ------------------------------------------------------------------------------------------------
_SKIP_BASES = frozenset(nnx.Module.__mro__)
_CLASSES: Dict[type, type] = {}


def _run_method(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def method(self, *args, **kwargs):
        if _active():  # already inside one traced run: this call is part of its jaxpr
            return orig(self, *args, **kwargs)
        graphdef, state = nnx.split(self)
        if not any(isinstance(v, MatmulWeight) for v in
                   jax.tree_util.tree_leaves(state, is_leaf=lambda v: isinstance(v, MatmulWeight))):
            return orig(self, *args, **kwargs)

        def run(st, *a, **k):
            m = nnx.merge(graphdef, st)
            _LOCAL.depth = _active() + 1
            try:
                out = orig(m, *a, **k)
            finally:
                _LOCAL.depth -= 1
            return out, nnx.state(m)

        out, new_state = run_packed(run, state, *args, **kwargs)
        nnx.update(self, new_state)
        return out

    return method


def packed_class(cls: type) -> type:
    """The subclass of `cls` whose `__call__` and public methods run through `traced.run_packed` (cached)."""
    if getattr(cls, "_qformats_packed_base", None) is not None:
        return cls
    if cls not in _CLASSES:
        ns: Dict[str, Any] = {"_qformats_packed_base": cls, "__module__": cls.__module__,
                              "__doc__": f"{cls.__name__} running its matmuls on packed weights "
                                         "(qformats.nn.nnx_traced)."}
        for klass in cls.__mro__:
            if klass in _SKIP_BASES:
                continue
            for name, attr in vars(klass).items():
                if name in ns or not isinstance(attr, types.FunctionType):
                    continue
                if name == "__call__" or not name.startswith("_"):
                    ns[name] = _run_method(attr)
        _CLASSES[cls] = type(cls.__name__, (cls,), ns)
    return _CLASSES[cls]


def _references(model: nnx.Module, var) -> List[Tuple[Any, Any, nnx.Module]]:
    """(container, key, owning module) for every place in the graph that holds `var`."""
    refs = []
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for key, value in list(vars(node).items()):
            if value is var:
                refs.append((node, key, node))
            elif isinstance(value, (list, dict)):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                refs.extend((value, k, node) for k, v in items if v is var)
    return refs


def install(model: nnx.Module, var: nnx.Variable, mw: MatmulWeight, path: str) -> None:
    """Replace `var` by a PackedParam of `mw` everywhere in `model`, and let the root and every module holding
    it run packed (`packed_class`). ModelError when the Variable is held where no module attribute refers to
    it (e.g. inside an `nnx.List`)."""
    refs = _references(model, var)
    if not refs:
        raise ModelError(f"{path}: the param is not held as a module attribute (or a plain list / dict of one); "
                         "it cannot be replaced by its packed weight")
    new = PackedParam(mw)
    for container, key, owner in refs:
        if isinstance(container, nnx.Module):
            setattr(container, key, new)
        else:
            container[key] = new
        owner.__class__ = packed_class(type(owner))
    model.__class__ = packed_class(type(model))


def packed_weights(model: nnx.Module) -> Dict[str, MatmulWeight]:
    """param path -> MatmulWeight of every packed param of `model` (first path of a shared one)."""
    out, seen = {}, set()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and id(node) not in seen:
            v = node.get_value()
            if isinstance(v, MatmulWeight):
                seen.add(id(node))
                out["/".join(str(p) for p in path)] = v
    return out


def variable_at(model: nnx.Module, path: str) -> Optional[nnx.Variable]:
    """The Variable at a "/"-joined param path, or None."""
    node = model
    try:
        for part in path.split("/"):
            node = node[int(part)] if part.isdigit() and not hasattr(node, part) else getattr(node, part)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return node if isinstance(node, nnx.Variable) else None
