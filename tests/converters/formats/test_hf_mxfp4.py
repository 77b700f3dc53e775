"""converters.formats.hf_mxfp4: gpt-oss MXFP4 checkpoints (quant_method "mxfp4") read exactly as per-expert MXFP4
QArrays, dequantized bit-exactly against transformers' own dequantization, named by inspect, refused by name where
malformed or unsupported."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from converters.formats.hf_mxfp4 import read_hf_mxfp4  # noqa: E402
from converters.formats.quantized import read_quantized  # noqa: E402
from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint  # noqa: E402
from converters.pipelines.inspect_checkpoint import inspect_checkpoint, quantization_summary  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.qarray import QArray  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

H, I, E, HEADS, KV, HD, V, LAYERS = 64, 64, 4, 4, 2, 16, 48, 2
EXPERTS = "model.layers.{}.mlp.experts"


def _config():
    return dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=H, intermediate_size=I,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                vocab_size=V, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5,
                rope_theta=150000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                rope_scaling={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 32},
                quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def _tensors(seed=0, runnable=False):
    """A tiny gpt-oss MXFP4 state dict written by hand following transformers' reader: random codes (every byte),
    E8M0 scales 100..140 plus a few edge bytes (2, 254; 0 only with zero codes). `runnable`: scales 119..123 only
    (weights up to 6 * 2^-4), a model whose activations stay finite, and a final norm and lm_head
    scaled up for a spread of logits."""
    rng = np.random.default_rng(seed)
    bf = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 0.05).to(torch.bfloat16)  # noqa
    t = {"model.embed_tokens.weight": bf(V, H), "model.norm.weight": bf(H), "lm_head.weight": bf(V, H)}
    if runnable:  # a spread of logits, so that greedy decoding does not repeat one token
        t["model.norm.weight"] = t["model.norm.weight"] * 20 + 1
        t["lm_head.weight"] = t["lm_head.weight"] * 20
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = bf(H)
        t[p + "post_attention_layernorm.weight"] = bf(H)
        for proj, out, inp in (("q_proj", HEADS * HD, H), ("k_proj", KV * HD, H), ("v_proj", KV * HD, H),
                               ("o_proj", H, HEADS * HD)):
            t[p + f"self_attn.{proj}.weight"], t[p + f"self_attn.{proj}.bias"] = bf(out, inp), bf(out)
        t[p + "self_attn.sinks"] = bf(HEADS)
        t[p + "mlp.router.weight"], t[p + "mlp.router.bias"] = bf(E, H), bf(E)
        x = EXPERTS.format(n) + "."
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(119, 124, (E, rows, cols // 32), dtype=np.uint8) if runnable else \
                rng.integers(100, 141, (E, rows, cols // 32), dtype=np.uint8)
            if not runnable:
                scales[0, 0, 0], scales[0, 1, 0] = 2, 254
                scales[0, 2, 0] = 0
                blocks[0, 2, 0] = 0x88  # -0 in both nibbles: 2^-127 (a float32 subnormal) times -0
            t[x + f"{proj}_blocks"] = torch.from_numpy(blocks)
            t[x + f"{proj}_scales"] = torch.from_numpy(scales)
        t[x + "gate_up_proj_bias"], t[x + "down_proj_bias"] = bf(E, 2 * I), bf(E, H)
    return t


def _write(d: Path, tensors, config=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or _config()))
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss") / "mxfp4"
    return _write(d, _tensors())


def _u16(a):
    return np.asarray(a).view(np.uint16)


def test_experts_read_as_stored_mxfp4_codes_and_scales(ckpt):
    t = load_file(str(ckpt / "model.safetensors"))
    cm = read_quantized(ckpt)
    assert cm.quant.groups[0].format == "mxfp4-pack-quantized"
    qs = cm.qarrays()
    assert len(qs) == LAYERS * E * 3
    for n in range(LAYERS):
        x = EXPERTS.format(n)
        gub, gus = t[f"{x}.gate_up_proj_blocks"].numpy(), t[f"{x}.gate_up_proj_scales"].numpy()
        for e in range(E):
            g, u, dn = (qs[f"{x}.{e}.{p}"] for p in ("gate_proj", "up_proj", "down_proj"))
            assert g.shape == (H, I) and dn.shape == (I, H) and g.scheme.scale_format == "e8m0"
            assert np.array_equal(np.asarray(g.codes), gub[e, 0::2].reshape(I, H // 2))
            assert np.array_equal(np.asarray(u.codes), gub[e, 1::2].reshape(I, H // 2))
            assert np.array_equal(np.asarray(g.scale), gus[e, 0::2])
            assert np.array_equal(np.asarray(dn.codes), t[f"{x}.down_proj_blocks"].numpy()[e].reshape(H, I // 2))
            bias = t[f"{x}.gate_up_proj_bias"].float().numpy()
            assert np.array_equal(np.asarray(cm.modules[f"{x}.{e}.up_proj"]["bias"], np.float32), bias[e, 1::2])
    assert "model.layers.0.mlp.router" in cm.quant.ignore and "lm_head" in cm.quant.ignore
    assert "model.layers.0.self_attn.sinks" not in cm.modules  # a parameter of the attention module
    assert "sinks" in cm.modules["model.layers.0.self_attn"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_per_expert_values_equal_transformers_dequantize(ckpt, dtype):
    """Each expert's QArray decodes to transformers' convert_moe_packed_tensors, bit for bit."""
    t = load_file(str(ckpt / "model.safetensors"))
    tdt = getattr(torch, dtype)
    qs = read_hf_mxfp4(ckpt).qarrays()
    x = EXPERTS.format(1)
    gu = convert_moe_packed_tensors(t[f"{x}.gate_up_proj_blocks"], t[f"{x}.gate_up_proj_scales"], dtype=tdt)
    dn = convert_moe_packed_tensors(t[f"{x}.down_proj_blocks"], t[f"{x}.down_proj_scales"], dtype=tdt)
    for e in range(E):
        for p, ref in (("gate_proj", gu[e][:, 0::2]), ("up_proj", gu[e][:, 1::2]), ("down_proj", dn[e])):
            ours = np.asarray(dequantize(qs[f"{x}.{e}.{p}"], np.dtype(dtype) if dtype == "float32"
                                         else np.dtype(ml_dtypes.bfloat16)))
            want = ref.contiguous().view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy()
            assert np.array_equal(ours.view(want.dtype), want), (e, p)


def test_dequantize_checkpoint_equals_transformers_loading_it(ckpt, tmp_path):
    """`qformats dequantize` writes the fused gpt-oss parameters transformers' Mxfp4Config(dequantize=True) loads:
    every tensor of the model's state dict equal bit for bit (bf16), and transformers loads our output."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    out = tmp_path / "dense"
    n = dequantize_checkpoint(ckpt, out, dtype="bfloat16")
    assert n == LAYERS * E * 3
    ours = load_file(str(out / "model.safetensors"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ref = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.bfloat16).state_dict()
    assert sorted(ours) == sorted(ref)
    for k, v in ref.items():
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
        assert torch.equal(ours[k].view(torch.int16), v.contiguous().view(torch.int16)), k
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(again[k].view(torch.int16), v.contiguous().view(torch.int16)) for k, v in ref.items())


def test_dequantized_gpt_oss_requantizes_per_expert_as_llm_compressor(ckpt, tmp_path):
    """The dense result's fused experts are split into llm-compressor's per-expert Linears by quantize_checkpoint;
    MXFP4A16 of those values gives back the checkpoint's own codes and scales wherever compressed-tensors' E8M0
    rule re-derives the same scale (a group holding a code of magnitude 4 or 6, the top binade, as nearly every
    random group of 32 does), -0 codes becoming +0."""
    dense = tmp_path / "dense"
    dequantize_checkpoint(ckpt, dense, dtype="bfloat16")
    out = tmp_path / "q"
    s = quantize_checkpoint(dense, out, "MXFP4A16", progress=False)
    assert s.linearized and s.experts.startswith(f"{LAYERS} layers × {E} experts × 3 projections")
    q = load_file(str(out / "model.safetensors"))
    t = load_file(str(ckpt / "model.safetensors"))
    x = EXPERTS.format(0)
    blocks, scales = t[f"{x}.gate_up_proj_blocks"][1][1::2], t[f"{x}.gate_up_proj_scales"][1][1::2]  # up_proj
    top = ((blocks & 0x6) == 0x6).any(-1) | (((blocks >> 4) & 0x6) == 0x6).any(-1)
    assert top.float().mean() > 0.9
    got = q[f"{x}.1.up_proj.weight_scale"].reshape(I, H // 32)
    assert torch.equal(got[top], scales[top])

    def plus_zero(b):  # -0 (nibble 8) -> +0
        lo, hi = b & 0xF, b >> 4
        return torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)
    codes = q[f"{x}.1.up_proj.weight_packed"].reshape(I, H // 32, 16)
    assert torch.equal(plus_zero(codes)[top], plus_zero(blocks)[top])
    assert f"{x}.gate_up_proj" not in q and "model.layers.0.mlp.router.weight" in q


def test_inspect_names_the_format(ckpt):
    summary = quantization_summary(ckpt)
    assert summary.startswith("quantization: mxfp4 (gpt-oss MXFP4 experts, transformers' Mxfp4Config); read as "
                              "compressed-tensors format mxfp4-pack-quantized")
    assert "targets re:.*\\.experts" in summary
    rows = {r.name: r for r in inspect_checkpoint(ckpt)}
    r = rows[f"{EXPERTS.format(0)}.3.down_proj"]
    assert r.format == "mxfp4-pack-quantized" and r.shape == (H, I)
    assert r.stored_bytes == H * I // 2 + H * I // 32 + H * 2


def _broken(tmp_path, edit, config=None):
    t = _tensors()
    edit(t)
    return _write(tmp_path / "bad", t, config)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(f"{EXPERTS.format(0)}.down_proj_scales"), "without its down_proj_scales tensor"),
    (lambda t: t.__setitem__(f"{EXPERTS.format(1)}.down_proj_scales",
                             torch.full((E, H, I // 32), 255, dtype=torch.uint8)), "E8M0 scale 255"),
    (lambda t: (t[f"{EXPERTS.format(0)}.gate_up_proj_scales"][0, 3, 0].fill_(1),  # 1 * 2^-126: normal
                t[f"{EXPERTS.format(0)}.gate_up_proj_blocks"][0, 3, 0].fill_(0x22)), None),
    (lambda t: (t[f"{EXPERTS.format(0)}.gate_up_proj_scales"][0, 3, 0].fill_(1),  # 0.5 * 2^-126: subnormal
                t[f"{EXPERTS.format(0)}.gate_up_proj_blocks"][0, 3, 0].fill_(0x21)), "float32 subnormal"),
    (lambda t: (t[f"{EXPERTS.format(0)}.gate_up_proj_scales"][0, 3, 0].fill_(0),  # 2^-127 itself is subnormal
                t[f"{EXPERTS.format(0)}.gate_up_proj_blocks"][0, 3, 0].fill_(0x77)), "float32 subnormal"),
    (lambda t: t.__setitem__(f"{EXPERTS.format(0)}.down_proj_blocks",
                             torch.zeros((E, H, I // 32 + 1, 16), dtype=torch.uint8)), "down_proj_blocks"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight_blocks",
                             torch.zeros((4, 2, 16), dtype=torch.uint8)), "supported only as gpt-oss's"),
    (lambda t: t.pop(f"{EXPERTS.format(0)}.gate_up_proj_bias"), "gate_up_proj_bias"),
    # wrong dtypes / ranks, named with the expected layout
    (lambda t: t.__setitem__(f"{EXPERTS.format(1)}.gate_up_proj_blocks",
                             t[f"{EXPERTS.format(1)}.gate_up_proj_blocks"].view(torch.int8)),
     r"tensor 'model.layers.1.mlp.experts.gate_up_proj_blocks': expected U8 \[E, 2\*inter, hidden/32, 16\], found I8"),
    (lambda t: t.__setitem__(f"{EXPERTS.format(1)}.gate_up_proj_blocks",
                             t[f"{EXPERTS.format(1)}.gate_up_proj_blocks"].reshape(E, 2 * I, H // 2)),
     r"gate_up_proj_blocks': expected U8 \[E, 2\*inter, hidden/32, 16\], found U8 \[4, 128, 32\]"),
    (lambda t: t.__setitem__(f"{EXPERTS.format(0)}.down_proj_scales",
                             t[f"{EXPERTS.format(0)}.down_proj_scales"].float()),
     r"tensor 'model.layers.0.mlp.experts.down_proj_scales': expected U8 \[4, 64, 2\], found F32"),
    (lambda t: t.__setitem__(f"{EXPERTS.format(0)}.down_proj_bias", torch.zeros((E, H), dtype=torch.int32)),
     r"expected a float bias|down_proj_bias': expected BF16"),
    (lambda t: t.__setitem__(f"{EXPERTS.format(0)}.gate_up_proj_bias", torch.zeros((E, I), dtype=torch.bfloat16)),
     r"tensor 'model.layers.0.mlp.experts.gate_up_proj_bias': expected BF16 \[4, 128\], found BF16 \[4, 64\]"),
])
def test_malformed_checkpoints_are_refused_by_name(tmp_path, edit, message):
    d = _broken(tmp_path, edit)
    if message is None:
        read_hf_mxfp4(d)
        return
    with pytest.raises(CheckpointError, match=message):
        read_hf_mxfp4(d)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="mixtral"), "model_type 'mixtral'"),
    (dict(quantization_config={"quant_method": "mxfp4", "group_size": 32}), r"keys \['group_size'\]"),
])
def test_unsupported_configs_are_refused(tmp_path, change, message):
    d = _write(tmp_path / "c", _tensors(), dict(_config(), **change))
    with pytest.raises(CheckpointError, match=message):
        read_quantized(d)


def test_convert_writes_mxfp4_pack_quantized_per_expert(ckpt, tmp_path):
    """`qformats convert` writes llm-compressor's per-expert compressed-tensors layout losslessly: weight_packed /
    weight_scale are the stored blocks / scales, and compressed-tensors' own decompression of each expert equals
    transformers' dequantization of the MXFP4 checkpoint."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ct_oracle import decompress_dir

    from converters.pipelines.convert_quantized import convert_quantized

    out = convert_quantized(ckpt, tmp_path / "ct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    got = load_file(str(out / "model.safetensors"))
    t = load_file(str(ckpt / "model.safetensors"))
    x = EXPERTS.format(1)
    assert torch.equal(got[f"{x}.2.gate_proj.weight_packed"],
                       t[f"{x}.gate_up_proj_blocks"][2, 0::2].reshape(I, H // 2))
    assert torch.equal(got[f"{x}.2.down_proj.weight_scale"], t[f"{x}.down_proj_scales"][2])
    assert torch.equal(got[f"{x}.2.up_proj.bias"], t[f"{x}.gate_up_proj_bias"][2, 1::2])
    dec = decompress_dir(out)
    gu = convert_moe_packed_tensors(t[f"{x}.gate_up_proj_blocks"], t[f"{x}.gate_up_proj_scales"], dtype=torch.bfloat16)
    dn = convert_moe_packed_tensors(t[f"{x}.down_proj_blocks"], t[f"{x}.down_proj_scales"], dtype=torch.bfloat16)
    for e in range(E):
        for p, ref in (("gate_proj", gu[e][:, 0::2].T), ("up_proj", gu[e][:, 1::2].T), ("down_proj", dn[e].T)):
            d = dec[f"{x}.{e}.{p}"]
            assert d.dtype == torch.bfloat16 and torch.equal(d.view(torch.int16), ref.contiguous().view(torch.int16))


def test_convert_copies_subnormal_groups_that_running_refuses(tmp_path):
    """Groups whose values are float32 subnormals (scale byte 0 or 1) cannot be run exactly by XLA:CPU (refused by
    load_causal_lm, naming the tensor), but their bytes convert as they are: compressed-tensors' decompression of
    the result equals transformers' dequantization bit for bit, subnormals included."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ct_oracle import decompress_dir

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.pipelines.convert_quantized import convert_quantized

    t = _tensors()
    x = EXPERTS.format(0)
    t[f"{x}.gate_up_proj_scales"][1, 4, 0] = 0
    t[f"{x}.gate_up_proj_blocks"][1, 4, 0] = 0x7F  # 6 and -6 times 2^-127
    t[f"{x}.down_proj_scales"][2, 3, 1] = 1
    t[f"{x}.down_proj_blocks"][2, 3, 1] = 0x19  # 0.5 * 2^-126 and -0.5 * 2^-126
    src = _write(tmp_path / "sub", t)
    with pytest.raises(CheckpointError, match=rf"tensor '{x}.gate_up_proj_scales': E8M0 scale 0 .* subnormal"):
        load_causal_lm(src, tokenizer=False)
    out = convert_quantized(src, tmp_path / "ct")
    got = load_file(str(out / "model.safetensors"))
    assert torch.equal(got[f"{x}.1.gate_proj.weight_scale"], t[f"{x}.gate_up_proj_scales"][1, 0::2])
    dec = decompress_dir(out)
    gu = convert_moe_packed_tensors(t[f"{x}.gate_up_proj_blocks"], t[f"{x}.gate_up_proj_scales"], dtype=torch.bfloat16)
    dn = convert_moe_packed_tensors(t[f"{x}.down_proj_blocks"], t[f"{x}.down_proj_scales"], dtype=torch.bfloat16)
    assert gu[1][:, 0::2].T[2, :2].abs().min() > 0  # expert 1's gate row 2 = stored row 4: subnormal, not flushed
    for e, p, ref in ((1, "gate_proj", gu[1][:, 0::2].T), (2, "down_proj", dn[2].T)):
        d = dec[f"{x}.{e}.{p}"]
        assert torch.equal(d.view(torch.int16), ref.contiguous().view(torch.int16)), (e, p)
