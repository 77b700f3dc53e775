"""compressed-tensors parity, with compressed-tensors itself as the oracle.

read:   CT quantizes + compresses + saves a small model for each preset; our reader's dequantize is
        bit-identical to CT's per-format decompression.
quantize_checkpoint: the same dense weights quantized by us give byte-identical tensors and an identical
        config.json (text) to CT's compression, for every data-free preset.
write:  QArrays from qformats.quantize written by us are decompressed by CT to exactly our dequantize.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
sys.path.insert(0, str(Path(__file__).parent))

import ct_oracle as O  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import qformats as qf  # noqa: E402
from converters.formats.compressed_tensors.config import (  # noqa: E402
    CT_VERSION, parse_quantization_config, scheme_to_args)
from converters.formats.compressed_tensors.read import read_compressed  # noqa: E402
from converters.formats.compressed_tensors.write import write_compressed  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402

# + W4A8 (int-quantized: 4-bit values in int8), W6A16 (6-bit words straddling int32s), MXFP8 (MX activations)
READ_PRESETS = ["FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W8A16", "W4A16", "W4A16_ASYM", "W3A16",
                "NVFP4A16", "MXFP4A16", "MXFP6A16", "MXFP8A16", "NVFP4", "W4A8", "W6A16", "MXFP8"]
DATA_FREE = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W8A16", "W4A16", "W4A16_ASYM", "W3A16", "NVFP4A16",
             "MXFP4A16", "MXFP8A16", "MXFP6A16", "W4A8", "W6A16", "MXFP8"]
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}
# every preset in bf16; float32 for one preset per arithmetic path (keeps the suite fast on 2 cores)
F32_SUBSET = {"FP8_BLOCK", "W8A8", "W4A16_ASYM", "W3A16", "NVFP4A16", "MXFP6A16"}
F16_SUBSET = {"W8A8", "MXFP4A16"}  # all twelve were checked in float16 once; these stay in the suite


def _cases(names):
    return [(p, d) for p in names for d in DTYPES
            if d == "bf16" or (d == "f32" and p in F32_SUBSET) or (d == "f16" and p in F16_SUBSET)]


def _np_bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]).astype(np.int64)


def _t_bytes(t):
    return t.flatten().clone().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(preset, dtype) -> dir with: src/ (dense), ct/ (CT-compressed), and the CT state dict."""
    cache = {}

    def get(preset, dtag):
        key = (preset, dtag)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{preset}_{dtag}")
            m = O.make_model(O.LAYERS, DTYPES[dtag])
            (root / "src").mkdir()
            save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(root / "src/model.safetensors"))
            cfg = {"model_type": "tiny", "torch_dtype": str(DTYPES[dtag])[6:]}
            (root / "src/config.json").write_text(json.dumps(cfg))
            (root / "src/tokenizer.json").write_text('{"t": 1}')
            O.quantize_model(m, preset)
            sd = O.save_compressed(m, root / "ct", cfg)
            cache[key] = (root, sd)
        return cache[key]

    return get


@pytest.mark.parametrize("preset,dtag", _cases(READ_PRESETS))
def test_read_bit_identical_to_ct_decompress(built, preset, dtag):
    root, _ = built(preset, dtag)
    ref = O.decompress_dir(root / "ct")
    cm = read_compressed(root / "ct")
    assert set(ref) == set(cm.qarrays()) == {"model.layers.0.attn.q_proj", "model.layers.0.mlp.up_proj"}
    for mod, w in ref.items():
        q = cm.modules[mod]["weight"]
        assert q.shape == (w.shape[1], w.shape[0]) and q.axis == 0
        ours = np.asarray(qf.dequantize(q)).T
        assert ours.dtype.itemsize == w.element_size() and str(ours.dtype) == str(w.dtype)[6:]
        np.testing.assert_array_equal(_np_bits(ours), O.bits_of(w), err_msg=f"{preset} {mod}")
    # the rest comes through: biases, the ignored lm_head, activation scales
    assert "bias" in cm.modules["model.layers.0.attn.q_proj"]
    assert not hasattr(cm.modules["lm_head"]["weight"], "scheme")
    if preset == "FP8":
        assert "input_scale" in cm.modules["model.layers.0.attn.q_proj"]
    if preset == "NVFP4":
        assert "input_global_scale" in cm.modules["model.layers.0.attn.q_proj"]
    fp = cm.flax_params()
    assert fp["model"]["layers"]["0"]["attn"]["q_proj"]["kernel"].shape == (128, 64)
    assert fp["lm_head"]["kernel"].shape == (64, 32)


@pytest.mark.parametrize("preset,dtag", _cases(DATA_FREE))
def test_quantize_checkpoint_byte_identical_to_ct(built, preset, dtag, tmp_path):
    root, ref = built(preset, dtag)
    s = quantize_checkpoint(root / "src", tmp_path / "out", preset, progress=False)
    assert s.quantized == 2 and s.dst_bytes < s.src_bytes
    ours = load_file(str(tmp_path / "out/model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for k, a in ref.items():
        b = ours[k]
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), k
        np.testing.assert_array_equal(_t_bytes(a), _t_bytes(b), err_msg=k)
    # config.json: the same text compressed-tensors' update_config writes
    # (compressed-tensors stamps its own patch version; we write the format version we follow, CT_VERSION)
    theirs = (root / "ct/config.json").read_text()
    theirs = re.sub(r'"version": "0\.20\.\d+"', f'"version": "{CT_VERSION}"', theirs)
    assert (tmp_path / "out/config.json").read_text() == theirs
    assert (tmp_path / "out/tokenizer.json").read_text() == '{"t": 1}'


def test_config_args_match_ct_presets():
    from compressed_tensors.quantization import preset_name_to_scheme
    for name in READ_PRESETS + ["NVFP4", "MXFP4", "W4AFP8", "W2A16", "W8A16"]:
        ct = preset_name_to_scheme(name, ["Linear"]).model_dump()
        ss = qf.presets[name]
        assert scheme_to_args(ss.weights) == ct["weights"], name
        if ss.input_activations is not None:
            assert scheme_to_args(ss.input_activations, "input_activations") == ct["input_activations"], name


@pytest.mark.parametrize("preset", ["W4A16", "NVFP4A16", "MXFP6A16", "FP8_BLOCK", "W4A16_ASYM"])
def test_write_decompressed_by_ct(preset, tmp_path):
    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((96, 256)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((64, 128)) * 0.02).astype(np.float32)
    ss = qf.presets[preset]
    q1, q2 = qf.quantize(w1.T, ss.weights, axis=0), qf.quantize(w2, ss.weights, axis=-1)  # Flax and torch layouts
    write_compressed(tmp_path / "ck", {"a.weight": q1, "b.kernel": q2, "b.bias": np.zeros(64, np.float32)}, ss,
                     config={"model_type": "tiny"})
    ref = O.decompress_dir(tmp_path / "ck")
    for name, q in (("a", q1), ("b", q2)):
        ours = np.asarray(qf.dequantize(q, str(ref[name].dtype)[6:]))
        ours = ours.T if name == "a" else ours
        np.testing.assert_array_equal(_np_bits(ours), O.bits_of(ref[name]), err_msg=f"{preset} {name}")
    qc = json.loads((tmp_path / "ck/config.json").read_text())["quantization_config"]
    parse_quantization_config(qc)


@pytest.mark.parametrize("preset", ["FP6_E3M2", "FP5_E2M2_G32", "FP4_E3M0", "FP8_E4M3_G128"])
def test_fpx_extension_roundtrip(preset, tmp_path):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((128, 96)) * 0.1).astype(np.float32)  # Flax kernel [in, out]
    ss = qf.presets[preset]
    q = qf.quantize(w, ss.weights, axis=0)
    write_compressed(tmp_path / "ck", {"m.kernel": q}, ss)
    cfg = json.loads((tmp_path / "ck/config.json").read_text())["quantization_config"]
    g = cfg["config_groups"]["group_0"]
    if preset != "FP8_E4M3_G128":
        assert g["format"] == "fpx-pack-quantized" and "exponent_bits" in g["weights"]
    r = read_compressed(tmp_path / "ck").modules["m"]["weight"]
    assert r.scheme == q.scheme and r.shape == q.shape
    np.testing.assert_array_equal(_np_bits(qf.dequantize(r)), _np_bits(qf.dequantize(q)))


def test_mixed_precision_and_sharding(tmp_path):
    rng = np.random.default_rng(3)
    wa = rng.standard_normal((128, 64)).astype(np.float32)
    wb = rng.standard_normal((256, 32)).astype(np.float32)
    qa = qf.quantize(wa, qf.presets["W4A16"].weights, axis=0)
    qb = qf.quantize(wb, qf.presets["MXFP4A16"].weights, axis=0)
    write_compressed(tmp_path / "ck", {"x.a.weight": qa, "x.b.weight": qb,
                                       "emb.weight": rng.standard_normal((100, 16)).astype(np.float32)},
                     {"x.a": qf.presets["W4A16"], "x.b": qf.presets["MXFP4A16"]}, max_shard_size=4000)
    assert (tmp_path / "ck/model.safetensors.index.json").exists()
    qc = json.loads((tmp_path / "ck/config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    cm = read_compressed(tmp_path / "ck")
    assert cm.formats == {"x.a": "pack-quantized", "x.b": "mxfp4-pack-quantized"}
    for name, q in (("x.a", qa), ("x.b", qb)):
        np.testing.assert_array_equal(_np_bits(qf.dequantize(cm.modules[name]["weight"], np.float32)),
                                      _np_bits(qf.dequantize(q, np.float32)))
    # compressed-tensors reads each group too
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file as lf
    sd = {}
    for f in sorted((tmp_path / "ck").glob("*.safetensors")):
        sd.update(lf(str(f)))
    for gname, mod in (("group_0", "x.a"), ("group_1", "x.b")):
        g = qc["config_groups"][gname]
        assert g["targets"] == [f"re:^{mod.replace('.', chr(92) + '.')}$"]
        t = {k.rpartition(".")[2]: v for k, v in sd.items() if k.rpartition(".")[0] == mod}
        w = BaseCompressor.get_value_from_registry(g["format"]).decompress(t, QuantizationScheme.model_validate(g))
        q = cm.modules[mod]["weight"]
        np.testing.assert_array_equal(_np_bits(np.asarray(qf.dequantize(q)).T), O.bits_of(w["weight"]))


def test_legacy_pack_layout(tmp_path, built):
    """A 0.17-style checkpoint (32 // bits values per int32 word) of W3A16 reads the same values."""
    from qformats.packing import pack_int32, unpack_int32
    root, _ = built("W3A16", "bf16")
    dense = read_compressed(root / "ct")
    sd = load_file(str(root / "ct/model.safetensors"))
    for mod in dense.qarrays():
        n, k = sd[mod + ".weight_shape"].tolist()
        u = unpack_int32(sd[mod + ".weight_packed"].numpy(), 3, k)
        sd[mod + ".weight_packed"] = torch.from_numpy(np.array(pack_int32(u, 3, legacy=True)))
    (tmp_path / "old").mkdir()
    save_file(sd, str(tmp_path / "old/model.safetensors"))
    cfg = json.loads((root / "ct/config.json").read_text())
    cfg["quantization_config"]["version"] = "0.17.1"
    (tmp_path / "old/config.json").write_text(json.dumps(cfg))
    old = read_compressed(tmp_path / "old")
    for mod, q in dense.qarrays().items():
        np.testing.assert_array_equal(_np_bits(qf.dequantize(old.modules[mod]["weight"])), _np_bits(qf.dequantize(q)))


def test_static_activation_presets_refused(tmp_path):
    from qformats.errors import CheckpointError
    with pytest.raises(CheckpointError, match="static input activation scales"):
        quantize_checkpoint(tmp_path, tmp_path / "o", "FP8", progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("preset", ["W4A16_ASYM", "NVFP4A16"])
def test_transformers_loads_our_checkpoint(preset, tmp_path):
    """transformers + CompressedTensorsConfig(dequantize=True) loads what quantize_checkpoint writes, and its
    decompressed weights equal our dequantize bit for bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import CompressedTensorsConfig
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", preset, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = transformers.AutoModel.from_pretrained(tmp_path / "q",
                                                    quantization_config=CompressedTensorsConfig(dequantize=True))
    sd = lm.state_dict()
    qs = read_compressed(tmp_path / "q").qarrays()
    assert len(qs) == 7  # q, k, v, attention.output, intermediate, output, pooler
    for mod, q in qs.items():
        np.testing.assert_array_equal(_np_bits(np.asarray(qf.dequantize(q)).T), O.bits_of(sd[mod + ".weight"]),
                                      err_msg=mod)


@pytest.mark.parametrize("dtag", ["bf16"])
def test_nvfp4_fused_global_scales_like_llm_compressor(dtag, tmp_path):
    """q/k/v and gate/up share the smallest NVFP4 global scale (llm-compressor's fused-layer rule)."""
    layers = {f"model.layers.0.self_attn.{n}": (64 if n != "q_proj" else 128, 64) for n in ("q_proj", "k_proj",
                                                                                             "v_proj", "o_proj")}
    layers.update({"model.layers.0.mlp.gate_proj": (96, 64), "model.layers.0.mlp.up_proj": (96, 64),
                   "model.layers.0.mlp.down_proj": (64, 96)})
    m = O.make_model(layers, DTYPES[dtag], seed=4)
    with torch.no_grad():
        m.get_submodule("model.layers.0.self_attn.v_proj").weight.mul_(7)  # a different amax per member
    (tmp_path / "src").mkdir()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "src/model.safetensors"))
    quantize_checkpoint(tmp_path / "src", tmp_path / "ours", "NVFP4A16", progress=False)
    O.quantize_model(m, "NVFP4A16")
    ref = O.save_compressed(m, tmp_path / "ct")
    ours = load_file(str(tmp_path / "ours/model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for k, a in ref.items():
        np.testing.assert_array_equal(_t_bytes(a), _t_bytes(ours[k]), err_msg=k)
    g = {k: float(v) for k, v in ours.items() if k.endswith("weight_global_scale")}
    assert len({g[f"model.layers.0.self_attn.{n}.weight_global_scale"] for n in ("q_proj", "k_proj", "v_proj")}) == 1
    assert g["model.layers.0.self_attn.o_proj.weight_global_scale"] != g["model.layers.0.self_attn.q_proj."
                                                                         "weight_global_scale"]


def test_flax_params_roundtrip(tmp_path):
    from converters.formats.compressed_tensors.write import flatten_flax_params
    rng = np.random.default_rng(9)
    ss = qf.presets["W8A16"]
    params = {"enc": {"q": {"kernel": qf.quantize(rng.standard_normal((128, 32)).astype(np.float32), ss.weights,
                                                  axis=0), "bias": np.zeros(32, np.float32)},
                      "norm": {"scale": np.ones(32, np.float32)},
                      "out": {"kernel": rng.standard_normal((32, 16)).astype(np.float32)}}}
    flat = flatten_flax_params(params)
    assert sorted(flat) == ["enc.norm.scale", "enc.out.weight", "enc.q.bias", "enc.q.weight"]
    assert flat["enc.out.weight"].shape == (16, 32)
    write_compressed(tmp_path / "ck", flat, ss)
    back = read_compressed(tmp_path / "ck").flax_params()
    np.testing.assert_array_equal(back["enc"]["out"]["kernel"], params["enc"]["out"]["kernel"])
    q0, q1 = params["enc"]["q"]["kernel"], back["enc"]["q"]["kernel"]
    assert q1.shape == q0.shape == (128, 32)
    np.testing.assert_array_equal(np.asarray(qf.dequantize(q1)), np.asarray(qf.dequantize(q0)))


def test_reads_019_style_config(built, tmp_path):
    """compressed-tensors 0.19 writes every QuantizationArgs field (nulls, observer, zp_dtype): still read."""
    import shutil
    root, _ = built("W4A16_ASYM", "bf16")
    shutil.copytree(root / "ct", tmp_path / "old")
    cfg = json.loads((tmp_path / "old/config.json").read_text())
    w = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    w.update(actorder=None, block_structure=None, observer="minmax", observer_kwargs={}, scale_dtype=None,
             zp_dtype="torch.int8")
    cfg["quantization_config"]["version"] = "0.19.1"
    (tmp_path / "old/config.json").write_text(json.dumps(cfg))
    new, old = read_compressed(root / "ct"), read_compressed(tmp_path / "old")
    for mod, q in new.qarrays().items():
        assert old.modules[mod]["weight"].scheme == q.scheme
        np.testing.assert_array_equal(_np_bits(qf.dequantize(old.modules[mod]["weight"])), _np_bits(qf.dequantize(q)))


_RT_PRESETS = ["W4A16_ASYM", "W3A16", "W8A8", "FP8_BLOCK", "NVFP4A16", "MXFP6A16", "MXFP4A16", "FP6_E3M2_G32",
               "FP5_E2M2", "W2A16", "W6A16"]


@settings(max_examples=8, deadline=None)
@given(preset=st.sampled_from(_RT_PRESETS), n=st.sampled_from([16, 48, 136]), k=st.sampled_from([128, 256]),
       dt=st.sampled_from(["float32", "bfloat16"]), flax=st.booleans(), seed=st.integers(0, 3))
def test_write_read_roundtrip_property(tmp_path_factory, preset, n, k, dt, flax, seed):
    """write_compressed -> read_compressed gives back the same scheme and bit-identical dequantized values."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.03).astype(np.float32)
    import jax.numpy as jnp
    ss = qf.presets[preset]
    x = jnp.asarray(w if flax else w.T, dt)
    q = qf.quantize(x, ss.weights, axis=0 if flax else 1)
    d = tmp_path_factory.mktemp("rt") / "ck"
    write_compressed(d, {"m.kernel" if flax else "m.weight": q}, ss)
    r = read_compressed(d).modules["m"]["weight"]
    assert r.scheme == q.scheme and r.shape == (k, n)
    ours = np.asarray(qf.dequantize(q, np.float32))
    back = np.asarray(qf.dequantize(r, np.float32))
    np.testing.assert_array_equal(_np_bits(back), _np_bits(ours if flax else ours.T))
