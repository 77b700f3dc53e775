"""HF fine-grained FP8 checkpoints (`quant_method: "fp8"`, transformers' FineGrainedFP8) read as FP8-block QArrays.

The layout (DeepSeek-V3/R1, Qwen3-*-FP8, MiniMax): each quantized Linear stores `weight` float8_e4m3fn [out, in]
and `weight_scale_inv` float32 [ceil(out / bm), ceil(in / bn)], (bm, bn) = quantization_config.weight_block_size
(default [128, 128]); the value is

    W[o, i] = float32(weight[o, i]) * weight_scale_inv[o // bm, i // bn]

(transformers multiplies by the stored "inverse" scale: it is the scale in compressed-tensors' sense, x = q * s).
Blocks at the right / bottom edge are partial (the scale grid is rounded up), as transformers allocates
`FP8Linear.weight_scale_inv` and as its kernels and its backward-pass `_dequantize_fp8_weight` read it. That is
exactly qformats' `block` strategy with block (bm, bn) (`qformats.presets["FP8_BLOCK"]`'s weights with the
checkpoint's block), so the codes and the scale become the QArray's leaves as stored, without a detour through
float: codes = weight viewed as uint8 [out, in], scale = weight_scale_inv, logical shape [in, out] (the Flax
kernel) along axis 0, dtype float32 (the scale's dtype) -- what `read_compressed` gives for a compressed-tensors
float-quantized block checkpoint of the same values. `dequantize(q, float32).T` is the float32 product above,
which is what transformers' `Fp8Dequantize` (`FineGrainedFP8Config(dequantize=True)`) computes before casting to
the model's dtype wherever its block inference (block = dim // grid) agrees with the allocation: a dimension
that is at most one block or a whole number of blocks. (For a longer dimension with a partial last block,
transformers' dequantize=True path re-derives the block as dim // grid -- e.g. 100 rows for 200 rows and a
2-row grid -- or raises when that does not divide; this reader keeps the ceil-division blocks the checkpoint was
written with.)

Activations (`activation_scheme: "dynamic"`): transformers quantizes them per token in groups of bn along the
input (e4m3, scale = amax / 448), which is compressed-tensors' dynamic per-token-group FP8 (FP8_BLOCK's
input_activations with group size bn). A module whose in_features is not a multiple of bn cannot take that
scheme (qformats' group strategy needs whole groups; the torch kernel quantizes the partial last group on its
own), so such modules go to a second, weight-only config group: they run with float activations.

Which modules are quantized: those holding `weight_scale_inv`; their `weight` must be float8_e4m3fn. Modules
listed in `modules_to_not_convert` (transformers' rule: a prefix up to a module boundary, a regex with that
boundary, or a suffix) must hold no weight_scale_inv. `quant` is the compressed-tensors QuantConfig of the same
values (targets: the module names; ignore: the stored 2-D dense weights' modules that modules_to_not_convert
names).

Not read (a CheckpointError naming the file, tensor and what is supported): `activation_scheme: "static"`
(`activation_scale`), `scale_fmt: "ue8m0"`, `expert_dtype: "fp4"`, `modules_to_convert` (FP8 embeddings), `fmt`
other than "e4m3", `weight_block_size` null (per-tensor) or not two positive integers, fused-expert 3-D tensors,
a scale that is not float32 or not [ceil(out / bm), ceil(in / bn)], a weight that is not 2-D float8_e4m3fn.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from converters.formats.safe_files import read_quantization_config
from qformats.errors import CheckpointError, QFormatsError
from qformats.presets import presets
from qformats.qarray import QArray
from qformats.schemes import SchemeSet

__all__ = ["read_hf_fp8", "fp8_schemes", "not_converted"]

def fp8_schemes(block: Tuple[int, int]) -> Tuple[SchemeSet, SchemeSet]:
    """(with activations, weight only): FP8_BLOCK's weight scheme with block `block` = (bm, bn), and its dynamic
    per-token-group FP8 input scheme with group size bn; the weight-only set for modules whose in_features bn
    does not divide."""
    base = presets["FP8_BLOCK"]
    w = dataclasses.replace(base.weights, block=tuple(block))
    a = dataclasses.replace(base.input_activations, group_size=int(block[1]))
    return (SchemeSet("FP8_BLOCK", weights=w, input_activations=a), SchemeSet("FP8_BLOCK:w", weights=w))


def not_converted(module: str, patterns: List[str]) -> bool:
    """Whether transformers leaves `module` unconverted for these modules_to_not_convert patterns
    (`quantizers_utils.should_convert_module`): a pattern matching from the start up to a module boundary (as a
    regex), or a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in patterns:
        if module.endswith(key):
            return True
        try:
            if re.match(rf"(?:{key}){boundary}", module):
                return True
        except re.error:
            continue
    return False


def _options(qc: Dict[str, Any], where: str) -> Tuple[Tuple[int, int], List[str]]:
    """(block (bm, bn), modules_to_not_convert) of an fp8 quantization_config; CheckpointError for any option
    this reader does not read."""
    at = f"{where}: quantization_config"
    if qc.get("quant_method") != "fp8":
        raise CheckpointError(f"{at}: expected quant_method 'fp8', found {qc.get('quant_method')!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":
        raise CheckpointError(f"{at}: activation_scheme {scheme!r} is not supported; supported: 'dynamic' (static "
                              f"per-tensor activation_scale is not read)")
    if qc.get("fmt", "e4m3") != "e4m3":  # DeepSeek-V3's config records the element format this way
        raise CheckpointError(f"{at}: fmt {qc.get('fmt')!r} is not supported; supported: 'e4m3' (float8_e4m3fn)")
    if qc.get("scale_fmt", "float") != "float":
        raise CheckpointError(f"{at}: scale_fmt {qc.get('scale_fmt')!r} is not supported; supported: 'float' "
                              f"(float32 weight_scale_inv)")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise CheckpointError(f"{at}: expert_dtype {qc.get('expert_dtype')!r} is not supported; supported: 'fp8'")
    if qc.get("modules_to_convert"):
        raise CheckpointError(f"{at}: modules_to_convert {qc.get('modules_to_convert')!r} (FP8 embeddings) is not "
                              f"supported; supported: none (FP8 Linear weights only)")
    block = qc.get("weight_block_size", [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{at}: weight_block_size {block!r} is not supported; supported: two positive integers "
                              f"[rows, cols] (per-tensor scales, weight_block_size null, are not read)")
    skip = qc.get("modules_to_not_convert")
    if skip is None:
        skip = qc.get("ignored_layers")
    skip = [] if skip is None else skip
    if not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise CheckpointError(f"{at}: modules_to_not_convert: expected a list of module names, found {skip!r}")
    return (int(block[0]), int(block[1])), list(skip)


def read_hf_fp8(path: "str | os.PathLike"):
    """Read an HF fine-grained FP8 checkpoint directory into a `CompressedModel` (module docstring): every module
    holding `weight_scale_inv` gets {"weight": QArray [in, out] of the FP8 block scheme, codes and scale as
    stored, "bias"?, ...}; other tensors stay dense under their local names. W = code * weight_scale_inv per
    (bm, bn) block, partial edge blocks included.

    Raises CheckpointError naming the file, module / tensor and what is supported, before any tensor data is
    read (the headers are checked first)."""
    from converters.formats.compressed_tensors.config import parse_quantization_config, serialize_quantization_config
    from converters.formats.compressed_tensors.read import CompressedModel, split_name
    from converters.formats.safetensors_io import open_checkpoint

    path = Path(path)
    cfg, qc_raw, where = read_quantization_config(path)
    block, skip = _options(qc_raw, where)
    bm, bn = block
    ck = open_checkpoint(path)
    try:
        mods: Dict[str, Dict[str, str]] = {}
        for name in ck.keys():
            m, local = split_name(name)
            mods.setdefault(m, {})[local] = name
        with_acts, weight_only, ignore = [], [], []
        for m, t in mods.items():
            at = f"{ck.file_of(next(iter(t.values())))}: module {m!r}"
            fp8 = [loc for loc, n in t.items() if ck.info(n).dtype.startswith("F8_")]
            if "activation_scale" in t:
                raise CheckpointError(f"{at}: tensor {t['activation_scale']!r}: static activation scales are not "
                                      f"supported; supported: dynamic activations (no activation_scale)")
            if "weight_scale_inv" not in t:
                if fp8 or any(loc.endswith("_scale_inv") for loc in t):
                    bad = fp8 or [loc for loc in t if loc.endswith("_scale_inv")]
                    raise CheckpointError(f"{at}: tensor {t[bad[0]]!r} ({ck.info(t[bad[0]]).dtype}) without a "
                                          f"weight_scale_inv: only Linear weights with per-block weight_scale_inv "
                                          f"are supported (fused-expert and FP8 embedding tensors are not)")
                w = t.get("weight")
                if w is not None and len(ck.info(w).shape) == 2 and not_converted(m, skip):
                    ignore.append(m)
                continue
            if not_converted(m, skip):
                raise CheckpointError(f"{at}: modules_to_not_convert names this module, but it holds "
                                      f"weight_scale_inv; expected a dense module")
            if "weight" not in t:
                raise CheckpointError(f"{at}: tensor {t['weight_scale_inv']!r} without a 'weight' tensor")
            wi, si = ck.info(t["weight"]), ck.info(t["weight_scale_inv"])
            if wi.dtype != "F8_E4M3" or len(wi.shape) != 2:
                raise CheckpointError(f"{at}: tensor {t['weight']!r}: expected a 2-D F8_E4M3 (float8_e4m3fn) "
                                      f"[out, in] weight, found {wi.dtype} {list(wi.shape)}")
            n, k = wi.shape
            want = (-(-n // bm), -(-k // bn))
            if si.dtype != "F32" or tuple(si.shape) != want:
                raise CheckpointError(f"{at}: tensor {t['weight_scale_inv']!r}: expected F32 {list(want)} "
                                      f"([ceil({n} / {bm}), ceil({k} / {bn})], weight_block_size {list(block)}), "
                                      f"found {si.dtype} {list(si.shape)}")
            extra = [loc for loc in fp8 if loc != "weight"]
            if extra:
                raise CheckpointError(f"{at}: tensor {t[extra[0]]!r}: FP8 tensors other than 'weight' are not "
                                      f"supported")
            (with_acts if k % bn == 0 else weight_only).append(m)
        acts, wonly = fp8_schemes(block)
        groups = [(sorted(g), ss) for g, ss in ((with_acts, acts), (weight_only, wonly)) if g]
        if not groups:
            raise CheckpointError(f"{ck.path}: quant_method 'fp8' but no module holds a weight_scale_inv tensor")
        quant = parse_quantization_config(serialize_quantization_config(groups, sorted(ignore)), where)
        group_of = {m: g for g in quant.groups for m in g.targets}
        modules, formats, group_names, stored = {}, {}, {}, {}
        for m in sorted(mods):
            t = mods[m]
            stored[m] = sum(ck.info(n).nbytes for n in t.values())
            g = group_of.get(m)
            if g is None:
                modules[m] = {loc: ck.get(n) for loc, n in t.items()}
                continue
            n, k = ck.info(t["weight"]).shape
            codes = ck.get(t["weight"]).view(np.uint8)
            scale = ck.get(t["weight_scale_inv"])
            q = QArray(codes, scale, None, None, scheme=g.weights, shape=(k, n), dtype=np.dtype(np.float32), axis=0)
            try:
                q.check()
            except QFormatsError as e:
                raise CheckpointError(f"{ck.file_of(t['weight'])}: module {m!r}: {e}") from None
            tensors = {loc: ck.get(nm) for loc, nm in t.items() if loc not in ("weight", "weight_scale_inv")}
            tensors["weight"] = q
            modules[m], formats[m], group_names[m] = tensors, g.format, g.name
        return CompressedModel(path, cfg, quant, modules, formats, group_names, stored)
    finally:
        ck.close()
