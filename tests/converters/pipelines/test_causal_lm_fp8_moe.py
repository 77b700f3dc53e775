"""load_causal_lm on a DeepSeek-V3 HF fine-grained FP8 checkpoint (quant_method "fp8", 128x128-style blocks, here
8x8 on a tiny model): the routed experts stay packed as stacked FP8-block QExperts holding the file's
float8_e4m3fn codes and float32 weight_scale_inv byte for byte; with activations left in float, the logits are
transformers' FineGrainedFP8Config(dequantize=True) model's within float32 accumulation order and the 32 greedy
tokens those of the dequantized weights. (The packed run's default, dynamic FP8 activations per token group as
FineGrainedFP8's kernels compute them, has no CPU reference: transformers dequantizes on the CPU.)"""

import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qformats" / "models" / "decoder"))

import test_deepseek_v3 as ds  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_causal_lm_deepseek_v3 import write_fp8_deepseek  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.nn import QExperts, quantized_layers  # noqa: E402


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return write_fp8_deepseek(tmp_path_factory.mktemp("ds") / "fp8", ds.hf_model(ds.TINY))


def test_routed_experts_are_fp8_block_qexperts_of_the_files_bytes(fp8):
    path = fp8
    model, _, _ = load_causal_lm(path, tokenizer=False)
    t = load_file(str(path / "model.safetensors"))
    layers = quantized_layers(model)
    stacks = {p: m for p, m in layers.items() if isinstance(m, QExperts)}
    assert sorted(stacks) == sorted(f"model/layers/{n}/mlp/experts/{p}" for n in (1, 2)
                                    for p in ("gate_proj", "up_proj", "down_proj"))
    for p, m in stacks.items():
        q = m.kernel.get_value()
        assert q.scheme.strategy == "block" and tuple(q.scheme.block) == (8, 8) and q.scheme.format.name == "fp8_e4m3fn"
        name = p.replace("/", ".").replace("experts.", "experts.{}.")
        codes = np.stack([t[name.format(e) + ".weight"].view(torch.uint8).numpy() for e in range(m.num_experts)])
        scales = np.stack([t[name.format(e) + ".weight_scale_inv"].numpy() for e in range(m.num_experts)])
        assert np.array_equal(np.asarray(q.codes), codes) and np.array_equal(np.asarray(q.scale), scales), p


@pytest.mark.slow  # a forward and two generate compilations, a transformers model: ~80 s on a busy 2-core machine
def test_weight_only_logits_equal_transformers_dequantized(fp8):
    path = fp8
    model, _, _ = load_causal_lm(path, tokenizer=False)
    layers = quantized_layers(model)
    # the packed run quantizes activations per token group as FineGrainedFP8's kernels do; transformers' CPU path
    # dequantizes the weights only, so compare with float activations
    for m in layers.values():
        m.schemes = dataclasses.replace(m.schemes, input_activations=None)
    got = np.asarray(ds.forward(model, jnp.asarray(ds.IDS)))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    with torch.no_grad():
        want = ref(torch.from_numpy(ds.IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=ds.LOGITS_ATOL)
    # 32 greedy tokens: those of our dense model holding transformers' dequantized weights
    from qformats.models.generate import generate

    dense = ds.flax_model(ref)
    prompt = np.asarray(ds.IDS[0, :5], np.int32)
    a, b = (np.asarray(generate(mm, prompt, 32)) for mm in (model, dense))
    assert a.tolist() == b.tolist() and len(set(a.tolist())) > 2


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"),
     r"tensor 'model.layers.2.mlp.experts.5.down_proj.weight' \(F8_E4M3\) without a weight_scale_inv"),
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.0.up_proj.weight_scale_inv",
                             t["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"].half()),
     r"tensor 'model.layers.1.mlp.experts.0.up_proj.weight_scale_inv': expected F32 \[4, 8\]"),
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.3.gate_proj.weight",
                             t["model.layers.1.mlp.experts.3.gate_proj.weight"][:16]),
     r"tensor 'model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv': expected F32 \[2, 8\]"),
])
def test_malformed_expert_tensors_are_refused_by_name(fp8, tmp_path, edit, message):
    import shutil

    from safetensors.torch import save_file

    from qformats.errors import CheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    t = load_file(str(bad / "model.safetensors"))
    edit(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(bad, tokenizer=False)
