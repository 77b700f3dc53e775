"""Loading causal-LM checkpoints onto a jax Mesh: each device's slice read from the memory map straight to it.

`load_causal_lm_sharded(src, mesh)` is `converters.causal_lm.load_causal_lm` for a model larger than one
device: the model's structure is built abstractly (`nnx.eval_shape`), every parameter's sharding comes from
logical rules (`qformats.sharding`; by default the decoder's Megatron layout,
`qformats.models.decoder.tensor_parallel_rules`), and each parameter is assembled with
`jax.make_array_from_single_device_arrays` from shards that are read one at a time: the shard's rows (and
columns) of the stored tensor are taken from the memory-mapped safetensors file
(`converters.safetensors_io`'s lazy row slicing), converted, put on their device, and dropped. No tensor is
ever whole in host memory (only one shard at a time), and in a multi-process run (`jax.distributed`) each
process reads only the byte ranges of its own devices' shards.

Dense HF checkpoints and compressed-tensors checkpoints whose stored tensors are the QArray leaves
themselves (naive / int / float-quantized 8-bit, pack-quantized in the dense int32 layout, NVFP4 / MXFP4 /
MXFP6 / MXFP8, symmetric; the header checks of `converters.ct_read.check_modules` first) load this way;
asymmetric pack-quantized zero points (packed across output channels), pre-0.18 int32 layouts and
int-quantized codes narrower than 8 bits are CheckpointErrors naming the module (load them with
`load_causal_lm` and `qformats.sharding.shard_model`). GGUF files are read by `gguf`'s own reader (whole
tensors): load them with `load_causal_lm`. A `kv_cache_scheme` (FP8 KV cache) is taken as `load_causal_lm`
takes it: static k_scale / v_scale (kv_heads floats per layer at most) read whole and replicated on every device.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from qformats.errors import CheckpointError, ModelError

__all__ = ["ReadStats", "place", "load_causal_lm_sharded", "load_on_mesh", "tensor_parallel_setup"]

Index = Tuple[slice, ...]


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


def _rows_cols(ck, name: str, rows: slice, cols: Tuple[slice, ...], stats: Optional[ReadStats]) -> np.ndarray:
    """Stored tensor `name`[rows, *cols] (a view of the map where possible: rows are selected before any read)."""
    info = ck.info(name)
    if not info.shape:
        a = np.asarray(ck.get(name))
    else:
        a = ck.get_slice(name)[(rows,) + tuple(cols)]
    if stats is not None:
        stats.bytes += int(a.size) * info.numpy_dtype.itemsize
        stats.reads += 1
    return a


def _whole(ck, name: str, stats: Optional[ReadStats]) -> np.ndarray:
    """A small stored tensor whole (shapes, global scales, zero-point checks), counted in `stats`."""
    return _rows_cols(ck, name, slice(None), (), stats)


def _dense_reader(ck, name: str, transpose: bool, stats):
    """read(index) of the Flax-layout parameter from the stored HF tensor (transposed for Linear kernels)."""
    def read(index: Index) -> np.ndarray:
        if transpose:  # Flax kernel [in, out] = torch [out, in].T
            return _rows_cols(ck, name, index[1], (index[0],), stats).T
        return _rows_cols(ck, name, index[0], index[1:], stats) if index else _rows_cols(ck, name, slice(None), (),
                                                                                         stats)
    return read


# ---- compressed-tensors -------------------------------------------------------------------------------------

_DIRECT_8BIT = ("naive-quantized", "int-quantized", "float-quantized", "mxfp8-quantized")
_LOCALS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_global_scale",
           "weight_g_idx", "input_scale", "input_global_scale", "bias")
_DIRECT_PACKED = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized")


def _module_qarray(ck, qc, mod: str, tensors: Dict[str, str], group, mesh, rules, fpath: str, stats):
    """The QArray of one quantized module, each leaf placed shard by shard on `mesh` (layout: the float kernel's
    rules at `fpath`/kernel, `qformats.sharding.qarray_shardings`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from converters.formats.compressed_tensors.config import FPX_FORMAT
    from qformats.formats import IntFormat
    from qformats.grouping import expected_shapes
    from qformats.packing import packed_length_int32
    from qformats.qarray import QArray
    from qformats.sharding import qarray_specs, spec_for

    s, fmt, bits = group.weights, group.format, group.weights.bits
    where = f"{ck.file_of(next(iter(tensors.values())))}: module {mod!r} ({fmt}, group {group.name})"

    def expect(local, shape, dtypes):
        name = tensors.get(local)
        if name is None:
            raise CheckpointError(f"{where}: expected tensor {mod + '.' + local!r}, found none (module tensors: "
                                  f"{sorted(tensors)})")
        info = ck.info(name)
        if tuple(info.shape) != tuple(shape) or info.dtype not in dtypes:
            raise CheckpointError(f"{where}: tensor {name!r}: expected shape {list(shape)} and dtype in {dtypes}, "
                                  f"found {list(info.shape)} {info.dtype}")

    def unsupported(what):
        return CheckpointError(f"{where}: loading onto a mesh reads each shard straight from the file, which "
                               f"{what} does not allow; load it with converters.causal_lm.load_causal_lm, then "
                               f"qformats.sharding.shard_model")

    if "weight_shape" in tensors:
        expect("weight_shape", (2,), ("I64", "I32"))
        ws = np.asarray(_whole(ck, tensors["weight_shape"], stats)).reshape(-1)
        n, k = int(ws[0]), int(ws[1])
    elif "weight_packed" in tensors and len(ck.info(tensors["weight_packed"]).shape) == 2:
        # packed bytes without a weight_shape (NVFP4 / MX): K = bytes * 8 / bits
        n, nbytes = (int(d) for d in ck.info(tensors["weight_packed"]).shape)
        k = nbytes * 8 // s.bits
    else:
        if "weight" not in tensors or len(ck.info(tensors["weight"]).shape) != 2:
            raise CheckpointError(f"{where}: expected a 2-D 'weight' or a 'weight_shape' tensor, found "
                                  f"{sorted(tensors)}")
        n, k = (int(d) for d in ck.info(tensors["weight"]).shape)
    if n < 1 or k < 1:
        raise CheckpointError(f"{where}: expected a positive weight shape, found [{n}, {k}]")
    if s.strategy in ("group", "tensor_group") and k % s.group_size:
        raise CheckpointError(f"{where}: group size {s.group_size} does not divide the {k} input columns")
    want = expected_shapes(s, (k, n), 0)
    kbytes = want["codes"][1]
    unknown = sorted(set(tensors) - set(_LOCALS))
    if unknown:
        raise CheckpointError(f"{where}: unexpected tensors {[mod + '.' + u for u in unknown]} in a quantized "
                              f"module")
    # -- codes: read(index over [N, Kbytes]) ------------------------------------------------------------------
    if fmt in _DIRECT_8BIT:
        if bits != 8:
            raise unsupported(f"{fmt} with {bits}-bit integer codes (stored one per int8, packed on load)")
        name = tensors["weight"]
        expect("weight", (n, k), ("I8", "U8") if isinstance(s.format, IntFormat) else ("F8_E4M3", "F8_E5M2", "U8"))
        view = ck.info(name).numpy_dtype if isinstance(s.format, IntFormat) else np.uint8

        def codes_read(ix):
            return _rows_cols(ck, name, ix[0], (ix[1],), stats).view(view)
        codes_dtype = view
    elif fmt == "pack-quantized":
        name = tensors["weight_packed"]
        expect("weight_packed", (n, ck.info(name).shape[-1] if ck.info(name).shape else 0), ("I32",))
        words = int(ck.info(name).shape[1])
        if words != packed_length_int32(k, bits) or (qc.dense_packing is False and bits not in (1, 2, 4, 8)):
            raise unsupported("the pre-0.18 int32 layout (32 // bits values per word)")
        vals = k if bits == 8 else kbytes  # bytes of the little-endian word stream that hold the codes

        def stream(ix):
            # the int32 words' little-endian bytes are the code stream: read the words that hold the
            # shard's bytes (rows and word columns from the map), then cut at the byte boundaries
            a, b, _ = ix[1].indices(vals)
            w0 = a // 4
            words = _rows_cols(ck, name, ix[0], (slice(w0, -(-b // 4)),), stats)
            return words.view("<u1")[:, a - 4 * w0: b - 4 * w0]
        if bits == 8:
            def codes_read(ix):
                return (stream(ix).astype(np.int16) - 128).astype(np.int8)
            codes_dtype = np.int8
        else:
            codes_read = stream
            codes_dtype = np.uint8
    elif fmt in _DIRECT_PACKED or fmt == FPX_FORMAT:
        name = tensors["weight_packed"]
        expect("weight_packed", (n, kbytes), ("U8",))

        def codes_read(ix):
            return _rows_cols(ck, name, ix[0], (ix[1],), stats)
        codes_dtype = np.uint8
    else:
        raise unsupported(f"format {fmt!r}")
    # -- scale, zero point, global scale ---------------------------------------------------------------------
    sname = tensors.get("weight_scale")
    if sname is None:
        raise CheckpointError(f"{where}: expected tensor {mod + '.weight_scale'!r}, found none")
    s_info = ck.info(sname)
    if math.prod(s_info.shape) != math.prod(want["scale"]):
        raise CheckpointError(f"{where}: tensor {sname!r}: expected {math.prod(want['scale'])} scales (shape "
                              f"{list(want['scale'])}), found shape {list(s_info.shape)}")
    if s.scale_format == "e8m0":
        s_dtype, q_dtype = np.uint8, jnp.bfloat16
    else:
        s_dtype = s_info.numpy_dtype
        q_dtype = jnp.bfloat16 if s.strategy == "tensor_group" else s_dtype

    def small_or_slice(name, shape):
        if tuple(ck.info(name).shape) == tuple(shape):
            return lambda ix: _rows_cols(ck, name, ix[0], ix[1:], stats)
        return lambda ix: _rows_cols(ck, name, slice(None), (), stats).reshape(shape)[ix]

    raw_scale = small_or_slice(sname, want["scale"])

    def scale_read(ix):
        return raw_scale(ix).view(s_dtype) if s.scale_format == "e8m0" else raw_scale(ix)
    zp_read = None
    if not s.symmetric:
        if fmt == "pack-quantized" and s.strategy in ("group", "channel"):
            raise unsupported("an asymmetric pack-quantized zero point (int32 words packed across output channels)")
        if "weight_zero_point" not in tensors or math.prod(ck.info(tensors["weight_zero_point"]).shape) != \
                math.prod(want["scale"]):
            raise CheckpointError(f"{where}: expected a weight_zero_point of shape {list(want['scale'])}")
        raw_zp = small_or_slice(tensors["weight_zero_point"], want["scale"])

        def zp_read(ix):
            z = raw_zp(ix)
            if z.size and (z.min() < s.format.qmin or z.max() > s.format.qmax):
                raise CheckpointError(f"{where}: weight_zero_point: expected values in [{s.format.qmin}, "
                                      f"{s.format.qmax}]")
            return z.astype(np.int8)
    elif "weight_zero_point" in tensors:
        # symmetric: the stored zero point (scale-sized) must be all zero, as ct_read requires
        if np.asarray(_whole(ck, tensors["weight_zero_point"], stats)).any():
            raise CheckpointError(f"{where}: weight_zero_point: the weights args say symmetric, expected no zero "
                                  f"point or an all-zero one, found nonzero values")
    if "weight_g_idx" in tensors:
        gi = np.asarray(_whole(ck, tensors["weight_g_idx"], stats))
        if not np.array_equal(gi, np.arange(k) // s.group_size):
            raise CheckpointError(f"{where}: weight_g_idx: expected the trivial group index (column // "
                                  f"{s.group_size}); activation-ordered groups are not supported")
    gs = gs_host = None
    if s.strategy == "tensor_group":
        expect("weight_global_scale", (1,), ("F32",))
        gs_host = np.asarray(_whole(ck, tensors["weight_global_scale"], stats), np.float32).reshape(1)
    # -- shardings from the float kernel's rules, then the leaves ---------------------------------------------
    sds = jax.ShapeDtypeStruct
    abstract = QArray(sds(want["codes"], codes_dtype), sds(want["scale"], s_dtype),
                      None if zp_read is None else sds(want["scale"], np.int8),
                      None if s.strategy != "tensor_group" else sds((1,), np.float32), scheme=s, shape=(k, n),
                      dtype=q_dtype, axis=0)
    kpath = f"{fpath}/kernel"
    specs = qarray_specs(abstract, spec_for(kpath, (k, n), mesh, rules), mesh, kpath)
    sh = lambda p: NamedSharding(mesh, p)  # noqa: E731
    codes = place(want["codes"], codes_dtype, sh(specs.codes), codes_read, stats)
    scale = place(want["scale"], s_dtype, sh(specs.scale), scale_read, stats)
    zp = None if zp_read is None else place(want["scale"], np.int8, sh(specs.scale), zp_read, stats)
    if s.strategy == "tensor_group":
        gs = place((1,), np.float32, sh(specs.global_scale), lambda ix: gs_host[ix], stats)
    q = QArray(codes, scale, zp, gs, scheme=s, shape=(k, n), dtype=q_dtype, axis=0)
    q.check()
    return q


def _coded(ck, tensors: Dict[str, str]) -> bool:
    """Whether a module holds quantized tensors (packed codes, scales, or a weight that is not float)."""
    if any(p in tensors for p in ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                                  "weight_global_scale", "weight_g_idx")):
        return True
    return "weight" in tensors and ck.info(tensors["weight"]).dtype not in ("F64", "F32", "BF16", "F16")


def _choose_group(ck, qc, mod, tensors, mesh, rules, fpath, stats):
    """(QArray placed on the mesh, config group): the first weight group targeting `mod` (by name first, as
    compressed-tensors matches) whose stored layout the module's tensors fit."""
    groups = [g for g in qc.groups if g.weights is not None and g.format != "dense"]
    cands = [g for g in groups if g.matches_by_name(mod)] or [g for g in groups if g.matches(mod)]
    if not cands:
        raise CheckpointError(f"{ck.file_of(next(iter(tensors.values())))}: module {mod!r} holds quantized tensors "
                              f"but no compressing quantization_config group targets it")
    first = None
    for g in cands:
        try:
            return _module_qarray(ck, qc, mod, tensors, g, mesh, rules, fpath, stats), g
        except CheckpointError as e:
            first = first or e
    raise first


# ---- the model ------------------------------------------------------------------------------------------------

def load_causal_lm_sharded(src: "str | os.PathLike", mesh, rules=None, *, dtype=None, param_dtype=None,
                           tokenizer: bool = True, stats: Optional[ReadStats] = None):
    """Loads a dense or compressed-tensors llama / mistral / qwen2 / qwen3 checkpoint directory onto `mesh`.

    Args:
      src: the checkpoint directory (single file or sharded).
      mesh: a `jax.sharding.Mesh`; in a multi-process run (`jax.distributed.initialize`) the global mesh, of
        which this process places the shards of its own devices.
      rules: a `qformats.sharding.ShardingRules`; default: `decoder.tensor_parallel_rules(config, axis)` for a
        1-D mesh of axis `axis` (ModelError for a mesh of several axes without rules).
      dtype, param_dtype: as `converters.causal_lm.load_causal_lm`.
      tokenizer: also return the checkpoint's tokenizer.
      stats: a `ReadStats` to fill with the bytes this process read.

    Returns (model, hf_config, tokenizer or None), like `load_causal_lm`; every parameter is a global
    jax.Array laid out by `rules` (packed weights: the layout of the float weight they stand for).

    Raises:
      CheckpointError: unreadable or unsupported checkpoint, missing / unexpected / misshapen tensors, a
        compressed layout that cannot be read shard by shard.
      ModelError: a parameter the mesh cannot split (naming it).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from converters.pipelines.causal_lm import load_tokenizer
    from converters.formats.safetensors_io import open_checkpoint
    from converters.formats.safe_files import read_json
    from qformats.models import decoder
    from qformats.sharding import spec_for

    dtype = jnp.float32 if dtype is None else dtype
    param_dtype = dtype if param_dtype is None else param_dtype
    p = Path(src)
    if not p.is_dir():
        raise CheckpointError(f"{p}: expected a checkpoint directory (dense or compressed-tensors) to load onto a "
                              f"mesh, found {'no such path' if not p.exists() else 'a file'}")
    hf_config = read_json(p / "config.json")
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{p / 'config.json'}: expected a JSON object, found {type(hf_config).__name__}")
    try:
        cfg = decoder.DecoderConfig.from_hf(hf_config)
    except ModelError as e:
        raise CheckpointError(f"{p / 'config.json'}: {e}") from None
    if rules is None:
        if len(mesh.axis_names) != 1:
            raise ModelError(f"load_causal_lm_sharded: a mesh of axes {mesh.axis_names} needs explicit rules")
        rules = decoder.tensor_parallel_rules(cfg, mesh.axis_names[0])
    model = nnx.eval_shape(lambda: decoder.CausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    slots = decoder.hf_tensor_names(cfg)
    qc = None
    qc_raw = hf_config.get("quantization_config")
    if isinstance(qc_raw, dict) and qc_raw.get("quant_method") == "compressed-tensors":
        from converters.formats.compressed_tensors.config import parse_quantization_config

        qc = parse_quantization_config(qc_raw, str(p / "config.json"))
    with open_checkpoint(p) as ck:
        quantized: Dict[str, Dict[str, Any]] = {}
        schemes: Dict[str, Any] = {}
        consumed = set()
        if qc is not None:
            from converters.formats.compressed_tensors.read import split_name

            by_module: Dict[str, Dict[str, str]] = {}
            for name in ck.keys():
                m, local = split_name(name)
                by_module.setdefault(m, {})[local] = name
            for mod in sorted(by_module):
                t = by_module[mod]
                if not _coded(ck, t):
                    continue
                slot = slots.get(f"{mod}.weight")
                if slot is None or not slot.transpose:
                    raise CheckpointError(f"{p}: module {mod!r} holds quantized tensors but the model has no Linear "
                                          f"there")
                if qc.is_ignored(mod):
                    raise CheckpointError(f"{p}: module {mod!r} is in quantization_config.ignore but holds "
                                          f"quantized tensors {sorted(t)}")
                fpath = "/".join(str(x) for x in slot.path[:-1])
                q, g = _choose_group(ck, qc, mod, t, mesh, rules, fpath, stats)
                entry: Dict[str, Any] = {"weight": q}
                for local in ("input_scale", "input_global_scale"):
                    if local in t:
                        entry[local] = np.asarray(_whole(ck, t[local], stats))
                bias = f"{mod}.bias"
                if bias in ck:
                    sl = slots[bias]
                    bpath = "/".join(str(x) for x in sl.path)
                    shape = tuple(ck.info(bias).shape)
                    entry["bias"] = place(shape, param_dtype,
                                          NamedSharding(mesh, spec_for(bpath, shape, mesh, rules)),
                                          _dense_reader(ck, bias, False, stats), stats)
                    consumed.add(bias)
                consumed.update(t.values())
                quantized[fpath] = entry
                schemes[fpath] = g.input_activations
        kv_scales = None
        if qc is not None and qc.kv_cache is not None:
            from converters.pipelines.causal_lm import kv_scale_names, read_kv_scales

            kv_scales = read_kv_scales(ck, cfg, qc.kv_cache, str(p))
            if kv_scales is not None:
                consumed.update(kv_scale_names(cfg))
        packed = {f"{m.replace('/', '.')}.weight" for m in quantized}
        dense = {n: s for n, s in slots.items() if n not in packed and n not in consumed}
        missing = [n for n in dense if n not in ck]
        extra = [n for n in ck.keys() if n not in dense and n not in consumed]
        checks = [n for n in extra if n.endswith(".rotary_emb.inv_freq")
                  or (n == "lm_head.weight" and cfg.tie_word_embeddings)]
        extra = [n for n in extra if n not in checks]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {', '.join(missing[:8])}")
        if extra:
            problems.append(f"{len(extra)} unexpected: {', '.join(extra[:8])}")
        for n, slot in dense.items():
            if n in ck:
                var = model
                for part in slot.path:
                    var = var[part] if isinstance(part, int) else getattr(var, part)
                want = tuple(var.get_value().shape)
                got = tuple(ck.info(n).shape)
                if (got[::-1] if slot.transpose else got) != want:
                    problems.append(f"{n} {got} (expected {want[::-1] if slot.transpose else want})")
        for n in checks:
            if n == "lm_head.weight":
                if "model.embed_tokens.weight" in ck and not _equal_by_rows(ck, n, "model.embed_tokens.weight"):
                    problems.append("lm_head.weight differs from model.embed_tokens.weight but the config ties them")
            elif not np.allclose(np.asarray(ck.get(n), np.float32), decoder.inv_freq(cfg), rtol=1e-6, atol=0):
                problems.append(f"{n} does not equal the inverse frequencies of the config's rope")
        if problems:
            raise CheckpointError(f"{p}: " + "; ".join(problems))
        placed = []
        for n, slot in dense.items():
            path = "/".join(str(x) for x in slot.path)
            var = model
            for part in slot.path[:-1]:
                var = var[part] if isinstance(part, int) else getattr(var, part)
            v = getattr(var, slot.path[-1])
            a = v.get_value()
            sharding = NamedSharding(mesh, spec_for(path, a.shape, mesh, rules))
            placed.append((v, place(a.shape, a.dtype, sharding, _dense_reader(ck, n, slot.transpose, stats), stats)))
    from qformats.nn import load_quantized

    try:
        load_quantized(model, quantized, schemes)
    except ModelError as e:
        raise CheckpointError(f"{p}: {e}") from None
    for v, a in placed:
        v.set_value(a)
    if qc is not None and qc.kv_cache is not None:
        # KV-cache scales are replicated on every device, per-head ones included: kv_heads floats per layer, read
        # by attention wherever its heads live (the cache buffers themselves split by KV heads, set_sharding)
        from jax.sharding import PartitionSpec

        rep = NamedSharding(mesh, PartitionSpec())
        scales = None if kv_scales is None else [tuple(jax.device_put(jnp.asarray(x), rep) for x in pair)
                                                 for pair in kv_scales]
        try:
            decoder.enable_kv_cache_quantization(model, qc.kv_cache, scales)
        except ModelError as e:
            raise CheckpointError(f"{p}: {e}") from None
    empty = [path for path, v in _variables(model) if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if empty:
        raise CheckpointError(f"{p}: expected every parameter of the model in the checkpoint, found {len(empty)} "
                              f"not filled: {', '.join(empty[:6])}")
    tok = load_tokenizer(p) if tokenizer else None
    return model, hf_config, tok


def _variables(model):
    from flax import nnx

    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Variable):
            yield "/".join(str(x) for x in path), v


def _equal_by_rows(ck, a: str, b: str, chunk_bytes: int = 1 << 22) -> bool:
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


def load_on_mesh(src: "str | os.PathLike", mesh, rules=None, *, dtype=None, param_dtype=None,
                 tokenizer: bool = True, stats: Optional[ReadStats] = None):
    """Any checkpoint `converters.causal_lm.load_causal_lm` takes, placed on `mesh` (what `qformats generate
    --tensor-parallel N` runs: `mesh = tensor_parallel_setup(N)` first, before any other JAX operation).

    A directory goes through `load_causal_lm_sharded` (shard by shard from the file); a `.gguf` file is read by
    gguf's own reader (whole tensors, dequantized on the host) and then placed by `qformats.sharding.shard_model`.
    Returns (model, hf_config, tokenizer or None); `qformats.sharding.param_bytes_per_device(model)` gives the
    bytes each device holds.
    """
    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        from converters.pipelines.causal_lm import load_causal_lm
        from qformats.models import decoder
        from qformats.sharding import shard_model

        model, hf_config, tok = load_causal_lm(p, dtype=dtype, param_dtype=param_dtype, tokenizer=tokenizer)
        if rules is None:
            if len(mesh.axis_names) != 1:
                raise ModelError(f"load_on_mesh: a mesh of axes {mesh.axis_names} needs explicit rules")
            rules = decoder.tensor_parallel_rules(model.config, mesh.axis_names[0])
        return shard_model(model, mesh, rules), hf_config, tok
    return load_causal_lm_sharded(p, mesh, rules, dtype=dtype, param_dtype=param_dtype, tokenizer=tokenizer,
                                  stats=stats)
