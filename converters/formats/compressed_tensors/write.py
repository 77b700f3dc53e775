"""Write QArrays as a compressed-tensors checkpoint (0.20 layout): tensors, config.json, index, other files.

`CompressedWriter` streams: tensors go to a `converters.formats.shard_writer.ShardedWriter` as they come, one module
at a time, and `finish` adds config.json (the source config plus `quantization_config` exactly as
compressed-tensors 0.20 serializes it, `json.dump(indent=2, sort_keys=True)`) and the other files (tokenizer,
...), then moves the whole directory into place at once. `write_compressed` is the one-call form. An exception
leaves no partial DST; an existing DST is refused unless `overwrite`, and then stays intact until the new
checkpoint is complete.

Tensors per weight (torch layout `[N, K]` = the QArray's `tshape`):
  naive/int/float-quantized, mxfp8-quantized: `weight` (I8 or F8_E4M3), `weight_scale`, [`weight_zero_point`]
  pack-quantized: `weight_packed` I32 `[N, ceil(K*b/32)]` (dense little-endian), `weight_shape` I64,
                  `weight_scale`, [`weight_zero_point` I32 packed along dim 0]
  nvfp4-pack-quantized: `weight_packed` U8 `[N, K/2]`, `weight_scale` F8_E4M3, `weight_global_scale` F32 [1]
  mxfp4/mxfp6-pack-quantized: `weight_packed` U8, `weight_scale` U8 (E8M0)
  fpx-pack-quantized (our extension): `weight_packed` U8, `weight_scale`, `weight_shape` I64
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from converters.formats.compressed_tensors.config import FPX_FORMAT, format_for, serialize_quantization_config
from converters.formats.shard_writer import ShardedWriter, TensorSpec
from qformats.errors import CheckpointError, QFormatsError
from qformats.formats import IntFormat
from qformats.kv_cache import KVCacheScheme
from qformats.packing import pack_int32, unpack
from qformats.qarray import QArray
from qformats.schemes import SchemeSet

__all__ = ["CompressedWriter", "config_with", "flatten_flax_params", "qarray_to_tensors", "write_compressed"]


def qarray_to_tensors(q: QArray, fmt: str, where: str = "weight") -> Dict[str, np.ndarray]:
    """The compressed-tensors tensors (local names) of one 2-D QArray stored in format `fmt`."""
    if not isinstance(q, QArray):
        raise CheckpointError(f"{where}: expected a QArray, found {type(q).__name__}")
    if q.ndim != 2:
        raise CheckpointError(f"{where}: expected a 2-D (Linear) QArray, found shape {q.shape}")
    try:
        q.check()
    except QFormatsError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if q.scheme.format.kind == "table":
        raise CheckpointError(f"{where}: {q!r} stores {q.scheme.format.name} table indices, and compressed-tensors has "
                              f"no table format; write the table's values as int8 codes "
                              f"(converters.pipelines.convert_quantized.gguf_ct_qarray) or dense (dequantize) instead")
    if q.offset is not None:
        raise CheckpointError(f"{where}: {q!r} carries an additive float offset (w = d q + m, GGUF's Q4_1 / Q5_1 / "
                              f"K-quant minima), which compressed-tensors cannot store (its zero point is an integer "
                              f"in code units); write it dense (dequantize) instead")
    if q.compute_dtype is not None and q.compute_dtype != QArray(q.codes, q.scale, None, None, scheme=q.scheme,
                                                                 shape=q.shape, dtype=q.dtype, axis=q.axis).work_dtype:
        raise CheckpointError(f"{where}: {q!r} computes in {q.compute_dtype.name}, not in its scale's dtype, which is "
                              f"what compressed-tensors computes in: its values would change; widen the scale first "
                              f"(converters.pipelines.convert_quantized.gguf_ct_qarray for a GGUF weight)")
    s = q.scheme
    n, k = q.tshape
    bits = s.bits
    codes = np.asarray(q.codes)
    scale = np.asarray(q.scale)
    out: Dict[str, np.ndarray] = {}
    if fmt in ("naive-quantized", "int-quantized", "float-quantized", "mxfp8-quantized"):
        if isinstance(s.format, IntFormat):
            if bits == 8:
                out["weight"] = codes.astype(np.int8)
            else:
                u = np.asarray(unpack(codes, bits, k)).astype(np.int16)
                out["weight"] = (u + s.format.qmin).astype(np.int8)
        else:
            out["weight"] = codes.view(_ml("float8_e4m3fn"))
        out["weight_scale"] = scale
    elif fmt == "pack-quantized":
        if bits == 8:
            b = (codes.astype(np.int16) + 128).astype(np.uint8)
        else:
            b = codes.astype(np.uint8)
        words = -(-k * bits // 32)
        padded = np.zeros((n, 4 * words), np.uint8)
        padded[:, : b.shape[1]] = b
        out["weight_packed"] = padded.view("<i4").astype(np.int32)
        out["weight_shape"] = np.array([n, k], np.int64)
        out["weight_scale"] = scale
    elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", FPX_FORMAT):
        out["weight_packed"] = codes.astype(np.uint8)
        out["weight_scale"] = scale
        if fmt == "nvfp4-pack-quantized":
            out["weight_global_scale"] = np.asarray(q.global_scale, np.float32).reshape(1)
        if fmt == FPX_FORMAT:
            out["weight_shape"] = np.array([n, k], np.int64)
    else:
        raise CheckpointError(f"{where}: cannot write format {fmt!r}")
    if q.zero_point is not None:
        zp = np.asarray(q.zero_point).astype(np.int8)
        if fmt == "pack-quantized" and s.strategy in ("group", "channel"):
            u = (zp.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
            out["weight_zero_point"] = np.asarray(pack_int32(u, bits, axis=0)).astype(np.int32)
        else:
            out["weight_zero_point"] = zp
    return out


def flatten_flax_params(params: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested Flax params (dicts, or NNX State / Variables with `.value`) -> flat torch-style tensor names.

    `kernel` becomes `weight`: a QArray is kept as is (its storage is already torch's [out, in]), a dense 2-D
    kernel [in, out] is transposed to [out, in]. Everything else keeps its name ("a.b.bias", "a.b.scale").
    The inverse of `converters.formats.compressed_tensors.read.to_flax_params` for Linear layers.
    """
    out: Dict[str, Any] = {}
    for key, v in params.items():
        name = f"{prefix}{key}"
        if hasattr(v, "value") and not isinstance(v, (QArray, np.ndarray)) and not hasattr(v, "items"):
            v = v.value
        if isinstance(v, QArray):
            out[name[: -len("kernel")] + "weight" if str(key) == "kernel" else name] = v
        elif hasattr(v, "items"):
            out.update(flatten_flax_params(v, name + "."))
        elif str(key) == "kernel" and getattr(v, "ndim", 0) == 2:
            out[name[: -len("kernel")] + "weight"] = np.ascontiguousarray(np.asarray(v).T)
        else:
            out[name] = np.asarray(v)
    return out


def _ml(name: str) -> np.dtype:
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name))


def config_with(base: Optional[Mapping[str, Any]], qconfig: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """config.json's content: `base` with `quantization_config` = qconfig (removed when qconfig is None)."""
    cfg = dict(base or {})
    if qconfig is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qconfig
    return cfg


class CompressedWriter:
    """Streams tensors and QArrays into a compressed-tensors checkpoint at `dst`: `add_dense(name, array)`,
    `add_qarray(module, q, scheme_set)`, then `finish(base_config, ignore=..., targets=..., copy_from=...)`,
    which moves the complete directory into place; `abort` (or an exception inside `with`) leaves `dst` as
    it was. `max_shard_size`, `overwrite`, `plan` (the tensor list, for a writer that streams each tensor
    to disk as it comes) and `sources` (the paths read, which `dst` must stay apart from) are
    `ShardedWriter`'s."""

    def __init__(self, dst: "str | os.PathLike", max_shard_size: "int | str" = "5GB", *, overwrite: bool = False,
                 plan: Optional[Sequence[TensorSpec]] = None, sources: Sequence["str | os.PathLike"] = ()):
        self.dst = Path(dst)
        self._w = ShardedWriter(self.dst, max_shard_size, overwrite=overwrite, plan=plan, sources=sources)
        self._groups: List[Tuple[Tuple[Any, Any, Any], SchemeSet, List[str]]] = []
        self.dense_bytes = 0  # bytes the quantized weights had dense
        self.written_bytes = 0

    def add_dense(self, name: str, array: Any) -> None:
        """Writes tensor `name` as is (biases, norms, embeddings, weights left dense, ...)."""
        arr = np.asarray(array)
        self._w.add(name, arr)
        self.written_bytes += arr.nbytes

    def add_qarray(self, module: str, q: QArray, scheme_set: Optional[SchemeSet] = None) -> str:
        """Write the weight of `module` (a 2-D QArray) in the format its scheme calls for; returns the format."""
        ia = scheme_set.input_activations if scheme_set is not None else None
        oa = scheme_set.output_activations if scheme_set is not None else None
        fmt = format_for(q.scheme, ia)
        prefix = f"{module}." if module else ""
        for local, arr in qarray_to_tensors(q, fmt, f"{self.dst}: module {module!r}").items():
            self._w.add(prefix + local, arr)
            self.written_bytes += arr.nbytes
        self.dense_bytes += q.dense_nbytes
        key = (q.scheme, ia, oa)
        for k, _, mods in self._groups:
            if k == key:
                mods.append(module)
                break
        else:
            name = scheme_set.name if scheme_set is not None else q.scheme.describe()
            self._groups.append((key, SchemeSet(name, q.scheme, ia, oa), [module]))
        return fmt

    def quantization_config(self, ignore: Sequence[str] = (), targets: Optional[Sequence[str]] = None,
                            transform_config: Optional[Dict[str, Any]] = None,
                            kv_cache_scheme: Optional[KVCacheScheme] = None) -> Optional[Dict[str, Any]]:
        """`targets` (default ["Linear"]) when all quantized modules share one scheme; else one group per
        scheme with `re:^<module>$` targets. `kv_cache_scheme`: compressed-tensors' kv_cache_scheme (its static
        k_scale / v_scale are tensors the caller adds); with no quantized weight the config then has
        `config_groups: {}`. None when nothing is quantized."""
        if not self._groups and kv_cache_scheme is None:
            return None
        if not self._groups:
            groups = []
        elif len(self._groups) == 1:
            groups = [(list(targets or ["Linear"]), self._groups[0][1])]
        else:
            groups = [([f"re:^{re.escape(m)}$" for m in mods], ss) for _, ss, mods in self._groups]
        return serialize_quantization_config(groups, list(ignore), transform_config=transform_config,
                                             kv_cache=kv_cache_scheme)

    def finish(self, base_config: Optional[Mapping[str, Any]] = None, *, ignore: Sequence[str] = (),
               targets: Optional[Sequence[str]] = None, copy_from: "str | os.PathLike | None" = None,
               transform_config: Optional[Dict[str, Any]] = None,
               kv_cache_scheme: Optional[KVCacheScheme] = None) -> Dict[str, Any]:
        """Adds config.json (base_config + the quantization_config, with `transform_config` when rotations were
        fused: `converters.pipelines.rotate`, and `kv_cache_scheme` for a quantized KV cache) and the other files of
        `copy_from`, then moves the checkpoint into place; returns the quantization_config ({} when nothing is
        quantized)."""
        try:
            qc = self.quantization_config(ignore, targets, transform_config, kv_cache_scheme)
            self._w.add_json("config.json", config_with(base_config, qc))
            self._w.copy_extra_files(copy_from)
        except BaseException:
            self._w.abort()
            raise
        self._w.finish()
        return qc or {}

    def abort(self) -> None:
        """Removes everything written so far; `dst` is as it was."""
        self._w.abort()

    def __enter__(self) -> "CompressedWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:
            self.abort()


def write_compressed(dst: "str | os.PathLike", tensors: Mapping[str, Any], schemes: "SchemeSet | Mapping[str, SchemeSet] | None" = None,
                     *, ignore: Sequence[str] = (), targets: Optional[Sequence[str]] = None,
                     config: Optional[Mapping[str, Any]] = None, copy_from: "str | os.PathLike | None" = None,
                     max_shard_size: "int | str" = "5GB", overwrite: bool = False,
                     transform_config: Optional[Mapping[str, Any]] = None,
                     kv_cache_scheme: Optional[KVCacheScheme] = None) -> Path:
    """Write a compressed-tensors checkpoint at `dst`.

    Args:
      tensors: full tensor name -> array or QArray. A QArray must be a module's `weight` ("a.b.weight") or a
        Flax `kernel` ("a.b.kernel"); it is written under the module "a.b" in the format its scheme calls for.
        Everything else is written as is (biases, norms, embeddings, static `input_scale`s, ...).
      schemes: the SchemeSet (for the input/output activation args of the config), or module -> SchemeSet.
      ignore: names for quantization_config.ignore (the Linear modules left dense, e.g. ["lm_head"]).
      targets: config group targets when there is one scheme (default ["Linear"]).
      config: the model's config.json dict (quantization_config is added); copy_from: a directory whose
        other files (tokenizer, generation config, ...) are copied.
      transform_config: the rotations fused into these weights (`converters.pipelines.rotate.Rotated.transform_config`),
        recorded in quantization_config; their online tensors go in `tensors` like any dense tensor.
      kv_cache_scheme: the KV-cache scheme (`qformats.kv_cache`) recorded as quantization_config.kv_cache_scheme;
        its static scales go in `tensors` as "<attention module>.k_scale" / ".v_scale".
    Returns the path written.
    """
    dst = Path(dst)
    sources = () if copy_from is None else (copy_from,)  # the directory whose files are copied is read from
    with CompressedWriter(dst, max_shard_size, overwrite=overwrite, sources=sources) as w:
        for name in sorted(tensors):
            v = tensors[name]
            if isinstance(v, QArray):
                mod, _, local = name.rpartition(".")
                if local not in ("weight", "kernel"):
                    raise CheckpointError(f"{dst}: tensor {name!r}: a QArray must be a module's 'weight' or "
                                          f"'kernel', found {local!r}")
                ss = schemes.get(mod) if isinstance(schemes, Mapping) else schemes
                w.add_qarray(mod, v, ss)
            else:
                w.add_dense(name, v)
        w.finish(config, ignore=ignore, targets=targets, copy_from=copy_from,
                 transform_config=None if transform_config is None else dict(transform_config),
                 kv_cache_scheme=kv_cache_scheme)
    return dst
