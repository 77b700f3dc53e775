"""Scanned decoder layers: runs of consecutive layers of one structure, stacked once, each run executed by one
`jax.lax.scan`, so a model's compile time does not grow with its depth (`scan_layers`).

Everything that builds, loads, quantizes, calibrates or shards the decoder addresses layers by their per-layer paths
(`model/layers/{i}/...`); `scan_layers` is the last step before inference: it regroups `model.model.layers` in place
into a `ScannedLayers` module, and `CausalLM.__call__` / `CausalLM.init_cache` run either form.

Grouping: layer i joins the run of layer i - 1 when both have the same structure — the same nnx graph (module
classes and static attributes, where a string naming the layer's own index, such as a quantized projection's
`path`, counts as the same) and the same state leaves (tree structure, shapes, dtypes, shardings). A stack of
identical dense layers is one run; a heterogeneous stack (dense and MoE layers, layers quantized with different
schemes) forms several runs, each scanned. Sliding windows are data, not structure: a run mixing window sizes scans
over the index of each layer's mask.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError

__all__ = ["LayerRun", "ScannedLayers", "scan_layers", "layer_runs"]


class LayerRun(nnx.Module):
    """`count` consecutive decoder layers first .. first + count - 1 of one structure: `layer` is one layer module
    whose every variable holds the run's values stacked on a new leading axis (layer first + j at index j);
    `windows[j]` is layer first + j's attention window (None: full causal attention).

    Errors raised while tracing a run name its first layer (its modules keep that layer's static attributes)."""

    def __init__(self, layer: nnx.Module, first: int, count: int, windows: Sequence[Optional[int]]):
        self.layer = layer
        self.first = int(first)
        self.count = int(count)
        self.windows = tuple(windows)

    def __call__(self, x, cos, sin, masks: Dict[Optional[int], jax.Array], kv: Optional[Tuple[jax.Array, ...]],
                 start):
        """x [B, T, d] through the run's layers in order: for j = 0 .. count - 1,
        x, kv_j = layer_j(x, cos, sin, masks[windows[j]], kv_j, start), as one `jax.lax.scan` over the stacked
        variables. kv: the run's cache buffers stacked [count, ...] (or None). Returns (x, the updated stacked
        buffers or None).

        The cache is scanned over (layer j reads its own entry, as `xs`, and the scan stacks its updated entry, as
        `ys`), not carried: a loop-carried stack that the body both reads and updates is copied whole by XLA at
        every layer (O(count^2 S) per call), an entry in and an entry out is O(count S)."""
        graphdef, state = nnx.split(self.layer)
        distinct = sorted(set(self.windows), key=lambda w: (w is None, w or 0))
        if len(distinct) == 1:
            mask_stack, pick = masks[distinct[0]], None
        else:  # the window is data: the layer picks its mask by index
            mask_stack = jnp.stack([masks[w] for w in distinct])
            pick = jnp.asarray([distinct.index(w) for w in self.windows], jnp.int32)

        def body(h, xs):
            st, wi, entry = xs
            layer = nnx.merge(graphdef, st)
            mask = mask_stack if wi is None else mask_stack[wi]
            h, entry = layer(h, cos, sin, mask, entry, start)
            if kv is not None:
                entry = tuple(e.astype(c.dtype) for c, e in zip(kv, entry))
            return h, (entry if kv is not None else None)

        with jax.named_scope(f"layers_{self.first}_{self.first + self.count - 1}"):
            x, kv = jax.lax.scan(body, x, (state, pick, None if kv is None else tuple(kv)))
        return x, kv


class ScannedLayers(nnx.Module):
    """The decoder's layers as consecutive `LayerRun`s (`runs`), covering layers 0 .. num_layers - 1 in order."""

    def __init__(self, runs: Sequence[LayerRun]):
        self.runs = nnx.List(list(runs))
        self.num_layers = sum(r.count for r in runs)

    def __len__(self) -> int:
        return self.num_layers

    def __call__(self, x, cos, sin, masks, kv, start):
        """x through every run in order; kv: one stacked cache entry per run (or None). Returns (x, entries)."""
        entries = []
        for r, run in enumerate(self.runs):
            x, e = run(x, cos, sin, masks, None if kv is None else kv[r], start)
            entries.append(e)
        return x, entries


def _static_value(attr: Any, index: int) -> Any:
    """A graphdef attribute with a string naming layer `index` made independent of the index."""
    value = getattr(attr, "value", None)
    if type(attr).__name__ == "Static" and isinstance(value, str):
        return ("Static", re.sub(rf"(layers[./]){index}(?=[./]|$)", r"\1#", value))
    return attr


def _structure(graphdef, leaves, treedef, index: int):
    """What must be equal for two layers to share a run: the graph (index-neutral), the state tree, and per leaf
    its shape, dtype and sharding."""
    attributes = getattr(graphdef, "attributes", None)
    graph = graphdef if attributes is None else (
        list(graphdef.nodes), [(name, _static_value(a, index)) for name, a in attributes])
    return (graph, treedef, [(np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None))
                             for x in leaves])


def layer_runs(model) -> List[Tuple[int, int]]:
    """[(first, count)] of the runs `scan_layers` forms for `model` (a `CausalLM` with per-layer layers)."""
    layers = model.model.layers
    if isinstance(layers, ScannedLayers):
        return [(r.first, r.count) for r in layers.runs]
    runs: List[Tuple[int, int]] = []
    prev = None
    for i, layer in enumerate(layers):
        graphdef, state = nnx.split(layer)
        leaves, treedef = jax.tree.flatten(state)
        key = _structure(graphdef, leaves, treedef, i)
        if runs and key == prev:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
        prev = key
    return runs


def _stack(leaves: List[Any]) -> Any:
    """The leaves of one variable of a run stacked on a new axis 0, laid out like them (a NamedSharding gains a
    replicated leading axis)."""
    first = leaves[0]
    if not isinstance(first, jax.Array):
        return np.stack([np.asarray(x) for x in leaves])
    sharding = first.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*leaves)


def scan_layers(model):
    """Regroups `model.model.layers` (a `CausalLM`'s per-layer list) in place into a `ScannedLayers` of runs of
    consecutive layers of one structure (`layer_runs`) and returns the model; a model already scanned is returned
    as it is.

    Each run's variables are stacked once, variable by variable, on a new leading axis (packed QArrays leaf by
    leaf; sharded arrays keep their layout, with the layer axis replicated), and the per-layer arrays are released
    as soon as their stack exists, so the memory peak is the model plus one variable stacked over one run. The
    model computes the same values as before (each layer runs the same operations in the same order, inside a
    `jax.lax.scan`), with one traced layer per run instead of one per layer.

    After this step the model is for inference (`__call__`, `init_cache`, `qformats.models.generate`): functions
    that address layers by index (`load_hf_tensors`, `quantize_model` rules, calibration, `shard_model`,
    `enable_kv_cache_quantization`, rotations) must run before it. Variables a layer writes during its call are
    not kept across a scan.
    """
    layers = model.model.layers
    if isinstance(layers, ScannedLayers):
        return model
    windows = model.config.sliding_windows
    if len(layers) != len(windows):
        raise ModelError(f"scan_layers: the model has {len(layers)} layers and {len(windows)} sliding-window "
                         f"entries in its config")
    spans = layer_runs(model)
    pieces = []
    for layer in layers:
        graphdef, state = nnx.split(layer)
        leaves, treedef = jax.tree.flatten(state)
        pieces.append([graphdef, treedef, leaves])
        del state
    # the modules' references go: from here on `pieces` holds the only (per-layer) references to the arrays
    model.model.layers = nnx.List([])
    del layers, layer
    runs = []
    for first, count in spans:
        graphdef, treedef, leaves0 = pieces[first]
        stacked = []
        for j in range(len(leaves0)):
            stacked.append(_stack([pieces[first + k][2][j] for k in range(count)]))
            for k in range(count):
                pieces[first + k][2][j] = None
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, stacked))
        runs.append(LayerRun(layer, first, count, windows[first:first + count]))
    model.model.layers = ScannedLayers(runs)
    return model
