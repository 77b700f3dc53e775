"""GGUF -> compressed-tensors (`convert_gguf_compressed`, `qformats convert x.gguf DST`): the symmetric block types keep
their codes and scales, and transformers + compressed-tensors 0.20 decompress them to gguf's own dequantization bit
for bit; types with a float offset are refused (grouped, naming the tensors) or, with --dequantize, written dense."""

from __future__ import annotations

import json
import warnings

import numpy as np
from flax import nnx
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from gguf_mixed import mixed_gguf  # noqa: E402

from converters.formats.gguf_convert import open_gguf  # noqa: E402
from converters.pipelines.convert_quantized import convert_gguf_compressed  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402

# the model's forward as one jitted program (eagerly, each operation of each layer compiles on its own)
_logits_of = nnx.jit(lambda m, x: m(x)[0])

# every type compressed-tensors holds exactly, one per projection; an untied lm_head in Q8_0; a Q8_0 embedding
SYMMETRIC = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q5_0", "attn_output": "Q6_K", "ffn_gate": "Q3_K",
             "ffn_up": "MXFP4", "ffn_down": "IQ4_NL", "output": "Q8_0"}
FORMATS = {"Q8_0": ("pack-quantized", 8, 32), "Q4_0": ("pack-quantized", 4, 32), "Q5_0": ("pack-quantized", 5, 32),
           "Q6_K": ("pack-quantized", 6, 16), "Q3_K": ("pack-quantized", 3, 16), "IQ4_NL": ("pack-quantized", 8, 32),
           "MXFP4": ("mxfp4-pack-quantized", 4, 32)}
OFFSET = {"attn_q": "Q4_1", "attn_k": "Q4_K", "attn_v": "Q5_1", "attn_output": "Q5_K", "ffn_gate": "Q2_K",
          "ffn_up": "Q8_0", "ffn_down": "Q8_0"}
IDS = np.array([[0, 5, 17, 99, 200, 3, 44, 250]], np.int64)
# float32 on both sides, the same weights: accumulation order only
ATOL = 2e-5


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def _load_torch(path, dequantize=False):
    kwargs = {}
    if dequantize:
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _ct_weights(model) -> dict:
    """HF name -> float32 weight of every Linear of a transformers model loaded compressed, each quantized module
    decompressed by compressed-tensors' own compressor for the scheme it resolved for that module."""
    from compressed_tensors.compressors import BaseCompressor

    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        scheme = getattr(m, "quantization_scheme", None)
        sd = {k: v.detach() for k, v in m.state_dict().items()}
        if scheme is not None and "weight_packed" in sd:
            sd = BaseCompressor.get_value_from_registry(scheme.format).decompress(sd, scheme)
        out[f"{name}.weight"] = sd["weight"].float().numpy()
    return out


def _our_logits(src) -> np.ndarray:
    import jax.numpy as jnp

    from converters.pipelines.causal_lm import load_causal_lm

    model, _, _ = load_causal_lm(src, tokenizer=False)
    return np.asarray(_logits_of(model, jnp.asarray(IDS, jnp.int32)))


@pytest.fixture(scope="module")
def symmetric(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_ct")
    src = mixed_gguf(root / "sym.gguf", SYMMETRIC, tied=False, embed="Q8_0")
    return src, convert_gguf_compressed(src, root / "ct")


def test_symmetric_types_keep_codes_and_decompress_to_gguf_bit_for_bit(symmetric):
    src, r = symmetric
    g = open_gguf(src)
    assert set(r.quantized) == set(FORMATS) and not r.dequantized
    assert r.dense == {"F32": [n for n in g.keys() if n.endswith("norm.weight")], "Q8_0": ["model.embed_tokens.weight"]}
    lines = {line.split(":")[0]: line for line in r.summary() if "kept quantized" in line}
    for t, (fmt, bits, _) in FORMATS.items():  # vLLM's WNA16 serves num_bits 4 and 8: the others are named
        n = 3 if t == "Q8_0" else 2  # one per layer, and the Q8_0 lm_head
        assert lines[t].startswith(f"{t}: {n} Linear weight(s) kept quantized as {fmt}"), lines[t]
        assert ("vLLM" in lines[t]) == (fmt == "pack-quantized" and bits not in (4, 8)), lines[t]
    qc = json.loads((r.path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and qc["ignore"] == []
    for t, names in r.quantized.items():
        fmt, bits, group = FORMATS[t]
        assert r.formats[t] == fmt
        groups = [c for c in qc["config_groups"].values() if f"re:^{names[0].rsplit('.', 1)[0]}$".replace(".", r"\.")
                  in c["targets"]]
        assert len(groups) == 1, t
        w = groups[0]["weights"]
        assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (bits, group, True, "group")
        assert w["type"] == ("float" if t == "MXFP4" else "int")
        assert w["scale_dtype"] == ("torch.uint8" if t == "MXFP4" else "torch.float32")
    model = _load_torch(r.path)
    got = _ct_weights(model)
    assert sorted(got) == sorted(n for n in g.keys() if n.endswith("proj.weight") or n == "lm_head.weight")
    for n, w in got.items():
        np.testing.assert_array_equal(_bits(w), _bits(g.get(n)), err_msg=n)
    sd = model.state_dict()
    for n in g.keys():
        if n not in got:
            np.testing.assert_array_equal(_bits(sd[n].numpy()), _bits(g.get(n)), err_msg=n)
    # logits: transformers' llama on the weights compressed-tensors decompressed (its MXFP4 comes out bfloat16,
    # exactly the values, and its lazy forward would not cast it for a float32 run)
    cfg = transformers.AutoConfig.from_pretrained(r.path)
    del cfg.quantization_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    dense.load_state_dict({n: torch.from_numpy(np.array(got[n] if n in got else g.get(n))) for n in g.keys()}, strict=True)
    with torch.no_grad():
        theirs = dense(torch.from_numpy(IDS)).logits.numpy()
    ours = _our_logits(src)  # the GGUF file kept packed
    assert np.abs(ours - theirs).max() <= ATOL * max(1.0, np.abs(ours).max())
    np.testing.assert_allclose(_our_logits(r.path), ours, rtol=0, atol=ATOL)  # and our loader on the result


def test_offset_types_refused_grouped_naming_tensors(tmp_path):
    src = mixed_gguf(tmp_path / "off.gguf", OFFSET, layers=2)
    with pytest.raises(CheckpointError) as e:
        convert_gguf_compressed(src, tmp_path / "ct")
    msg = str(e.value)
    assert msg.startswith(f"{src}: pass --dequantize")
    for t, proj in (("Q4_1", "self_attn.q_proj"), ("Q4_K", "self_attn.k_proj"), ("Q5_1", "self_attn.v_proj"),
                    ("Q5_K", "self_attn.o_proj"), ("Q2_K", "mlp.gate_proj")):
        assert f"{t} (2): model.layers.0.{proj}.weight, model.layers.1.{proj}.weight" in msg, msg
    assert "Q8_0" not in msg
    assert not (tmp_path / "ct").exists()


def test_dequantize_writes_offset_types_dense_and_keeps_the_rest(tmp_path):
    src = mixed_gguf(tmp_path / "off.gguf", OFFSET, layers=1)
    r = convert_gguf_compressed(src, tmp_path / "ct", dequantize=True)
    assert sorted(r.quantized) == ["Q8_0"] and sorted(r.dequantized) == ["Q2_K", "Q4_1", "Q4_K", "Q5_1", "Q5_K"]
    assert any("Q4_1: 1 Linear weight(s) written dense" in line for line in r.summary())
    qc = json.loads((r.path / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert qc["ignore"] == ["lm_head"] + [f"model.layers.0.{p}" for p in (
        "mlp.gate_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")]
    g = open_gguf(src)
    # one scheme: transformers' own dequantize-at-load path takes it
    sd = _load_torch(r.path, dequantize=True).state_dict()
    for n in g.keys():
        np.testing.assert_array_equal(_bits(sd[n].numpy()), _bits(g.get(n)), err_msg=n)


def test_widen_writes_3_5_6_bit_types_as_8_bit_exactly(tmp_path):
    """--widen: Q5_0 / Q6_K / Q3_K keep their integers and scales in num_bits 8 pack-quantized (what vLLM's WNA16
    serves); transformers + compressed-tensors decompress them to gguf's values bit for bit, and its forward pass on
    the checkpoint gives our logits on the GGUF file (float32 summation order only)."""
    src = mixed_gguf(tmp_path / "w.gguf", {"attn_q": "Q5_0", "attn_k": "Q6_K", "attn_v": "Q3_K", "ffn_up": "Q8_0",
                                           "ffn_down": "Q4_0"}, layers=1)
    r = convert_gguf_compressed(src, tmp_path / "ct", widen=True)
    assert r.widened == {"Q5_0": 5, "Q6_K": 6, "Q3_K": 3} and r.num_bits["Q4_0"] == 4
    lines = {line.split(":")[0]: line for line in r.summary() if "kept quantized" in line}
    assert all("widened to num_bits 8" in lines[t] and "--widen" not in lines[t] for t in r.widened), lines
    qc = json.loads((r.path / "config.json").read_text())["quantization_config"]
    # one group per scheme: widened Q5_0 is Q8_0's (int8, groups of 32), widened Q6_K and Q3_K share int8 groups of 16
    assert sorted((c["weights"]["num_bits"], c["weights"]["group_size"]) for c in qc["config_groups"].values()) == \
        [(4, 32), (8, 16), (8, 32)]
    g = open_gguf(src)
    model = _load_torch(r.path)
    got = _ct_weights(model)
    for n in g.keys():
        if n.endswith("proj.weight"):
            np.testing.assert_array_equal(_bits(got[n]), _bits(g.get(n)), err_msg=n)
    with torch.no_grad():
        theirs = model(torch.from_numpy(IDS)).logits.numpy()
    ours = _our_logits(src)
    assert np.abs(ours - theirs).max() <= ATOL * max(1.0, np.abs(ours).max())


def test_cli_convert_gguf(tmp_path, capsys):
    from converters.cli import main

    src = mixed_gguf(tmp_path / "off.gguf", {"attn_q": "Q4_1", "ffn_up": "Q8_0"}, layers=1)
    assert main(["convert", str(src), str(tmp_path / "no")]) == 1
    err = capsys.readouterr().err
    assert "pass --dequantize" in err and "Q4_1 (1): model.layers.0.self_attn.q_proj.weight" in err
    assert not (tmp_path / "no").exists()
    assert main(["convert", str(src), str(tmp_path / "ct"), "--dequantize"]) == 0
    err = capsys.readouterr().err
    assert "Q8_0: 1 Linear weight(s) kept quantized as pack-quantized" in err
    assert "Q4_1: 1 Linear weight(s) written dense" in err
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["format"] == \
        "pack-quantized"
    assert (tmp_path / "ct" / "tokenizer.json").is_file() and (tmp_path / "ct" / "generation_config.json").is_file()
    assert main(["convert", str(src), str(tmp_path / "bf"), "--dtype", "bfloat16"]) == 1
    assert "--dense" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_refused_then_dense_with_dequantize(tmp_path):
    """The real SmolLM2 GGUF: every projection is Q4_1 and only the tied embedding Q8_0. Refused naming the Q4_1
    tensors; with dequantize every Linear weight is written dense (nothing compressed-tensors can hold is left, so
    the checkpoint carries no quantization_config, and the summary says so), equal to gguf's values bit for bit."""
    from converters.evaluation.embedded import smollm2_gguf

    src = smollm2_gguf()
    g = open_gguf(src)
    types = {n: g.tensor_type(n) for n in g.keys()}
    q41 = [n for n, t in types.items() if t == "Q4_1"]
    assert len(q41) == 7 * g.config["num_hidden_layers"] and types["model.embed_tokens.weight"] == "Q8_0"
    with pytest.raises(CheckpointError, match=r"pass --dequantize.*Q4_1 \(%d\): model\.layers\.0\." % len(q41)):
        convert_gguf_compressed(src, tmp_path / "no")
    r = convert_gguf_compressed(src, tmp_path / "ct", dequantize=True)
    assert r.dequantized == {"Q4_1": q41} and r.quantized == {}
    assert r.dense["Q8_0"] == ["model.embed_tokens.weight"]
    assert r.summary()[0].startswith("no Linear weight kept quantized")
    assert "quantization_config" not in json.loads((r.path / "config.json").read_text())
    sd = _load_torch(r.path).state_dict()
    for n in g.keys():
        np.testing.assert_array_equal(_bits(sd[n].numpy()), _bits(g.get(n)), err_msg=n)
