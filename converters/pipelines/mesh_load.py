"""Placing checkpoint tensors on a jax Mesh, each device's slice read from the memory map straight to it.

`converters.pipelines.causal_lm.load_causal_lm(src, mesh=mesh)` loads through these: every parameter is assembled
with `jax.make_array_from_single_device_arrays` from shards read one at a time (`place`): the shard's rows
(and columns) of the stored tensor are taken from the memory-mapped safetensors file (`SliceSource`, over
`converters.formats.safetensors_io`'s lazy row slicing), converted, put on their device, and dropped. No tensor is
ever whole in host memory (only one shard at a time), and in a multi-process run (`jax.distributed`) each
process reads only the byte ranges of its own devices' shards. Quantized weights are decoded by
`converters.formats.compressed_tensors.read.decode_weight` (the decoder `read_compressed` uses), each QArray leaf read by slices
(`place_weight`); layouts whose values span slices are CheckpointErrors naming the module.

Mixture-of-experts stacks [E, ...] stored one tensor per expert (HF "mlp.experts.{e}.gate_proj.weight", and the
compressed-tensors modules of each expert) are placed the same way (`place_expert_stack`, `place_expert_weights`):
a device's shard of the stack is read from its own experts' tensors only (the rows / columns of its slice), so
under expert parallelism no device, and no host, ever holds the whole stack. Fused stacks stored [E, in, out]
(gpt-oss) are ordinary tensors (`place` with `dense_reader`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np

from converters.formats.compressed_tensors.read import Index, StoredWeight, TensorSource
from qformats.errors import CheckpointError, ModelError

__all__ = ["ReadStats", "SliceSource", "dense_reader", "equal_by_rows", "parallel_setup", "place",
           "place_expert_stack", "place_expert_weights", "place_weight", "tensor_parallel_setup"]


@dataclasses.dataclass
class ReadStats:
    """What a sharded load read from the checkpoint files: `bytes` of stored tensor data (the byte ranges of
    the shards this process placed, each read once per device that holds it) and the number of `reads`;
    `largest` is the largest single shard placed (bytes, in its device dtype)."""

    bytes: int = 0
    reads: int = 0
    largest: int = 0


def tensor_parallel_setup(n: int, axis: str = "tp"):
    """A 1-D `jax.sharding.Mesh` of `n` devices named `axis`, for tensor-parallel runs.

    On a host whose JAX backend is the CPU, the CPU device count is set to `n` first (`jax_num_cpu_devices`),
    which must happen before JAX starts its backends: call this before any other JAX operation. Accelerator
    hosts use their first `n` devices.

    Raises ModelError when fewer than `n` devices are available (for the CPU: JAX already started with fewer).
    """
    import jax
    from jax.sharding import Mesh

    if int(n) != n or n < 1:
        raise ModelError(f"tensor parallel: expected a positive device count, got {n!r}")
    n = int(n)
    try:
        if n > 1 and jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already initialised: the count below tells whether there are enough devices
    devices = jax.devices()
    if len(devices) < n:
        hint = (" (JAX started before the CPU device count could be set: call tensor_parallel_setup before any "
                "other JAX operation)") if devices[0].platform == "cpu" else ""
        raise ModelError(f"tensor parallel {n}: expected at least {n} {devices[0].platform} devices, found "
                         f"{len(devices)}{hint}")
    return Mesh(np.array(devices[:n]), (axis,))


def parallel_setup(tensor: int = 1, expert: int = 1):
    """The `jax.sharding.Mesh` of a run on `expert` x `tensor` devices: ("tp",) of `tensor` devices when `expert`
    is 1 (`tensor_parallel_setup`), else ("ep", "tp") of shape (expert, tensor) -- the expert stacks split over
    "ep", attention and dense MLPs over "tp" (`qformats.models.decoder.sharding.decoder_parallel_rules`). Call it
    before any other JAX operation (the CPU device count is set here). ModelError for a size below 1 or too few
    devices."""
    for what, n in (("tensor", tensor), ("expert", expert)):
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ModelError(f"{what} parallel: expected a positive device count, got {n!r}")
    tensor, expert = int(tensor), int(expert)
    if expert == 1:
        return tensor_parallel_setup(tensor, "tp")
    from jax.sharding import Mesh

    try:
        flat = tensor_parallel_setup(tensor * expert, "devices")
    except ModelError as e:
        raise ModelError(f"expert parallel {expert} x tensor parallel {tensor}: {e}") from None
    return Mesh(flat.devices.reshape(expert, tensor), ("ep", "tp"))


def place(shape, dtype, sharding, read: Callable[[Index], np.ndarray], stats: Optional[ReadStats] = None):
    """A global `jax.Array` of `shape` / `dtype` laid out by `sharding`, built shard by shard:

      for each device d of this process: a_d = read(index_d)  (index_d: d's slice of the global array), put on d;

    then `jax.make_array_from_single_device_arrays`. Only one shard is on the host at a time (the batch
    `jax.make_array_from_callback` would hold every shard of the process first)."""
    import jax
    import jax.numpy as jnp

    shape = tuple(int(s) for s in shape)
    dtype = jnp.dtype(dtype)
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        host = np.ascontiguousarray(read(index), dtype=dtype)
        want = tuple(len(range(*s.indices(d))) for s, d in zip(index, shape))
        if host.shape != want:
            raise CheckpointError(f"sharded load: a shard of {shape} at {index} came out as {host.shape}, expected "
                                  f"{want}")
        arrays.append(jax.device_put(host, device))
        if stats is not None:
            stats.largest = max(stats.largest, host.nbytes)
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


class SliceSource(TensorSource):
    """A `converters.formats.compressed_tensors.read.TensorSource` that counts in `stats` (a ReadStats, or None) every read: the bytes of
    stored data each `read(name, index)` returned (one device's slice, or a small tensor whole)."""

    def __init__(self, ck, stats: Optional[ReadStats] = None):
        super().__init__(ck)
        self.stats = stats

    def read(self, name: str, index: Optional[Index] = None) -> np.ndarray:
        a = super().read(name, index)
        if self.stats is not None:
            self.stats.bytes += int(a.size) * self.ck.info(name).numpy_dtype.itemsize
            self.stats.reads += 1
        return a


def dense_reader(src: TensorSource, name: str, transpose: bool) -> Callable[[Index], np.ndarray]:
    """read(index) of a dense parameter from stored tensor `name`: name[index], or for a Linear kernel
    (`transpose`: Flax [in, out] = torch [out, in].T) name[index[1], index[0]].T."""
    def read(index: Index) -> np.ndarray:
        if transpose:
            return src.read(name, (index[1], index[0])).T
        return src.read(name, tuple(index) or None)
    return read


def place_weight(w: StoredWeight, mesh, rules, fpath: str, stats: Optional[ReadStats] = None):
    """The QArray of a decoded weight (`converters.formats.compressed_tensors.read.decode_weight`), each leaf placed on `mesh` slice by
    slice (`place`), laid out as the float kernel `fpath`/kernel would be (`qformats.sharding.qarray_specs`).

    Raises CheckpointError naming the module when its layout cannot be read by slices (`w.whole_only`)."""
    import jax
    from jax.sharding import NamedSharding

    from qformats.sharding import qarray_specs, spec_for

    if w.whole_only is not None:
        raise CheckpointError(f"{w.where}: loading onto a mesh reads each shard straight from the file, which "
                              f"{w.whole_only} does not allow; load it with converters.pipelines.causal_lm.load_causal_lm "
                              f"on one device, then qformats.nn.sharding.shard_model")
    leaves = [w.codes, w.scale, w.zero_point, w.global_scale]
    abstract = w.qarray(*(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves))
    kpath = f"{fpath}/kernel"
    specs = qarray_specs(abstract, spec_for(kpath, w.shape, mesh, rules), mesh, kpath)
    placed = [None if x is None else place(x.shape, x.dtype, NamedSharding(mesh, spec), x.read, stats)
              for x, spec in zip(leaves, (specs.codes, specs.scale, specs.scale, specs.global_scale))]
    return w.qarray(*placed)


def equal_by_rows(ck, a: str, b: str, chunk_bytes: int = 1 << 22) -> bool:
    """Whether two stored tensors are equal, compared a block of rows at a time (views of the map)."""
    ia, ib = ck.info(a), ck.info(b)
    if ia.shape != ib.shape or ia.dtype != ib.dtype:
        return False
    if not ia.shape:
        return bool(np.array_equal(ck.get(a), ck.get(b)))
    row = max(1, math.prod(ia.shape[1:]) * ia.numpy_dtype.itemsize)
    step = max(1, chunk_bytes // row)
    for r in range(0, ia.shape[0], step):
        if not np.array_equal(ck.get(a, rows=slice(r, r + step)), ck.get(b, rows=slice(r, r + step))):
            return False
    return True


# ---- mixture-of-experts stacks, one stored tensor (or quantized module) per expert -------------------------------
def place_expert_stack(shape, dtype, sharding, readers, stats: Optional[ReadStats] = None):
    """A global [E, ...] `jax.Array` (`place`) whose expert e is read by `readers[e](index)` (index: a slice per
    dimension of one expert's array): a device's shard [e0:e1, i, j] is stack([readers[e]((i, j)) for e in
    e0..e1-1]), so only that device's experts' tensors are read, each only at its slice. ModelError when
    len(readers) != E."""
    shape = tuple(int(x) for x in shape)
    if len(readers) != shape[0]:
        raise ModelError(f"expert stack {shape}: expected {shape[0]} experts' tensors, found {len(readers)}")

    def read(index):
        experts = range(shape[0])[index[0]]
        inner = tuple(index[1:])
        parts = [np.asarray(readers[e](inner)) for e in experts]
        if not parts:
            return np.zeros((0,) + tuple(len(range(*s.indices(d))) for s, d in zip(inner, shape[1:])), dtype)
        return np.stack(parts)

    return place(shape, dtype, sharding, read, stats)


def place_expert_weights(ws, mesh, rules, fpath: str, stats: Optional[ReadStats] = None):
    """The stacked QArray (leaves [E, ...], per-expert shape [in, out]; `qformats.nn.QExperts`) of every expert's
    decoded weight `ws` [E] (`converters.formats.compressed_tensors.read.decode_weight`), each leaf placed on
    `mesh` shard by shard (`place_expert_stack`) in the layout `rules` give the float stack `fpath`/kernel
    [E, in, out] (`qformats.sharding.stacked_qarray_specs`): a device reads only its own experts' codes and scales.

    Raises CheckpointError naming the module of an expert whose layout cannot be read by slices, or when the
    experts differ in scheme, shape or leaves."""
    import jax
    from jax.sharding import NamedSharding

    from qformats.sharding import spec_for, stacked_qarray_specs

    w0 = ws[0]
    for w in ws:
        if w.whole_only is not None:
            raise CheckpointError(f"{w.where}: loading onto a mesh reads each shard straight from the file, which "
                                  f"{w.whole_only} does not allow; load it with converters.pipelines.causal_lm."
                                  f"load_causal_lm on one device, then qformats.nn.sharding.shard_model")
        same = (w.scheme, w.shape, w.dtype) == (w0.scheme, w0.shape, w0.dtype) and all(
            (a is None) == (b is None) and (a is None or (a.shape, a.dtype) == (b.shape, b.dtype))
            for a, b in zip(_leaves(w), _leaves(w0)))
        if not same:
            raise CheckpointError(f"{w.where}: expected every expert of {fpath} quantized as {w0.where} is "
                                  f"({w0.scheme.describe()}, shape {w0.shape}), found {w.scheme.describe()}, "
                                  f"shape {w.shape}")
    e = len(ws)
    one = w0.qarray(*(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _leaves(w0)))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct((e,) + tuple(x.shape), x.dtype), one)
    kpath = f"{fpath}/kernel"
    specs = stacked_qarray_specs(abstract, spec_for(kpath, (e,) + tuple(w0.shape), mesh, rules), mesh, kpath)
    placed = []
    for i, (x, spec) in enumerate(zip(_leaves(w0), (specs.codes, specs.scale, specs.scale, specs.global_scale))):
        if x is None:
            placed.append(None)
            continue
        readers = [_leaves(w)[i].read for w in ws]
        placed.append(place_expert_stack((e,) + tuple(x.shape), x.dtype, NamedSharding(mesh, spec), readers, stats))
    return _stacked_qarray(w0, placed)


def _leaves(w):
    return (w.codes, w.scale, w.zero_point, w.global_scale)


def _stacked_qarray(w0, leaves):
    """The QArray of w0's scheme / shape with stacked (placed) leaves, unchecked (QArray.check wants unstacked)."""
    from qformats.qarray import QArray

    return QArray(*leaves, scheme=w0.scheme, shape=w0.shape, dtype=w0.dtype, axis=0)
