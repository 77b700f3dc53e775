"""converters.pipelines.causal_lm.load_causal_lm on deepseek_v3 checkpoints: the dense HF layout transformers 5 writes
(per-expert tensors), and DeepSeek's HF fine-grained FP8 block layout (every projection but the router packed)."""

import json
import sys
import warnings
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.nn import QExperts, quantized_layers  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qformats" / "models" / "decoder"))
import test_deepseek_v3 as ds  # noqa: E402


def test_dense_checkpoint_from_save_pretrained(tmp_path):
    """transformers' save_pretrained writes per-expert names (mlp.experts.{e}.gate_proj.weight, ...): loaded
    stacked, the logits are transformers'."""
    hf = ds.hf_model(ds.TINY)
    hf.save_pretrained(tmp_path)
    model, cfg, _ = load_causal_lm(tmp_path, tokenizer=False)
    assert cfg["model_type"] == "deepseek_v3" and model.config.moe.num_experts == 8
    with torch.no_grad():
        ref = hf(torch.from_numpy(ds.IDS)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ds.forward(model, jnp.asarray(ds.IDS))), ref, rtol=0, atol=ds.LOGITS_ATOL)


def write_fp8_deepseek(out: Path, hf, block=(8, 8)) -> Path:
    """hf's weights in DeepSeek-V3's on-disk FP8 layout: every 2-D Linear weight of the decoder layers but the
    router as float8_e4m3fn codes with a float32 weight_scale_inv per (bm, bn) block (amax / 448). The tiny
    config's projections are whole 8 x 8 blocks (transformers' dequantize=True path refuses partial ones)."""
    bm, bn = block
    tensors = {}
    for name, a in ds.hf_checkpoint(hf).items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and a.ndim == 2 and ".layers." in name and not mod.endswith("mlp.gate"):
            n, k = a.shape
            s = np.zeros((-(-n // bm), -(-k // bn)), np.float32)
            q = np.zeros_like(a)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    blk = a[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
                    s[i, j] = np.abs(blk).max() / 448
                    q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = blk / s[i, j]
            codes = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            tensors[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            tensors[f"{mod}.weight_scale_inv"] = torch.from_numpy(s)
        else:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(a))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = hf.config.to_dict()
    conf["dtype"] = "float32"
    conf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(conf))
    return out


def test_fp8_block_checkpoint_loads_packed(tmp_path):
    """Every MLA, dense-MLP, shared-expert and routed-expert projection of an FP8-block deepseek_v3 checkpoint is
    packed (experts stacked into QExperts) and dequantizes to transformers' own dequantization
    (FineGrainedFP8Config(dequantize=True), experts fused into gate_up_proj / down_proj) bit for bit; the router
    stays float32."""
    hf = ds.hf_model(ds.TINY)
    path = write_fp8_deepseek(tmp_path / "fp8", hf)
    model, _, _ = load_causal_lm(path, tokenizer=False)
    layers = quantized_layers(model)
    assert len(layers) == 3 * 5 + 3 + 2 * 6 and not any(p.endswith("mlp/gate") for p in layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    inter = ds.TINY["moe_intermediate_size"]
    for p, m in layers.items():
        name = p.replace("/", ".")
        if isinstance(m, QExperts):
            got = np.stack([np.asarray(dequantize(m.expert_weight(e), jnp.float32)).T for e in range(m.num_experts)])
            stack, proj = name.rsplit(".", 1)
            want = state[stack + (".down_proj" if proj == "down_proj" else ".gate_up_proj")]
            want = want if proj == "down_proj" else want[:, :inter] if proj == "gate_proj" else want[:, inter:]
        else:
            got, want = np.asarray(dequantize(m.kernel.get_value(), jnp.float32)).T, state[name + ".weight"]
        np.testing.assert_array_equal(got, want, err_msg=p)
    assert np.all(np.isfinite(np.asarray(ds.forward(model, jnp.asarray(ds.IDS)))))  # packed, FP8 activations


@pytest.mark.slow  # ~30 s on a busy 2-core machine
def test_w4a16_compressed_tensors_roundtrip(tmp_path):
    """quantize_model W4A16 -> save_causal_lm (per-expert packed modules, the float32 router and its score-correction
    bias under their HF names) -> load_causal_lm: the same logits."""
    from qformats.models.decoder import quantization_rules
    from qformats.nn import quantize_model

    from converters.pipelines.causal_lm import save_causal_lm

    hf = ds.hf_model(ds.TINY)
    model = ds.flax_model(hf)
    quantize_model(model, quantization_rules("W4A16:g16"))
    save_causal_lm(model, tmp_path / "ct", hf.config.to_dict())
    back, _, _ = load_causal_lm(tmp_path / "ct", tokenizer=False)
    assert isinstance(quantized_layers(back)["model/layers/1/mlp/experts/gate_proj"], QExperts)
    np.testing.assert_array_equal(np.asarray(back.model.layers[2].mlp.gate.e_score_correction_bias.get_value()),
                                  np.asarray(model.model.layers[2].mlp.gate.e_score_correction_bias.get_value()))
    np.testing.assert_array_equal(np.asarray(ds.forward(back, jnp.asarray(ds.IDS))),
                                  np.asarray(ds.forward(model, jnp.asarray(ds.IDS))))
