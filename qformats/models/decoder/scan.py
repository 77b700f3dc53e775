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

Float projections on XLA:CPU (`RowLinear`): inside the scan body layer j's [K, N] kernel is a `dynamic-slice` of the
stack, and XLA:CPU copies it out before a library dot (it fuses a producer only into a matrix-*vector* dot, as an
elemental loop; see `qformats.packed_dot`). One activation row (a decode step at batch 1) is where that copy costs
most (it reads and writes the weight once more, the GEMV reads it once), so there each float `nnx.Linear` of a run
becomes a `RowLinear` whose stack is kept transposed, [count, N, K], and which computes one row as a vector-matrix
dot that XLA:CPU fuses the slice into (row n of W^T contiguous along k): no copy. More rows run nnx.Linear's
library dot on the layer's W materialised [K, N] (the copy a plain nnx.Linear makes too, shared by the rows); the
`generate` CLI with --batch-size > 1 passes `row_linear=False`.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError

__all__ = ["LayerRun", "ScannedLayers", "RowLinear", "scan_layers", "layer_runs"]

ROW_CHUNK = 2048
"""Most elements of x per fused vector-matrix dot (XLA:CPU fuses a weight's producer into such a dot only while
the vector is under 16 KiB; `qformats.packed_dot.CHUNK`)."""


class RowLinear(nnx.Module):
    """`nnx.Linear` with its kernel stored transposed (`kernel_t` = W^T [N, K]), for scanned runs on XLA:CPU:

        y[..., n] = sum_k x[..., k] W[k, n] (+ b[n])

    computed as `nnx.Linear` does (operands promoted to `dtype`, its precision) by one dot_general for several rows
    of x, and for a single row as vector-matrix dots y = sum_c x[c] . W^T[:, c]^T over chunks c of at most
    `ROW_CHUNK` elements of K, the form XLA:CPU fuses the weight's producer (a scan's dynamic-slice) into. Several
    rows equal nnx.Linear bit for bit (the same dot on W materialised [K, N]); one row up to float32 summation
    order."""

    def __init__(self, linear: nnx.Linear):
        self.kernel_t = nnx.Param(jnp.asarray(linear.kernel.get_value()).T)
        self.bias = None if linear.bias is None else nnx.Param(linear.bias.get_value())
        self.dtype = linear.dtype
        self.precision = linear.precision
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def __call__(self, x: jax.Array) -> jax.Array:
        from flax.nnx.nn.dtypes import promote_dtype

        w = self.kernel_t.get_value()
        b = None if self.bias is None else self.bias.get_value()
        x, w, b = promote_dtype((x, w, b), dtype=self.dtype)
        k = x.shape[-1]
        if int(np.prod(x.shape[:-1])) == 1:
            v = x.reshape(k)
            parts = [jax.lax.dot_general(v[k0:k0 + ROW_CHUNK], w[:, k0:k0 + ROW_CHUNK].T, (((0,), (0,)), ((), ())),
                                         precision=self.precision) for k0 in range(0, k, ROW_CHUNK)]
            # summed as ones . stack: XLA output-fuses a plain `a + b` of such dots into one of them, which makes
            # that dot a library call again (qformats.packed_dot)
            y = parts[0] if len(parts) == 1 else jax.lax.dot_general(
                jnp.ones((len(parts),), parts[0].dtype), jnp.stack(parts), (((0,), (0,)), ((), ())))
            y = y.reshape(x.shape[:-1] + (w.shape[0],))
        else:
            # several rows: W [K, N] materialised (one copy, shared by every row) behind a barrier, so XLA keeps the
            # dot nnx.Linear runs (a transpose folded into the dot's dimension numbers is another library kernel:
            # a different summation order on multi-threaded XLA:CPU, and slower)
            wk = jax.lax.optimization_barrier(w.T)
            y = jax.lax.dot_general(x, wk, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        if b is not None:
            y = y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))
        return y


_LINEAR_PROMOTE = inspect.signature(nnx.Linear.__init__).parameters["promote_dtype"].default


def _row_linears(layer: nnx.Module) -> None:
    """Every float `nnx.Linear` inside `layer` (default dot_general, a 2-D kernel) replaced in place by its
    `RowLinear`."""
    found = [(path, m) for path, m in nnx.iter_modules(layer)
             if type(m) is nnx.Linear and m.dot_general is jax.lax.dot_general
             and m.promote_dtype is _LINEAR_PROMOTE and m.kernel.get_value().ndim == 2
             and jnp.issubdtype(m.kernel.get_value().dtype, jnp.floating) and path]
    for path, m in found:
        parent = layer
        for part in path[:-1]:
            parent = parent[part] if isinstance(part, int) else getattr(parent, part)
        if isinstance(path[-1], int):
            parent[path[-1]] = RowLinear(m)
        else:
            setattr(parent, path[-1], RowLinear(m))


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


def scan_layers(model, row_linear: Optional[bool] = None):
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

    row_linear: turn each float `nnx.Linear` of the layers into a `RowLinear` (the kernel stacked transposed; one
    activation row computed as a vector-matrix dot XLA:CPU fuses the layer's slice into, module docstring): True,
    False, or None (default) for "on a CPU backend, on one device" (`model.sharding` unset). Its values equal the
    `nnx.Linear`'s bit for bit for several rows, and up to float32 summation order for one row.
    """
    layers = model.model.layers
    if isinstance(layers, ScannedLayers):
        return model
    windows = model.config.sliding_windows
    if len(layers) != len(windows):
        raise ModelError(f"scan_layers: the model has {len(layers)} layers and {len(windows)} sliding-window "
                         f"entries in its config")
    spans = layer_runs(model)
    if row_linear is None:
        row_linear = jax.default_backend() == "cpu" and getattr(model, "sharding", None) is None
    pieces = []
    for layer in layers:
        if row_linear:
            _row_linears(layer)
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
