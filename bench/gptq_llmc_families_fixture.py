"""Generates tests/qformats/models/decoder/data/gptq_llmc_{deepseek_v3,gpt_oss}.npz: llm-compressor's GPTQ codes for a
tiny DeepSeek-V3 and a tiny gpt-oss.

The tiny models (`FAMILIES` below: 2 layers, hidden 64, 8 experts, top-2; DeepSeek-V3 with query / KV LoRA, a dense
first layer, a shared expert and group-limited routing over 4 groups; gpt-oss with fused interleaved gate_up experts
and their biases, attention sinks and biases, a sliding window) are written as dense HF checkpoints in the on-disk
layout transformers 5 reads (`tensors`: numpy default_rng(0) weights). The calibration samples are 96 one-token
sequences (default_rng(2)): a one-token attention returns its v (latent attention: kv_b's value part) whatever masks
and positions, so both sides calibrate on the same activations up to rounding. llm-compressor 0.14's `oneshot` (its
venv, `--llmc-python`) linearizes the experts and runs GPTQModifier: W4A16 int4 symmetric groups of 16, block 128,
dampening 0.01, actorder static, lm_head and the routers ignored, `moe_calibrate_all_experts=True`, batch 1. The
fixture keeps, per quantized Linear, its int4 codes (two per byte) and group scales, plus the config, the samples and
a digest of the weights, so tests/qformats/models/decoder/test_families_gptq_llmc.py runs our calibration on the
same model and inputs without llm-compressor.

    python bench/gptq_llmc_families_fixture.py --family deepseek_v3|gpt_oss [--llmc-python /work/oneshot/bin/python]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

GROUP = 16
FAMILIES = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_interleave": True, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "num_nextn_predict_layers": 0},
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "router_aux_loss_coef": 0.0, "output_router_logits": False},
}


def _dense():
    spec = importlib.util.spec_from_file_location("gptq_llmc_fixture", Path(__file__).parent / "gptq_llmc_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tensors(family: str, seed: int = 0) -> dict:
    """HF tensor name -> float32 array in the on-disk layout (`qformats.models.decoder.hf_tensor_names`): the
    embedding's rows scaled per input channel, norms exp(N(0, 0.3)), biases / sinks / score-correction biases
    N(0, 0.1^2), every other weight N(0, 1) / sqrt(fan-in)."""
    import jax.numpy as jnp
    from flax import nnx

    from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensor_names
    from qformats.models.decoder.params import resolve_path

    cfg = DecoderConfig.from_hf(FAMILIES[family])
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    out = {}
    for name, slot in sorted(hf_tensor_names(cfg).items()):
        shape = tuple(resolve_path(model, slot.path).get_value().shape)[(0 if slot.expert is None else 1):]
        shape = shape[::-1] if slot.transpose else shape
        if name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[1]))
        elif name.endswith("norm.weight"):
            a = np.exp(0.3 * rng.standard_normal(shape))
        elif name.endswith(("bias", "sinks")):
            a = 0.1 * rng.standard_normal(shape)
        else:  # [out, in] Linears; gpt-oss's fused stacks [E, in, out]
            fan_in = shape[-2] if len(shape) == 3 else shape[-1]
            a = rng.standard_normal(shape) / np.sqrt(fan_in)
        out[name] = np.asarray(a, np.float32)
    return out


def samples() -> list:
    """96 one-token samples, ids from [3, vocab) (default_rng(2))."""
    rng = np.random.default_rng(2)
    return [rng.integers(3, 128, 1).astype(np.int32) for _ in range(96)]


def digest(t: dict) -> str:
    return _dense().digest(t)


def write_checkpoint(family: str, dst: Path, t: dict) -> Path:
    """The tiny model as a dense HF directory (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(FAMILIES[family]))
    save_file(t, str(dst / "model.safetensors"))
    return dst


THEIRS = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
src, ids_file, out, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model, info = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
assert not bad, bad
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(
    model.config.vocab_size)}, unk_token="t0")), pad_token="t0")
w4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                     strategy="group", group_size=group))
oneshot(model=model, processor=tok, dataset=ds,
        recipe=GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head", "re:.*mlp.gate$", "re:.*mlp.router$"]),
        max_seq_length=512, num_calibration_samples=len(ids), shuffle_calibration_samples=False,
        moe_calibrate_all_experts=True)
res = {}
for name, m in model.named_modules():
    if hasattr(m, "weight_scale"):
        w, s = m.weight.detach().float(), m.weight_scale.detach().float()
        codes = torch.round(w / s.repeat_interleave(group, dim=1)).to(torch.int8)
        assert torch.equal(codes.float() * s.repeat_interleave(group, dim=1), w), name  # on the grid
        res[name + ".codes"] = codes.numpy()
        res[name + ".scale"] = s.numpy()
print(sorted(res)[:6], len(res), file=sys.stderr)
np.savez(out, **res)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--out", default=None, help="default: tests/qformats/models/decoder/data/gptq_llmc_FAMILY.npz")
    a = ap.parse_args()
    a.out = a.out or str(Path(__file__).resolve().parents[1] / "tests" / "qformats" / "models" / "decoder" / "data" /
                         f"gptq_llmc_{a.family}.npz")
    dense = _dense()
    t = tensors(a.family)
    s = samples()
    with tempfile.TemporaryDirectory() as d:
        src = write_checkpoint(a.family, Path(d) / "tiny", t)
        ids = Path(d) / "ids.json"
        ids.write_text(json.dumps([x.tolist() for x in s]))
        out = Path(d) / "theirs.npz"
        env = {**os.environ, "LOGURU_LEVEL": "WARNING", "PYTHONPATH": ""}
        subprocess.run([a.llmc_python, "-c", THEIRS, str(src), str(ids), str(out), str(GROUP)], check=True, env=env,
                       cwd=d)
        theirs = dict(np.load(out))
    fixture = {"digest": np.array(digest(t)), "lengths": np.array([len(x) for x in s]), "ids": np.concatenate(s)}
    for key, v in theirs.items():
        fixture[key] = dense.pack(v) if key.endswith(".codes") else v
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **fixture)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes, {len(theirs) // 2} Linears)", file=sys.stderr)


if __name__ == "__main__":
    main()
