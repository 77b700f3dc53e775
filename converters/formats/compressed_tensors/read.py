"""Read compressed-tensors checkpoints into QArrays (no torch): module path -> {"weight": QArray, "bias", ...}.

Every format compressed-tensors 0.20 writes (and 0.19 and older pack-quantized layouts), plus our
`fpx-pack-quantized` extension (see `converters.formats.compressed_tensors.config`). The QArray of a torch Linear weight `[N, K]`
(out, in) has the logical shape of the Flax kernel, `[K, N]`, with `axis=0`: its codes and contracted
scale are then exactly torch's `[N, ...]` storage, so nothing is transposed or repacked except:
  - pack-quantized int32 words -> our byte stream (for the dense layout a reinterpretation of the same
    little-endian bits; the pre-0.18 `32 // bits` layout is unpacked and repacked),
  - signed int8 codes of fewer than 8 bits (int-quantized W4A8) -> packed offset codes,
  - 8-bit pack-quantized values (offset by 128) -> int8.

`QArray.dtype` is the dtype compressed-tensors' own decompression returns (`ModelCompressor.decompress`,
transformers' `run_compressed=False`): the scale's dtype for naive/int/float/pack-quantized, bfloat16 for
the NVFP4 / MX formats (their decompressors compute in bfloat16). `qformats.dequantize(q)` then gives
bit-identical values (transposed: `dequantize(q).T` is torch's `[N, K]` weight).

Which modules are quantized: those holding a compressed-looking tensor (`weight_packed`, `weight_shape`,
`weight_scale`, `weight_zero_point`, `weight_global_scale`, `weight_g_idx`, or a `weight` that is not
float). A module takes the config group whose `re:` targets (or exact names) match its path; class-name
targets ("Linear") cannot be checked without the model, so they match any module; among several candidates
the one whose tensors fit wins.

Before any tensor data is read, the whole checkpoint is checked against its config from the headers alone
(plus the two integers of each `weight_shape`): every compressed-looking tensor belongs to a module that a
config group quantizes (a missing config.json, a missing or null quantization_config, no group with
weights, an ignored module are errors, never a fallback to dense); every quantized module holds exactly
the tensors its format stores, with their dtypes and the shapes the scheme and `weight_shape` imply; a
module a compressing group targets by name holds its compressed tensors. Any mismatch is a CheckpointError
naming the file, module, tensor and what was expected.

Legacy `weight_g_idx` (older llm-compressor / converted GPTQ checkpoints): the trivial index (column // group_size)
reads as usual; an activation-ordered one (integer weights) gives the module's dense torch-layout [N, K] weight
W[:, j] = (q[:, j] - z[:, g[j]]) * s[:, g[j]] instead of a QArray, with a warning naming the module.

One decoder for every placement: `plan_modules` (the header checks above, the group of each module) and
`decode_weight(ck, module, qc, src)`, whose QArray leaves read from a `TensorSource` either whole (`whole()`,
what `read_compressed` returns) or one device's slice at a time (`converters.pipelines.mesh_load.place_weight`, for
`converters.pipelines.causal_lm.load_causal_lm(src, mesh=...)`). `is_quantized(config)` says whether a checkpoint's
config.json declares quantized weights.

Dense values: `dense_weight(q, dtype)` is what transformers loads (`from_pretrained(...,
quantization_config=CompressedTensorsConfig(dequantize=True))`): compressed-tensors' decompression in
`q.dtype` (one rounding of the product), then a cast to the model's dtype; `exact=True` rounds the
float32 product straight to `dtype` instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from converters.formats.compressed_tensors.config import (FPX_FORMAT, ConfigGroup, QuantConfig,
                                                           parse_quantization_config)
from converters.formats.safe_files import read_json
from converters.formats.safetensors_io import Checkpoint, open_checkpoint
from converters.formats.compressed_tensors.transforms import check_targets_present, parse_transform_config
from qformats.errors import CheckpointError, QFormatsError
from qformats.formats import IntFormat
from qformats.packing import pack_numpy, packed_length_int32, unpack_int32
from qformats.qarray import QArray
from qformats.grouping import expected_shapes
from qformats.quantize import dequantize
from qformats.schemes import QuantScheme

__all__ = ["CompressedModel", "Leaf", "QUANT_PARAM_NAMES", "StoredModule", "StoredWeight", "TensorSource",
           "decode_weight", "dense_weight", "is_quantized", "iter_modules", "open_compressed", "plan_modules",
           "read_compressed", "to_flax_params", "split_name"]

#: Local tensor names that hold quantization parameters of a module (never dense weights).
QUANT_PARAM_NAMES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_global_scale",
                     "input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                     "k_scale", "v_scale", "k_zero_point", "v_zero_point", "weight_g_idx")
_WEIGHT_PARTS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                 "weight_global_scale", "weight_g_idx")
_FLOAT_SCALE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
#: Local names that only a quantized module holds (with `weight` in a dtype that is not float).
_CODED_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_global_scale",
                "weight_g_idx")
_FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")
_PACKED_FORMATS = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized",
                   FPX_FORMAT)
_INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


#: One slice per dimension of an array: the part of it that one device holds.
Index = Tuple[slice, ...]


def is_quantized(config: Any) -> bool:
    """Whether a checkpoint's config.json (a dict) declares quantized weights: a non-empty `quantization_config`
    (compressed-tensors, or any other quant_method, which the readers then refuse by name)."""
    return isinstance(config, Mapping) and bool(config.get("quantization_config"))


def split_name(name: str) -> Tuple[str, str]:
    """'a.b.weight' -> ('a.b', 'weight'); 'weight' -> ('', 'weight')."""
    mod, _, local = name.rpartition(".")
    return mod, local


@dataclasses.dataclass
class CompressedModel:
    """A compressed-tensors checkpoint, opened.

    Arrays are read-only numpy views of the memory-mapped files (zero copy); QArrays are pytrees, so
    `jax.tree.map(jnp.asarray, model.modules)` (or jax.device_put) moves everything to a device.

    path: the checkpoint directory (or file). config: config.json (dict; {} if absent). quant: the parsed
    quantization_config (None for a dense checkpoint). modules: module path -> local tensor name -> array,
    with "weight" a QArray for quantized modules (their weight_* tensors consumed). formats: module path ->
    compression format of its weight. groups: module path -> config group name.
    """

    path: Path
    config: Dict[str, Any]
    quant: Optional[QuantConfig]
    modules: Dict[str, Dict[str, Any]]
    formats: Dict[str, str]
    groups: Dict[str, str]
    stored_nbytes: Dict[str, int]

    def qarrays(self) -> Dict[str, QArray]:
        return {m: t["weight"] for m, t in self.modules.items() if isinstance(t.get("weight"), QArray)}

    def flax_params(self) -> Dict[str, Any]:
        return to_flax_params(self.modules)


def to_flax_params(modules: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Nested Flax-style params: a.b.c -> {"a": {"b": {"c": {...}}}}. A 2-D Linear `weight` becomes `kernel`
    ([in, out]: the QArray as is, a dense torch weight transposed); `bias` stays; other tensors keep their
    local names."""
    out: Dict[str, Any] = {}
    for mod, tensors in modules.items():
        node = out
        for part in (mod.split(".") if mod else []):
            node = node.setdefault(part, {})
        for local, arr in tensors.items():
            if local == "weight" and isinstance(arr, QArray):
                node["kernel"] = arr
            elif local == "weight" and getattr(arr, "ndim", 0) == 2:
                node["kernel"] = np.asarray(arr).T
            else:
                node[local] = arr
    return out


def dense_weight(q: QArray, dtype=None, exact: bool = False):
    """The dense values of a weight read from a checkpoint, as transformers loads them (same layout as
    `dequantize(q)`: the Flax kernel `[in, out]`; `.T` is torch's `[out, in]`).

    Default: w = cast_dtype(dequantize(q, q.dtype)) -- compressed-tensors decompresses in `q.dtype`
    (bfloat16 for NVFP4 / MX: `bf16((code * (scale / global_scale)))` computed in float32 and rounded
    to bfloat16 once; the scale's dtype for the other formats), and transformers casts that to the
    model's dtype. `exact=True`: w = cast_dtype(code * scale / global_scale computed in float32), the
    value before that rounding (differs from the torch side for NVFP4 read as float32). `dtype` None:
    `q.dtype`.
    """
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    if exact:
        return dequantize(q, dtype)
    return dequantize(q, q.dtype).astype(dtype)


# ---- opening ----------------------------------------------------------------------------------------------------
def _load_config(path: Path) -> Dict[str, Any]:
    root = path if path.is_dir() else path.parent
    cfg_path = root / "config.json"
    if not (cfg_path.exists() or cfg_path.is_symlink()):
        return {}
    cfg = read_json(cfg_path, root)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


@dataclasses.dataclass
class StoredModule:
    """One module of a checkpoint, from its headers: `tensors` maps local names ("weight_packed") to stored
    names; `group` is the config group whose format stores its weight (None: a dense module)."""

    name: str
    tensors: Dict[str, str] = dataclasses.field(default_factory=dict)
    group: Optional[ConfigGroup] = None


def _modules_of(ck: Checkpoint) -> Dict[str, StoredModule]:
    mods: Dict[str, StoredModule] = {}
    for name in ck.keys():
        m, local = split_name(name)
        mods.setdefault(m, StoredModule(m)).tensors[local] = name
    return mods


def open_compressed(path: "str | os.PathLike") -> Tuple[Checkpoint, Dict[str, Any], Optional[QuantConfig]]:
    """Open the safetensors of `path` and parse its config.json's quantization_config (None if dense)."""
    path = Path(path)
    cfg = _load_config(path)
    qc = None
    if "quantization_config" in cfg and cfg["quantization_config"] is not None:
        qc = parse_quantization_config(cfg["quantization_config"],
                                       str((path if path.is_dir() else path.parent) / "config.json"))
    ck = open_checkpoint(path)
    if qc is not None and qc.raw.get("transform_config"):
        try:  # offline rotations (the only ones accepted here) are fused: each must have its counterpart stored
            where = f"{(path if path.is_dir() else path.parent) / 'config.json'}: transform_config"
            check_targets_present(parse_transform_config(qc.raw["transform_config"], where),
                                  sorted({split_name(n)[0] for n in ck.keys()
                                          if split_name(n)[1] in ("weight", "weight_packed")}), where)
        except BaseException:
            ck.close()
            raise
    return ck, cfg, qc


def read_compressed(path: "str | os.PathLike") -> CompressedModel:
    """Read a compressed-tensors (or dense) checkpoint: see the module docstring.

    Raises CheckpointError (naming the file and tensor) for anything malformed or unsupported.
    """
    path = Path(path)
    ck, cfg, qc = open_compressed(path)
    try:
        modules, formats, groups, stored = {}, {}, {}, {}
        for mod in iter_modules(ck, qc):
            modules[mod.name] = mod.tensors
            if mod.format is not None:
                formats[mod.name], groups[mod.name] = mod.format, mod.group
            stored[mod.name] = mod.stored_nbytes
        return CompressedModel(path, cfg, qc, modules, formats, groups, stored)
    finally:
        ck.close()


@dataclasses.dataclass
class LoadedModule:
    name: str
    tensors: Dict[str, Any]
    format: Optional[str]
    group: Optional[str]
    stored_nbytes: int


def iter_modules(ck: Checkpoint, qc: Optional[QuantConfig]) -> Iterator[LoadedModule]:
    """Yield modules one at a time (streaming: only one module's tensors are built at once), after the whole
    checkpoint has been checked against the config from its headers (see the module docstring)."""
    for m in plan_modules(ck, qc):
        stored = sum(ck.info(full).nbytes for full in m.tensors.values())
        if m.group is None or m.group.format == "dense":
            yield LoadedModule(m.name, {k: ck.get(v) for k, v in m.tensors.items()}, None, None, stored)
            continue
        tensors = {k: ck.get(v) for k, v in m.tensors.items() if k not in _WEIGHT_PARTS}
        q = decode_weight(ck, m, qc).whole()  # a dense array for legacy activation-ordered g_idx groups
        tensors["weight"] = q
        if "weight_zero_point" in m.tensors and isinstance(q, QArray) and q.zero_point is None:
            tensors["weight_zero_point"] = ck.get(m.tensors["weight_zero_point"])
        yield LoadedModule(m.name, tensors, m.group.format, m.group.name, stored)


def plan_modules(ck: Checkpoint, qc: Optional[QuantConfig]) -> List[StoredModule]:
    """Every module of an open checkpoint (sorted by name), each with the config group that stores its weight
    (None: dense), after the whole checkpoint has been checked against `qc` from its headers (module
    docstring; reads no tensor data but each `weight_shape`'s two integers).

    Raises CheckpointError naming the file, module, tensor and what was expected."""
    mods = _modules_of(ck)
    plan = _plan(ck, qc, mods)
    out = []
    for name in sorted(mods):
        mods[name].group = plan[name]
        out.append(mods[name])
    return out


def _where(ck: Checkpoint, m: StoredModule) -> str:
    first = next((m.tensors[p] for p in ("weight_packed", "weight_scale", "weight") if p in m.tensors),
                 next(iter(m.tensors.values())))
    return f"{ck.file_of(first)}: module {m.name!r}"


def _coded(ck: Checkpoint, m: StoredModule) -> list:
    """The module's tensors that only a quantized module holds."""
    out = [p for p in _CODED_PARTS if p in m.tensors]
    if "weight" in m.tensors and ck.info(m.tensors["weight"]).dtype not in _FLOAT_DTYPES:
        out.append("weight")
    return out


def _no_config(ck: Checkpoint, qc: Optional[QuantConfig]) -> str:
    root = ck.path if ck.path.is_dir() else ck.path.parent
    if qc is not None:
        return (f"{root / 'config.json'}: quantization_config has no config group with weights in a compressed "
                f"format (groups: {[(g.name, list(g.targets), g.format) for g in qc.groups]})")
    if not ((root / "config.json").exists() or (root / "config.json").is_symlink()):
        return f"no config.json in {root}"
    return f"{root / 'config.json'} has no quantization_config"


def _plan(ck: Checkpoint, qc: Optional[QuantConfig], mods: Dict[str, StoredModule]) -> Dict[str, Optional[ConfigGroup]]:
    groups = [g for g in qc.groups if g.weights is not None] if qc is not None else []
    # "dense" groups (a frozen, not yet compressed model: float weights beside their scales) stay raw
    compressing = [g for g in groups if g.format != "dense"]
    plan: Dict[str, Optional[ConfigGroup]] = {}
    used = set()
    for name in sorted(mods):
        m = mods[name]
        coded = _coded(ck, m)
        if not coded:
            plan[name] = None
            _check_dense(ck, m, qc, compressing)
            continue
        where = _where(ck, m)
        if not groups:
            raise CheckpointError(f"{where}: holds quantized tensors {coded} but the checkpoint does not say how "
                                  f"to read them ({_no_config(ck, qc)}); expected a compressed-tensors "
                                  f"quantization_config with a group that targets it")
        if qc.is_ignored(name):
            raise CheckpointError(f"{where}: the module is in quantization_config.ignore but holds quantized "
                                  f"weight tensors ({sorted(m.tensors)})")
        group = _pick_group(ck, m, qc, where)
        used.add(group.name)
        if group.format == "dense":
            bad = [p for p in coded if p in ("weight_packed", "weight_shape", "weight")]
            if bad or "weight" not in m.tensors:
                raise CheckpointError(f"{where}: config group {group.name!r} has format 'dense' (float weights "
                                      f"beside their scales), but the module holds "
                                      f"{[m.name + '.' + p for p in bad] or 'no float weight'}; expected a "
                                      f"float 'weight' and no packed tensors")
        else:
            _check_layout(ck, m, group, qc, f"{where} ({group.format}, group {group.name})")
        plan[name] = group
    if compressing or groups:
        for g in groups:
            if g.name not in used:
                warnings.warn(f"{ck.path}: quantization_config group {g.name!r} (targets {list(g.targets)}) "
                              f"matches no quantized module in the checkpoint", stacklevel=4)
        for t in qc.ignore:
            if t.startswith("re:"):
                continue
            if t == "lm_head" and any(k.rpartition(".")[2] == "embed_tokens" for k in mods):
                continue  # a tied lm_head (no tensor of its own) is ignored by name, as llm-compressor writes it
            if t not in mods and not any(k.startswith(t + ".") for k in mods):
                warnings.warn(f"{ck.path}: quantization_config.ignore entry {t!r} matches no module in the "
                              f"checkpoint", stacklevel=4)
    return plan


def _check_dense(ck: Checkpoint, m: StoredModule, qc: Optional[QuantConfig], compressing) -> None:
    """A module without quantized tensors: a compressing group must not target it by name (its scale or
    packed codes would then be missing, renamed or mis-encoded)."""
    if not compressing or "weight" not in m.tensors or qc.is_ignored(m.name):
        return
    if len(ck.info(m.tensors["weight"]).shape) != 2:
        return
    for g in compressing:
        if g.matches_by_name(m.name):
            need = "weight_packed" if g.format in _PACKED_FORMATS else "weight_scale"
            raise CheckpointError(f"{_where(ck, m)}: config group {g.name!r} ({g.format}) targets it by name, "
                                  f"expected tensor {m.name + '.' + need!r} with its quantized weight, found "
                                  f"only a {ck.info(m.tensors['weight']).dtype} weight (module tensors: "
                                  f"{sorted(m.tensors)})")


def _pick_group(ck: Checkpoint, m: StoredModule, qc: QuantConfig, where: str) -> ConfigGroup:
    groups = [g for g in qc.groups if g.weights is not None]
    cands = [g for g in groups if g.matches_by_name(m.name)] or [g for g in groups if g.matches(m.name)]
    if not cands:
        raise CheckpointError(f"{where}: holds quantized weight tensors but no quantization_config group "
                              f"targets it (groups: {[(g.name, list(g.targets)) for g in qc.groups]})")
    if len(cands) > 1:
        fits = [g for g in cands if _fits(ck, m, g)]
        cands = fits or cands
    return cands[0]


def _fits(ck: Checkpoint, m: StoredModule, g: ConfigGroup) -> bool:
    packed = g.format in ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized",
                          "mxfp6-pack-quantized", FPX_FORMAT)
    if packed != ("weight_packed" in m.tensors):
        return False
    if g.format == "nvfp4-pack-quantized" and "weight_global_scale" not in m.tensors:
        return False
    if g.format == "pack-quantized":
        return ck.info(m.tensors["weight_packed"]).dtype == "I32"
    if "weight_scale" in m.tensors:
        sd = ck.info(m.tensors["weight_scale"]).dtype
        return (sd in ("U8", "F8_E8M0")) == (g.weights.scale_format == "e8m0")
    return True


# ---- one weight -----------------------------------------------------------------------------------------------
def _need(ck: Checkpoint, m: StoredModule, local: str, where: str, dtypes, ndim=None):
    """The header info of tensor `local`, checked for dtype and rank (no data read)."""
    if local not in m.tensors:
        raise CheckpointError(f"{where}: expected tensor {m.name + '.' + local!r} for its format, found none "
                              f"(module tensors: {sorted(m.tensors)})")
    info = ck.info(m.tensors[local])
    if info.dtype not in dtypes:
        raise CheckpointError(f"{_at(ck, m, local)}: expected dtype {' or '.join(dtypes)}, found {info.dtype}")
    if ndim is not None and len(info.shape) not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise CheckpointError(f"{_at(ck, m, local)}: expected a {ndim}-d tensor, found shape {list(info.shape)}")
    return info


def _at(ck: Checkpoint, m: StoredModule, local: str) -> str:
    full = m.tensors[local]
    return f"{ck.file_of(full)}: tensor {full!r}"


def _weight_shape(ck: Checkpoint, m: StoredModule, where: str, src: "TensorSource") -> Tuple[int, int]:
    info = _need(ck, m, "weight_shape", where, ("I64", "I32", "U64", "U32", "I16"), 1)
    if info.shape != (2,):
        raise CheckpointError(f"{_at(ck, m, 'weight_shape')}: expected shape [2] ([out, in]), found "
                              f"{list(info.shape)}")
    ws = src.read(m.tensors["weight_shape"])
    if (ws < 1).any() or (ws > 2**40).any():
        raise CheckpointError(f"{_at(ck, m, 'weight_shape')}: expected [out, in] of positive ints, found "
                              f"{ws.tolist()}")
    return int(ws[0]), int(ws[1])


def _check_int_range(a: np.ndarray, lo: int, hi: int, at: str) -> None:
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise CheckpointError(f"{at}: expected values in [{lo}, {hi}], found [{int(a.min())}, {int(a.max())}]")


def _parts(fmt: str, s: QuantScheme) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(required, optional) weight tensors of a module stored in `fmt` with weight scheme `s`."""
    packed = fmt in _PACKED_FORMATS
    req = ["weight_packed" if packed else "weight", "weight_scale"]
    opt = ["weight_g_idx"]
    if fmt in ("pack-quantized", FPX_FORMAT):
        req.append("weight_shape")
    elif packed:
        opt.append("weight_shape")  # written by some compressed-tensors versions; checked when present
    if s.strategy == "tensor_group":
        req.append("weight_global_scale")
    # compressed-tensors before 0.9 wrote zero points for symmetric weights too
    (opt if s.symmetric else req).append("weight_zero_point")
    return tuple(req), tuple(opt)


@dataclasses.dataclass(frozen=True)
class _Layout:
    n: int  # out features
    k: int  # in features
    scale: Tuple[int, ...]  # the contracted scale shape the scheme gives
    legacy: bool  # pre-0.18 `32 // bits` int32 layout of weight_packed
    zp_legacy: bool  # the same for a packed weight_zero_point


def _check_layout(ck: Checkpoint, m: StoredModule, g: ConfigGroup, qc: QuantConfig, where: str,
                  src: Optional["TensorSource"] = None) -> _Layout:
    """Header-level check of one quantized module: exactly its format's tensors, their dtypes, and the
    shapes the scheme and weight_shape imply. Reads no tensor data except weight_shape's two ints (from `src`;
    default: the checkpoint's map)."""
    src = TensorSource(ck) if src is None else src
    s: QuantScheme = g.weights
    fmt, bits = g.format, s.bits
    req, opt = _parts(fmt, s)
    present = [p for p in _WEIGHT_PARTS + ("weight_g_idx",) if p in m.tensors]
    missing = [m.name + "." + p for p in req if p not in m.tensors]
    extra = [m.name + "." + p for p in present if p not in req + opt]
    if missing or extra:
        raise CheckpointError(f"{where}: expected exactly the tensors {[m.name + '.' + p for p in req]} "
                              f"(optional: {list(opt)}), " + (f"missing {missing}" if missing else "") +
                              (", " if missing and extra else "") +
                              (f"found {extra} which the format does not store" if extra else ""))
    legacy = zp_legacy = False
    # -- codes ---------------------------------------------------------------------------------------------
    if fmt in ("naive-quantized", "int-quantized", "float-quantized", "mxfp8-quantized"):
        if (fmt == "int-quantized") != isinstance(s.format, IntFormat) and fmt != "naive-quantized":
            raise CheckpointError(f"{where}: format {fmt!r} does not store the {s.format.name} weights the "
                                  f"weights args describe")
        if (fmt == "mxfp8-quantized") != (s.scale_format == "e8m0"):
            raise CheckpointError(f"{where}: E8M0 scales go with format 'mxfp8-quantized' only; the weights args "
                                  f"say {s.describe()}")
        if isinstance(s.format, IntFormat):
            info = _need(ck, m, "weight", where, ("I8",), 2)
        else:
            if bits != 8 or s.format.name != "fp8_e4m3fn":
                raise CheckpointError(f"{where}: format {fmt!r} stores 8-bit e4m3 floats, but the weights args "
                                      f"say {s.format.name}")
            info = _need(ck, m, "weight", where, ("F8_E4M3",), 2)
        n, k = info.shape
    elif fmt == "pack-quantized":
        if not isinstance(s.format, IntFormat):
            raise CheckpointError(f"{where}: pack-quantized holds integers, but the weights args say "
                                  f"{s.format.name}")
        info = _need(ck, m, "weight_packed", where, ("I32",), 2)
        n, k = _weight_shape(ck, m, where, src)
        legacy = _legacy_layout(qc, bits, k, info.shape[1], _at(ck, m, "weight_packed"))
        if info.shape[0] != n:
            raise CheckpointError(f"{_at(ck, m, 'weight_packed')}: expected {n} rows (weight_shape), found "
                                  f"{info.shape[0]}")
    elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", FPX_FORMAT):
        want = {"nvfp4-pack-quantized": ("fp4_e2m1", "tensor_group"), "mxfp4-pack-quantized": ("fp4_e2m1", "e8m0"),
                "mxfp6-pack-quantized": ("fp6_e2m3", "e8m0")}.get(fmt)
        if want is not None and (s.format.name != want[0] or (want[1] == "e8m0") != (s.scale_format == "e8m0")
                                 or (want[1] == "tensor_group") != (s.strategy == "tensor_group")):
            raise CheckpointError(f"{where}: format {fmt!r} expects {want[0]} weights "
                                  f"({'E8M0 group scales' if want[1] == 'e8m0' else 'tensor_group'}), the weights "
                                  f"args say {s.describe()}")
        info = _need(ck, m, "weight_packed", where, ("U8",), 2)
        n, cols = info.shape
        if fmt == FPX_FORMAT:
            n2, k = _weight_shape(ck, m, where, src)
            if n2 != n or cols != (k * bits + 7) // 8:
                raise CheckpointError(f"{_at(ck, m, 'weight_packed')}: expected shape [{n2}, "
                                      f"{(k * bits + 7) // 8}] for weight_shape [{n2}, {k}] of {bits}-bit "
                                      f"codes, found {list(info.shape)}")
        else:
            if bits == 4:
                k = cols * 2
            elif cols % 3:
                raise CheckpointError(f"{_at(ck, m, 'weight_packed')}: expected a multiple of 3 bytes per row "
                                      f"(four 6-bit codes in 3 bytes), found {cols}")
            else:
                k = cols * 4 // 3
            ws = _weight_shape(ck, m, where, src) if "weight_shape" in m.tensors else (n, k)
            if ws != (n, k):
                raise CheckpointError(f"{_at(ck, m, 'weight_shape')}: expected [{n}, {k}] (the shape "
                                      f"weight_packed {list(info.shape)} holds), found {list(ws)}")
    else:
        raise CheckpointError(f"{where}: unsupported format {fmt!r}")
    # -- scale ------------------------------------------------------------------------------------------------
    try:
        exp = expected_shapes(s, (k, n), 0)
    except QFormatsError as e:
        raise CheckpointError(f"{where}: weight [{n}, {k}] does not fit the scheme: {e}") from None
    if s.strategy in ("group", "tensor_group") and k % s.group_size:
        raise CheckpointError(f"{where}: in_features {k} is not a multiple of group_size {s.group_size}")
    if s.scale_format == "e8m0":
        sc = _need(ck, m, "weight_scale", where, ("U8", "F8_E8M0"))
    elif s.strategy == "tensor_group":
        sc = _need(ck, m, "weight_scale", where, ("F8_E4M3",))
    else:
        sc = _need(ck, m, "weight_scale", where, tuple(_FLOAT_SCALE))
    if tuple(sc.shape) != exp["scale"] and not (s.strategy == "tensor" and math.prod(sc.shape) == 1):
        raise CheckpointError(f"{_at(ck, m, 'weight_scale')}: expected shape {list(exp['scale'])} for a "
                              f"{s.strategy} scale of weight [{n}, {k}], found {list(sc.shape)}")
    # -- zero point / global scale / g_idx ----------------------------------------------------------------------
    if "weight_zero_point" in m.tensors:
        g_count = exp["scale"][-1] if s.strategy != "tensor" else 1
        if not s.symmetric and fmt == "pack-quantized" and s.strategy in ("group", "channel"):
            zpk = _need(ck, m, "weight_zero_point", where, ("I32",), 2)
            zp_legacy = _legacy_layout(qc, bits, n, zpk.shape[0], _at(ck, m, "weight_zero_point"))
            if zpk.shape[1] != g_count:
                raise CheckpointError(f"{_at(ck, m, 'weight_zero_point')}: expected {g_count} columns (one per "
                                      f"scale column), found {zpk.shape[1]}")
        else:
            z = _need(ck, m, "weight_zero_point", where, ("I8", "I32", "I16", "U8", "I64"))
            if math.prod(z.shape) != math.prod(exp["scale"]):
                raise CheckpointError(f"{_at(ck, m, 'weight_zero_point')}: expected shape {list(exp['scale'])}, "
                                      f"found {list(z.shape)}")
    if "weight_global_scale" in m.tensors:
        gs = _need(ck, m, "weight_global_scale", where, ("F32",))
        if math.prod(gs.shape) != 1:
            raise CheckpointError(f"{_at(ck, m, 'weight_global_scale')}: expected one float32, found shape "
                                  f"{list(gs.shape)}")
    if "weight_g_idx" in m.tensors:
        gi = _need(ck, m, "weight_g_idx", where, ("I32", "I64"), 1)
        if s.strategy != "group" or gi.shape != (k,):
            raise CheckpointError(f"{_at(ck, m, 'weight_g_idx')}: expected a [{k}] group index of a group "
                                  f"scheme, found shape {list(gi.shape)} with strategy {s.strategy!r}")
    return _Layout(n, k, exp["scale"], legacy, zp_legacy)


# ---- decoding one weight from a byte source ---------------------------------------------------------------------
class TensorSource:
    """Where the decoder reads stored tensor data: `read(name)` is tensor `name` whole, `read(name, index)`
    only name[index] (one slice per leading dimension; the rows are chosen before any byte is read).

    This one reads a Checkpoint's memory map (read-only zero-copy views); `converters.pipelines.mesh_load.SliceSource`
    counts what each device reads."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck

    def read(self, name: str, index: Optional[Index] = None) -> np.ndarray:
        if index is None or not self.ck.info(name).shape:
            return self.ck.get(name)
        return self.ck.get_slice(name)[index]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a decoded QArray, read on demand: `read(None)` the whole array (`shape`, `dtype`),
    `read(index)` only array[index] (index: one slice per dimension), from its stored tensors' matching bytes."""

    shape: Tuple[int, ...]
    dtype: np.dtype
    read: Callable[[Optional[Index]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """The weight of one quantized module, decoded lazily: the QArray's leaves as readers over a TensorSource.

    The QArray has logical shape `shape` = (K, N) (the Flax kernel, `axis=0`): codes [N, ceil(K * bits / 8)]
    (torch's [out, in] storage), scale / zero_point the contracted scale shape, global_scale [1].
    `whole()` reads every leaf whole (what `read_compressed` returns); a placement that gives each device its
    own slice calls `leaf.read(index)` per device (`converters.pipelines.mesh_load.place_weight`), which a layout whose
    values span the slices does not allow: `whole_only` says why (None: any slice reads on its own).
    """

    module: str
    where: str
    group: ConfigGroup
    scheme: QuantScheme
    shape: Tuple[int, int]
    dtype: Any
    codes: Leaf
    scale: Leaf
    zero_point: Optional[Leaf]
    global_scale: Optional[Leaf]
    whole_only: Optional[str]
    g_idx: Optional[np.ndarray]  # an activation-ordered (non-trivial) group index: the weight loads dense

    def qarray(self, codes, scale, zero_point=None, global_scale=None) -> QArray:
        """The QArray of these leaves (arrays, placed arrays or ShapeDtypeStructs); CheckpointError when the
        parts do not fit the scheme."""
        q = QArray(codes, scale, zero_point, global_scale, scheme=self.scheme, shape=self.shape, dtype=self.dtype,
                   axis=0)
        try:
            q.check()
        except QFormatsError as e:
            raise CheckpointError(f"{self.where}: {e}") from None
        return q

    def whole(self):
        """The QArray, every leaf read whole; for a non-trivial `g_idx`, the dense torch-layout [N, K] weight
        (`_g_idx_dense`) instead."""
        codes = self.codes.read(None)
        sc = self.scale.read(None)
        zp = None if self.zero_point is None else self.zero_point.read(None)
        gs = None if self.global_scale is None else self.global_scale.read(None)
        if self.g_idx is not None:
            return _g_idx_dense(self, codes, sc, zp)
        return self.qarray(codes, sc, zp, gs)


def _cut(a: np.ndarray, index: Optional[Index]) -> np.ndarray:
    return a if index is None else a[index]


def decode_weight(ck: Checkpoint, m: StoredModule, qc: QuantConfig, src: Optional[TensorSource] = None) \
        -> StoredWeight:
    """The weight of quantized module `m` (a `plan_modules` entry) as a `StoredWeight`, reading bytes from `src`
    (default: the checkpoint's memory map). Reads now only what the leaves do not hold: weight_shape, and whole
    the small tensors that are checked or needed whole (a symmetric zero point, global scale, g_idx).

    The codes: naive / int / float-quantized 8-bit values as stored (float8 viewed as uint8); int-quantized
    codes narrower than 8 bits packed (offset by -qmin); pack-quantized int32 words as their little-endian byte
    stream (8-bit values offset by 128 back to int8; the pre-0.18 `32 // bits` layout unpacked and repacked);
    NVFP4 / MX / fpx bytes as stored. Zero points: asymmetric pack-quantized ones unpacked from int32 words
    across output channels (minus the offset 2^(bits-1)), others cast to int8.

    Raises CheckpointError (naming the file, module and tensor) for a layout or values that do not fit."""
    g: ConfigGroup = m.group
    s: QuantScheme = g.weights
    fmt, bits = g.format, s.bits
    src = TensorSource(ck) if src is None else src
    where = f"{_where(ck, m)} ({fmt}, group {g.name})"
    lay = _check_layout(ck, m, g, qc, where, src)
    n, k = lay.n, lay.k
    t = m.tensors
    kbytes = (k * bits + 7) // 8
    whole_only = None
    # -- codes [N, kbytes] ------------------------------------------------------------------------------------
    if fmt in ("naive-quantized", "int-quantized", "float-quantized", "mxfp8-quantized"):
        name = t["weight"]
        if not isinstance(s.format, IntFormat):
            codes_dtype = np.uint8

            def codes(ix):
                return src.read(name, ix).view(np.uint8)
        elif bits == 8:
            codes_dtype = np.int8

            def codes(ix):
                return src.read(name, ix)
        else:
            codes_dtype = np.uint8
            whole_only = f"{fmt} with {bits}-bit integer codes (stored one per int8, packed on load)"

            def codes(ix):
                w = src.read(name)
                _check_int_range(w, s.format.qmin, s.format.qmax, _at(ck, m, "weight"))
                return _cut(pack_numpy((w.astype(np.int16) - s.format.qmin).astype(np.uint8), bits), ix)
    elif fmt == "pack-quantized":
        name = t["weight_packed"]
        vals = k if bits == 8 else kbytes  # bytes of the little-endian word stream that hold the codes

        def stream(ix):
            # the int32 words' little-endian bytes are the code stream: read the words that hold the slice's
            # bytes (rows and word columns), then cut at the byte boundaries
            if ix is None:
                return src.read(name).view("<u1")[:, :vals]
            a, b, _ = ix[1].indices(vals)
            w0 = a // 4
            words = src.read(name, (ix[0], slice(w0, -(-b // 4))))
            return words.view("<u1")[:, a - 4 * w0: b - 4 * w0]
        if bits == 8:
            codes_dtype = np.int8

            def codes(ix):
                return (stream(ix).astype(np.int16) - 128).astype(np.int8)
        elif not lay.legacy:
            codes_dtype = np.uint8

            def codes(ix):
                return np.ascontiguousarray(stream(ix))
        else:
            codes_dtype = np.uint8
            if 32 % bits:  # with 32 % bits == 0 the legacy words hold the same byte stream as the dense ones
                whole_only = "the pre-0.18 int32 layout (32 // bits values per word)"

            def codes(ix):
                if ix is None or 32 % bits:
                    return _cut(pack_numpy(np.asarray(unpack_int32(src.read(name), bits, k, legacy=True)), bits), ix)
                return np.ascontiguousarray(stream(ix))
    else:
        name = t["weight_packed"]
        codes_dtype = np.uint8

        def codes(ix):
            return src.read(name, ix)
    # -- scale ------------------------------------------------------------------------------------------------
    sname = t["weight_scale"]
    s_info = ck.info(sname)
    e8m0 = s.scale_format == "e8m0"
    s_dtype = np.dtype(np.uint8) if e8m0 else s_info.numpy_dtype
    dtype = jnp.bfloat16 if e8m0 or s.strategy == "tensor_group" else s_info.numpy_dtype

    def _scale_shaped(name):
        """read(index) of a tensor stored in the contracted scale shape (or reshaped to it, read whole)."""
        if tuple(ck.info(name).shape) == lay.scale:
            return lambda ix: src.read(name, ix)
        return lambda ix: _cut(src.read(name).reshape(lay.scale), ix)
    raw_scale = _scale_shaped(sname)

    def scale(ix):
        a = raw_scale(ix)
        return a.view(np.uint8) if e8m0 else a
    # -- zero point / global scale / g_idx ----------------------------------------------------------------------
    zp = None
    if not s.symmetric:
        if fmt == "pack-quantized" and s.strategy in ("group", "channel"):
            whole_only = "an asymmetric pack-quantized zero point (int32 words packed across output channels)"
            zname = t["weight_zero_point"]

            def zp(ix):
                u = np.asarray(unpack_int32(src.read(zname), bits, n, legacy=lay.zp_legacy, axis=0))
                return _cut((u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8), ix)
        else:
            raw_zp = _scale_shaped(t["weight_zero_point"])

            def zp(ix):
                z = raw_zp(ix)
                _check_int_range(z, s.format.qmin, s.format.qmax, _at(ck, m, "weight_zero_point"))
                return z.astype(np.int8)
    elif "weight_zero_point" in t and src.read(t["weight_zero_point"]).any():
        raise CheckpointError(f"{_at(ck, m, 'weight_zero_point')}: the weights args say symmetric, expected no "
                              f"zero point or an all-zero one, found nonzero values")
    gs = None
    if s.strategy == "tensor_group":
        gs_host = src.read(t["weight_global_scale"]).reshape(1)
        gs = Leaf((1,), np.dtype(np.float32), lambda ix: _cut(gs_host, ix))
    g_idx = None
    if "weight_g_idx" in t:
        gi = src.read(t["weight_g_idx"])
        if not np.array_equal(gi, np.arange(k) // s.group_size):
            at = _at(ck, m, "weight_g_idx")
            if not isinstance(s.format, IntFormat):
                raise CheckpointError(f"{at}: a non-trivial group index is supported for integer weights only, "
                                      f"found {s.format.name} ({fmt})")
            _check_int_range(gi, 0, lay.scale[-1] - 1, at)
            g_idx = gi
            whole_only = (f"activation-ordered groups (a weight_g_idx other than column // {s.group_size}, loaded as "
                          f"a dense weight)")
    return StoredWeight(m.name, where, g, s, (k, n), dtype, Leaf((n, kbytes), np.dtype(codes_dtype), codes),
                        Leaf(lay.scale, s_dtype, scale),
                        None if zp is None else Leaf(lay.scale, np.dtype(np.int8), zp), gs, whole_only, g_idx)


def _g_idx_dense(w: StoredWeight, codes, sc, zp) -> np.ndarray:
    """The dense torch-layout [N, K] weight of a module with a non-trivial `weight_g_idx` (legacy activation-
    ordered GPTQ groups): W[:, j] = (q[:, j] - z[:, g[j]]) * s[:, g[j]], the product rounded once to the scale's
    dtype as compressed-tensors' dequantization does. A QArray keeps its groups contiguous along K, so such a
    layer is loaded dense, with a warning naming it."""
    s, gi, where = w.scheme, w.g_idx, w.where
    k, n = w.shape
    if s.bits == 8:
        vals = np.asarray(codes).view(np.int8).astype(np.float32)
    else:  # packed offset codes, little-endian bit stream of each row: back to unsigned values, minus the offset
        from qformats.packing import unpack

        vals = np.asarray(unpack(np.asarray(codes), s.bits, k)).astype(np.float32) + s.format.qmin
    g = np.asarray(gi, np.int64)
    if zp is not None:
        vals = vals - np.asarray(zp, np.float32)[:, g]
    dtype = sc.dtype
    dense = (vals * np.asarray(sc, np.float32)[:, g]).astype(dtype)
    warnings.warn(f"{where}: weight_g_idx holds activation-ordered groups (not column // {s.group_size}); this "
                  f"layer is loaded as a dense [{n}, {k}] {np.dtype(dtype).name} weight, "
                  "W[:, j] = (q[:, j] - z[:, g[j]]) * s[:, g[j]]", stacklevel=3)
    return dense


def _legacy_layout(qc: QuantConfig, bits: int, n: int, words: int, at: str) -> bool:
    """Which int32 layout holds n values of `bits` bits in `words` words: from the version when recorded
    (dense since 0.18), else from the word count (dense on a tie)."""
    dense_w, legacy_w = packed_length_int32(n, bits), packed_length_int32(n, bits, legacy=True)
    pref = qc.dense_packing
    if pref is True and words == dense_w:
        return False
    if pref is False and words == legacy_w:
        return True
    if pref is None and words in (dense_w, legacy_w):
        return words != dense_w
    layout = {True: f"dense (version {'.'.join(map(str, qc.version or ()))})", False: "legacy 32//bits",
              None: "dense or legacy"}[pref]
    raise CheckpointError(f"{at}: expected {dense_w if pref is not False else legacy_w} int32 words for {n} "
                          f"values of {bits} bits in the {layout} layout, found {words}")

