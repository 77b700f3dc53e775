"""load_causal_lm on gpt-oss's MXFP4 checkpoint (quant_method "mxfp4"): the experts become stacked MXFP4 QExperts
holding the file's blocks and E8M0 scales byte for byte (gate_up_proj interleaved as stored), attention / router /
embeddings dense as stored; logits equal to the dequantized checkpoint's run and to transformers'
Mxfp4Config(dequantize=True); `qformats generate` runs it; `qformats convert` writes the per-expert
compressed-tensors checkpoint, which loads back packed and which compressed-tensors + transformers read to the
same logits."""

import copy
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # test_hf_mxfp4 (the fixture), ct_oracle

import test_hf_mxfp4 as mx  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.nn import QExperts, quantized_layers  # noqa: E402

IDS = np.random.default_rng(0).integers(0, mx.V, (2, 12)).astype(np.int32)
fwd = nnx.jit(lambda m, x: m(x)[0])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return mx._write(tmp_path_factory.mktemp("gptoss_run") / "mxfp4", mx._tensors(runnable=True))


@pytest.fixture(scope="module")
def dense(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("gptoss_run") / "dense"
    dequantize_checkpoint(ckpt, out, dtype="bfloat16")
    return out


@pytest.fixture(scope="module")
def packed(ckpt):
    return load_causal_lm(ckpt, tokenizer=False)[0]


def test_experts_are_stacked_mxfp4_holding_the_files_bytes(ckpt, packed):
    """gate_up_proj / down_proj are QExperts whose codes and E8M0 scales are the stored *_blocks / *_scales (rows
    interleaved gate / up as on disk), biases as stored; nothing else is packed."""
    t = load_file(str(ckpt / "model.safetensors"))
    layers = quantized_layers(packed)
    assert sorted(layers) == sorted(f"model/layers/{n}/mlp/experts/{p}" for n in range(mx.LAYERS)
                                    for p in ("gate_up_proj", "down_proj"))
    for n in range(mx.LAYERS):
        x = mx.EXPERTS.format(n)
        for proj, shape in (("gate_up_proj", (mx.H, 2 * mx.I)), ("down_proj", (mx.I, mx.H))):
            m = layers[f"model/layers/{n}/mlp/experts/{proj}"]
            assert isinstance(m, QExperts) and m.num_experts == mx.E
            q = m.kernel.get_value()
            assert q.shape == shape and q.scheme.scale_format == "e8m0" and q.scheme.group_size == 32
            blocks, scales = t[f"{x}.{proj}_blocks"].numpy(), t[f"{x}.{proj}_scales"].numpy()
            assert isinstance(q.codes, jax.Array) and q.codes.dtype == jnp.uint8 and q.scale.dtype == jnp.uint8
            assert np.array_equal(np.asarray(q.codes), blocks.reshape(mx.E, shape[1], shape[0] // 2))
            assert np.array_equal(np.asarray(q.scale), scales)
            bias = np.asarray(m.bias.get_value(), np.float32)
            assert np.array_equal(bias, t[f"{x}.{proj}_bias"].float().numpy())
    attn = packed.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nnx.Linear) and attn.q_proj.kernel.get_value().dtype == jnp.float32


def test_logits_equal_transformers_dequantized_model(ckpt, packed):
    """The packed model's logits are those of transformers' Mxfp4Config(dequantize=True) model in float32, within
    float32 accumulation order (observed: 2e-7 of the largest logit)."""
    got = np.asarray(fwd(packed, jnp.asarray(IDS)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(IDS).long()).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.slow  # three compilations (two forwards, one generate), ~60 s on a busy 2-core machine
def test_logits_and_32_greedy_tokens_equal_the_dequantized_run(ckpt, dense, packed, tmp_path, capsys):
    """Packed MXFP4 experts with kernels off (dequantize-then-dot) give exactly the logits of the same model loaded
    from `qformats dequantize`'s dense output (the same float32 weights, the same grouped products); with kernels on
    (the prefill tiles' `packed_matmul`: two nibble-half products summed) the same up to float32 summation order,
    stated as 1e-6 of the largest logit; `qformats generate` (python -m converters.cli) on the MXFP4 directory gives
    the dense model's 32 greedy tokens."""
    pytest.importorskip("tokenizers")
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from converters.cli import main
    from qformats import set_kernels_enabled
    from qformats.models.generate import generate

    ref_model = load_causal_lm(dense, tokenizer=False)[0]
    assert not quantized_layers(ref_model)
    want = np.asarray(fwd(ref_model, jnp.asarray(IDS)))
    set_kernels_enabled(False)
    try:
        off = nnx.jit(lambda m, x: m(x)[0])  # a new trace: the flag is read at trace time
        np.testing.assert_array_equal(np.asarray(off(packed, jnp.asarray(IDS))), want)
    finally:
        set_kernels_enabled(True)
    np.testing.assert_allclose(np.asarray(fwd(packed, jnp.asarray(IDS))), want, rtol=0,
                               atol=1e-6 * np.abs(want).max())
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(mx.V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(src / "tokenizer.json"))
    rc = main(["generate", str(src), "--prompt", "w5 w6 w7", "--max-new-tokens", "32", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    want = [int(t) for t in np.asarray(generate(ref_model, np.asarray([5, 6, 7], np.int32), 32))]
    assert json.loads(out)["tokens"] == want and len(set(want)) > 2


def test_convert_loads_back_packed_and_in_transformers(ckpt, packed, tmp_path):
    """`qformats convert` (per-expert mxfp4-pack-quantized, llm-compressor's linearized gpt-oss names): load_causal_lm
    fuses it back into the same QExperts bytes and logits; compressed-tensors 0.20's decompression of every expert,
    put into transformers' GptOss model, gives transformers' logits of the MXFP4 source exactly. (transformers 5 does
    not load the linearized expert names by itself: they need llm-compressor's load mappings, or vLLM.)"""
    import ct_oracle

    from converters.cli import main

    out = tmp_path / "ct"
    assert main(["convert", str(ckpt), str(out)]) == 0
    back = load_causal_lm(out, tokenizer=False)[0]
    a, b = quantized_layers(back), quantized_layers(packed)
    assert sorted(a) == sorted(b)
    for p in a:
        qa, qb = a[p].kernel.get_value(), b[p].kernel.get_value()
        assert qa.scheme == qb.scheme and qa.shape == qb.shape
        assert np.array_equal(np.asarray(qa.codes), np.asarray(qb.codes)), p
        assert np.array_equal(np.asarray(qa.scale), np.asarray(qb.scale)), p
    np.testing.assert_array_equal(np.asarray(fwd(back, jnp.asarray(IDS))), np.asarray(fwd(packed, jnp.asarray(IDS))))

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16).eval()
    dec = ct_oracle.decompress_dir(out)  # module -> torch [out, in]
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    stored = load_file(str(out / "model.safetensors"))
    for n in range(mx.LAYERS):
        x = mx.EXPERTS.format(n)
        gu, dn = state[f"{x}.gate_up_proj"], state[f"{x}.down_proj"]
        gu.zero_(), dn.zero_()
        for e in range(mx.E):
            gu[e][:, 0::2] = dec[f"{x}.{e}.gate_proj"].T
            gu[e][:, 1::2] = dec[f"{x}.{e}.up_proj"].T
            dn[e] = dec[f"{x}.{e}.down_proj"].T
            assert torch.equal(state[f"{x}.gate_up_proj_bias"][e, 1::2], stored[f"{x}.{e}.up_proj.bias"])
    hf = copy.deepcopy(ref)
    hf.load_state_dict(state)
    with torch.no_grad():
        want = ref(torch.from_numpy(IDS).long()).logits
        got = hf(torch.from_numpy(IDS).long()).logits
    assert torch.equal(got, want)


def test_incomplete_or_mixed_experts_are_refused_by_name(ckpt, tmp_path):
    """A compressed-tensors gpt-oss checkpoint missing one expert's module, or with an expert's up_proj packed
    differently from its gate_proj, is refused naming the module."""
    from converters.pipelines.convert_quantized import convert_quantized
    from safetensors.torch import save_file

    out = convert_quantized(ckpt, tmp_path / "ct")
    t = load_file(str(out / "model.safetensors"))
    x = mx.EXPERTS.format(1)
    for local in ("weight_packed", "weight_scale", "bias"):
        del t[f"{x}.3.down_proj.{local}"]
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{x}: 1 of its {3 * mx.E} per-expert modules missing: "
                                              rf"\['{x}.3.down_proj'\]"):
        load_causal_lm(out, tokenizer=False)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16:g32"])
def test_llm_compressor_layout_gpt_oss_checkpoints_load_as_stacks(tmp_path, scheme):
    """A compressed-tensors gpt-oss checkpoint in llm-compressor's per-expert layout (`qformats quantize`,
    byte-identical to oneshot; NVFP4's gate / up global scales shared as llm-compressor shares them) loads as packed
    QExperts: each fused expert decodes exactly to the interleave of its gate_proj / up_proj modules' decodings."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qformats" / "models" / "decoder"))
    from moe_tiny import write_checkpoint

    from converters.formats.quantized import read_quantized
    from converters.pipelines.quantize_checkpoint import quantize_checkpoint
    from qformats.quantize import dequantize

    write_checkpoint("gpt_oss", tmp_path / "dense")
    out = tmp_path / "ct"
    quantize_checkpoint(tmp_path / "dense", out, scheme, progress=False)
    model = load_causal_lm(out, tokenizer=False)[0]
    mods = read_quantized(out).modules
    layers = quantized_layers(model)
    x = "model.layers.2.mlp.experts"
    gu, dn = layers[x.replace(".", "/") + "/gate_up_proj"], layers[x.replace(".", "/") + "/down_proj"]
    assert isinstance(gu, QExperts) and gu.kernel.get_value().scheme == mods[f"{x}.0.gate_proj"]["weight"].scheme
    f32 = lambda q: np.asarray(dequantize(q, jnp.float32))  # noqa: E731
    for e in (0, gu.num_experts - 1):
        g, u = f32(mods[f"{x}.{e}.gate_proj"]["weight"]), f32(mods[f"{x}.{e}.up_proj"]["weight"])
        np.testing.assert_array_equal(f32(gu.expert_weight(e)), np.stack([g, u], -1).reshape(g.shape[0], -1))
        np.testing.assert_array_equal(f32(dn.expert_weight(e)), f32(mods[f"{x}.{e}.down_proj"]["weight"]))
