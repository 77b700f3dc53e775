"""Hostile and inconsistent checkpoints, one defect at a time: quantized tensors never read as dense, the
safetensors header held to what the safetensors library accepts, only regular files inside the checkpoint,
size-capped JSON, contained copies of extra files, config patterns matched in bounded time, and names that
are not valid Unicode refused at the source."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import qformats as qf
from qformats import matching as patterns
from converters.formats.compressed_tensors.read import read_compressed
from converters.formats.compressed_tensors.write import write_compressed
from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint
from converters.formats.safe_files import MAX_JSON_BYTES, copy_extra_files, read_json
from converters.formats.safetensors_io import MAX_METADATA_ENTRIES, SafetensorsFile, save_file
from qformats.errors import CheckpointError
from time_limit import time_limit

RNG = np.random.default_rng(3)
W = (RNG.standard_normal((128, 32)) * 0.1).astype(np.float32)  # a Flax kernel [in, out]


def _ck(path: Path, preset: str = "FP8_DYNAMIC", targets=None) -> Path:
    ss = qf.presets[preset]
    tensors = {"model.q_proj.weight": qf.quantize(W, ss.weights, axis=0),
               "model.norm.weight": np.ones(32, np.float32)}
    write_compressed(path, tensors, ss, config={"model_type": "tiny"}, targets=targets)
    return path


def _tensors(path: Path) -> dict:
    with SafetensorsFile(path / "model.safetensors") as f:
        return {k: np.array(f.get(k)) for k in f.keys()}


def _rewrite(path: Path, fn) -> None:
    t = _tensors(path)
    fn(t)
    (path / "model.safetensors").unlink()
    save_file(t, path / "model.safetensors")


def _config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


# ---- quantized tensors never read as dense ---------------------------------------------------------------------
@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.pop("model.q_proj.weight_scale"), ["'model.q_proj'", "model.q_proj.weight_scale", "expected"]),
    (lambda t: t.update({"model.q_proj.weight_scal": t.pop("model.q_proj.weight_scale")}),
     ["'model.q_proj'", "weight_scal", "expected"]),
    (lambda t: t.update({"model.q_proj.weight_scale": t["model.q_proj.weight_scale"].view(np.int32)}),
     ["'model.q_proj.weight_scale'", "expected dtype", "found I32"]),
    (lambda t: t.update({"model.norm.weight_packed": np.zeros((32, 1), np.int32)}),
     ["'model.norm'", "model.norm.weight_packed"]),
    (lambda t: t.update({"model.q_proj.weight_zero_point": np.ones((32, 1), np.int8)}),
     ["'model.q_proj.weight_zero_point'", "symmetric", "nonzero"]),
])
def test_quantized_module_inconsistent_with_format(tmp_path, edit, needles):
    d = _ck(tmp_path / "ck")
    _rewrite(d, edit)
    with pytest.raises(CheckpointError) as e:
        read_compressed(d)
    for n in needles:
        assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("edit, needle", [
    ("no-config", "no config.json"),
    ("no-qc", "has no quantization_config"),
    ("null-qc", "has no quantization_config"),
    ("null-groups", "no config group with weights"),
    ("null-weights", "no config group with weights"),
    ("dense", "format 'dense'"),
    ("mismatched", "expected exactly the tensors"),
    ("int-args", "does not store"),
])
def test_compressed_tensors_need_a_config_that_quantizes_them(tmp_path, edit, needle):
    d = _ck(tmp_path / "ck", "W4A16")
    if edit == "no-config":
        (d / "config.json").unlink()
    elif edit == "no-qc":
        _config(d, lambda c: c.pop("quantization_config"))
    elif edit == "null-qc":
        _config(d, lambda c: c.update(quantization_config=None))
    elif edit == "null-groups":
        _config(d, lambda c: c["quantization_config"].update(config_groups=None))
    elif edit == "null-weights":
        _config(d, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(weights=None))
    elif edit == "dense":
        _config(d, lambda c: (c["quantization_config"].update(format="dense"),
                              c["quantization_config"]["config_groups"]["group_0"].update(format="dense")))
    elif edit == "mismatched":
        _config(d, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="naive-quantized"))
    else:  # float-quantized group with int args
        d = _ck(tmp_path / "ck8", "W8A8")
        _config(d, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="float-quantized"))
    with pytest.raises(CheckpointError) as e:
        read_compressed(d)
    assert needle in str(e.value) and "model.q_proj" in str(e.value), str(e.value)


def test_module_targeted_by_name_without_its_scale(tmp_path):
    """A module a compressing group targets by name but that holds only a float weight: its compressed tensors
    were lost, and reading it as dense would be silently wrong."""
    d = _ck(tmp_path / "ck", targets=["re:model\\..*_proj"])
    _rewrite(d, lambda t: t.update({"model.k_proj.weight": np.zeros((16, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model.k_proj'.*targets it by name.*model.k_proj.weight_scale"):
        read_compressed(d)
    # the same module in `ignore` reads as dense
    _config(d, lambda c: c["quantization_config"].update(ignore=["model.k_proj"]))
    assert read_compressed(d).modules["model.k_proj"]["weight"].dtype == np.float32


def test_frozen_dense_group_reads_raw(tmp_path):
    """format 'dense' (llm-compressor's save_compressed=False): float weights beside their scales, read as stored."""
    d = tmp_path / "ck"
    ss = qf.presets["FP8_DYNAMIC"]
    write_compressed(d, {"model.q_proj.weight": W.T.copy(), "model.q_proj.weight_scale": np.ones((32, 1), np.float32)},
                     ss, config={"model_type": "tiny"})
    _config(d, lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
        "config_groups": {"group_0": {"format": "dense", "targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}))
    m = read_compressed(d)
    np.testing.assert_array_equal(m.modules["model.q_proj"]["weight"], W.T)


# ---- the safetensors header, as the safetensors library takes it -------------------------------------------------
def _file(path: Path, header: bytes, data: bytes, n: "int | None" = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)
    return path


def _theirs_accepts(path: Path) -> bool:
    from safetensors import safe_open
    try:
        with safe_open(str(path), "np") as f:
            for k in f.keys():
                f.get_slice(k)
        return True
    except Exception:  # noqa: BLE001 - any rejection
        return False


def _ours_accepts(path: Path) -> bool:
    try:
        with SafetensorsFile(path) as f:
            for k in f.keys():
                f.get(k)
        return True
    except CheckpointError:
        return False


T1 = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}


@pytest.mark.parametrize("header, data, n, accepted", [
    (b"{}", b"", None, True),
    (b"{}      ", b"", None, True),
    (b"", b"", None, False),  # zero-length header
    (b"{}", b"x", None, False),  # trailing bytes
    (json.dumps(T1).encode(), b"ab", None, True),
    (json.dumps(T1).encode() + b" ", b"ab", len(json.dumps(T1)), False),  # length one byte short
    (json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}).encode(), b"xab", None, False),  # gap
    (json.dumps({**T1, "z": {"dtype": "U8", "shape": [0], "data_offsets": [1, 1]}}).encode(), b"ab", None, False),
    (json.dumps({**T1, "z": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]}}).encode(), b"ab", None, True),
    (b'{"\\ud800":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"ab", None, False),  # lone surrogate
    (b"{}\x00\x00", b"", None, False),
])
def test_header_rules_match_safetensors(tmp_path, header, data, n, accepted):
    p = _file(tmp_path / "x.safetensors", header, data, n)
    assert _theirs_accepts(p) == accepted
    assert _ours_accepts(p) == accepted


@pytest.mark.parametrize("n, accepted", [(MAX_METADATA_ENTRIES, True), (300_000, False)])
def test_many_metadata_entries_read_or_refused_in_linear_time(tmp_path, n, accepted):
    """A header with 300,000 `__metadata__` entries is refused (typed, naming the cap) in well under two seconds;
    one at the cap opens as fast with its metadata intact; duplicates and lone surrogates are still named. The bound is
    on this process's CPU time (a busy machine stretches wall time; a quadratic parse would take minutes of CPU)."""
    meta = {f"key{i}": f"value{i}" for i in range(n)}
    text = json.dumps({"__metadata__": meta, **T1}).encode()
    p = _file(tmp_path / "m.safetensors", text + b" " * (-len(text) % 8), b"ab")
    t0 = time.process_time()
    with time_limit(30):
        if accepted:
            with SafetensorsFile(p) as f:
                assert f.metadata == meta and f.keys() == ["a"]
        else:
            with pytest.raises(CheckpointError, match=f"__metadata__: expected at most {MAX_METADATA_ENTRIES} "
                                                      f"entries, found {n}"):
                SafetensorsFile(p)
    assert time.process_time() - t0 < 2.0
    if not accepted:
        return
    dup = text.replace(b'"key1": "value1"', b'"key2": "value1"')
    p = _file(tmp_path / "d.safetensors", dup + b" " * (-len(dup) % 8), b"ab")
    with pytest.raises(CheckpointError, match="duplicate key 'key2'"):
        SafetensorsFile(p)
    bad = text.replace(b'"key7": "value7"', b'"key7": "va\\ud800lue7"')
    p = _file(tmp_path / "s.safetensors", bad + b" " * (-len(bad) % 8), b"ab")
    with pytest.raises(CheckpointError, match="__metadata__ value .*lone surrogate"):
        SafetensorsFile(p)


def test_where_safetensors_rejects_we_reject(tmp_path):
    """Random edits of a real file's header and length field: every file safe_open rejects, we reject."""
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.uint8),
               "e": np.zeros((0, 2), np.int8)}, tmp_path / "base.safetensors")
    raw = (tmp_path / "base.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    r = random.Random(11)
    rejected = 0
    for i in range(300):
        h = json.loads(json.dumps(header))
        k = r.choice(sorted(h))
        field = r.choice(["data_offsets", "shape", "dtype"])
        v = h[k][field]
        if field == "data_offsets":
            h[k][field] = [v[0] + r.choice([-1, 0, 1, 4]), v[1] + r.choice([-1, 0, 1, 4])]
        elif field == "shape":
            h[k][field] = [max(d + r.choice([-1, 0, 1]), 0) for d in v] or [1]
        else:
            h[k][field] = r.choice(["U8", "I8", "F32", "I32", "F16", "F4", "F64"])
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        body = data + r.choice([b"", b"", b"\0", b"\0" * 4])
        p = _file(tmp_path / f"m{i}.safetensors", text, body, len(text) + r.choice([0, 0, 0, -1, -2, 1]))
        if not _theirs_accepts(p):
            rejected += 1
            assert not _ours_accepts(p), (i, h)
    assert rejected > 100


# ---- only regular files, size-capped JSON -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "outside", "directory", "huge"])
def test_config_json_must_be_a_small_regular_file_inside(tmp_path, kind):
    d = _ck(tmp_path / "ck")
    cfg = d / "config.json"
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
    elif kind.startswith("/dev/"):
        os.symlink(kind, cfg)
    elif kind == "outside":
        (tmp_path / "elsewhere.json").write_text("{}")
        os.symlink(tmp_path / "elsewhere.json", cfg)
    elif kind == "directory":
        cfg.mkdir()
    else:
        with open(cfg, "wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)
    with time_limit(5), pytest.raises(CheckpointError) as e:
        read_compressed(d)
    msg = str(e.value)
    assert "config.json" in msg
    assert {"fifo": "a FIFO", "/dev/zero": "symbolic link to /dev/zero", "/dev/urandom": "/dev/urandom",
            "outside": "inside the checkpoint directory", "directory": "a directory",
            "huge": f"at most {MAX_JSON_BYTES} bytes"}[kind] in msg, msg


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_weights_must_be_a_regular_file(tmp_path, kind):
    d = _ck(tmp_path / "ck")
    (d / "model.safetensors").unlink()
    if kind == "fifo":
        os.mkfifo(d / "model.safetensors")
    else:
        os.symlink(kind, d / "model.safetensors")
    with time_limit(5), pytest.raises(CheckpointError, match="model.safetensors"):
        read_compressed(d)


def test_hugging_face_cache_layout_is_followed(tmp_path):
    """snapshots/<rev>/ holds links to ../../blobs/<hash>: allowed (only there), as huggingface_hub lays it out."""
    src = _ck(tmp_path / "ck")
    repo = tmp_path / "models--x--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in src.iterdir():
        shutil.copy(p, blobs / (p.name + ".blob"))
        os.symlink(Path("..") / ".." / "blobs" / (p.name + ".blob"), snap / p.name)
    ref = read_compressed(src)
    got = read_compressed(snap)
    np.testing.assert_array_equal(np.asarray(qf.dequantize(got.qarrays()["model.q_proj"])),
                                  np.asarray(qf.dequantize(ref.qarrays()["model.q_proj"])))
    assert read_json(snap / "config.json", snap)["model_type"] == "tiny"


# ---- copying the extra files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, needle", [("..", "directory"), ("/dev/zero", "/dev/zero"), ("fifo", "a FIFO"),
                                          ("outside", "inside the checkpoint directory")])
def test_dequantize_copies_extra_files_safely(tmp_path, kind, needle):
    d = _ck(tmp_path / "ck")
    tok = d / "tokenizer.json"
    if kind == "fifo":
        os.mkfifo(tok)
    elif kind == "outside":
        (tmp_path / "secret.txt").write_text("x")
        os.symlink(tmp_path / "secret.txt", tok)
    else:
        os.symlink(kind, tok)
    with time_limit(10), pytest.raises(CheckpointError) as e:
        dequantize_checkpoint(d, tmp_path / "out")
    assert "tokenizer.json" in str(e.value) and needle in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_copy_extra_files_copies_regular_files_and_directories(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "1_Pooling").mkdir(parents=True)
    (src / "tokenizer.json").write_text('{"a": 1}')
    (src / "1_Pooling" / "config.json").write_text("{}")
    os.symlink("tokenizer.json", src / "vocab.json")  # a link inside the directory: copied as a file
    (src / ".git").mkdir()
    dst.mkdir()
    assert copy_extra_files(src, dst) == ["1_Pooling", "tokenizer.json", "vocab.json"]
    assert (dst / "vocab.json").read_text() == '{"a": 1}' and not (dst / "vocab.json").is_symlink()
    assert (dst / "1_Pooling" / "config.json").read_text() == "{}"
    with pytest.raises(CheckpointError, match="outside the source"):
        copy_extra_files(src, src / "1_Pooling")


# ---- config patterns in bounded time ------------------------------------------------------------------------------
NORMAL = [(r".*lm_head", "lm_head"), (r".*lm_head", "model.lm_head"), (r"lm_head", "model.lm_head"),
          (r"model\.layers\.\d+\.mlp\.gate$", "model.layers.12.mlp.gate"),
          (r"model\.layers\.\d+\.mlp\.gate$", "model.layers.12.mlp.gate_proj"), (r"visual.*", "visual.blocks.0"),
          (r".*(q|k|v)_proj", "model.layers.0.self_attn.k_proj"), (r"re:x", "x"), (r"(?i)LM_HEAD", "lm_head"),
          (r"[a-z]+\.[0-9]{2}", "layers.07"), (r"", "anything")]


@pytest.mark.parametrize("pattern, name", NORMAL)
def test_patterns_agree_with_re_match(pattern, name):
    assert patterns.pattern_matches(pattern, name) == (re.match(pattern, name) is not None)


def test_redos_pattern_in_ignore_is_bounded(tmp_path, monkeypatch):
    """`re:(a|aa)+$` against a 40-character name: Python's re backtracks for minutes; we answer at once (RE2) or
    refuse the pattern with a typed error (no RE2)."""
    name = "a" * 40 + "b"
    d = tmp_path / "ck"
    ss = qf.presets["FP8_DYNAMIC"]
    write_compressed(d, {f"{name}.weight": qf.quantize(W, ss.weights, axis=0)}, ss, config={"model_type": "tiny"})
    _config(d, lambda c: c["quantization_config"].update(ignore=["re:(a|aa)+$"]))
    if patterns.LINEAR_TIME:
        with time_limit(5):
            assert name in read_compressed(d).qarrays()
    monkeypatch.setattr(patterns, "_re2", None)
    monkeypatch.setattr(patterns, "LINEAR_TIME", False)
    patterns._compile.cache_clear()
    try:
        with time_limit(5), pytest.raises(CheckpointError, match=r"config.json: quantization_config: ignore\[0\]"):
            read_compressed(d)
        for pattern, n in NORMAL:  # the fallback keeps re.match's answers
            assert patterns.pattern_matches(pattern, n) == (re.match(pattern, n) is not None)
    finally:
        patterns._compile.cache_clear()


def test_unsupported_pattern_is_a_typed_error(tmp_path):
    d = _ck(tmp_path / "ck")
    _config(d, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(targets=["re:(unclosed"]))
    with pytest.raises(CheckpointError, match=r"targets\[0\].*re:\(unclosed"):
        read_compressed(d)


# ---- names that are not valid Unicode -----------------------------------------------------------------------------
def test_lone_surrogate_name_named_at_the_source(tmp_path, capsys):
    d = _ck(tmp_path / "ck")
    raw = (d / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    text = raw[8:8 + n].replace(b'"model.norm.weight"', b'"model.n\\udc80rm.weight"')
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor name 'model.n\\udc80rm.weight'"):
        read_compressed(d)
    from converters.cli import main
    assert main(["dequantize", str(d), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "udc80" in err and ".tmp" not in err, err
