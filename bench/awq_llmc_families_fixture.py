"""Generates tests/qformats/models/decoder/data/awq_llmc_{deepseek_v3,qwen2_moe}.npz: llm-compressor's AWQ on tiny models.

deepseek_v3: bench/gptq_llmc_families_fixture.py's tiny DeepSeek-V3 (query / KV LoRA, 8 experts of 32, top-2,
group-limited routing, a shared expert) with every layer sparse (`first_k_dense_replace` 0: llm-compressor 0.14's
`_deepseek_mappings` put `mlp.gate` among post_attention_layernorm's balances, and `match_modules_set` cannot group a
dense layer without one: with a dense first layer it merges every layer's norm into one set and AWQModifier raises
"needs to match a single smoothlayer"). qwen2_moe: the same sizes (hidden 64, 2 layers, 8 experts of 32, top-2, GQA
4 / 2 heads) with a shared expert of 48 and its sigmoid gate, every layer sparse (a dense `mlp_only_layers` layer
leaves `_moe_default_mappings`' post_attention_layernorm set incomplete: "Found a final incomplete set"). Weights as
bench/gptq_llmc_families_fixture.py draws them (`tensors`); the samples are the first 32 of its one-token samples (a
one-token attention returns its v whatever masks and positions, so both sides see the same layer inputs).
llm-compressor 0.14's `oneshot` (its venv, `--llmc-python`) runs [AWQModifier(n_grid=20, duo_scaling=True),
QuantizationModifier(W4A16 int4 symmetric groups of 16, lm_head, the routers and the shared-expert gate ignored)] with
its mappings for the architecture (DeepSeek-V3: input_layernorm over q_a_proj and kv_a_proj_with_mqa, q_a_layernorm
over q_b_proj, kv_a_layernorm over kv_b_proj, post_attention_layernorm over the router, every expert's and the shared
experts' gate / up; Qwen2-MoE: input_layernorm over q/k/v, post_attention_layernorm over the router and every expert's
gate / up only, so the shared expert and its gate read the smoothed norm uncompensated; each up_proj over its
down_proj) and `moe_calibrate_all_experts=True`, batch 1, samples unshuffled. The fixture keeps, per quantized module,
its int4 codes (two per byte) and group scales, the smoothed norms, routers and shared-expert gates, plus the config,
samples and weights' digest; tests/qformats/models/decoder/test_moe_awq_families_llmc.py runs our AWQ on the same
model and compares.

    python bench/awq_llmc_families_fixture.py --family deepseek_v3|qwen2_moe [--llmc-python PY] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

SAMPLES = 32
FAMILY = {"deepseek_v3": "deepseek_v3_sparse", "qwen2_moe": "qwen2_moe_sparse"}
"""--family -> the name of its tiny config in `families()`."""
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False,
    "router_aux_loss_coef": 0.0, "output_router_logits": False}


def families():
    """bench/gptq_llmc_families_fixture.py as a module, with the configs of FAMILY added (its deepseek_v3 with every
    layer sparse, QWEN2_MOE)."""
    spec = importlib.util.spec_from_file_location("gptq_llmc_families_fixture",
                                                  Path(__file__).parent / "gptq_llmc_families_fixture.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.FAMILIES[FAMILY["deepseek_v3"]] = {**gen.FAMILIES["deepseek_v3"], "first_k_dense_replace": 0}
    gen.FAMILIES[FAMILY["qwen2_moe"]] = QWEN2_MOE
    return gen


def theirs_script(dense) -> str:
    """The llm-compressor script (`dense`: bench/gptq_llmc_fixture.py as a module): AWQ then W4A16 RTN, every expert
    calibrated on every token; saves each quantized module's codes and scales, the norms and routers."""
    return dense.ONESHOT_PREAMBLE + dense.W4_GROUP + r"""
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
# AWQ pins its cached batches (host -> GPU copies); a CPU-only torch cannot pin: pinning moves no value
IntermediatesCache.pin_memory = lambda self, batch_index: None
oneshot(model=model, processor=tok, dataset=ds,
        recipe=[AWQModifier(n_grid=20, duo_scaling=True),
                QuantizationModifier(config_groups={"group_0": w4}, ignore=["lm_head", "re:.*mlp.gate$",
                                                                            "re:.*mlp.shared_expert_gate$"])],
        max_seq_length=512, num_calibration_samples=len(ids), shuffle_calibration_samples=False,
        moe_calibrate_all_experts=True)
res = {}
for name, m in model.named_modules():
    if hasattr(m, "weight_scale"):
        w, s = m.weight.detach().float(), m.weight_scale.detach().float()
        # round-to-nearest (the QuantizationModifier leaves the smoothed weights float until compression)
        codes = torch.clamp(torch.round(w / s.repeat_interleave(group, dim=1)), -8, 7).to(torch.int8)
        res[name + ".codes"] = codes.numpy()
        res[name + ".scale"] = s.numpy()
    elif name.endswith(("layernorm", "mlp.gate", "shared_expert_gate")):
        res[name + ".weight"] = m.weight.detach().float().numpy()
print(sorted(res)[:6], len(res), file=sys.stderr)
np.savez(out, **res)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILY), default="deepseek_v3")
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--out", default=None, help="default: tests/qformats/models/decoder/data/awq_llmc_FAMILY.npz")
    a = ap.parse_args()
    a.out = a.out or str(Path(__file__).resolve().parents[1] / "tests" / "qformats" / "models" / "decoder" / "data" /
                         f"awq_llmc_{a.family}.npz")
    gen = families()
    fam = FAMILY[a.family]
    dense = gen._dense()
    t = gen.tensors(fam)
    s = gen.samples()[:SAMPLES]
    with tempfile.TemporaryDirectory() as d:
        src = gen.write_checkpoint(fam, Path(d) / "tiny", t)
        theirs = dense.run_oneshot(a.llmc_python, theirs_script(dense), src, s, Path(d) / "theirs.npz", gen.GROUP)
    fixture = {"digest": np.array(gen.digest(t)), "lengths": np.array([len(x) for x in s]), "ids": np.concatenate(s),
               "config": np.array(json.dumps(gen.FAMILIES[fam]))}
    for key, v in theirs.items():
        fixture[key] = dense.pack(v) if key.endswith(".codes") else v
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **fixture)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes, {sum(k.endswith('.codes') for k in theirs)} Linears)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
