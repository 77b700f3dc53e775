"""Seeded fuzz over hostile compressed-tensors checkpoints: a typed error or the unmutated reading, nothing else.

Base checkpoints are written by our own writer from tiny tensors (pack-quantized asymmetric, NVFP4, FP8,
int8, MXFP6, and a sharded one). Each case applies one mutation of a class -- header, config, tensor-level,
shard-index, byte-flip, truncation, special files -- and reads the whole checkpoint (`read_compressed`, then
`dense_weight` of every quantized weight). Asserted for every case:
  - the only exception is CheckpointError (no other exception, no hang: a per-case alarm);
  - a successful read equals the unmutated one, except for the tensors the mutation itself changed (the
    bytes flipped, the header entries edited): a quantized weight never reads as dense, never changes
    format, and no untouched tensor changes value, shape or dtype;
  - memory traced during a case stays under 2x the checkpoint's bytes plus the largest dense weight.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import random
import shutil
import struct
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest

import qformats as qf
from converters.formats.compressed_tensors.read import dense_weight, read_compressed
from converters.formats.compressed_tensors.write import write_compressed
from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint
from converters.formats.safetensors_io import INDEX_FILE, SafetensorsFile
from qformats.errors import CheckpointError
from qformats.qarray import QArray
from time_limit import time_limit

SEED = 20261130
PER_CASE_SECONDS = 5
CASES = {"header": 400, "config": 400, "tensor": 300, "index": 200, "byteflip": 500, "truncation": 250,
         "special": 60}
PRESETS = ("W4A16_ASYM", "NVFP4A16", "FP8_DYNAMIC", "W8A8", "MXFP6A16")
_RNG = np.random.default_rng(7)
_W = {"m.a": (_RNG.standard_normal((64, 32)) * 0.1).astype(np.float32),  # Flax kernels [in, out]
      "m.b": (_RNG.standard_normal((64, 48)) * 0.1).astype(np.float32)}


def _write_base(path: Path, preset: str, shard: "int | None" = None) -> Path:
    ss = qf.presets[preset]
    sch = ss.weights
    if sch.group_size and 64 % sch.group_size:
        sch = dataclasses.replace(sch, group_size=32)
    tensors = {f"{m}.weight": qf.quantize(w, sch, axis=0) for m, w in _W.items()}
    tensors.update({"m.a.bias": np.linspace(-1, 1, 32).astype(np.float32), "m.norm.weight": np.ones(48, np.float32),
                    "emb.weight": np.arange(40, dtype=np.float32).reshape(8, 5)})
    kw = {"max_shard_size": shard} if shard else {}
    write_compressed(path, tensors, ss, config={"model_type": "tiny", "torch_dtype": "float32"}, **kw)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def _reading(path: Path) -> dict:
    """name -> (kind, format or dtype, shape, bytes): the whole checkpoint as the reader gives it."""
    m = read_compressed(path)
    out = {}
    for mod, tensors in m.modules.items():
        for local, arr in tensors.items():
            key = f"{mod}.{local}" if mod else local
            if isinstance(arr, QArray):
                d = np.asarray(dense_weight(arr))
                out[key] = ("q", m.formats[mod], d.shape, d.tobytes())
            else:
                a = np.asarray(arr)
                out[key] = ("dense", str(a.dtype), a.shape, a.tobytes())
    return out


@dataclasses.dataclass
class Base:
    name: str
    path: Path
    files: dict  # file name -> bytes
    reading: dict
    largest: int  # bytes of the largest dense weight
    spans: dict  # safetensors file -> [(begin, end, tensor)] absolute byte ranges
    headers: dict  # safetensors file -> (header dict, header length)


def _header(raw: bytes):
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), n


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    out = []
    specs = [(p, None) for p in PRESETS] + [("W4A16_ASYM", 3000)]
    for preset, shard in specs:
        name = preset + ("-sharded" if shard else "")
        path = _write_base(root / name, preset, shard)
        files = {p.name: p.read_bytes() for p in path.iterdir()}
        if shard:
            assert INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) >= 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reading = _reading(path)
        assert sum(v[0] == "q" for v in reading.values()) == 2
        spans, headers = {}, {}
        for fname, raw in files.items():
            if fname.endswith(".safetensors"):
                h, n = _header(raw)
                headers[fname] = (h, n)
                spans[fname] = [(8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1], k)
                                for k, e in h.items() if k != "__metadata__"]
        largest = max(int(np.prod(v[2])) * 4 for v in reading.values())
        out.append(Base(name, path, files, reading, largest, spans, headers))
    return out


# ---- mutations: each returns (files to write (name -> bytes | special), touched tensor names) ------------------
NASTY = [None, True, -1, 0, 1, 2**63, -(2**63), 1.5, "", "x", "F32", "re:(a|aa)+$", [], {}, [1, 2], [[0]],
         {"a": 1}, "\ud800", "I32", "U8", "F8_E4M3", 10**30]


CODED = ["weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_shape", "weight_g_idx"]
RENAMES = CODED + ["weight", "bias", "weight_scales", "weigh"]


def _rand_value(r: random.Random, old):
    if isinstance(old, bool) or old is None:
        return r.choice(NASTY)
    if isinstance(old, int) and r.random() < 0.6:
        return old + r.choice([-2, -1, 1, 2, 8, -old - 1, old])
    if isinstance(old, str) and r.random() < 0.5:
        return r.choice(["dense", "pack-quantized", "float-quantized", "int-quantized", "naive-quantized",
                         "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", "tensor", "channel",
                         "group", "tensor_group", "block", "int", "float", "torch.uint8", "torch.float8_e4m3fn",
                         old + "x", old[:-1], old.upper()])
    if isinstance(old, list) and old and r.random() < 0.5:
        i = r.randrange(len(old))
        return old[:i] + [_rand_value(r, old[i])] + old[i + 1:]
    return r.choice(NASTY)


def _serialize(h: dict, n_old: int, data: bytes, r: random.Random, length_delta: int = 0) -> bytes:
    try:
        raw = json.dumps(h, ensure_ascii=r.random() < 0.5).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        raw = b"{}"
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", max(len(raw) + length_delta, 0)) + raw + data


def _changed(h0: dict, h1) -> set:
    if not isinstance(h1, dict):
        return set(h0)
    return {k for k in set(h0) | set(h1) if k != "__metadata__" and h0.get(k) != h1.get(k)}


def _pick_st(base: Base, r: random.Random) -> str:
    return r.choice(sorted(base.headers))


def m_header(base: Base, r: random.Random):
    fname = _pick_st(base, r)
    raw = base.files[fname]
    h0, n = base.headers[fname]
    h = json.loads(json.dumps(h0))
    data = raw[8 + n:]
    names = [k for k in h if k != "__metadata__"]
    k = r.choice(names)
    op = r.randrange(9)
    delta = 0
    if op == 0:  # a field
        field = r.choice(["dtype", "shape", "data_offsets"])
        h[k][field] = _rand_value(r, h[k][field])
    elif op == 1:  # delete a field or the entry
        if r.random() < 0.5:
            h[k].pop(r.choice(["dtype", "shape", "data_offsets"]))
        else:
            del h[k]
    elif op == 2:  # rename: another local name, another module, a compressed-looking name
        mod, _, local = k.rpartition(".")
        new = r.choice([f"{mod}.{r.choice(RENAMES)}",
                        f"{r.choice(['m.a', 'm.b', 'm.norm', 'emb', 'm.c', ''])}.{local}".lstrip("."),
                        k + "_", k.upper()])
        if new not in h:
            h[new] = h.pop(k)
    elif op == 3:  # swap the byte ranges of two entries
        k2 = r.choice(names)
        h[k]["data_offsets"], h[k2]["data_offsets"] = h[k2]["data_offsets"], h[k]["data_offsets"]
    elif op == 4:  # header length field off by a little
        delta = r.choice([-8, -2, -1, 1, 2, 8])
    elif op == 5:  # metadata
        h["__metadata__"] = r.choice([None, {"format": 1}, {"format": "pt", "x": "\ud800"}, [], "pt", {}])
    elif op == 6:  # another dtype, same shape and offsets
        code = r.choice(["U8", "I8", "F16", "BF16", "F32", "I32", "F8_E4M3", "F8_E8M0", "I64"])
        h[k]["dtype"] = code
    elif op == 7:  # extra tensor in the file (bytes appended)
        h[r.choice(["m.a.weight_global_scale", "m.norm.weight_scale", "m.norm.weight_packed", "m.a.weight_g_idx",
                    "m.b.weight_zero_point", "emb.weight_shape"])] = {
            "dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
        data = data + struct.pack("<f", 1.0)
    else:  # reorder keys only (no semantic change)
        h = dict(reversed(list(h.items())))
    files = {fname: _serialize(h, n, data, r, delta)}
    return files, _changed(h0, h) | ({"*"} if delta else set())


def _cfg_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _cfg_paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _cfg_paths(value, prefix + (i,))


def m_config(base: Base, r: random.Random):
    cfg = json.loads(base.files["config.json"])
    op = r.randrange(10)
    if op == 0:
        return {"config.json": None}, set()  # removed
    if op == 1:
        cfg.pop("quantization_config")
    elif op == 2:
        cfg["quantization_config"] = r.choice([None, {}, [], "compressed-tensors"])
    elif op == 3:
        g = next(iter(cfg["quantization_config"]["config_groups"].values()))
        g[r.choice(["weights", "format", "targets"])] = r.choice([None, "dense", [], "float-quantized",
                                                                  "pack-quantized", ["re:(a|aa)+$"]])
    elif op == 4:
        cfg["quantization_config"][r.choice(["config_groups", "format", "ignore", "version"])] = r.choice(
            [None, "dense", {}, ["m.a"], ["re:m\\..*"], ["re:(x+x+)+y"], "0.1.0", "mixed-precision"])
    else:  # a random leaf of the quantization_config
        qc = cfg["quantization_config"]
        paths = [p for p in _cfg_paths(qc) if p]
        path = r.choice(paths)
        node = qc
        for key in path[:-1]:
            node = node[key]
        if r.random() < 0.3 and isinstance(node, dict):
            node.pop(path[-1])
        else:
            node[path[-1]] = _rand_value(r, node[path[-1]])
    text = json.dumps(cfg, ensure_ascii=False) if r.random() < 0.9 else json.dumps(cfg)[:-1]
    return {"config.json": text.encode("utf-8", "surrogatepass")}, set()


def m_tensor(base: Base, r: random.Random):
    """Rewrite one file with our writer from modified arrays: drop, rename, recast, reshape, add a tensor."""
    from converters.formats.safetensors_io import save_file
    fname = _pick_st(base, r)
    with SafetensorsFile(base.path / fname) as f:
        t = {k: np.array(f.get(k)) for k in f.keys()}
    k = r.choice(sorted(t))
    op = r.randrange(6)
    touched = {k}
    if op == 0:
        del t[k]
    elif op == 1:
        mod, _, local = k.rpartition(".")
        new = f"{mod}.{r.choice(['weight_scale', 'weight_packed', 'weight', 'scale', 'weight_shape', 'bias'])}"
        if new not in t:
            t[new] = t.pop(k)
            touched.add(new)
    elif op == 2:
        import ml_dtypes
        dt = r.choice([np.int8, np.uint8, np.int32, np.float32, np.float16, ml_dtypes.bfloat16,
                       ml_dtypes.float8_e4m3fn, np.int64])
        with np.errstate(all="ignore"):
            t[k] = t[k].astype(dt)
    elif op == 3:
        a = t[k]
        t[k] = r.choice([a.reshape(-1), a[..., None], a.T if a.ndim == 2 else a[None], a[:-1] if a.shape and
                         a.shape[0] > 1 else a])
    elif op == 4:
        mod = r.choice(["m.a", "m.b", "m.norm", "emb"])
        new = f"{mod}.{r.choice(CODED)}"
        if new not in t and not any(new in v for v in base.headers.values()):
            t[new] = r.choice([np.ones(1, np.float32), np.zeros((48, 2), np.int32), np.array([48, 64], np.int64)])
            touched.add(new)
    else:
        mod = r.choice(["m.norm", "emb", "m.c"])
        t[f"{mod}.weight"] = np.zeros((4, 4), np.int8)
        touched.add(f"{mod}.weight")
    tmp = base.path.parent / f".tensor-{os.getpid()}.safetensors"
    save_file(t, tmp, metadata={"format": "pt"})
    data = tmp.read_bytes()
    tmp.unlink()
    return {fname: data}, touched


def m_index(base: Base, r: random.Random):
    if INDEX_FILE not in base.files:
        return m_header(base, r)
    idx = json.loads(base.files[INDEX_FILE])
    wm = idx["weight_map"]
    shards = sorted(set(wm.values()))
    k = r.choice(sorted(wm))
    op = r.randrange(8)
    if op == 0:
        del wm[k]
    elif op == 1:
        wm[k] = r.choice([s for s in shards if s != wm[k]] or shards)
    elif op == 2:
        wm[k] = r.choice(["missing.safetensors", "/etc/passwd", "../x.safetensors", "", None, 3, "."])
    elif op == 3:
        wm[k + ".extra"] = wm[k]
    elif op == 4:
        idx["weight_map"] = r.choice([None, [], {}, "model.safetensors"])
    elif op == 5:
        return {INDEX_FILE: None}, set()
    elif op == 6:
        return {r.choice(shards): None}, set()
    else:
        idx["metadata"] = r.choice([None, {"total_size": -1}, [], "x"])
    return {INDEX_FILE: json.dumps(idx).encode()}, set()


def m_byteflip(base: Base, r: random.Random):
    fname = r.choice(sorted(base.headers) + ["config.json"] * 2 + ([INDEX_FILE] if INDEX_FILE in base.files else []))
    raw = bytearray(base.files[fname])
    touched = set()
    for _ in range(r.choice([1, 1, 1, 2, 4])):
        i = r.randrange(len(raw))
        raw[i] ^= 1 << r.randrange(8)
        if fname in base.spans:
            touched |= {k for b, e, k in base.spans[fname] if b <= i < e}
            if i < 8 + base.headers[fname][1]:
                touched.add("*header*")
    if "*header*" in touched:  # whatever entries the flip changed (if it still parses)
        touched.discard("*header*")
        with contextlib.suppress(Exception):
            h1, _ = _header(bytes(raw))
            touched |= _changed(base.headers[fname][0], h1)
    return {fname: bytes(raw)}, touched


def m_truncation(base: Base, r: random.Random):
    fname = r.choice(sorted(base.files))
    raw = base.files[fname]
    if r.random() < 0.7:
        cut = r.choice([0, 1, 7, 8, 9, len(raw) // 2, len(raw) - 1, r.randrange(len(raw) + 1)])
        return {fname: raw[:cut]}, set()
    return {fname: raw + r.choice([b"\0", b" ", b"\0" * 8, os.urandom(r.randrange(1, 64))])}, set()


SPECIAL = ["fifo", "dev_zero", "dev_urandom", "dir", "outside", "dangling", "huge"]


def m_special(base: Base, r: random.Random):
    fname = r.choice(["config.json", "tokenizer.json"] + sorted(base.headers) +
                     ([INDEX_FILE] if INDEX_FILE in base.files else []))
    return {fname: ("special", r.choice(SPECIAL))}, set()


MUTATORS = {"header": m_header, "config": m_config, "tensor": m_tensor, "index": m_index, "byteflip": m_byteflip,
            "truncation": m_truncation, "special": m_special}


# ---- running a case ------------------------------------------------------------------------------------------
def _materialize(base: Base, work: Path, files: dict, outside: Path) -> int:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    for name, raw in base.files.items():
        if name not in files:
            (work / name).write_bytes(raw)
    for name, spec in files.items():
        p = work / name
        if spec is None:
            continue
        if isinstance(spec, tuple):
            kind = spec[1]
            if kind == "fifo":
                os.mkfifo(p)
            elif kind == "dev_zero":
                os.symlink("/dev/zero", p)
            elif kind == "dev_urandom":
                os.symlink("/dev/urandom", p)
            elif kind == "dir":
                os.symlink("..", p) if name == "tokenizer.json" else p.mkdir()
            elif kind == "outside":
                os.symlink(outside, p)
            elif kind == "dangling":
                os.symlink(work / "no-such-file", p)
            else:  # a sparse file larger than any cap on JSON
                with open(p, "wb") as f:
                    f.truncate(65 * 2**20 if name.endswith(".json") else 2**34)
            continue
        p.write_bytes(spec)
    # the checkpoint's size as the reader sees it: regular files (a sparse giant counts in full)
    return sum(os.stat(q).st_size for q in work.iterdir() if q.is_file())


def _explained(base: Base, got: dict, touched: set) -> "str | None":
    """None when `got` equals the base reading except for what the mutation touched; else what differs."""
    if "*" in touched:
        touched = set(base.reading) | set(got)
    mods = {k.rpartition(".")[0] for k in touched}
    for key, (kind, fmt, shape, data) in base.reading.items():
        mod = key.rpartition(".")[0]
        if kind == "q":
            if key not in got or got[key][0] != "q" or got[key][1] != fmt:
                return f"quantized weight {key} ({fmt}) read as {got.get(key, ('absent',))[:2]}"
            if got[key] != base.reading[key] and mod not in mods:
                return f"quantized weight {key} changed although none of its tensors was touched"
        elif key not in got:
            if key not in touched:
                return f"untouched tensor {key} disappeared"
        elif got[key] != base.reading[key] and key not in touched:
            return f"untouched tensor {key} changed"
    for key, (kind, *_rest) in got.items():
        if key not in base.reading and kind == "q":
            return f"a new quantized weight {key} appeared"
        if key not in base.reading and key not in touched:
            return f"a tensor {key} appeared that the mutation did not make"
    return None


def test_hostile_checkpoints_typed_error_or_same_reading(bases, tmp_path):
    warnings.simplefilter("ignore")
    outside = tmp_path / "outside.json"
    outside.write_text('{"model_type": "elsewhere"}')
    work = tmp_path / "case"
    counts = collections.Counter()
    failures = []
    start = time.perf_counter()
    tracemalloc.start()
    try:
        for cls, n in CASES.items():
            for i in range(n):
                r = random.Random(f"{SEED}-{cls}-{i}")
                base = bases[i % len(bases)]
                files, touched = MUTATORS[cls](base, r)
                size = _materialize(base, work, files, outside)
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                shown = [v if isinstance(v, tuple) else "..." for v in files.values()]
                what = f"{cls} #{i} on {base.name}: {sorted(files)} {shown}"
                try:
                    with time_limit(PER_CASE_SECONDS, "the case"):
                        got = _reading(work)
                        if cls == "special":
                            dequantize_checkpoint(work, tmp_path / "out", overwrite=True)
                except CheckpointError:
                    counts[cls, "CheckpointError"] += 1
                except Exception as e:  # noqa: BLE001 - the point of the test
                    failures.append(f"{what}: {type(e).__name__}: {str(e)[:300]}")
                    counts[cls, "other exception"] += 1
                else:
                    why = _explained(base, got, touched)
                    if why is None:
                        counts[cls, "same reading" if got == base.reading else "differs where mutated"] += 1
                    else:
                        failures.append(f"{what}: read without error but {why} (touched {sorted(touched)[:6]})")
                        counts[cls, "silently different"] += 1
                peak = tracemalloc.get_traced_memory()[1] - before
                if peak > 2 * size + base.largest + 2**20:
                    failures.append(f"{what}: traced memory peak {peak} bytes for a {size}-byte checkpoint")
    finally:
        tracemalloc.stop()
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - start
    summary = "\n".join(f"  {c:10s} {o:22s} {k}" for (c, o), k in sorted(counts.items()))
    print(f"\n{sum(CASES.values())} hostile cases in {elapsed:.1f} s:\n{summary}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
    for cls in CASES:  # every class exercised the error path; no class silently read everything
        assert counts[cls, "CheckpointError"] > 0, cls
