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

__all__ = ["ReadStats", "SliceSource", "SlicedQArray", "dense_reader", "equal_by_rows", "gguf_dense_reader",
           "gguf_sliced", "host_sliced", "load_gguf_on_mesh", "load_native_on_mesh", "parallel_setup", "place",
           "place_expert_stack", "place_expert_weights", "place_sliced", "place_weight", "tensor_parallel_setup"]


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


# ---- formats other than compressed-tensors: GGUF kept packed, and the HF-native quantized formats ------------------
# (`converters.formats.quantized.READERS`). Separate from the compressed-tensors path above; both end in `place`.

_QARRAY_LEAVES = ("codes", "scale", "zero_point", "global_scale", "offset")


@dataclasses.dataclass(frozen=True)
class SlicedQArray:
    """A QArray to place on a mesh: `abstract` (its scheme, shapes and dtypes, leaves `jax.ShapeDtypeStruct`) and,
    for each leaf it has (`codes`, `scale`, `zero_point`, `global_scale`, `offset`), `reads[leaf](index)` giving
    that leaf's slice `leaf[index]` (one slice per dimension) as a host array."""

    abstract: object
    reads: dict


def place_sliced(w: SlicedQArray, mesh, rules, fpath: str, stats: Optional[ReadStats] = None):
    """The QArray of `w`, each leaf a global jax.Array placed device slice by device slice (`place`), laid out as
    the float kernel `fpath`/kernel would be (`qformats.sharding.qarray_specs`: output rows split with their codes,
    scales and offsets; a split reduction axis takes whole packed bytes and whole scale groups).

    Raises ModelError naming the kernel when the layout cannot be split that way (a group or packed byte cut)."""
    from jax.sharding import NamedSharding

    from qformats.qarray import QArray
    from qformats.sharding import qarray_specs, spec_for

    a = w.abstract
    kpath = f"{fpath}/kernel"
    specs = qarray_specs(a, spec_for(kpath, a.shape, mesh, rules), mesh, kpath)
    placed = {}
    for leaf in _QARRAY_LEAVES:
        x = getattr(a, leaf)
        placed[leaf] = None if x is None else place(x.shape, x.dtype, NamedSharding(mesh, getattr(specs, leaf)),
                                                    w.reads[leaf], stats)
    return QArray(placed["codes"], placed["scale"], placed["zero_point"], placed["global_scale"], scheme=a.scheme,
                  shape=a.shape, dtype=a.dtype, axis=a.axis, offset=placed["offset"],
                  compute_dtype=a.compute_dtype)


def host_sliced(q) -> SlicedQArray:
    """A `SlicedQArray` over a QArray whose leaves are host (numpy) arrays: each device's slice is cut from them."""
    import jax

    from qformats.qarray import QArray

    leaves = {leaf: getattr(q, leaf) for leaf in _QARRAY_LEAVES}
    sds = {k: None if v is None else jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in leaves.items()}
    abstract = QArray(sds["codes"], sds["scale"], sds["zero_point"], sds["global_scale"], scheme=q.scheme,
                      shape=q.shape, dtype=q.dtype, axis=q.axis, offset=sds["offset"],
                      compute_dtype=q.compute_dtype)
    reads = {k: (lambda ix, v=v: np.asarray(v)[tuple(ix)]) for k, v in leaves.items() if v is not None}
    return SlicedQArray(abstract, reads)


def gguf_sliced(g, name: str, stats: Optional[ReadStats] = None) -> SlicedQArray:
    """Tensor `name` of an open GGUF model (`converters.formats.gguf_convert.GGUFModel`, a block type of
    `converters.formats.gguf_packed.PACKED_TYPES`) as a `SlicedQArray` equal to `g.get_packed(name)`, each slice
    decoded from only its bytes of the memory map: the stored rows of the requested HF rows (`g.row_order`, llama's
    Q / K un-permutation), and of those only the blocks covering the requested range of K, decoded by
    `gguf_packed.decode_blocks` and cut to the range (codes re-packed from a whole byte: `qarray_specs` splits
    packed codes on byte boundaries). Each leaf's read decodes its blocks again (codes, scales and offsets of one
    slice read the same bytes up to three times, from the page cache after the first); `stats` counts every read."""
    import jax

    from converters.formats.gguf_packed import PACKED_TYPES, decode_blocks, gguf_qarray
    from qformats.packing import pack_numpy
    from qformats.qarray import QArray

    data, type_name = g.raw(name)
    n, k = g.shape(name)
    where = f"{g.path}: tensor {name!r}"
    probe = gguf_qarray(np.asarray(data[:1]), type_name, (1, k), where)  # scheme and leaf dtypes of one row
    block, _, group, _ = PACKED_TYPES[type_name]
    bits = probe.scheme.bits
    row_bytes = data.shape[-1] // (k // block)
    order = g.row_order(name)

    def rows_of(ix) -> np.ndarray:
        r = np.arange(n)[ix]
        return r if order is None else order[r]

    def decoded(rix, k0: int, k1: int):
        b0, b1 = k0 // block, -(-k1 // block)
        raw = np.asarray(data[rows_of(rix), b0 * row_bytes:b1 * row_bytes])
        if stats is not None:
            stats.bytes += raw.nbytes
            stats.reads += 1
        u, s, o = decode_blocks(raw, type_name, (raw.shape[0], (b1 - b0) * block), where)
        lo = k0 - b0 * block
        return u[:, lo:lo + k1 - k0], s[:, lo // group:(lo + k1 - k0) // group], \
            None if o is None else o[:, lo // group:(lo + k1 - k0) // group]

    def codes(ix):
        rix, cix = ix
        c0, c1, _ = cix.indices(-(-k * bits // 8) if bits < 8 else k)
        if bits == 8:
            return decoded(rix, c0, c1)[0]
        u = decoded(rix, c0 * 8 // bits, min(k, c1 * 8 // bits))[0]
        return pack_numpy(u, bits)

    def part(i):
        def read(ix):
            rix, gix = ix
            g0, g1, _ = gix.indices(k // group)
            return decoded(rix, g0 * group, g1 * group)[i]
        return read

    sds = lambda a, rows=n: None if a is None else jax.ShapeDtypeStruct((rows,) + a.shape[1:], a.dtype)  # noqa: E731
    abstract = QArray(sds(probe.codes), sds(probe.scale), None, None, scheme=probe.scheme, shape=(k, n),
                      dtype=probe.dtype, axis=0, offset=sds(probe.offset), compute_dtype=probe.compute_dtype)
    reads = {"codes": codes, "scale": part(1)}
    if probe.offset is not None:
        reads["offset"] = part(2)
    return SlicedQArray(abstract, reads)


def gguf_dense_reader(g, name: str, transpose: bool, stats: Optional[ReadStats] = None) \
        -> Callable[[Index], np.ndarray]:
    """read(index) of a dense parameter from GGUF tensor `name` (float or block type): the stored rows of the
    requested HF rows, dequantized by gguf (`gguf.quants.dequantize`, as `GGUFModel.get`) then cut to the requested
    columns; for a Linear kernel (`transpose`: Flax [in, out] = HF [out, in].T) HF rows index[1], columns index[0]."""
    import gguf

    data, type_name = g.raw(name)
    shape = g.shape(name)
    order = g.row_order(name)

    def read(index: Index) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        rix, rest = (index[1], index[:1]) if transpose else (index[0], index[1:])
        r = np.arange(shape[0])[rix]
        rows = np.asarray(data[r if order is None else order[r]])
        if stats is not None:
            stats.bytes += rows.nbytes
            stats.reads += 1
        w = np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[type_name]), np.float32)
        w = w.reshape((len(r),) + tuple(shape[1:]))[(slice(None),) + tuple(rest)]
        return w.T if transpose else w
    return read


def load_gguf_on_mesh(g, model, cfg, mesh, rules, stats: Optional[ReadStats] = None, packed: bool = True) -> None:
    """Fills the abstract decoder `model` from an open GGUF model `g` onto `mesh`, every parameter placed slice by
    slice from the memory map: with `packed`, each Linear weight in a block type of `gguf_packed.PACKED_TYPES` as
    the packed QArray `g.get_packed` gives (`gguf_sliced`, swapped in by `qformats.nn.load_quantized`) and a
    block-quantized token embedding as a `decoder.PackedEmbed` over its packed QArray (`gguf_packed.
    swap_packed_embedding`; logical [hidden, vocab], codes and scales split by vocabulary rows as the lm_head's
    kernel: a lookup gathers whole rows, a tied lm_head is a vocabulary-parallel packed GEMV), every other tensor
    dequantized by gguf (`gguf_dense_reader`).

    Raises CheckpointError naming the tensor for a quantized Linear weight of a type not packed (with `packed`), and
    ModelError naming the parameter for a layout the mesh cannot split."""
    from jax.sharding import NamedSharding

    from converters.formats.gguf_packed import DENSE_TYPES, PACKED_TYPES
    from qformats.models import decoder
    from qformats.models.decoder.params import resolve_path
    from qformats.nn import load_quantized
    from qformats.sharding import spec_for

    if cfg.moe is not None:
        raise CheckpointError(f"{g.path}: loading a mixture-of-experts GGUF onto a mesh is not supported")
    slots = decoder.hf_tensor_names(cfg)
    quantized, dense = {}, []
    embedding = None
    if packed:  # a block-quantized embedding stays packed, split by vocabulary rows like the lm_head's kernel
        from converters.formats.gguf_packed import GGUF_EMBEDDING, swap_packed_embedding

        if swap_packed_embedding(g, model, cfg, lambda n: place_sliced(gguf_sliced(g, n, stats), mesh, rules,
                                                                        "model/embed_tokens", stats)):
            embedding = GGUF_EMBEDDING
    for name in g.keys():
        if name == embedding:
            continue
        slot = slots.get(name)
        if slot is None:
            raise CheckpointError(f"{g.path}: tensor {name!r}: the model has no place for it")
        t = g.tensor_type(name)
        if packed and slot.transpose and t not in DENSE_TYPES:
            if t not in PACKED_TYPES:
                raise CheckpointError(f"{g.path}: tensor {name!r}: GGML type {t} is not packed by qformats (packed "
                                      f"exactly: {', '.join(PACKED_TYPES)}); load it with packed=False")
            fpath = "/".join(str(x) for x in slot.path[:-1])
            quantized[fpath] = {"weight": place_sliced(gguf_sliced(g, name, stats), mesh, rules, fpath, stats)}
        else:
            dense.append((name, slot))
    placed = []
    for name, slot in dense:
        v = resolve_path(model, slot.path)
        a = v.get_value()
        path = "/".join(str(x) for x in slot.path)
        if slot.transpose is False and path.rsplit("/", 1)[0] in quantized and path.endswith("/bias"):
            quantized[path.rsplit("/", 1)[0]]["bias"] = place(
                a.shape, a.dtype, NamedSharding(mesh, spec_for(path, a.shape, mesh, rules)),
                gguf_dense_reader(g, name, False, stats), stats)
            continue
        placed.append((v, place(a.shape, a.dtype, NamedSharding(mesh, spec_for(path, a.shape, mesh, rules)),
                                gguf_dense_reader(g, name, slot.transpose, stats), stats)))
    try:
        load_quantized(model, quantized)
    except ModelError as e:
        raise CheckpointError(f"{g.path}: {e}") from None
    for v, a in placed:
        v.set_value(a)


def load_native_on_mesh(path, model, cfg, mesh, rules, stats: Optional[ReadStats] = None) -> None:
    """Fills the abstract decoder `model` from a quantized checkpoint directory of another format than
    compressed-tensors (`converters.formats.quantized.READERS`: HF fine-grained FP8, ModelOpt NVFP4, AutoGPTQ,
    AutoAWQ, torchao) onto `mesh`. The format's reader (`read_quantized`) gives each quantized Linear's QArray of
    the checkpoint's own codes and scales (GPTQ / AWQ re-packed by the reader) and every other tensor as stored, all
    on the host; each parameter is then placed device slice by device slice from those host arrays (`host_sliced` + `place_sliced`, `place`), laid out by `rules`, nothing dequantized and
    nothing put on one device first. A GPTQ layer with activation-ordered groups is a dense weight (as the reader
    gives it) and is placed dense. Unlike the compressed-tensors path, the reader holds the whole checkpoint on the
    host while placing (each process reads every tensor), since these layouts are re-packed on reading.

    Raises CheckpointError naming the tensor for one the model has no place for or a missing one; ModelError naming
    the parameter for a layout the mesh cannot split (e.g. an FP8 block of 128 rows cut by the split)."""
    from jax.sharding import NamedSharding

    from converters.formats.quantized import read_quantized
    from qformats.models import decoder
    from qformats.models.decoder.params import resolve_path
    from qformats.nn import load_quantized
    from qformats.qarray import QArray
    from qformats.sharding import spec_for

    if cfg.moe is not None:
        raise CheckpointError(f"{path}: loading a mixture-of-experts checkpoint of another format onto a mesh is not "
                              f"supported")
    cm = read_quantized(path)
    slots = decoder.hf_tensor_names(cfg)
    groups = {gr.name: gr for gr in (cm.quant.groups if cm.quant is not None else ())}
    quantized, schemes, placed, unknown = {}, {}, [], []
    for mod, tensors in cm.modules.items():
        q = tensors.get("weight")
        for local, arr in tensors.items():
            full = f"{mod}.{local}" if mod else local
            scale_of_input = local in ("input_scale", "input_global_scale")
            slot = slots.get(f"{mod}.weight" if scale_of_input else full)
            if slot is None:
                if full.endswith(".rotary_emb.inv_freq") or (full == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                unknown.append(full)
                continue
            vpath = "/".join(str(x) for x in slot.path)
            if isinstance(arr, QArray):
                fpath = vpath.rsplit("/", 1)[0]
                quantized.setdefault(fpath, {})["weight"] = place_sliced(host_sliced(arr), mesh, rules, fpath, stats)
                gr = groups.get(cm.groups.get(mod, ""))
                schemes[fpath] = gr.input_activations if gr is not None else None
            elif scale_of_input:
                quantized.setdefault(vpath.rsplit("/", 1)[0], {})[local] = np.asarray(arr)
            else:
                v = resolve_path(model, slot.path)
                a = v.get_value()
                host = np.asarray(arr)
                want = a.shape[::-1] if slot.transpose else a.shape
                if tuple(host.shape) != tuple(want):
                    raise CheckpointError(f"{path}: tensor {full!r}: expected shape {tuple(want)}, found "
                                          f"{tuple(host.shape)}")
                read = (lambda ix, h=host: h[ix[1], ix[0]].T) if slot.transpose else (lambda ix, h=host: h[tuple(ix)])
                target = (v, place(a.shape, a.dtype, NamedSharding(mesh, spec_for(vpath, a.shape, mesh, rules)),
                                   read, stats))
                fpath = vpath.rsplit("/", 1)[0]
                if local == "bias" and isinstance(q, QArray):
                    quantized.setdefault(fpath, {})["bias"] = target[1]
                else:
                    placed.append(target)
    if unknown:
        raise CheckpointError(f"{path}: {len(unknown)} tensor(s) the model has no place for: {', '.join(unknown[:8])}")
    try:
        load_quantized(model, quantized, schemes)
    except ModelError as e:
        raise CheckpointError(f"{path}: {e}") from None
    for v, a in placed:
        v.set_value(a)


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
