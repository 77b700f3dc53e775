"""Sharding of NNX models on a jax Mesh: every parameter placed by `qformats.sharding.ShardingRules`, packed
QArrays leaf by leaf in the layout of the float weight they replaced."""

from __future__ import annotations

from typing import Dict

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from qformats.qarray import QArray
from qformats.sharding import ShardingRules, qarray_shardings, spec_for

__all__ = ["param_shardings", "shard_model", "param_bytes_per_device"]


def _variables(model):
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            yield "/".join(str(p) for p in path), var


def param_shardings(model, mesh: Mesh, rules: ShardingRules) -> Dict[str, object]:
    """Variable path -> its sharding on `mesh`: a NamedSharding for an array, a QArray of NamedShardings for a
    packed weight (the layout of the logical float weight, `qarray_shardings`). Variables holding None or
    non-array values are left out."""
    out: Dict[str, object] = {}
    for path, var in _variables(model):
        value = var.get_value()
        if isinstance(value, QArray):  # leaves with leading stacked axes (expert stacks): the stack's logical shape
            lead = tuple(value.codes.shape[:value.codes.ndim - len(value.tshape)])
            spec = spec_for(path, lead + tuple(value.shape), mesh, rules)
            out[path] = qarray_shardings(value, spec, mesh, path)
        elif hasattr(value, "shape") and hasattr(value, "dtype"):
            out[path] = NamedSharding(mesh, spec_for(path, value.shape, mesh, rules))
    return out


def shard_model(model, mesh: Mesh, rules: ShardingRules):
    """Places every parameter (and other array variable) of an NNX `model` on `mesh` by `rules`, in place;
    returns `model`.

    Each variable is `jax.device_put` to its sharding (`param_shardings`): a float array to the NamedSharding
    of its logical axes, a packed QArray leaf by leaf to the layout of the float weight it replaced. All
    layouts are checked before anything moves (ModelError naming the parameter that the mesh cannot split).
    A jit of the model then runs SPMD: XLA partitions the computation to follow the parameters.
    Derived kernel-layout caches (`qformats.nn.KernelCache`) are rebuilt from the placed weights. A model with
    a `set_sharding(mesh, rules)` method is told its layout (the decoder lays out its KV cache by it).
    """
    shardings = param_shardings(model, mesh, rules)
    for path, var in _variables(model):
        if path in shardings:
            var.set_value(jax.device_put(var.get_value(), shardings[path]))
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "cache_kernel_layout") and getattr(node, "kernel_cache", None) is not None:
            node.cache_kernel_layout()
    if callable(getattr(model, "set_sharding", None)):
        model.set_sharding(mesh, rules)
    return model


def param_bytes_per_device(model) -> Dict[object, int]:
    """Device -> bytes of the model's parameters (`nnx.Param`, packed QArray leaves included) stored on it: the
    sum over every parameter leaf of the nbytes of its shard on that device."""
    out: Dict[object, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        if not isinstance(leaf, jax.Array):
            leaf = jax.numpy.asarray(leaf)
        for sh in leaf.addressable_shards:
            out[sh.device] = out.get(sh.device, 0) + int(np.prod(sh.data.shape)) * sh.data.dtype.itemsize
    return out
