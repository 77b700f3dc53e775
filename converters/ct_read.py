"""Read compressed-tensors checkpoints into QArrays (no torch): module path -> {"weight": QArray, "bias", ...}.

Every format compressed-tensors 0.20 writes (and 0.19 and older pack-quantized layouts), plus our
`fpx-pack-quantized` extension (see `converters.ct_config`). The QArray of a torch Linear weight `[N, K]`
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

Which modules are quantized: those holding `weight_packed` or `weight_scale`. A module takes the config
group whose `re:` targets (or exact names) match its path; class-name targets ("Linear") cannot be checked
without the model, so they match any module; among several candidates the one whose tensors fit wins.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from converters.ct_config import FPX_FORMAT, ConfigGroup, QuantConfig, parse_quantization_config
from converters.safetensors_io import Checkpoint, open_checkpoint, read_json
from qformats.errors import CheckpointError, QFormatsError
from qformats.formats import IntFormat
from qformats.packing import pack, packed_length_int32, unpack_int32
from qformats.qarray import QArray
from qformats.quantize import expected_shapes
from qformats.schemes import QuantScheme

__all__ = ["CompressedModel", "QUANT_PARAM_NAMES", "open_compressed", "read_compressed", "to_flax_params",
           "split_name"]

#: Local tensor names that hold quantization parameters of a module (never dense weights).
QUANT_PARAM_NAMES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_global_scale",
                     "input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                     "k_scale", "v_scale", "k_zero_point", "v_zero_point", "weight_g_idx")
_WEIGHT_PARTS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                 "weight_global_scale")
_FLOAT_SCALE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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


# ---- opening ----------------------------------------------------------------------------------------------------
def _load_config(path: Path) -> Dict[str, Any]:
    cfg_path = (path if path.is_dir() else path.parent) / "config.json"
    if not cfg_path.exists():
        return {}
    cfg = read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


class _Module:
    def __init__(self, name: str):
        self.name = name
        self.tensors: Dict[str, str] = {}  # local -> full name


def _modules_of(ck: Checkpoint) -> Dict[str, _Module]:
    mods: Dict[str, _Module] = {}
    for name in ck.keys():
        m, local = split_name(name)
        mods.setdefault(m, _Module(m)).tensors[local] = name
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
    """Yield modules one at a time (streaming: only one module's tensors are built at once)."""
    mods = _modules_of(ck)
    used_groups = set()
    # "dense" groups (e.g. a frozen, not yet compressed model: float weights beside their scales) stay raw
    active = qc is not None and any(g.weights is not None and g.format != "dense" for g in qc.groups)
    for name in sorted(mods):
        m = mods[name]
        stored = sum(ck.info(full).nbytes for full in m.tensors.values())
        quantized = active and ("weight_packed" in m.tensors or "weight_scale" in m.tensors)
        group = None
        if quantized:
            where = f"{ck.file_of(m.tensors.get('weight_packed') or m.tensors['weight_scale'])}: module {name!r}"
            if qc.is_ignored(name):
                raise CheckpointError(f"{where}: the module is in quantization_config.ignore but holds quantized "
                                      f"weight tensors ({sorted(m.tensors)})")
            group = _pick_group(ck, m, qc, where)
            used_groups.add(group.name)
            quantized = group.format != "dense"
        if not quantized:
            yield LoadedModule(name, {k: ck.get(v) for k, v in m.tensors.items()}, None, None, stored)
            continue
        tensors = {k: ck.get(v) for k, v in m.tensors.items() if k not in _WEIGHT_PARTS}
        q = _weight_qarray(ck, m, group, qc, where)
        tensors["weight"] = q
        if "weight_zero_point" in m.tensors and q.zero_point is None:
            tensors["weight_zero_point"] = ck.get(m.tensors["weight_zero_point"])
        yield LoadedModule(name, tensors, group.format, group.name, stored)
    if active:
        for g in qc.groups:
            if g.weights is not None and g.name not in used_groups:
                warnings.warn(f"{ck.path}: quantization_config group {g.name!r} (targets {list(g.targets)}) "
                              f"matches no quantized module in the checkpoint", stacklevel=2)
        for t in qc.ignore:
            if t.startswith("re:"):
                continue
            if t not in mods and not any(k.startswith(t + ".") for k in mods):
                warnings.warn(f"{ck.path}: quantization_config.ignore entry {t!r} matches no module in the "
                              f"checkpoint", stacklevel=2)


def _pick_group(ck: Checkpoint, m: _Module, qc: QuantConfig, where: str) -> ConfigGroup:
    groups = [g for g in qc.groups if g.weights is not None]
    cands = [g for g in groups if g.matches_by_name(m.name)] or [g for g in groups if g.matches(m.name)]
    if not cands:
        raise CheckpointError(f"{where}: holds quantized weight tensors but no quantization_config group "
                              f"targets it (groups: {[(g.name, list(g.targets)) for g in qc.groups]})")
    if len(cands) > 1:
        fits = [g for g in cands if _fits(ck, m, g)]
        cands = fits or cands
    return cands[0]


def _fits(ck: Checkpoint, m: _Module, g: ConfigGroup) -> bool:
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
def _need(ck: Checkpoint, m: _Module, local: str, where: str, dtypes, ndim=None) -> np.ndarray:
    if local not in m.tensors:
        raise CheckpointError(f"{where}: expected tensor {m.name + '.' + local!r} for its format, found none "
                              f"(module tensors: {sorted(m.tensors)})")
    full = m.tensors[local]
    info = ck.info(full)
    at = f"{ck.file_of(full)}: tensor {full!r}"
    if info.dtype not in dtypes:
        raise CheckpointError(f"{at}: expected dtype {' or '.join(dtypes)}, found {info.dtype}")
    if ndim is not None and len(info.shape) not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise CheckpointError(f"{at}: expected a {ndim}-d tensor, found shape {list(info.shape)}")
    return ck.get(full)


def _at(ck: Checkpoint, m: _Module, local: str) -> str:
    full = m.tensors[local]
    return f"{ck.file_of(full)}: tensor {full!r}"


def _weight_shape(ck: Checkpoint, m: _Module, where: str) -> Tuple[int, int]:
    ws = _need(ck, m, "weight_shape", where, ("I64", "I32", "U64", "U32", "I16"), 1)
    if ws.shape != (2,) or (ws < 1).any() or (ws > 2**40).any():
        raise CheckpointError(f"{_at(ck, m, 'weight_shape')}: expected [out, in] of positive ints, found "
                              f"{ws.tolist()}")
    return int(ws[0]), int(ws[1])


def _check_int_range(a: np.ndarray, lo: int, hi: int, at: str) -> None:
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise CheckpointError(f"{at}: expected values in [{lo}, {hi}], found [{int(a.min())}, {int(a.max())}]")


def _weight_qarray(ck: Checkpoint, m: _Module, g: ConfigGroup, qc: QuantConfig, where: str) -> QArray:
    s: QuantScheme = g.weights
    fmt = g.format
    bits = s.bits
    where = f"{where} ({fmt}, group {g.name})"
    if fmt == "dense":
        raise CheckpointError(f"{where}: format 'dense' but the module holds quantization tensors")
    # -- codes ---------------------------------------------------------------------------------------------
    if fmt in ("naive-quantized", "int-quantized", "float-quantized", "mxfp8-quantized"):
        if isinstance(s.format, IntFormat):
            w = _need(ck, m, "weight", where, ("I8",), 2)
            n, k = w.shape
            if bits == 8:
                codes = w
            else:
                _check_int_range(w, s.format.qmin, s.format.qmax, _at(ck, m, "weight"))
                codes = pack((w.astype(np.int16) - s.format.qmin).astype(np.uint8), bits)
        else:
            if bits != 8 or s.format.name != "fp8_e4m3fn":
                raise CheckpointError(f"{where}: format {fmt!r} stores 8-bit e4m3 floats, but the weights args "
                                      f"say {s.format.name}")
            w = _need(ck, m, "weight", where, ("F8_E4M3",), 2)
            n, k = w.shape
            codes = w.view(np.uint8)
    elif fmt == "pack-quantized":
        if not isinstance(s.format, IntFormat):
            raise CheckpointError(f"{where}: pack-quantized holds integers, but the weights args say "
                                  f"{s.format.name}")
        wp = _need(ck, m, "weight_packed", where, ("I32",), 2)
        n, k = _weight_shape(ck, m, where)
        legacy = _legacy_layout(qc, bits, k, wp.shape[1], _at(ck, m, "weight_packed"))
        if wp.shape[0] != n:
            raise CheckpointError(f"{_at(ck, m, 'weight_packed')}: expected {n} rows (weight_shape), found "
                                  f"{wp.shape[0]}")
        if bits == 8:
            codes = (wp.view("<u1")[:, :k].astype(np.int16) - 128).astype(np.int8)
        elif not legacy:
            codes = np.ascontiguousarray(wp.view("<u1")[:, : (k * bits + 7) // 8])
        else:
            codes = pack(unpack_int32(wp, bits, k, legacy=True), bits)
    elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", FPX_FORMAT):
        want = {"nvfp4-pack-quantized": ("fp4_e2m1", "tensor_group"), "mxfp4-pack-quantized": ("fp4_e2m1", "e8m0"),
                "mxfp6-pack-quantized": ("fp6_e2m3", "e8m0")}.get(fmt)
        if want is not None and (s.format.name != want[0] or (want[1] == "e8m0") != (s.scale_format == "e8m0")
                                 or (want[1] == "tensor_group") != (s.strategy == "tensor_group")):
            raise CheckpointError(f"{where}: format {fmt!r} expects {want[0]} weights "
                                  f"({'E8M0 group scales' if want[1] == 'e8m0' else 'tensor_group'}), the weights "
                                  f"args say {s.describe()}")
        wp = _need(ck, m, "weight_packed", where, ("U8",), 2)
        n, cols = wp.shape
        if fmt == FPX_FORMAT:
            n2, k = _weight_shape(ck, m, where)
            if n2 != n or cols != (k * bits + 7) // 8:
                raise CheckpointError(f"{_at(ck, m, 'weight_packed')}: expected shape [{n2}, "
                                      f"{(k * bits + 7) // 8}] for weight_shape [{n2}, {k}] of {bits}-bit "
                                      f"codes, found {list(wp.shape)}")
        elif bits == 4:
            k = cols * 2
        else:
            if cols % 3:
                raise CheckpointError(f"{_at(ck, m, 'weight_packed')}: expected a multiple of 3 bytes per row "
                                      f"(four 6-bit codes in 3 bytes), found {cols}")
            k = cols * 4 // 3
        codes = wp
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
        sc = sc.view(np.uint8)
        dtype = jnp.bfloat16
    elif s.strategy == "tensor_group":
        sc = _need(ck, m, "weight_scale", where, ("F8_E4M3",))
        dtype = jnp.bfloat16
    else:
        sc = _need(ck, m, "weight_scale", where, tuple(_FLOAT_SCALE))
        dtype = sc.dtype
    if tuple(sc.shape) != exp["scale"]:
        if s.strategy == "tensor" and sc.size == 1:
            sc = sc.reshape(1)
        else:
            raise CheckpointError(f"{_at(ck, m, 'weight_scale')}: expected shape {list(exp['scale'])} for a "
                                  f"{s.strategy} scale of weight [{n}, {k}], found {list(sc.shape)}")
    # -- zero point / global scale -----------------------------------------------------------------------------
    zp = None
    if not s.symmetric:
        zfull = m.tensors.get("weight_zero_point")
        if zfull is None:
            raise CheckpointError(f"{where}: asymmetric weights need tensor {m.name + '.weight_zero_point'!r}, "
                                  f"found none")
        g_count = exp["scale"][-1] if s.strategy != "tensor" else 1
        if fmt == "pack-quantized" and s.strategy in ("group", "channel"):
            zpk = _need(ck, m, "weight_zero_point", where, ("I32",), 2)
            leg = _legacy_layout(qc, bits, n, zpk.shape[0], _at(ck, m, "weight_zero_point"))
            if zpk.shape[1] != g_count:
                raise CheckpointError(f"{_at(ck, m, 'weight_zero_point')}: expected {g_count} columns (one per "
                                      f"scale column), found {zpk.shape[1]}")
            u = np.asarray(unpack_int32(zpk, bits, n, legacy=leg, axis=0))
            zp = (u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
        else:
            z = _need(ck, m, "weight_zero_point", where, ("I8", "I32", "I16", "U8", "I64"))
            if z.size != math.prod(exp["scale"]):
                raise CheckpointError(f"{_at(ck, m, 'weight_zero_point')}: expected shape {list(exp['scale'])}, "
                                      f"found {list(z.shape)}")
            _check_int_range(z, s.format.qmin, s.format.qmax, _at(ck, m, "weight_zero_point"))
            zp = z.astype(np.int8).reshape(exp["scale"])
    gs = None
    if s.strategy == "tensor_group":
        gs = _need(ck, m, "weight_global_scale", where, ("F32",))
        if gs.size != 1:
            raise CheckpointError(f"{_at(ck, m, 'weight_global_scale')}: expected one float32, found shape "
                                  f"{list(gs.shape)}")
        gs = gs.reshape(1)
    q = QArray(codes, sc, zp, gs, scheme=s, shape=(k, n), dtype=dtype, axis=0)
    try:
        q.check()
    except QFormatsError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return q


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

