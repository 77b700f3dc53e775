"""Read AutoGPTQ / GPTQModel (`quant_method: "gptq"`) and AutoAWQ GEMM (`quant_method: "awq"`) checkpoints into QArrays.

Both store, per quantized Linear of torch weight [N, K] (out, in), int32 words of unsigned b-bit codes `q`, int32
words of unsigned zero points `z` and float `scales` [G, N] (G = K / group_size groups of consecutive inputs), with
    W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)].
Each module becomes what `converters.formats.compressed_tensors.read.read_compressed` gives for the same values in a
compressed-tensors `pack-quantized` checkpoint: a QArray of logical shape [K, N] (axis 0), asymmetric int group
scheme (W4A16_ASYM with the checkpoint's group size; channel strategy for group_size -1), codes the little-endian
bit stream of the offset codes q_ct + 2^(b-1) = q per output row, zero points z - 2^(b-1) as int8 [N, G], scales
[N, G] in their stored dtype (which `QArray.dtype` is). Integer repacking only: no value goes through float.

GPTQ (AutoGPTQ `qlinear`, GPTQModel): `qweight` [K*b/32, N] packs along the input as one little-endian bit stream per
output column (b = 2, 3, 4, 8; the 3-bit layout spans word boundaries), so `qweight.T`'s bytes are our codes as they
are. `qzeros` [G, N*b/32] packs along the output the same way. `checkpoint_format` (or `format`) "gptq" (the
default) stores z - 1 (AutoGPTQ's convention, read back as (stored + 1) mod 2^b, as AutoGPTQ's own torch
dequantization does); "gptq_v2" (GPTQModel) stores z. `g_idx` [K] int32: the identity (k // group_size) reads as a
QArray; any other (desc_act) index gives the dense torch-layout [N, K] weight by the same formula with g(k) = g_idx[k]
(rounded once to the scale's dtype), exactly as `read_compressed` does for compressed-tensors' `weight_g_idx`, with a
warning naming the module. `sym` needs nothing: the zero points are stored either way.

AWQ GEMM (AutoAWQ `WQLinear_GEMM`, 4 bits): `qweight` [K, N/8] and `qzeros` [G, N/8] pack 8 outputs per word in the
order AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds output 8w + AWQ_ORDER[i]); `scales` [G, N].
`zero_point: false` stores no qzeros: the scheme is then symmetric (W4A16), value (q - 8) * s, as compressed-tensors'
AutoAWQ converter writes it.

`quant` is the compressed-tensors QuantConfig that holds the same values (one group, targets = the quantized module
names, format pack-quantized). Anything else -- exllama / marlin / bitblas / GEMV layouts, other bit widths, GPTQModel
per-module `dynamic` overrides or a pack dtype other than int32, a missing, extra or misshapen tensor, a g_idx
outside [0, G) -- is a CheckpointError naming the file, the tensor and what is supported.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from converters.formats.compressed_tensors.config import (ConfigGroup, QuantConfig, parse_quantization_config,
                                                           scheme_to_args)
from converters.formats.compressed_tensors.read import (CompressedModel, Leaf, StoredWeight, _load_config,
                                                         split_name)
from converters.formats.safetensors_io import Checkpoint, open_checkpoint
from qformats.errors import CheckpointError
from qformats.formats import IntFormat
from qformats.packing import pack_numpy, unpack
from qformats.schemes import QuantScheme

__all__ = ["AWQ_ORDER", "GPTQ_BITS", "read_awq", "read_gptq"]

#: AutoAWQ GEMM: nibble i of a word holds output column 8 * word + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Bit widths of the GPTQ int32 layout read here.
GPTQ_BITS = (2, 3, 4, 8)
_GPTQ_FORMATS = ("gptq", "gptq_v2")
_FLOAT = ("F16", "BF16", "F32")
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_PARTS = ("qweight", "qzeros", "scales")


# ---- config -----------------------------------------------------------------------------------------------------
def _qc(cfg: Mapping[str, Any], where: str, method: str) -> Mapping[str, Any]:
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != method:
        raise CheckpointError(f"{where}: expected a quantization_config with quant_method {method!r}, found "
                              f"{qc!r:.200}")
    return qc


def _int_field(qc: Mapping[str, Any], key: str, default: Any, allowed, where: str) -> int:
    v = qc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v not in allowed:
        raise CheckpointError(f"{where}: quantization_config.{key} {v!r} is not supported; expected one of "
                              f"{list(allowed) if not isinstance(allowed, range) else 'a positive integer or -1'}")
    return v


def _group_size(qc: Mapping[str, Any], where: str) -> Optional[int]:
    """The group size, None for -1 (one group of all inputs: per-channel scales)."""
    gs = qc.get("group_size", 128)
    if isinstance(gs, bool) or not isinstance(gs, int) or not (gs == -1 or gs > 0):
        raise CheckpointError(f"{where}: quantization_config.group_size {gs!r} is not supported; expected a "
                              f"positive integer or -1")
    return None if gs == -1 else gs


def _scheme(bits: int, group_size: Optional[int], symmetric: bool) -> QuantScheme:
    if group_size is None:
        return QuantScheme(IntFormat(bits, signed=True), "channel", symmetric=symmetric, scale_format="input")
    return QuantScheme(IntFormat(bits, signed=True), "group", symmetric=symmetric, scale_format="input",
                       group_size=group_size)


def _quant_config(scheme: QuantScheme, targets: List[str], where: str) -> QuantConfig:
    """The compressed-tensors QuantConfig of one pack-quantized group holding `scheme` for `targets`."""
    raw = {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                         "output_activations": None, "targets": list(targets),
                                         "weights": scheme_to_args(scheme)}},
           "format": "pack-quantized", "global_compression_ratio": None, "ignore": [], "kv_cache_scheme": None,
           "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
           "version": "0.20.0"}
    return parse_quantization_config(raw, where)


# ---- tensors ----------------------------------------------------------------------------------------------------
def _modules(ck: Checkpoint) -> Dict[str, Dict[str, str]]:
    mods: Dict[str, Dict[str, str]] = {}
    for name in ck.keys():
        m, local = split_name(name)
        mods.setdefault(m, {})[local] = name
    return mods


def _at(ck: Checkpoint, full: str) -> str:
    return f"{ck.file_of(full)}: tensor {full!r}"


def _info(ck: Checkpoint, t: Dict[str, str], local: str, mod: str, dtypes, shape: Tuple[int, ...], what: str):
    if local not in t:
        raise CheckpointError(f"{ck.file_of(next(iter(t.values())))}: module {mod!r}: expected tensor "
                              f"{mod + '.' + local!r} ({what}), found none (module tensors: {sorted(t)})")
    info = ck.info(t[local])
    if info.dtype not in dtypes:
        raise CheckpointError(f"{_at(ck, t[local])}: expected dtype {' or '.join(dtypes)} ({what}), found "
                              f"{info.dtype}")
    if tuple(info.shape) != tuple(shape):
        raise CheckpointError(f"{_at(ck, t[local])}: expected shape {list(shape)} ({what}), found "
                              f"{list(info.shape)}")
    return info


def _words_bytes(words: np.ndarray) -> np.ndarray:
    """The little-endian bytes of int32 words [..., W] as uint8 [..., 4W]."""
    return np.ascontiguousarray(words.astype("<i4", copy=False)).view(np.uint8)


def _check_range(a: np.ndarray, lo: int, hi: int, at: str) -> None:
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise CheckpointError(f"{at}: expected values in [{lo}, {hi}], found [{int(a.min())}, {int(a.max())}]")


def _weight(mod: str, where: str, group: ConfigGroup, scheme: QuantScheme, k: int, n: int, codes: np.ndarray,
            scale: np.ndarray, zp: Optional[np.ndarray], g_idx: Optional[np.ndarray]):
    """The QArray of one module through compressed-tensors' decoder (`StoredWeight`): the same checks, and for a
    non-trivial `g_idx` the same dense weight, as `read_compressed` gives."""
    leaf = lambda a: Leaf(tuple(a.shape), a.dtype, lambda ix, a=a: a if ix is None else a[ix])  # noqa: E731
    trivial = g_idx is None or np.array_equal(g_idx, np.arange(k) // scheme.group_size)
    w = StoredWeight(mod, where, group, scheme, (k, n), scale.dtype, leaf(codes), leaf(scale),
                     None if zp is None else leaf(zp), None, None, None if trivial else g_idx)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*activation-ordered groups.*")
        out = w.whole()
    if not trivial:
        warnings.warn(f"{where}: g_idx holds activation-ordered groups (not k // {scheme.group_size}); this layer "
                      f"is loaded as a dense [{n}, {k}] {np.dtype(scale.dtype).name} weight, "
                      "W[:, k] = (q[:, k] - z[:, g_idx[k]]) * s[:, g_idx[k]]", stacklevel=4)
    return out


def _read(path: "str | os.PathLike", method: str, parts: Tuple[str, ...], decode) -> CompressedModel:
    """Open `path`, decode every module holding a `qweight` with `decode(ck, mod, tensors) -> (weight, k, n)`,
    keep every other tensor as stored."""
    path = Path(path)
    root = path if path.is_dir() else path.parent
    cfg = _load_config(path)
    ck = open_checkpoint(path)
    try:
        mods = _modules(ck)
        quantized = sorted(m for m, t in mods.items() if "qweight" in t)
        for m, t in sorted(mods.items()):
            stray = [p for p in parts if p in t]
            if stray and "qweight" not in t:
                raise CheckpointError(f"{ck.file_of(t[stray[0]])}: module {m!r} holds {stray} but no "
                                      f"{m + '.qweight'!r}; expected qweight with its {list(parts[1:])}")
            if "qweight" in t and "weight" in t:
                raise CheckpointError(f"{_at(ck, t['weight'])}: module {m!r} holds both a dense weight and a "
                                      f"{method} qweight; expected one")
        if not quantized:
            raise CheckpointError(f"{root / 'config.json'}: quant_method {method!r} but no tensor named "
                                  f"'*.qweight' in {path}; expected {method} packed Linear weights")
        modules, formats, groups, stored = {}, {}, {}, {}
        scheme, qc = None, None
        for m in sorted(mods):
            t = mods[m]
            stored[m] = sum(ck.info(full).nbytes for full in t.values())
            if m not in quantized:
                modules[m] = {local: ck.get(full) for local, full in t.items()}
                continue
            extra = [local for local in t if local not in parts + ("bias",)]
            if extra:
                raise CheckpointError(f"{_at(ck, t[extra[0]])}: module {m!r} holds {sorted(extra)}, which a "
                                      f"{method} Linear does not store; expected {list(parts)} and an optional "
                                      f"bias")
            if qc is None:
                scheme, qc = decode.scheme, _quant_config(decode.scheme, quantized, str(root / "config.json"))
            where = f"{ck.file_of(t['qweight'])}: module {m!r} ({method})"
            tensors = {"weight": decode(ck, m, t, where, qc.groups[0])}
            if "bias" in t:
                tensors["bias"] = ck.get(t["bias"])
            modules[m] = tensors
            formats[m], groups[m] = "pack-quantized", qc.groups[0].name
        return CompressedModel(path, cfg, qc, modules, formats, groups, stored)
    finally:
        ck.close()


# ---- GPTQ -------------------------------------------------------------------------------------------------------
class _GPTQ:
    """Decodes one GPTQ module (see the module docstring)."""

    def __init__(self, qc: Mapping[str, Any], where: str):
        self.bits = _int_field(qc, "bits", 4, GPTQ_BITS, where)
        self.group_size = _group_size(qc, where)
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if "checkpoint_format" in qc and "format" in qc and qc["format"] != qc["checkpoint_format"]:
            raise CheckpointError(f"{where}: quantization_config.checkpoint_format {qc['checkpoint_format']!r} and "
                                  f"format {qc['format']!r} disagree")
        if fmt not in _GPTQ_FORMATS or qc.get("is_marlin_format"):
            raise CheckpointError(f"{where}: GPTQ checkpoint format "
                                  f"{'marlin' if qc.get('is_marlin_format') else fmt!r} is not supported; "
                                  f"expected checkpoint_format one of {list(_GPTQ_FORMATS)}")
        self.v1 = fmt == "gptq"
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise CheckpointError(f"{where}: quantization_config.pack_dtype {qc['pack_dtype']!r} is not supported; "
                                  f"expected int32")
        if qc.get("dynamic"):
            raise CheckpointError(f"{where}: quantization_config.dynamic (per-module bits / group_size overrides) "
                                  f"is not supported; expected one bits / group_size for every module")
        self.scheme = _scheme(self.bits, self.group_size, symmetric=False)

    def __call__(self, ck: Checkpoint, m: str, t: Dict[str, str], where: str, group: ConfigGroup):
        b = self.bits
        qw = _need2(ck, m, t, "qweight", where, "int32 codes packed along the input")
        rows, n = qw.shape
        if (rows * 32) % b:
            raise CheckpointError(f"{_at(ck, t['qweight'])}: {rows} rows of int32 words do not hold whole "
                                  f"{b}-bit codes (expected a multiple of {b} rows)")
        k = rows * 32 // b
        gs = k if self.group_size is None else self.group_size
        if k % gs:
            raise CheckpointError(f"{where}: in_features {k} (from qweight {list(qw.shape)}) is not a multiple of "
                                  f"group_size {gs}")
        g = k // gs
        if (n * b) % 32:
            raise CheckpointError(f"{where}: out_features {n} of {b}-bit zero points do not fill whole int32 words "
                                  f"(expected n * {b} a multiple of 32)")
        _info(ck, t, "qzeros", m, ("I32",), (g, n * b // 32), "int32 zero points packed along the output")
        _info(ck, t, "scales", m, _FLOAT, (g, n), "group scales")
        if "g_idx" in t:
            _info(ck, t, "g_idx", m, ("I32", "I64"), (k,), "group of each input")
        words = ck.get(t["qweight"])
        codes = np.ascontiguousarray(words.T.astype("<i4", copy=False)).view(np.uint8)  # [N, K*b/8]
        if b == 8:  # compressed-tensors keeps 8-bit codes as int8 q - 128
            codes = (codes.astype(np.int16) - 128).astype(np.int8)
        z = np.asarray(unpack(_words_bytes(ck.get(t["qzeros"])), b, n))  # [G, N] stored values
        if self.v1:
            z = (z.astype(np.int16) + 1) % (1 << b)
        zp = np.ascontiguousarray((z.astype(np.int16) - (1 << (b - 1))).astype(np.int8).T)
        scale = np.ascontiguousarray(ck.get(t["scales"]).T)
        g_idx = None
        if "g_idx" in t:
            g_idx = np.asarray(ck.get(t["g_idx"]))
            _check_range(g_idx, 0, g - 1, _at(ck, t["g_idx"]))
            if self.group_size is None:
                g_idx = None  # one group: every index is 0
        return _weight(m, where, group, self.scheme, k, n, codes, scale, zp, g_idx)


def _need2(ck: Checkpoint, m: str, t: Dict[str, str], local: str, where: str, what: str):
    info = ck.info(t[local])
    if info.dtype != "I32" or len(info.shape) != 2:
        raise CheckpointError(f"{_at(ck, t[local])}: expected a 2-d int32 tensor ({what}), found {info.dtype} "
                              f"{list(info.shape)}")
    return info


def read_gptq(path: "str | os.PathLike") -> CompressedModel:
    """Read an AutoGPTQ / GPTQModel checkpoint directory (`quant_method: "gptq"`) into a `CompressedModel`: every
    module holding a `qweight` gets its weight as the QArray of W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]
    (module docstring; a dense [N, K] weight for an activation-ordered g_idx), other tensors as stored.
    CheckpointError (naming the file and tensor) for anything malformed or not supported."""
    path = Path(path)
    where = str((path if path.is_dir() else path.parent) / "config.json")
    decode = _GPTQ(_qc(_load_config(path), where, "gptq"), where)
    return _read(path, "gptq", _GPTQ_PARTS, decode)


# ---- AWQ --------------------------------------------------------------------------------------------------------
class _AWQ:
    """Decodes one AutoAWQ GEMM module (see the module docstring)."""

    def __init__(self, qc: Mapping[str, Any], where: str):
        self.bits = _int_field(qc, "bits", 4, (4,), where)
        self.group_size = _group_size(qc, where)
        version = qc.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise CheckpointError(f"{where}: AutoAWQ version {version!r} is not supported; expected 'gemm'")
        zero_point = qc.get("zero_point", True)
        if not isinstance(zero_point, bool):
            raise CheckpointError(f"{where}: quantization_config.zero_point {zero_point!r}: expected true or false")
        self.zero_point = zero_point
        self.scheme = _scheme(4, self.group_size, symmetric=not zero_point)

    @staticmethod
    def unpack(words: np.ndarray) -> np.ndarray:
        """AutoAWQ GEMM words [R, W] -> codes [R, 8W] in output order: out[r, 8w + AWQ_ORDER[i]] = nibble i."""
        nib = (words.astype(np.int64)[:, :, None] >> (4 * np.arange(8))) & 15  # [R, W, 8] by nibble
        out = np.empty_like(nib)
        out[:, :, list(AWQ_ORDER)] = nib
        return out.reshape(words.shape[0], -1).astype(np.uint8)

    def __call__(self, ck: Checkpoint, m: str, t: Dict[str, str], where: str, group: ConfigGroup):
        qw = _need2(ck, m, t, "qweight", where, "int32 codes packed along the output, AutoAWQ GEMM order")
        k, n = qw.shape[0], qw.shape[1] * 8
        gs = k if self.group_size is None else self.group_size
        if k % gs:
            raise CheckpointError(f"{where}: in_features {k} (from qweight {list(qw.shape)}) is not a multiple of "
                                  f"group_size {gs}")
        g = k // gs
        _info(ck, t, "scales", m, _FLOAT, (g, n), "group scales")
        q = self.unpack(ck.get(t["qweight"]))  # [K, N]
        codes = pack_numpy(np.ascontiguousarray(q.T), 4)  # [N, K/2]: q is the offset code q_ct + 8
        zp = None
        if self.zero_point:
            _info(ck, t, "qzeros", m, ("I32",), (g, n // 8), "int32 zero points, AutoAWQ GEMM order")
            z = self.unpack(ck.get(t["qzeros"]))  # [G, N]
            zp = np.ascontiguousarray((z.astype(np.int16) - 8).astype(np.int8).T)
        elif "qzeros" in t:
            raise CheckpointError(f"{_at(ck, t['qzeros'])}: quantization_config.zero_point is false, expected no "
                                  f"qzeros")
        scale = np.ascontiguousarray(ck.get(t["scales"]).T)
        return _weight(m, where, group, self.scheme, k, n, codes, scale, zp, None)


def read_awq(path: "str | os.PathLike") -> CompressedModel:
    """Read an AutoAWQ GEMM checkpoint directory (`quant_method: "awq"`, version "gemm", 4 bits) into a
    `CompressedModel`: every module holding a `qweight` gets its weight as the QArray of
    W[n, k] = (q[n, k] - z[n, k // group_size]) * s[n, k // group_size] (z = 8 without zero points), other tensors
    as stored. CheckpointError (naming the file and tensor) for anything malformed or not supported."""
    path = Path(path)
    where = str((path if path.is_dir() else path.parent) / "config.json")
    decode = _AWQ(_qc(_load_config(path), where, "awq"), where)
    return _read(path, "awq", _AWQ_PARTS, decode)
