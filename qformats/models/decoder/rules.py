"""`qformats.nn` quantization rules of the decoder family: which of its Linear layers a scheme quantizes."""

from __future__ import annotations

from typing import List

from qformats.nn import Rule


def quantization_rules(scheme, *, quantize_lm_head: bool = False) -> List[Rule]:
    """`qformats.nn` rules quantizing the seven projections of every decoder layer with `scheme` and leaving
    `lm_head` dense (as llm-compressor's recipes do: `ignore=["lm_head"]`) unless `quantize_lm_head` (and the
    model has an untied lm_head). The embedding is an nnx.Embed, which rules never touch. deepseek_v3: its
    latent-attention projections (q_a/q_b/kv_a_proj_with_mqa/kv_b/o), dense MLPs, shared experts and every
    routed expert (stacked `Experts`); its router `mlp/gate` is not a Linear and stays float32."""
    rules = [Rule(r"model/layers/\d+/(self_attn/([qkvo]_proj|q_[ab]_proj|kv_a_proj_with_mqa|kv_b_proj)"
                  r"|mlp/((experts|shared_experts)/)?(gate|up|down)_proj)", scheme)]
    return rules + [Rule("lm_head", scheme)] if quantize_lm_head else rules
