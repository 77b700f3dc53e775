"""NVIDIA ModelOpt NVFP4 checkpoints (quant_method "modelopt") read into the NVFP4 QArrays compressed-tensors has.

A ModelOpt NVFP4 checkpoint (ModelOpt's unified HF export) stores per quantized Linear `M`:
  M.weight          uint8 [N, K/2]: two E2M1 codes per byte, element 2i in the low nibble (as compressed-tensors'
                    `weight_packed`);
  M.weight_scale    float8_e4m3fn [N, K/16]: one scale per 16 inputs;
  M.weight_scale_2  float32, one element: the global weight scale s2 (amax / (6 * 448));
  M.input_scale     float32, one element: the static input global scale (absent for weight-only layers);
with w = e2m1(code) * weight_scale * s2. Its config.json `quantization_config` holds `quant_algo` ("NVFP4"), `ignore`
(the excluded modules, fnmatch wildcards), `config_groups` and `kv_cache_scheme` as ModelOpt >= 0.29 writes them; the
older layout nests `quant_algo`, `group_size`, `exclude_modules`, `kv_cache_quant_algo` under `quantization` (the
`hf_quant_config.json` file, read when config.json names no `quant_algo`).

`read_modelopt` maps it exactly as compressed-tensors 0.20's converter (`entrypoints/convert/converters/
modelopt_nvfp4.py`) does, without a detour through float:
  weight -> the QArray's codes as stored; weight_scale -> its scale as stored;
  weight_global_scale = float32(1 / weight_scale_2) -> its global scale (compressed-tensors dequantizes
    code * (scale / global_scale));
  input_global_scale = float32(1 / input_scale), kept under that name beside the weight.
Modules with an `input_scale` get the NVFP4 preset's schemes (NVFP4 weights, NVFP4 input activations under their static
global scale), modules without one NVFP4A16's; quant_algo "W4A16_NVFP4" is NVFP4A16 throughout. The result is the
`CompressedModel` that `converters.formats.compressed_tensors.read.read_compressed` gives for the converter's output:
the same QArrays (codes, scales, global scales, scheme, bfloat16 dtype) and tensors, `quant` the compressed-tensors
QuantConfig whose groups target the quantized modules by name.

Dense values: `compressed_tensors.read.dense_weight(q)` is bf16(code * (scale / global_scale)), the quotient in
float32: what compressed-tensors' decompression gives for the converted checkpoint when the scales are stored as [1].
Stored 0-dim (as ModelOpt's export writes them, to our knowledge), the converter keeps them 0-dim and torch computes
that quotient in bfloat16 (bf16 / 0-dim f32 promotes to bf16), so compressed-tensors' decompression can differ from
ours by one bfloat16 ulp. Neither is ModelOpt's own code * scale * weight_scale_2 (float32(1 / s2) is not s2's
reciprocal exactly).

Everything else is a CheckpointError naming the file, module or tensor and what is supported: another quant_algo
(FP8, FP8_PB_WO, NVFP4_AWQ, W4A8_AWQ, MXFP8, MIXED_PRECISION, ...), a group size other than 16, an
`activation_scheme` other than "static", KV-cache quantization, a quantized module that `ignore` excludes, missing or
extra tensors, wrong dtypes or shapes, a global scale that is not a finite positive number.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from converters.formats.compressed_tensors.config import parse_quantization_config, serialize_quantization_config
from converters.formats.compressed_tensors.read import CompressedModel, split_name
from converters.formats.safe_files import read_json
from converters.formats.safetensors_io import Checkpoint, open_checkpoint
from qformats.errors import CheckpointError, QFormatsError
from qformats.presets import presets
from qformats.qarray import QArray
from qformats.schemes import SchemeSet

__all__ = ["FORMAT", "SUPPORTED_ALGOS", "read_modelopt"]

#: quant_algo -> whether its quantized modules may carry a static input scale (NVFP4) or not (weight-only).
SUPPORTED_ALGOS = {"NVFP4": True, "W4A16_NVFP4": False}
#: The compressed-tensors format that holds these weights.
FORMAT = "nvfp4-pack-quantized"
GROUP_SIZE = 16
_QUANT_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_SCALE_NAMES = ("weight_scale", "weight_scale_2", "input_scale")
_FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")


class _Config:
    """The fields of a ModelOpt quantization config that the reader uses."""

    def __init__(self, algo: str, exclude: List[str], where: str):
        self.algo, self.exclude, self.where = algo, exclude, where

    def excluded(self, module: str) -> Optional[str]:
        """The `ignore` / exclude_modules entry that excludes `module` (exact name or fnmatch wildcard), or None."""
        return next((p for p in self.exclude if p == module or fnmatch.fnmatchcase(module, p)), None)


def _wildcard_to_ct(pattern: str) -> str:
    """A ModelOpt fnmatch wildcard as a compressed-tensors ignore entry: plain names as they are, wildcards as a
    `re:` pattern matched from the start with re.match ("*" -> ".*", "?" -> ".", [seq] / [!seq] kept as a class)."""
    if not any(c in pattern for c in "*?["):
        return pattern
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        j = pattern.find("]", i + 2) if c == "[" else -1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and j > 0:
            body = pattern[i + 1:j]
            out.append("[" + ("^" + re.escape(body[1:]) if body.startswith("!") else re.escape(body)) + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "re:" + "".join(out) + "$"


def _parse_config(root: Path, cfg: Mapping[str, Any]) -> _Config:
    cfg_path = root / "config.json"
    qc = cfg.get("quantization_config")
    where = f"{cfg_path}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: expected an object, found {type(qc).__name__}")
    if "quant_algo" in qc:  # ModelOpt >= 0.29: compressed-tensors-like keys in config.json
        detail, exclude_key, kv = qc, "ignore", qc.get("kv_cache_scheme") or qc.get("kv_cache_quant_algo")
        if "ignore" not in qc and "exclude_modules" in qc:
            exclude_key = "exclude_modules"
    else:  # the hf_quant_config.json layout, nested in config.json or beside it
        detail = qc.get("quantization")
        if detail is None and os.path.lexists(root / "hf_quant_config.json"):
            where = str(root / "hf_quant_config.json")
            hq = read_json(root / "hf_quant_config.json", root)
            detail = hq.get("quantization") if isinstance(hq, dict) else None
        if not isinstance(detail, dict):
            raise CheckpointError(f"{where}: expected quant_algo (or a 'quantization' object with quant_algo, as "
                                  f"hf_quant_config.json holds), found neither")
        where = f"{where}: quantization"
        exclude_key, kv = "exclude_modules", detail.get("kv_cache_quant_algo")
    algo = detail.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in SUPPORTED_ALGOS:
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not read by qformats; supported ModelOpt algorithms: "
                              f"{', '.join(SUPPORTED_ALGOS)} (FP8, FP8_PB_WO, NVFP4_AWQ, W4A8_AWQ, MXFP8, "
                              f"MIXED_PRECISION are not)")
    act = detail.get("activation_scheme")
    if act not in (None, "static"):
        raise CheckpointError(f"{where}: activation_scheme {act!r}: only static input scales (input_scale) are "
                              f"supported")
    sizes = [("group_size", detail.get("group_size"))]
    groups = detail.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CheckpointError(f"{where}: config_groups: expected an object, found {type(groups).__name__}")
    for gname, g in groups.items():
        for role in ("weights", "input_activations"):
            args = g.get(role) if isinstance(g, dict) else None
            if args is None:
                continue
            if not isinstance(args, dict) or args.get("num_bits", 4) != 4 or args.get("type", "float") != "float":
                raise CheckpointError(f"{where}: config_groups.{gname}.{role}: expected 4-bit float (NVFP4) args, "
                                      f"found {args!r}")
            sizes.append((f"config_groups.{gname}.{role}.group_size", args.get("group_size")))
    for key, gs in sizes:
        if gs is not None and (isinstance(gs, bool) or gs != GROUP_SIZE):
            raise CheckpointError(f"{where}: {key} {gs!r}: NVFP4 scales groups of {GROUP_SIZE} inputs; other group "
                                  f"sizes are not supported")
    if kv not in (None, {}, ""):
        raise CheckpointError(f"{where}: KV-cache quantization ({kv!r}) is not supported for ModelOpt checkpoints; "
                              f"supported: weights and input activations only")
    exclude = detail.get(exclude_key, [])
    if exclude is None:
        exclude = []
    if not (isinstance(exclude, list) and all(isinstance(p, str) for p in exclude)):
        raise CheckpointError(f"{where}: {exclude_key}: expected a list of module names / wildcards, found "
                              f"{exclude!r}")
    return _Config(algo.upper(), exclude, where)


def _one_float(ck: Checkpoint, name: str) -> np.ndarray:
    """A stored one-element float32 scale (any shape), checked finite and positive."""
    info = ck.info(name)
    if info.dtype != "F32" or int(np.prod(info.shape)) != 1:
        raise CheckpointError(f"{ck.file_of(name)}: tensor {name!r}: expected one float32, found {info.dtype} "
                              f"shape {list(info.shape)}")
    a = ck.get(name)
    v = float(a.reshape(-1)[0])
    if not (np.isfinite(v) and v > 0):
        raise CheckpointError(f"{ck.file_of(name)}: tensor {name!r}: expected a finite positive scale, found {v!r}")
    return a


def _weight(ck: Checkpoint, mod: str, t: Dict[str, str], schemes: SchemeSet) -> QArray:
    """The NVFP4 QArray of one quantized module: logical shape [K, N] along axis 0, codes / scales as stored, global
    scale float32(1 / weight_scale_2)."""
    missing = [f"{mod}.{p}" for p in ("weight", "weight_scale", "weight_scale_2") if p not in t]
    first = next(iter(t.values()))
    where = f"{ck.file_of(first)}: module {mod!r}"
    if missing:
        raise CheckpointError(f"{where}: holds NVFP4 tensors but lacks {missing}; a ModelOpt NVFP4 Linear stores "
                              f"weight (uint8), weight_scale (float8_e4m3fn), weight_scale_2 (float32) and "
                              f"input_scale (float32, for NVFP4 activations)")
    w, s = ck.info(t["weight"]), ck.info(t["weight_scale"])
    if w.dtype != "U8" or len(w.shape) != 2:
        raise CheckpointError(f"{ck.file_of(t['weight'])}: tensor {t['weight']!r}: expected uint8 [out, in/2] (two "
                              f"E2M1 codes per byte) beside weight_scale_2, found {w.dtype} shape {list(w.shape)}; "
                              f"supported: ModelOpt NVFP4")
    n, k = w.shape[0], 2 * w.shape[1]
    if k % GROUP_SIZE:
        raise CheckpointError(f"{where}: in_features {k} is not a multiple of the NVFP4 group size {GROUP_SIZE}")
    if s.dtype != "F8_E4M3" or tuple(s.shape) != (n, k // GROUP_SIZE):
        raise CheckpointError(f"{ck.file_of(t['weight_scale'])}: tensor {t['weight_scale']!r}: expected "
                              f"float8_e4m3fn [{n}, {k // GROUP_SIZE}] (one scale per {GROUP_SIZE} inputs of weight "
                              f"[{n}, {k}]), found {s.dtype} shape {list(s.shape)}")
    s2 = _one_float(ck, t["weight_scale_2"])
    gs = (np.float32(1) / s2.astype(np.float32)).reshape(1).astype(np.float32)
    q = QArray(ck.get(t["weight"]), ck.get(t["weight_scale"]), None, gs, scheme=schemes.weights, shape=(k, n),
               dtype=jnp.bfloat16, axis=0)
    try:
        q.check()
    except QFormatsError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return q


def read_modelopt(path: "str | os.PathLike") -> CompressedModel:
    """Read a ModelOpt NVFP4 checkpoint directory into a `CompressedModel` (see the module docstring): per quantized
    module {"weight": NVFP4 QArray [in, out], "input_global_scale"?: float32(1 / input_scale), "bias"?}, every other
    tensor by its local name; `quant` the equivalent compressed-tensors QuantConfig.

    Raises CheckpointError naming the file, module or tensor for anything not covered (module docstring)."""
    path = Path(path)
    root = path if path.is_dir() else path.parent
    cfg = read_json(root / "config.json", root)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{root / 'config.json'}: expected a JSON object, found {type(cfg).__name__}")
    mc = _parse_config(root, cfg)
    with_acts = SUPPORTED_ALGOS[mc.algo]
    w4a4, w4a16 = presets["NVFP4"], presets["NVFP4A16"]
    with open_checkpoint(path) as ck:
        mods: Dict[str, Dict[str, str]] = {}
        for name in ck.keys():
            m, local = split_name(name)
            mods.setdefault(m, {})[local] = name
        modules: Dict[str, Dict[str, Any]] = {}
        formats: Dict[str, str] = {}
        groups: Dict[str, str] = {}
        stored: Dict[str, int] = {}
        targets: Tuple[List[str], List[str]] = ([], [])
        for mod in sorted(mods):
            t = mods[mod]
            stored[mod] = sum(ck.info(n).nbytes for n in t.values())
            kv = [n for local, n in t.items() if local in ("k_scale", "v_scale")]
            if kv:
                raise CheckpointError(f"{ck.file_of(kv[0])}: tensor {kv[0]!r}: KV-cache scales are not supported for "
                                      f"ModelOpt checkpoints; supported: NVFP4 weights and input activations")
            quantized = any(p in t for p in _SCALE_NAMES) or (
                "weight" in t and ck.info(t["weight"]).dtype not in _FLOAT_DTYPES)
            if not quantized:
                modules[mod] = {local: ck.get(n) for local, n in t.items()}
                continue
            where = f"{ck.file_of(next(iter(t.values())))}: module {mod!r}"
            ex = mc.excluded(mod)
            if ex is not None:
                raise CheckpointError(f"{where}: holds quantized tensors but {mc.where} excludes it ({ex!r})")
            extra = [f"{mod}.{p}" for p in t if p not in _QUANT_PARTS + ("bias",)]
            if extra:
                raise CheckpointError(f"{where}: found {extra}, which ModelOpt NVFP4 does not store (pre_quant_scale: "
                                      f"NVFP4_AWQ); supported: {[f'{mod}.{p}' for p in _QUANT_PARTS]} and bias")
            acts = "input_scale" in t
            if acts and not with_acts:
                raise CheckpointError(f"{ck.file_of(t['input_scale'])}: tensor {t['input_scale']!r}: quant_algo "
                                      f"{mc.algo} is weight-only, expected no input_scale")
            schemes = w4a4 if acts else w4a16
            entry: Dict[str, Any] = {"weight": _weight(ck, mod, t, schemes)}
            if acts:
                isc = _one_float(ck, t["input_scale"])
                entry["input_global_scale"] = (np.float32(1) / isc.astype(np.float32)).astype(np.float32)
            if "bias" in t:
                entry["bias"] = ck.get(t["bias"])
            modules[mod] = entry
            formats[mod] = FORMAT
            targets[0 if acts else 1].append(mod)
    specs = [(tg, ss) for tg, ss in zip(targets, (w4a4, w4a16)) if tg]
    if not specs:
        raise CheckpointError(f"{path}: config.json declares ModelOpt {mc.algo} but no module holds NVFP4 tensors "
                              f"(weight uint8, weight_scale, weight_scale_2)")
    raw = serialize_quantization_config(specs, [_wildcard_to_ct(p) for p in mc.exclude])
    quant = parse_quantization_config(raw, f"{root / 'config.json'} (as compressed-tensors)")
    for gname, (tg, _) in zip(raw["config_groups"], specs):
        for mod in tg:
            groups[mod] = gname
    return CompressedModel(path, cfg, quant, modules, formats, groups, stored)
