"""Generates tests/qformats/models/decoder/data/gptq_llmc_moe_tiny.npz: llm-compressor's GPTQ codes for a tiny Qwen3-MoE.

The tiny Qwen3-MoE decoder (`tiny_qwen3_moe` below: 2 sparse layers, hidden 64, 8 experts of 32, top-2 renormalised,
weights from numpy's default_rng(0)) is written as a dense HF checkpoint with per-expert tensors (the layout
transformers 5 saves); the calibration samples are `gptq_llmc_fixture.tiny_samples` (12 sequences, default_rng(1)).
llm-compressor 0.14's `oneshot` (its venv, `--llmc-python`) linearizes the experts and runs GPTQModifier: W4A16 int4
symmetric groups of 32, block 128, dampening 0.01, actorder static, lm_head ignored (the transformers 5 router is no
Linear), `moe_calibrate_all_experts=True` (its default: every expert sees every token for its Hessian), batch 1,
samples unshuffled. The fixture keeps, per projection (attention and every expert's gate / up / down), its int4 codes
(two per byte) and its group scales, plus the samples and a digest of the weights, so the test
(tests/qformats/models/decoder/test_moe_gptq_llmc.py) runs our calibration on the same model and inputs without
llm-compressor and compares the codes.

    python bench/gptq_llmc_moe_fixture.py [--llmc-python /work/oneshot/bin/python] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
          "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
          "attention_bias": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
          "router_aux_loss_coef": 0.0, "output_router_logits": False}
ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
GROUP = 32


def _dense():
    spec = importlib.util.spec_from_file_location("gptq_llmc_fixture", Path(__file__).parent / "gptq_llmc_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def modules() -> list:
    """HF module names of every quantized projection, in layer order."""
    c = CONFIG
    out = []
    for i in range(c["num_hidden_layers"]):
        out += [f"model.layers.{i}.{p}" for p in ATTN]
        out += [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(c["num_experts"]) for p in EXPERT_PROJ]
    return out


def tiny_qwen3_moe(seed: int = 0) -> dict:
    """HF tensor name -> float32 array: the embedding's rows scaled per input channel (well-separated diag(H)), norms
    exp(N(0, 0.3)), q/k norms too, projections, router and experts N(0, 1) / sqrt(fan-in)."""
    c = CONFIG
    rng = np.random.default_rng(seed)
    d, f, v, e = c["hidden_size"], c["moe_intermediate_size"], c["vocab_size"], c["num_experts"]
    hd, nh, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    t = {"model.embed_tokens.weight": rng.standard_normal((v, d)) * np.exp(rng.standard_normal(d)),
         "model.norm.weight": np.exp(0.3 * rng.standard_normal(d)),
         "lm_head.weight": rng.standard_normal((v, d)) / np.sqrt(d)}
    shapes = {"self_attn.q_proj": (nh * hd, d), "self_attn.k_proj": (kv * hd, d), "self_attn.v_proj": (kv * hd, d),
              "self_attn.o_proj": (d, nh * hd), "mlp.gate": (e, d)}
    for x in range(e):
        shapes.update({f"mlp.experts.{x}.gate_proj": (f, d), f"mlp.experts.{x}.up_proj": (f, d),
                       f"mlp.experts.{x}.down_proj": (d, f)})
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.exp(0.3 * rng.standard_normal(d))
        t[p + "post_attention_layernorm.weight"] = np.exp(0.3 * rng.standard_normal(d))
        t[p + "self_attn.q_norm.weight"] = np.exp(0.3 * rng.standard_normal(hd))
        t[p + "self_attn.k_norm.weight"] = np.exp(0.3 * rng.standard_normal(hd))
        for name, shape in shapes.items():
            t[p + name + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return {k: np.asarray(a, np.float32) for k, a in t.items()}


def tiny_samples(kind: str = "varied") -> list:
    """"varied": the dense fixture's 12 sequences of 3..47 tokens; "single": 96 one-token samples (default_rng(2)),
    whose attention output is v itself whatever the positions and mask (see BENCHMARKS.md, MoE section)."""
    if kind == "single":
        rng = np.random.default_rng(2)
        return [rng.integers(3, CONFIG["vocab_size"], 1).astype(np.int32) for _ in range(96)]
    return _dense().tiny_samples()


def digest(tensors: dict) -> str:
    return _dense().digest(tensors)


def write_checkpoint(dst: Path, tensors: dict) -> Path:
    """The tiny Qwen3-MoE as a dense HF directory (config.json + model.safetensors, per-expert tensors)."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def theirs_script() -> str:
    """The llm-compressor script: GPTQ W4A16 over every Linear (the experts linearized) but lm_head and the routers,
    every expert calibrated on every token, then each quantized module's codes and scales."""
    dense = _dense()
    return dense.ONESHOT_PREAMBLE + dense.W4_GROUP + r"""
from llmcompressor.modifiers.quantization import GPTQModifier
oneshot(model=model, processor=tok, dataset=ds,
        recipe=GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head", "re:.*mlp.gate$"]),
        max_seq_length=512, num_calibration_samples=len(ids), shuffle_calibration_samples=False,
        moe_calibrate_all_experts=True)
""" + dense.GROUP_CODES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--samples", choices=("varied", "single"), default="varied")
    ap.add_argument("--out", default=None, help="default: tests/qformats/models/decoder/data/"
                                                "gptq_llmc_moe_tiny[_single].npz")
    a = ap.parse_args()
    a.out = a.out or str(Path(__file__).resolve().parents[1] / "tests" / "qformats" / "models" / "decoder" / "data" /
                         f"gptq_llmc_moe_tiny{'_single' if a.samples == 'single' else ''}.npz")
    dense = _dense()
    tensors = tiny_qwen3_moe()
    samples = tiny_samples(a.samples)
    with tempfile.TemporaryDirectory() as d:
        src = write_checkpoint(Path(d) / "tiny", tensors)
        theirs = dense.run_oneshot(a.llmc_python, theirs_script(), src, samples, Path(d) / "theirs.npz", GROUP)
    fixture = {"digest": np.array(digest(tensors)), "lengths": np.array([len(s) for s in samples]),
               "ids": np.concatenate(samples)}
    missing = [n for n in modules() if n + ".codes" not in theirs]
    if missing:
        raise SystemExit(f"llm-compressor quantized no {missing[:4]} ...; it quantized {sorted(theirs)[:8]}")
    for name in modules():
        fixture[name + ".codes"] = dense.pack(theirs[name + ".codes"])
        fixture[name + ".scale"] = theirs[name + ".scale"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **fixture)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
