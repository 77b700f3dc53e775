"""torchao's safetensors checkpoints (`quant_method: "torchao"`, `torchao.prototype.safetensors`) read as QArrays.

torchao saves a quantized tensor subclass as its plain data tensors plus a JSON record in the file's
`__metadata__` (`flatten_tensor_state_dict`): for a weight `m.weight`, the tensors `m._weight_qdata`,
`m._weight_scale` (and `m._weight_zero_point`), and `__metadata__["m.weight"] = {"_type": ..., "_data":
{attributes}, "_tensor_data_names": [...]}`; `__metadata__["tensor_names"]` lists every tensor of the file. Plain
tensors keep their names (`{"_type": "Tensor"}`). Read here, without torch, for the weight-only types torchao
makes on a CPU, each with its own dequantization (`Tensor.dequantize()`) reproduced bit for bit:

- `Float8Tensor` (Float8WeightOnlyConfig): qdata float8_e4m3fn [N, K], scale float32 shaped by `block_size`
  (bm, bn): [N, 1] per row ((1, K)), [N, K / g] per group ((1, g)), one value per tensor ((N, K)), or 2-D blocks
  [N / bm, K / bn]. torchao: w = float32(qdata) * scale, cast to the model dtype -- the QArray of the fp8_e4m3fn
  channel / group / tensor / block scheme with the float32 scale as stored, `dequantize(q, dtype)`.
- `IntxUnpackedToInt8Tensor` (IntxWeightOnlyConfig, int1..int8): qdata int8 [N, K] (one value per byte),
  scale and zero_point int8 [N, K / g] for block_size (1, g) (g = K: per row). torchao (`dequantize_affine`):
  w = (dtype(qdata) - dtype(zero_point)) * scale, each op in the model dtype, which is the scale's dtype -- the
  QArray of the asymmetric intN group (channel) scheme with the scale as stored (codes packed at N bits: the
  file's int8 bytes hold N-bit values), `dequantize`.

Refused with a CheckpointError naming the file, tensor and what is read: any other `_type` (Int4Tensor,
Int4TilePackedTo4dTensor, Int4PlainInt32Tensor: torchao's Int4WeightOnlyConfig needs CUDA / the `mslk` kernels
to make them, none here to test against; Int8Tensor, MXTensor, NVFP4Tensor), activation quantization
(`act_quant_kwargs` / `activation_quantization`: this reader is weight-only), a qdata value outside the target
dtype's range, shapes that do not fit `block_size`, a tensor the metadata lists but the file lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from qformats.errors import CheckpointError, QFormatsError
from qformats.qarray import QArray
from qformats.schemes import QuantScheme, SchemeSet

__all__ = ["READ_TYPES", "read_torchao"]

#: torchao tensor subclasses read (`_type` in the file's metadata).
READ_TYPES = ("Float8Tensor", "IntxUnpackedToInt8Tensor")
_DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}
_SCALE_FORMAT = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _decoded(value: Any) -> Any:
    """A torchao JSON attribute with its {"_type": "torch.dtype", "_data": name} wrappers unwrapped."""
    if isinstance(value, dict) and "_type" in value and "_data" in value:
        return value["_data"]
    return value


def _strategy(block: Any, n: int, k: int, at: str) -> Tuple[str, dict]:
    """QuantScheme strategy keywords for torchao's block_size (bm, bn) over a weight [n, k]."""
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{at}: block_size {block!r}: expected two positive integers [rows, cols]")
    bm, bn = block
    if (bm, bn) == (n, k):
        return "tensor", {}
    if bm == 1 and bn == k:
        return "channel", {}
    if bm == 1:
        if k % bn:
            raise CheckpointError(f"{at}: block_size {block}: expected groups that divide the {k} columns")
        return "group", {"group_size": bn}
    return "block", {"block": (bm, bn)}


def _scheme_shape(strategy: str, kw: dict, n: int, k: int) -> Tuple[int, ...]:
    if strategy == "tensor":
        return (1,)
    if strategy == "channel":
        return (n, 1)
    if strategy == "group":
        return (n, k // kw["group_size"])
    bm, bn = kw["block"]
    return (-(-n // bm), -(-k // bn))


def _weight(ck, meta: dict, module: str, local: str, names: Dict[str, str], at: str) -> Tuple[QArray, List[str]]:
    """The QArray of one torchao weight record; returns it and the tensor names it consumed."""
    import jax.numpy as jnp

    from qformats.packing import pack_numpy

    kind = meta.get("_type")
    data = meta.get("_data") if isinstance(meta.get("_data"), dict) else {}
    if kind not in READ_TYPES:
        raise CheckpointError(f"{at}: torchao tensor type {kind!r} is not read; read: {', '.join(READ_TYPES)} "
                              f"(Int4Tensor and the other int4 layouts need CUDA kernels to be made, so none can be "
                              f"tested here)")
    if data.get("act_quant_kwargs") is not None or data.get("activation_quantization") is not None:
        raise CheckpointError(f"{at}: {kind} with activation quantization is not read; read: weight-only "
                              f"({kind} with act_quant_kwargs / activation_quantization null)")
    dname = _decoded(data.get("dtype"))
    if dname not in _DTYPES:
        raise CheckpointError(f"{at}: dtype {dname!r}: expected one of {', '.join(_DTYPES)}")
    dtype = jnp.dtype(_DTYPES[dname])
    wanted = ["qdata", "scale"] + (["zero_point"] if kind == "IntxUnpackedToInt8Tensor" else [])
    parts = {}
    for part in wanted:
        name = f"{module}._{local}_{part}" if module else f"_{local}_{part}"
        if name not in names:
            raise CheckpointError(f"{at}: expected the tensor {name!r} ({kind}.{part}), found it missing")
        parts[part] = names[name]
    qi, si = ck.info(parts["qdata"]), ck.info(parts["scale"])
    if len(qi.shape) != 2:
        raise CheckpointError(f"{at}: tensor {parts['qdata']!r}: expected a 2-D [out, in] weight, found "
                              f"{list(qi.shape)}")
    n, k = qi.shape
    strategy, kw = _strategy(data.get("block_size"), n, k, at)
    want = _scheme_shape(strategy, kw, n, k)
    if si.dtype not in _SCALE_FORMAT or int(np.prod(si.shape)) != int(np.prod(want)) or \
            (strategy != "tensor" and tuple(si.shape) != want):
        raise CheckpointError(f"{at}: tensor {parts['scale']!r}: expected a float scale of shape {list(want)} for "
                              f"block_size {data.get('block_size')}, found {si.dtype} {list(si.shape)}")
    scale = np.asarray(ck.get(parts["scale"])).reshape(want)
    if kind == "Float8Tensor":
        if qi.dtype != "F8_E4M3" or si.dtype != "F32":
            raise CheckpointError(f"{at}: Float8Tensor: expected F8_E4M3 qdata and an F32 scale, found {qi.dtype} "
                                  f"and {si.dtype}")
        scheme = QuantScheme("fp8_e4m3fn", strategy, scale_format="float32", **kw)
        q = QArray(jnp.asarray(ck.get(parts["qdata"]).view(np.uint8)), jnp.asarray(scale), None, None,
                   scheme=scheme, shape=(k, n), dtype=dtype, axis=0)
    else:
        target = _decoded(data.get("target_dtype"))
        bits = int(target[3:]) if isinstance(target, str) and target.startswith("int") and target[3:].isdigit() else 0
        if not 1 <= bits <= 8:
            raise CheckpointError(f"{at}: target_dtype {target!r}: expected int1 .. int8")
        if strategy not in ("channel", "group"):
            raise CheckpointError(f"{at}: block_size {data.get('block_size')}: expected per-row or per-group "
                                  f"(1, g) blocks")
        zi = ck.info(parts["zero_point"])
        if qi.dtype != "I8" or zi.dtype != "I8" or tuple(zi.shape) != want:
            raise CheckpointError(f"{at}: expected I8 qdata and an I8 zero_point of shape {list(want)}, found "
                                  f"{qi.dtype} and {zi.dtype} {list(zi.shape)}")
        if _SCALE_FORMAT[si.dtype] != dtype.name:
            raise CheckpointError(f"{at}: scale {si.dtype}: expected the model dtype {dtype.name} (torchao computes "
                                  f"in the scale's dtype)")
        qdata = np.asarray(ck.get(parts["qdata"]))
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if qdata.size and (qdata.min() < lo or qdata.max() > hi):
            raise CheckpointError(f"{at}: tensor {parts['qdata']!r}: {target} values expected in [{lo}, {hi}], "
                                  f"found [{qdata.min()}, {qdata.max()}]")
        scheme = QuantScheme(f"int{bits}", strategy, symmetric=False, scale_format=_SCALE_FORMAT[si.dtype], **kw)
        codes = qdata if bits == 8 else pack_numpy((qdata.astype(np.int16) - lo).astype(np.uint8), bits)
        zp = np.asarray(ck.get(parts["zero_point"])).reshape(want)
        q = QArray(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(zp), None, scheme=scheme, shape=(k, n),
                   dtype=dtype, axis=0)
    try:
        q.check()
    except QFormatsError as e:
        raise CheckpointError(f"{at}: {e}") from None
    return q, list(parts.values())


def read_torchao(path: "str | os.PathLike"):
    """Read a torchao safetensors checkpoint directory (config.json quant_method "torchao", tensors and metadata
    as `torchao.prototype.safetensors.flatten_tensor_state_dict` writes them) into a `CompressedModel`: each
    quantized weight a QArray [in, out] (module docstring) whose `dequantize` equals torchao's
    `Tensor.dequantize()` bit for bit, other tensors dense under their names. `quant`: the compressed-tensors
    QuantConfig of the same schemes (one group per scheme).

    Raises CheckpointError naming the file, tensor and what is read."""
    from converters.formats.compressed_tensors.config import parse_quantization_config, serialize_quantization_config
    from converters.formats.compressed_tensors.read import CompressedModel, split_name
    from converters.formats.safe_files import read_json
    from converters.formats.safetensors_io import SafetensorsFile, open_checkpoint

    path = Path(path)
    root = path if path.is_dir() else path.parent
    where = str(root / "config.json")
    cfg = read_json(root / "config.json")
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "torchao":
        raise CheckpointError(f"{where}: expected a quantization_config with quant_method 'torchao', found "
                              f"{None if not isinstance(qc, dict) else qc.get('quant_method')!r}")
    ck = open_checkpoint(path)
    try:
        names = {n: n for n in ck.keys()}
        records: Dict[str, Tuple[dict, Path]] = {}
        for f in ck.files:
            with SafetensorsFile(f, root) as sf:
                md = sf.metadata
            listed = md.get("tensor_names")
            if listed is None:
                continue
            try:
                listed = json.loads(listed)
                assert isinstance(listed, list) and all(isinstance(x, str) for x in listed)
            except (ValueError, AssertionError):
                raise CheckpointError(f"{f}: __metadata__ 'tensor_names': expected a JSON list of names") from None
            for name in listed:
                try:
                    rec = json.loads(md.get(name, "null"))
                except ValueError:
                    rec = None
                if not isinstance(rec, dict) or not isinstance(rec.get("_type"), str):
                    raise CheckpointError(f"{f}: __metadata__ {name!r}: expected a torchao JSON record with a _type")
                if rec["_type"] not in ("Tensor", "torch.Tensor"):
                    records[name] = (rec, f)
        if not records:
            raise CheckpointError(f"{ck.path}: quant_method 'torchao' but no safetensors file lists a torchao tensor "
                                  f"subclass in its __metadata__ (torchao.prototype.safetensors)")
        modules: Dict[str, Dict[str, Any]] = {}
        consumed: set = set()
        by_scheme: Dict[Any, List[str]] = {}
        for name, (rec, f) in sorted(records.items()):
            m, local = split_name(name)
            q, used = _weight(ck, rec, m, local, names, f"{f}: tensor {name!r}")
            consumed.update(used)
            modules.setdefault(m, {})[local] = q
            by_scheme.setdefault(q.scheme, []).append(m)
        for name in ck.keys():
            if name in consumed:
                continue
            m, local = split_name(name)
            if local.startswith("_"):
                raise CheckpointError(f"{ck.file_of(name)}: tensor {name!r}: a torchao data tensor no metadata "
                                      f"record claims")
            modules.setdefault(m, {})[local] = ck.get(name)
        groups = [(sorted(ms), SchemeSet(s.describe(), weights=s)) for s, ms in by_scheme.items()]
        quant = parse_quantization_config(serialize_quantization_config(groups, []), where)
        group_of = {m: g for g in quant.groups for m in g.targets}
        formats = {m: group_of[m].format for ms in by_scheme.values() for m in ms}
        group_names = {m: group_of[m].name for ms in by_scheme.values() for m in ms}
        stored = {m: 0 for m in modules}
        for name in ck.keys():
            stored[split_name(name)[0]] = stored.get(split_name(name)[0], 0) + ck.info(name).nbytes
        return CompressedModel(path, cfg, quant, modules, formats, group_names, stored)
    finally:
        ck.close()
