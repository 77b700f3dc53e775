"""quantize_checkpoint never skips a layer silently: group sizes that do not divide a weight's columns are refused,
every such layer named (as llm-compressor 0.14 refuses them), unless skip_indivisible says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import pytest

from converters.pipelines.quantize_checkpoint import quantize_checkpoint
from converters.formats.safetensors_io import SafetensorsFile, save_file
from qformats.errors import CheckpointError
from qformats.plan import group_indivisible
from qformats.presets import parse_scheme

RNG = np.random.default_rng(11)
# SmolLM2-135M's shapes, fewer rows: hidden 576 (not a multiple of 128), intermediate 1536 (a multiple).
SHAPES = {"model.layers.0.self_attn.q_proj.weight": (16, 576), "model.layers.0.self_attn.k_proj.weight": (8, 576),
          "model.layers.0.mlp.down_proj.weight": (16, 1536), "model.embed_tokens.weight": (32, 576),
          "model.norm.weight": (576,)}
Q, K, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"


@pytest.fixture()
def smol_shaped(tmp_path):
    src = tmp_path / "dense"
    src.mkdir()
    save_file({n: (RNG.standard_normal(s) * 0.05).astype(np.float32) for n, s in SHAPES.items()},
              src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 576}))
    return src


def _config(d):
    return json.loads((d / "config.json").read_text())["quantization_config"]


def test_indivisible_layers_are_refused_all_named(smol_shaped, tmp_path):
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(smol_shaped, tmp_path / "out", "W4A16", progress=False)
    msg = str(e.value)
    assert "2 of the 3 targeted weights do not fit scheme 'W4A16'" in msg
    assert f"  - {K} (weight [8, 576] in model.safetensors): columns=576 not divisible by group_size=128" in msg
    assert f"  - {Q} (weight [16, 576] in model.safetensors): columns=576 not divisible by group_size=128" in msg
    assert DOWN not in msg
    for way in ("ignore=[...]", "scheme='W4A16:g64'", "skip_indivisible=True"):  # the API's spelling, ways out first
        assert way in msg and msg.index(way) < msg.index("  - ")
    assert "--ignore" not in msg and "--skip-indivisible" not in msg
    assert not (tmp_path / "out").exists()


def test_columns_below_group_size_are_refused(tmp_path):
    src = tmp_path / "dense"
    src.mkdir()
    save_file({"a.weight": np.ones((8, 64), np.float32), "b.weight": np.ones((8, 256), np.float32)},
              src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"- a \(weight \[8, 64\] in model.safetensors\): columns=64 < "
                                              r"group_size=128 \(llm-compressor's early check lets this through"):
        quantize_checkpoint(src, tmp_path / "out", "W4A16", progress=False)


def test_skip_indivisible_keeps_exactly_those_dense_and_says_so(smol_shaped, tmp_path):
    out = tmp_path / "out"
    s = quantize_checkpoint(smol_shaped, out, "W4A16", progress=False, skip_indivisible=True)
    assert s.quantized == 1 and s.skipped == [K, Q]
    assert f"left dense by --skip-indivisible (2; " in s.text() and f"{K}, {Q}" in s.text()
    assert _config(out)["ignore"] == [K, Q]
    src, dst = SafetensorsFile(smol_shaped / "model.safetensors"), SafetensorsFile(out / "model.safetensors")
    for m in (Q, K):
        np.testing.assert_array_equal(dst.get(m + ".weight"), src.get(m + ".weight"))
    assert DOWN + ".weight_packed" in dst.keys() and DOWN + ".weight" not in dst.keys()


def test_ignore_is_the_other_way_out(smol_shaped, tmp_path):
    s = quantize_checkpoint(smol_shaped, tmp_path / "out", "W4A16", ignore=[Q, K], progress=False)
    assert s.quantized == 1 and s.skipped == []
    assert _config(tmp_path / "out")["ignore"] == [K, Q]


def test_group_override_quantizes_every_layer(smol_shaped, tmp_path):
    s = quantize_checkpoint(smol_shaped, tmp_path / "out", "W4A16:g64", progress=False)
    assert s.quantized == 3 and s.scheme == "W4A16:g64"
    qc = _config(tmp_path / "out")
    assert qc["ignore"] == [] and qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    dst = SafetensorsFile(tmp_path / "out/model.safetensors")
    assert dst.info(Q + ".weight_scale").shape == (16, 9)  # 576 / 64 groups per row


def test_block_partial_blocks_are_quantized_not_refused(smol_shaped, tmp_path):
    # FP8_BLOCK (128x128): 576 columns = 4.5 blocks, legal as in compressed-tensors (ceil-division scales).
    s = quantize_checkpoint(smol_shaped, tmp_path / "out", "FP8_BLOCK", progress=False)
    assert s.quantized == 3 and s.skipped == []
    assert SafetensorsFile(tmp_path / "out/model.safetensors").info(Q + ".weight_scale").shape == (1, 5)


# ---- the references: compressed-tensors' quantize and llm-compressor's rule ---------------------------------
@pytest.mark.parametrize("cols, group", [(576, 128), (64, 128), (1536, 128), (576, 64), (100, 32), (128, 128)])
def test_refusal_agrees_with_compressed_tensors(cols, group):
    torch = pytest.importorskip("torch")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=True)
    w = torch.randn(4, cols)
    groups = -(-cols // group)
    try:
        fake_quantize(w, torch.ones(4, groups), torch.zeros(4, groups, dtype=torch.int8), args)
        ct_refuses = False
    except ValueError:
        ct_refuses = True
    ours = group_indivisible(cols, parse_scheme(f"W4A16:g{group}").weights)
    assert (ours is not None) == ct_refuses


_LLMC_ORACLE = textwrap.dedent("""
    import json, sys, types
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization.group_size_validation import _layer_indivisible
    out = []
    for strategy, cols, g in json.loads(sys.argv[1]):
        kw = {"block_structure": [g, g]} if strategy == "block" else {"group_size": g}
        args = QuantizationArgs(num_bits=4, type="float" if strategy == "tensor_group" else "int", strategy=strategy, **kw)
        m = types.SimpleNamespace(weight=types.SimpleNamespace(shape=(8, cols)))
        out.append(_layer_indivisible(m, args) is not None)
    print(json.dumps(out))
""")


@pytest.mark.skipif(not os.environ.get("QFORMATS_LLMC_PYTHON"),
                    reason="llm-compressor pins another compressed-tensors: set QFORMATS_LLMC_PYTHON to the python of "
                           "a venv holding llmcompressor 0.14 (as bench/oneshot_parity.py's --oneshot-python)")
def test_refusal_is_llm_compressors_rule_where_it_refuses():
    cases = [(st, c, g) for st in ("group", "tensor_group", "block") for c in (64, 100, 128, 576, 1536)
             for g in (16, 32, 64, 128)]
    r = subprocess.run([os.environ["QFORMATS_LLMC_PYTHON"], "-c", _LLMC_ORACLE, json.dumps(cases)],
                       capture_output=True, text=True, check=True)
    llmc = json.loads(r.stdout.strip().splitlines()[-1])
    from qformats.schemes import QuantScheme
    for (st, c, g), refused in zip(cases, llmc):
        if st == "block":
            s = QuantScheme("fp8_e4m3fn", "block", block=(g, g), scale_format="input")
        elif st == "tensor_group":
            s = QuantScheme("fp4_e2m1", "tensor_group", group_size=g, scale_format="fp8_e4m3fn")
        else:
            s = QuantScheme("int4", "group", group_size=g, scale_format="input")
        ours = group_indivisible(c, s)
        # we refuse everything llm-compressor refuses, and beyond it only columns < group size (which
        # compressed-tensors' quantize refuses: test_refusal_agrees_with_compressed_tensors)
        assert (ours is not None) == (refused or (st != "block" and c < g and c % g != 0)), (st, c, g)
