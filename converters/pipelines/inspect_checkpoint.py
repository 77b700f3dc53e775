"""What a checkpoint holds: its quantization summary (format, scheme per config group, ignore list) and one row
per tensor or quantized module (format, scheme, shape, bytes, ratio), in natural order (layers.2 before layers.10)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import List, Optional

import numpy as np

from converters.formats.compressed_tensors.read import iter_modules, open_compressed
from qformats.plan import natural_key, paths_text, wrap_list
from qformats.qarray import QArray

__all__ = ["Row", "format_table", "inspect_checkpoint", "quantization_summary"]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass
class Row:
    name: str  # the module for a quantized weight, the tensor name otherwise
    format: str
    scheme: str
    shape: tuple
    stored_bytes: int
    dense_bytes: int

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(self.stored_bytes, 1)


def _other_method(path: Path) -> Optional[str]:
    """The quant_method of a checkpoint that another reader than compressed-tensors' reads (None otherwise)."""
    from converters.formats.quantized import quant_method
    from converters.formats.safe_files import read_json

    cfg_path = (path if path.is_dir() else path.parent) / "config.json"
    method = quant_method(read_json(cfg_path) if os.path.lexists(cfg_path) else {})
    return None if method in ("dense", "compressed-tensors", "sparseml") else method


def _other_rows(path: Path) -> List[Row]:
    """The rows of a checkpoint in another quantized format, from its reader's CompressedModel
    (`converters.formats.quantized.read_quantized`): a quantized module's stored bytes are its reader's count."""
    from converters.formats.quantized import read_quantized

    cm = read_quantized(path)
    tdt = cm.config.get("torch_dtype") or cm.config.get("dtype")
    rows: List[Row] = []
    for m, tensors in cm.modules.items():
        prefix = f"{m}." if m else ""
        q = tensors.get("weight")
        if isinstance(q, QArray):
            item = _ITEMSIZE.get(tdt, q.dtype.itemsize) if isinstance(tdt, str) else q.dtype.itemsize
            rows.append(Row(m, cm.formats.get(m, ""), q.scheme.describe(), tuple(q.tshape), cm.stored_nbytes[m],
                            int(np.prod(q.shape)) * item))
            continue
        for local, arr in tensors.items():
            a = np.asarray(arr)
            rows.append(Row(prefix + local, "dense", str(a.dtype), tuple(a.shape), a.nbytes, a.nbytes))
    return sorted(rows, key=lambda r: natural_key(r.name))


def inspect_checkpoint(path: "str | os.PathLike") -> List[Row]:
    """One row per quantized weight (all its tensors counted, shape in torch layout [out, in]) and per
    other tensor. A quantized weight's dense size counts the model's `torch_dtype` (else the QArray dtype).
    Checkpoints of the other quantized formats (`converters.formats.quantized.READERS`) are read by their reader:
    a row per module it gives (e.g. per expert for gpt-oss MXFP4), its format the compressed-tensors one that
    holds the same values."""
    if _other_method(Path(path)) is not None:
        return _other_rows(Path(path))
    ck, cfg, qc = open_compressed(Path(path))
    tdt: Optional[str] = cfg.get("torch_dtype") or cfg.get("dtype") if isinstance(cfg, dict) else None
    rows: List[Row] = []
    try:
        for mod in iter_modules(ck, qc):
            prefix = f"{mod.name}." if mod.name else ""
            q = mod.tensors.get("weight")
            if isinstance(q, QArray):
                wparts = [n for n in ck.keys() if n.startswith(prefix) and "." not in n[len(prefix):]
                          and n[len(prefix):].startswith("weight")]
                stored = sum(ck.info(n).nbytes for n in wparts)
                item = _ITEMSIZE.get(tdt, q.dtype.itemsize) if isinstance(tdt, str) else q.dtype.itemsize
                rows.append(Row(mod.name, mod.format or "", q.scheme.describe(), tuple(q.tshape), stored,
                                int(np.prod(q.shape)) * item))
            for local, arr in mod.tensors.items():
                if isinstance(arr, QArray):
                    continue
                info = ck.info(prefix + local)
                rows.append(Row(prefix + local, "dense", info.dtype, tuple(info.shape), info.nbytes, info.nbytes))
    finally:
        ck.close()
    return sorted(rows, key=lambda r: natural_key(r.name))


def quantization_summary(path: "str | os.PathLike", width: int = 100) -> str:
    """Lines a person reads first: the checkpoint's quantization_config (format, compressed-tensors version, each
    config group's targets and schemes, the ignore list with layer numbers folded, the KV-cache scheme, any
    transform), or "dense" when it has none. Another quantized format (`converters.formats.quantized.READERS`) is
    named by its quant_method and description, then summarised as the compressed-tensors config its reader gives."""
    other = _other_method(Path(path))
    if other is not None:
        from converters.formats.quantized import DESCRIPTIONS, read_quantized

        qc = read_quantized(Path(path)).quant
        lines = [f"quantization: {other} ({DESCRIPTIONS.get(other, other)}); read as compressed-tensors format "
                 f"{qc.format}"]
    else:
        ck, cfg, qc = open_compressed(Path(path))
        ck.close()
        if qc is None:
            return "quantization: none (a dense checkpoint)"
        version = ".".join(map(str, qc.version)) if qc.version else "not recorded"
        lines = [f"quantization: compressed-tensors, format {qc.format} (version {version})"]
    for g in qc.groups:
        parts = [f"{role} {s.describe()}{'' if role == 'weights' else ' dynamic' if s.dynamic else ' static'}"
                 for role, s in
                 (("weights", g.weights), ("input activations", g.input_activations),
                  ("output activations", g.output_activations)) if s is not None]
        lines.append(wrap_list(f"  {g.name} ({g.format}): ", ["targets " + " ".join(g.targets)] + parts, width))
    lines.append(wrap_list(f"  ignore ({len(qc.ignore)}): ", paths_text(qc.ignore) or ["none"], width))
    if qc.kv_cache_scheme is not None:
        from qformats.kv_cache import kv_cache_name
        lines.append(f"  kv cache: {kv_cache_name(qc.kv_cache)}")
    tc = qc.raw.get("transform_config") if isinstance(qc.raw, dict) else None
    if isinstance(tc, dict) and tc.get("config_groups"):
        lines.append(f"  transforms: {', '.join(map(str, tc['config_groups']))}")
    return "\n".join(lines)


def _fmt(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover


def format_table(rows: List[Row]) -> str:
    """The rows as an aligned text table with a TOTAL line (bytes stored, quantized / dense counts, ratio)."""
    head = ("tensor / module", "format", "scheme", "shape", "bytes", "ratio")
    body = [(r.name, r.format, r.scheme, "x".join(map(str, r.shape)) or "scalar", _fmt(r.stored_bytes),
             f"{r.ratio:.2f}") for r in rows]
    stored = sum(r.stored_bytes for r in rows)
    dense = sum(r.dense_bytes for r in rows)
    nq = sum(1 for r in rows if r.format != "dense")
    body.append(("TOTAL", f"{nq} quantized", f"{len(rows) - nq} dense", "", _fmt(stored),
                 f"{dense / max(stored, 1):.2f}"))
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(b, widths)) for b in body[:-1]]
    lines.append("  ".join("-" * w for w in widths))
    lines.append("  ".join(str(c).ljust(w) for c, w in zip(body[-1], widths)))
    return "\n".join(lines)
