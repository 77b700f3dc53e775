"""gpt-oss MXFP4 checkpoints (`quant_method: "mxfp4"`, transformers' Mxfp4Config) read as per-expert MXFP4 QArrays.

The layout (transformers 5 `integrations/mxfp4.py`, the reference): under each MoE block's `<P>.experts` module,
the fused expert projections are stored as

    gate_up_proj_blocks  U8 [E, 2·inter, hidden/32, 16]   gate_up_proj_scales  U8 [E, 2·inter, hidden/32]
    down_proj_blocks     U8 [E, hidden, inter/32, 16]     down_proj_scales     U8 [E, hidden, inter/32]

next to the dense `gate_up_proj_bias` [E, 2·inter] and `down_proj_bias` [E, hidden]. Row r of `*_blocks[e]` is
output feature r (torch's [out, in] orientation); each row holds its input features in groups of 32, a group in
16 bytes with two E2M1 codes per byte (element 2i in the low nibble, 2i+1 in the high nibble), one E8M0 scale byte
s per group. transformers' dequantization (`convert_moe_packed_tensors`, `Mxfp4Config(dequantize=True)`) is

    W[e, r, 32·g + j] = FP4_VALUES[code] · 2^(s[e, r, g] − 127)          (torch.ldexp, in the model's dtype)

then transposed to the fused gpt-oss parameters gate_up_proj [E, hidden, 2·inter] and down_proj [E, inter, hidden].
That is OCP MXFP4 exactly: compressed-tensors' `mxfp4-pack-quantized` (weight_packed [N, K/2], E8M0 weight_scale
[N, K/32]) and qformats' MXFP4A16 weights (`presets["MXFP4A16"]`). So the codes and scales become QArray leaves as
stored, without a detour through float.

Experts are given per expert, by llm-compressor's linearized module names (`converters.formats.moe_layout`), the
view `convert`, `inspect` and `dequantize` take: for expert e,

    <P>.experts.{e}.gate_proj: codes = gate_up_proj_blocks[e, 0::2] (gate: even rows), bias gate_up_proj_bias[e, 0::2]
    <P>.experts.{e}.up_proj:   codes = gate_up_proj_blocks[e, 1::2] (up: odd rows),    bias gate_up_proj_bias[e, 1::2]
    <P>.experts.{e}.down_proj: codes = down_proj_blocks[e],                            bias down_proj_bias[e]

each {"weight": QArray of the Flax kernel's shape [in, out] along axis 0, dtype bfloat16, "bias": ...} -- what
`read_compressed` gives for the compressed-tensors checkpoint llm-compressor 0.14 writes for gpt-oss. Every other
tensor (attention, router, embeddings, norms, sinks: `modules_to_not_convert`) stays dense under its own name.
`converters.formats.moe_layout.fused_gpt_oss_experts` puts dequantized experts back into the fused gpt-oss layout, as
transformers' dequantize=True loads it (`qformats dequantize` writes that). `load_causal_lm` puts the packed experts
back into the model's stacked MXFP4 QExperts (`qformats.models.decoder.params.fuse_linearized_experts`: rows
re-interleaved, so each stack's codes / scales are gate_up_proj_blocks / _scales and down_proj_blocks / _scales
byte for byte).

Not read (a CheckpointError naming the file, tensor and what is supported, from the headers, before any tensor
data is read, except the scale check): a model_type other than "gpt_oss"; quantization_config keys other than
quant_method / modules_to_not_convert / dequantize; `*_blocks` / `*_scales` outside a `<P>.experts` module or of
another projection; a blocks tensor without its scales (or the reverse); shapes or dtypes that differ from the
layout above or from each other (hidden, inter, E); a missing bias; E8M0 scale 255 (NaN in OCP MX, which
transformers' ldexp turns into ±inf / NaN instead); and a group whose scale makes one of its values a float32
subnormal (scale byte 0 with any nonzero code, whose scale 2^-127 is one, or 1 with |FP4| = 0.5: below 2^-126,
which transformers keeps and XLA:CPU flushes to zero, so the values could not be read exactly; refused only where
the values are computed: `qformats convert` copies such groups' bytes as they are).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from qformats.errors import CheckpointError, QFormatsError
from qformats.presets import presets
from qformats.qarray import QArray
from qformats.schemes import SchemeSet

__all__ = ["mxfp4_scheme", "read_hf_mxfp4"]

_PROJS = ("gate_up_proj", "down_proj")
#: The config group's target: every per-expert projection (compressed-tensors' `re:` match from the start).
EXPERT_TARGET = r"re:.*\.experts\.\d+\.(gate|up|down)_proj$"
_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")


def mxfp4_scheme() -> SchemeSet:
    """The compressed-tensors scheme set of gpt-oss's MXFP4 experts: MXFP4 weights (E8M0 per 32 inputs), bf16
    activations (`MXFP4A16`)."""
    return presets["MXFP4A16"]


def _config(path: Path) -> Tuple[Dict[str, Any], Dict[str, Any], str]:
    from converters.formats.safe_files import read_quantization_config

    cfg, qc, where = read_quantization_config(path)
    at = f"{where}: quantization_config"
    if qc.get("quant_method") != "mxfp4":
        raise CheckpointError(f"{at}: expected quant_method 'mxfp4', found {qc.get('quant_method')!r}")
    if cfg.get("model_type") != "gpt_oss":
        raise CheckpointError(f"{where}: model_type {cfg.get('model_type')!r} with quant_method 'mxfp4' is not "
                              f"supported; supported: 'gpt_oss' (transformers' Mxfp4GptOssExperts layout)")
    extra = sorted(k for k in qc if k not in _KEYS)
    if extra:
        raise CheckpointError(f"{at}: keys {extra} are not supported; supported: {list(_KEYS)}")
    return cfg, qc, where


def _need(ck, t: Dict[str, str], local: str, at: str, dtype: str, shape: Tuple[int, ...]):
    if local not in t:
        raise CheckpointError(f"{at}: expected a tensor {local!r} next to {sorted(t)[0]!r}, found none")
    info = ck.info(t[local])
    if info.dtype != dtype or tuple(info.shape) != tuple(shape):
        raise CheckpointError(f"{ck.file_of(t[local])}: tensor {t[local]!r}: expected {dtype} {list(shape)}, "
                              f"found {info.dtype} {list(info.shape)}")


def _layout(ck, mod: str, t: Dict[str, str]) -> Tuple[int, int, int]:
    """(E, hidden, inter) of one experts module, every tensor's dtype and shape checked."""
    at = f"{ck.file_of(next(iter(t.values())))}: module {mod!r}"
    for p in _PROJS:
        if (f"{p}_blocks" in t) != (f"{p}_scales" in t):
            have, miss = (f"{p}_blocks", f"{p}_scales") if f"{p}_blocks" in t else (f"{p}_scales", f"{p}_blocks")
            raise CheckpointError(f"{at}: tensor {t[have]!r} without its {miss} tensor; expected both {p}_blocks "
                                  f"and {p}_scales")
        if f"{p}_blocks" not in t:
            raise CheckpointError(f"{at}: expected MXFP4 {p}_blocks / {p}_scales, found only {sorted(t)}")
    gi = ck.info(t["gate_up_proj_blocks"])
    if gi.dtype != "U8" or len(gi.shape) != 4 or gi.shape[3] != 16 or gi.shape[1] % 2:
        raise CheckpointError(f"{ck.file_of(t['gate_up_proj_blocks'])}: tensor {t['gate_up_proj_blocks']!r}: "
                              f"expected U8 [E, 2*inter, hidden/32, 16], found {gi.dtype} {list(gi.shape)}")
    e, two_i, gh, _ = gi.shape
    hidden, inter = gh * 32, two_i // 2
    if inter % 32:
        raise CheckpointError(f"{at}: inter = {inter} (gate_up_proj_blocks {list(gi.shape)}) is not a multiple of "
                              f"32; expected down_proj_blocks in whole groups of 32")
    _need(ck, t, "gate_up_proj_scales", at, "U8", (e, two_i, gh))
    _need(ck, t, "down_proj_blocks", at, "U8", (e, hidden, inter // 32, 16))
    _need(ck, t, "down_proj_scales", at, "U8", (e, hidden, inter // 32))
    bdt = ck.info(t["gate_up_proj_bias"]).dtype if "gate_up_proj_bias" in t else "BF16"
    if bdt not in ("BF16", "F16", "F32"):
        raise CheckpointError(f"{at}: tensor {t['gate_up_proj_bias']!r}: expected a float bias, found {bdt}")
    _need(ck, t, "gate_up_proj_bias", at, bdt, (e, two_i))
    _need(ck, t, "down_proj_bias", at, bdt, (e, hidden))
    other = sorted(set(t) - {f"{p}_{s}" for p in _PROJS for s in ("blocks", "scales", "bias")})
    if other:
        raise CheckpointError(f"{at}: tensors {[t[o] for o in other]} are not part of gpt-oss's MXFP4 experts "
                              f"(expected {{gate_up,down}}_proj_{{blocks,scales,bias}})")
    return e, hidden, inter


def _scales(ck, name: str, blocks: np.ndarray, computed: bool = True) -> np.ndarray:
    """The scales of tensor `name`, checked against the values qformats decodes exactly (module docstring):
    no 255 (NaN), and, when the values are to be `computed` (run or dequantized by XLA), no group whose scale or
    value is a float32 subnormal, which XLA:CPU flushes to zero while transformers keeps it: s = 0 (2^-127
    itself) with a nonzero code, s = 1 with |FP4| = 0.5."""
    s = ck.get(name)
    bad = np.argwhere(s == 255)
    if bad.size:
        raise CheckpointError(f"{ck.file_of(name)}: tensor {name!r}: E8M0 scale 255 at index {bad[0].tolist()} "
                              f"({len(bad)} in all): NaN in OCP MX (transformers' ldexp makes it inf); not supported")
    if not computed:
        return s
    low = np.argwhere(s <= 1)
    for ix in low:
        b = blocks[tuple(ix)]
        mags = np.concatenate([b & 0x7, (b >> 4) & 0x7])  # E2M1 magnitude codes: 1, 2, 3 = 0.5, 1, 1.5
        if (mags > 0).any() and (s[tuple(ix)] == 0 or mags[mags > 0].min() < 2):
            raise CheckpointError(
                f"{ck.file_of(name)}: tensor {name!r}: E8M0 scale {int(s[tuple(ix)])} at index {ix.tolist()} gives "
                f"float32 subnormal weights (|value| < 2^-126), which XLA:CPU flushes to zero while transformers "
                f"keeps them; not supported (scales >= 2, or those codes, are)")
    return s


def read_hf_mxfp4(path: "str | os.PathLike", *, computed: bool = True):
    """Read a gpt-oss MXFP4 checkpoint directory into a `CompressedModel` (module docstring): per expert e of each
    `<P>.experts`, modules `<P>.experts.{e}.{gate,up,down}_proj` = {"weight": MXFP4 QArray [in, out] with codes and
    E8M0 scales as stored, "bias": ...}; other tensors dense under their local names. W = FP4(code) · 2^(s − 127).
    `computed=False` (the bytes are only copied, e.g. into a compressed-tensors checkpoint, never decoded by XLA):
    groups whose values are float32 subnormals are read too (compressed-tensors holds them exactly).

    Raises CheckpointError naming the file, module / tensor and what is supported (module docstring)."""
    from converters.formats.compressed_tensors.config import parse_quantization_config, serialize_quantization_config
    from converters.formats.compressed_tensors.read import CompressedModel, split_name
    from converters.formats.safetensors_io import open_checkpoint

    path = Path(path)
    cfg, _, where = _config(path)
    ss = mxfp4_scheme()
    ck = open_checkpoint(path)
    try:
        mods: Dict[str, Dict[str, str]] = {}
        for name in ck.keys():
            m, local = split_name(name)
            mods.setdefault(m, {})[local] = name
        experts: Dict[str, Tuple[int, int, int]] = {}
        for m, t in mods.items():
            packed = [loc for loc in t if loc.endswith(("_blocks", "_scales"))]
            if not packed:
                continue
            if not m.endswith(".experts") or any(loc.rsplit("_", 1)[0] not in _PROJS for loc in packed):
                raise CheckpointError(f"{ck.file_of(t[packed[0]])}: tensor {t[packed[0]]!r}: MXFP4 blocks / scales "
                                      f"are supported only as gpt-oss's <block>.experts.{{gate_up,down}}_proj_"
                                      f"{{blocks,scales}}")
            experts[m] = _layout(ck, m, t)
        if not experts:
            raise CheckpointError(f"{ck.path}: quant_method 'mxfp4' but no tensor holds MXFP4 *_blocks / *_scales")
        targets: List[str] = []
        modules: Dict[str, Dict[str, Any]] = {}
        stored: Dict[str, int] = {}
        names: Dict[str, str] = {}  # per-expert module -> its stored tensor of blocks (for error messages)
        for m in sorted(mods):
            t = mods[m]
            if m not in experts:
                modules[m] = {loc: ck.get(n) for loc, n in t.items()}
                stored[m] = sum(ck.info(n).nbytes for n in t.values())
                continue
            e_n, hidden, inter = experts[m]
            gub, dnb = ck.get(t["gate_up_proj_blocks"]), ck.get(t["down_proj_blocks"])
            gus = _scales(ck, t["gate_up_proj_scales"], gub, computed)
            dns = _scales(ck, t["down_proj_scales"], dnb, computed)
            gbias, dbias = ck.get(t["gate_up_proj_bias"]), ck.get(t["down_proj_bias"])
            for e in range(e_n):
                parts = {"gate_proj": (gub[e, 0::2], gus[e, 0::2], gbias[e, 0::2], hidden, inter, "gate_up_proj"),
                         "up_proj": (gub[e, 1::2], gus[e, 1::2], gbias[e, 1::2], hidden, inter, "gate_up_proj"),
                         "down_proj": (dnb[e], dns[e], dbias[e], inter, hidden, "down_proj")}
                for proj, (blocks, scales, bias, k, n, src) in parts.items():
                    name = f"{m}.{e}.{proj}"
                    codes = blocks.reshape(n, k // 2)  # a view of the memory map where the rows allow it
                    q = QArray(codes, scales, None, None, scheme=ss.weights, shape=(k, n),
                               dtype=_bf16(), axis=0)
                    try:
                        q.check()
                    except QFormatsError as err:
                        raise CheckpointError(f"{ck.file_of(t[src + '_blocks'])}: module {name!r}: {err}") from None
                    modules[name] = {"weight": q, "bias": bias}
                    stored[name] = codes.nbytes + scales.nbytes + bias.nbytes
                    names[name] = t[src + "_blocks"]
                    targets.append(name)
        ignore = sorted(m for m, t in modules.items() if m not in names and "weight" in t
                        and getattr(t["weight"], "ndim", 0) == 2 and "embed" not in m)
        # one regex target for every expert (what llm-compressor users write; thousands of names otherwise)
        quant = parse_quantization_config(serialize_quantization_config([([EXPERT_TARGET], ss)], ignore), where)
        g = quant.groups[0]
        return CompressedModel(path, cfg, quant, modules, {m: g.format for m in targets},
                               {m: g.name for m in targets}, stored)
    finally:
        ck.close()


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
