"""Bad checkpoints: each gives a CheckpointError naming the file and tensor (or a warning), never a traceback from
deep inside numpy, never partial output. Plus a hypothesis fuzz over mutated small compressed checkpoints."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qformats as qf
from converters.formats.compressed_tensors import write as ct_write
from converters.formats.compressed_tensors.read import read_compressed
from converters.formats.compressed_tensors.write import write_compressed
from converters.pipelines.quantize_checkpoint import quantize_checkpoint
from converters.formats.safetensors_io import SafetensorsFile, save_file
from qformats.errors import CheckpointError

RNG = np.random.default_rng(0)
W_A = (RNG.standard_normal((64, 32)) * 0.1).astype(np.float32)  # Flax kernels [in, out]
W_B = (RNG.standard_normal((64, 48)) * 0.1).astype(np.float32)
W_C = (RNG.standard_normal((32, 16)) * 0.1).astype(np.float32)


def _base(path: Path, preset: str = "W4A16_ASYM") -> Path:
    ss = qf.presets[preset]
    g = ss.weights.group_size
    sch = ss.weights if not g or 64 % g == 0 else dataclasses.replace(ss.weights, group_size=32)
    write_compressed(path, {"m.a.weight": qf.quantize(W_A, sch, axis=0), "m.a.bias": np.zeros(32, np.float32),
                            "m.b.weight": qf.quantize(W_B, sch, axis=0),
                            "m.norm.weight": np.ones(48, np.float32)}, ss, config={"model_type": "tiny"})
    return path


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    out = {}
    for preset in ("W4A16_ASYM", "NVFP4A16", "FP8_DYNAMIC", "MXFP6A16", "W3A16"):
        out[preset] = _base(tmp_path_factory.mktemp(preset) / "ck", preset)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _tensors(path: Path):
    with SafetensorsFile(path / "model.safetensors") as f:
        return {k: np.array(f.get(k)) for k in f.keys()}


def _set_config(path: Path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


# ---- files ----------------------------------------------------------------------------------------------------
def test_truncated_file(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors.*tensor"):
        read_compressed(d)


def test_header_longer_than_file(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    with pytest.raises(CheckpointError, match="model.safetensors: header length"):
        read_compressed(d)


def _rewrite_header(f: Path, fn):
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    fn(h)
    hb = json.dumps(h).encode()
    hb += b" " * (-len(hb) % 8)
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def test_offsets_out_of_range_and_overlap(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "a")
    _rewrite_header(d / "model.safetensors",
                    lambda h: h["m.a.weight_scale"].__setitem__("data_offsets", [0, 10**9]))
    with pytest.raises(CheckpointError, match="m.a.weight_scale.*out of range"):
        read_compressed(d)
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "b")

    def overlap(h):
        a, b = h["m.a.weight_packed"]["data_offsets"], h["m.b.weight_packed"]["data_offsets"]
        h["m.b.weight_packed"]["data_offsets"] = [a[0], a[0] + b[1] - b[0]]
    _rewrite_header(d / "model.safetensors", overlap)
    with pytest.raises(CheckpointError, match="overlap"):
        read_compressed(d)


def test_weight_packed_not_int32(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    t = _tensors(d)
    t["m.a.weight_packed"] = t["m.a.weight_packed"].view(np.float32)
    (d / "model.safetensors").unlink()
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'm.a.weight_packed': expected dtype I32, "
                                              r"found F32"):
        read_compressed(d)


@pytest.mark.parametrize("preset,missing", [("W4A16_ASYM", "weight_scale"), ("W4A16_ASYM", "weight_zero_point"),
                                            ("NVFP4A16", "weight_global_scale"), ("W3A16", "weight_shape")])
def test_missing_tensor(base_dirs, tmp_path, preset, missing):
    d = _copy(base_dirs[preset], tmp_path / "ck")
    t = _tensors(d)
    del t[f"m.b.{missing}"]
    (d / "model.safetensors").unlink()
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"module 'm.b'.*'m.b.{missing}'"):
        read_compressed(d)


def test_wrong_scale_shape(base_dirs, tmp_path):
    d = _copy(base_dirs["FP8_DYNAMIC"], tmp_path / "ck")
    t = _tensors(d)
    t["m.a.weight_scale"] = t["m.a.weight_scale"][:5]
    (d / "model.safetensors").unlink()
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'm.a.weight_scale': expected shape \[32, 1\]"):
        read_compressed(d)


@pytest.mark.parametrize("mutate,match", [
    (lambda q: q.__setitem__("format", "zz-quantized"), "unknown format 'zz-quantized'"),
    (lambda q: q["config_groups"]["group_0"].__setitem__("format", "zz"), "group_0: unknown format 'zz'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("strategy", "diagonal"),
     "unknown strategy 'diagonal'"),
    (lambda q: q.__setitem__("transform_config", {"config_groups": {"u": {}}}), "transform_config"),
    (lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 12), "num_bits"),
])
def test_bad_config(base_dirs, tmp_path, mutate, match):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    _set_config(d, mutate)
    with pytest.raises(CheckpointError, match="config.json: quantization_config.*" + match):
        read_compressed(d)


def test_non_json_config(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: expected JSON"):
        read_compressed(d)


def test_no_safetensors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty/config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="empty: expected model.safetensors"):
        read_compressed(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="empty: expected model.safetensors"):
        quantize_checkpoint(tmp_path / "empty", tmp_path / "out", "W4A16", progress=False)
    assert not (tmp_path / "out").exists()


def test_ignore_and_targets_matching_nothing_warn(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    _set_config(d, lambda q: q.__setitem__("ignore", ["nope.layer"]))
    with pytest.warns(UserWarning, match="ignore entry 'nope.layer' matches no module"):
        read_compressed(d)
    _set_config(d, lambda q: q["config_groups"].__setitem__("group_1", dict(
        q["config_groups"]["group_0"], targets=["re:^nothing$"])))
    with pytest.warns(UserWarning, match="group 'group_1'.*matches no quantized module"):
        read_compressed(d)
    src = tmp_path / "dense"
    src.mkdir()
    save_file({"x.weight": W_A.T.copy(), "embed_tokens.weight": W_C}, src / "model.safetensors")
    with pytest.warns(UserWarning, match="ignore entry 'foo' matches no targeted module"):
        quantize_checkpoint(src, tmp_path / "o1", "FP8_DYNAMIC", ignore=["foo"], progress=False)
    with pytest.warns(UserWarning, match="target 're:zzz' matches no weight"):
        quantize_checkpoint(src, tmp_path / "o2", "FP8_DYNAMIC", targets=["Linear", "re:zzz"], progress=False)


def test_ignored_module_with_quantized_tensors(base_dirs, tmp_path):
    d = _copy(base_dirs["W4A16_ASYM"], tmp_path / "ck")
    _set_config(d, lambda q: q.__setitem__("ignore", ["m.a"]))
    with pytest.raises(CheckpointError, match="module 'm.a': the module is in quantization_config.ignore"):
        read_compressed(d)


def test_no_partial_output_on_failure(tmp_path, monkeypatch):
    src = tmp_path / "dense"
    src.mkdir()
    save_file({"a.weight": W_A.T.copy(), "b.weight": W_B.T.copy()}, src / "model.safetensors")
    calls = []
    orig = ct_write.CompressedWriter.add_qarray

    def boom(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise CheckpointError("boom")
        return orig(self, *a, **k)

    monkeypatch.setattr(ct_write.CompressedWriter, "add_qarray", boom)
    with pytest.raises(CheckpointError, match="boom"):
        quantize_checkpoint(src, tmp_path / "out", "FP8_DYNAMIC", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep/x").write_text("old")
    with pytest.raises(CheckpointError, match="boom"):
        calls.clear()
        quantize_checkpoint(src, tmp_path / "keep", "FP8_DYNAMIC", overwrite=True, progress=False)
    assert (tmp_path / "keep/x").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "keep"]


def test_shape_not_fitting_scheme_refused_or_left_dense_on_request(tmp_path):
    src = tmp_path / "dense"
    src.mkdir()
    save_file({"a.weight": W_A.T.copy(), "odd.weight": np.ones((8, 40), np.float32)}, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"- odd \(weight \[8, 40\] .*columns=40 not divisible by group_size=32"):
        quantize_checkpoint(src, tmp_path / "out", "MXFP4A16", progress=False)
    s = quantize_checkpoint(src, tmp_path / "out", "MXFP4A16", progress=False, skip_indivisible=True)
    assert s.quantized == 1 and s.skipped == ["odd"]
    qc = json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["odd"]


# ---- fuzz ----------------------------------------------------------------------------------------------------
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.sampled_from(
    ["int", "float", "group", "channel", "tensor", "block", "tensor_group", "torch.uint8", "re:.*", "Linear",
     "pack-quantized", "nvfp4-pack-quantized", "mxfp6-pack-quantized", "float-quantized", "0.17.0", "local"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["a", "num_bits", "targets"]), c,
                                                           max_size=2), max_leaves=4)
_CFG_PATHS = [("format",), ("version",), ("ignore",), ("config_groups",), ("config_groups", "group_0"),
              ("config_groups", "group_0", "format"), ("config_groups", "group_0", "targets"),
              ("config_groups", "group_0", "weights"), ("config_groups", "group_0", "input_activations")] + [
    ("config_groups", "group_0", "weights", k) for k in
    ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "scale_dtype")]
_DTYPES = ["F32", "BF16", "F16", "I32", "I64", "U8", "I8", "F8_E4M3", "F8_E8M0", "BOOL"]


def _apply_path(cfg, path, value, delete):
    node = cfg
    for k in path[:-1]:
        if not isinstance(node, dict) or k not in node:
            return
        node = node[k]
    if isinstance(node, dict):
        if delete:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(preset=st.sampled_from(["W4A16_ASYM", "NVFP4A16", "FP8_DYNAMIC", "MXFP6A16", "W3A16"]),
       cfg_edits=st.lists(st.tuples(st.sampled_from(_CFG_PATHS), _JSON, st.booleans()), max_size=2),
       hdr_edits=st.lists(st.tuples(st.sampled_from(["m.a.weight_packed", "m.a.weight", "m.a.weight_scale",
                                                     "m.b.weight_zero_point", "m.b.weight_global_scale",
                                                     "m.b.weight_shape", "m.a.bias"]),
                                    st.sampled_from(["dtype", "shape", "drop"]), st.data()), max_size=2),
       flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=3))
def test_fuzz_only_checkpoint_error(base_dirs, tmp_path_factory, preset, cfg_edits, hdr_edits, flips):
    d = _copy(base_dirs[preset], tmp_path_factory.mktemp("fz") / "ck")
    cfg = json.loads((d / "config.json").read_text())
    for path, value, delete in cfg_edits:
        _apply_path(cfg["quantization_config"], path, value, delete)
    (d / "config.json").write_text(json.dumps(cfg))

    def edit(h):
        for name, what, data in hdr_edits:
            if name not in h:
                continue
            if what == "drop":
                del h[name]
            elif what == "dtype":
                h[name]["dtype"] = data.draw(st.sampled_from(_DTYPES))
            else:
                shape = h[name]["shape"]
                h[name]["shape"] = data.draw(st.lists(st.integers(0, 70), min_size=max(len(shape) - 1, 0),
                                                      max_size=len(shape) + 1))
    if hdr_edits:
        _rewrite_header(d / "model.safetensors", edit)
    if flips:
        raw = bytearray((d / "model.safetensors").read_bytes())
        for pos, val in flips:
            raw[min(int(pos * len(raw)), len(raw) - 1)] = val
        (d / "model.safetensors").write_bytes(bytes(raw))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = read_compressed(d)
        for q in cm.qarrays().values():
            qf.dequantize(q)
    except CheckpointError as e:
        assert str(e)
