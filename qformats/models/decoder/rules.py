"""`qformats.nn` quantization rules of the decoder family: which of its Linear layers and expert stacks a scheme quantizes."""

from __future__ import annotations

from typing import List

from qformats.nn import Rule

#: The projections a scheme quantizes: attention's four (deepseek_v3's latent attention: q_a/q_b/kv_a_proj_with_mqa/
#: kv_b/o), the dense MLP's three, and in mixture-of-experts layers the expert stacks (`mlp/experts/*`, mixtral's
#: `block_sparse_moe/experts/w1|w2|w3`, gpt_oss's `gate_up_proj`) and the shared expert's MLP (deepseek_v3's
#: `shared_experts`). Routers (`mlp/gate`, `block_sparse_moe/gate`, `mlp/router`) and `shared_expert_gate` stay
#: dense, as llm-compressor's MoE recipes leave them (`ignore=["re:.*mlp.gate$", ...]`); deepseek_v3's router is
#: not a Linear at all (`moe.DeepseekRouter`, float32).
PROJECTIONS = (r"model/layers/\d+/(self_attn/[qkvo]_proj|mlp/(gate|up|down)_proj"
               r"|(mlp|block_sparse_moe)/experts/(gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)"
               r"|mlp/shared_experts?/(gate|up|down)_proj"
               r"|self_attn/(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj))")


def quantization_rules(scheme, *, quantize_lm_head: bool = False) -> List[Rule]:
    """`qformats.nn` rules quantizing the projections of every decoder layer (`PROJECTIONS`) with `scheme` and
    leaving `lm_head` dense (as llm-compressor's recipes do: `ignore=["lm_head"]`) unless `quantize_lm_head` (and
    the model has an untied lm_head). The embedding is an nnx.Embed, which rules never touch; MoE routers and the
    shared expert's gate stay dense."""
    rules = [Rule(PROJECTIONS, scheme)]
    return rules + [Rule("lm_head", scheme)] if quantize_lm_head else rules
