"""The decoder families' module layouts that calibration needs: DeepSeek-V3's latent attention, gpt-oss's fused experts.

`qformats.models.decoder.calibration.calibrate_decoder` runs one algorithm (GPTQ / MSE Hessians, static activation
ranges) on every family; this module says which Linears a layer has and what input each one reads, where a family
departs from the llama layout:

  DeepSeek-V3 multi-head latent attention (`mla.MLAttention`), each Linear's H from its own input, as llm-compressor's
  GPTQ hooks build it on transformers' `DeepseekV3Attention`:
      q_a_proj, kv_a_proj_with_mqa  read the attention input x (one H, NVFP4 global scale shared: vLLM's
                                    fused_qkv_a_proj; `shared_scales.FUSED_GROUPS`)
      q_b_proj                      reads q_a_layernorm(q_a_proj(x))             (q_proj reads x without query LoRA)
      kv_b_proj                     reads kv_a_layernorm(c), c = kv_a_proj_with_mqa(x)[:, :kv_lora_rank], the
                                    normed latent of the same tokens (transformers: `kv_b_proj(kv_a_layernorm(k_pass))`;
                                    ours applies it to the cached latent, which during calibration is those tokens')
      o_proj                        reads the attention's per-head values, concatenated
  Its first_k_dense_replace layers hold an ordinary MLP; a sparse layer's shared experts are one ordinary MLP
  ("mlp/shared_experts/{gate,up,down}_proj"); the router (`DeepseekRouter`, float32) stays float, as llm-compressor's
  recipes ignore `mlp.gate`.

  gpt-oss's fused experts: `gate_up_proj` [E, d, 2I] with gate in the even and up in the odd columns and their
  biases. llm-compressor 0.14 linearizes them (`GptOssExpertMLP`: gate_proj = gate_up[e][:, 0::2].T, up_proj =
  gate_up[e][:, 1::2].T, biases alike) and quantizes each as its own Linear: here the even / odd columns are
  quantized apart (`expert_gate_up` gives them, biases included, so the down_proj input a_e = act(x W_g + b_g,
  x W_u + b_u) is the clamped SwiGLU's), then interleaved back into the fused stack (`params._interleave_rows`), which
  is exact for scales per output row (channel, group, tensor_group with the gate/up-shared global scale).
"""

from __future__ import annotations

from typing import Optional, Tuple

from qformats.errors import ModelError

__all__ = ["MLA_PROJECTIONS", "attention_projections", "expert_gate_up", "check_fused_experts", "refuse_scaling"]

ATTENTION_PROJECTIONS = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj")
MLA_PROJECTIONS = ("self_attn/q_a_proj", "self_attn/kv_a_proj_with_mqa", "self_attn/q_proj", "self_attn/q_b_proj",
                   "self_attn/kv_b_proj", "self_attn/o_proj")
"""The Linears of DeepSeek's latent attention, by path relative to the layer, in input order (q_a_proj and
kv_a_proj_with_mqa first: they read one input); q_proj (no query LoRA) or q_a_proj / q_b_proj, whichever exist."""

#: weight strategies whose scales are per output row: gate and up quantized apart interleave exactly
ROW_STRATEGIES = ("channel", "group", "tensor_group")


def attention_projections(layer) -> Tuple[str, ...]:
    """The attention Linears of a decoder layer (paths relative to it): q/k/v/o, or `MLA_PROJECTIONS` present."""
    attn = layer.self_attn
    if getattr(attn, "mla", None) is None:
        return ATTENTION_PROJECTIONS
    return tuple(p for p in MLA_PROJECTIONS if hasattr(attn, p.split("/", 1)[1]))


def expert_gate_up(experts, cfg) -> Tuple[object, object, Optional[object], Optional[object]]:
    """(gate, up [E, d, I], gate bias, up bias [E, I] or None) of an MoE block's float expert stacks (`ExpertFFNs`):
    the gate / up stacks as they are, or gpt-oss's fused gate_up_proj split as llm-compressor linearizes it
    (gate = columns 0::2, up = columns 1::2, biases alike)."""
    g, u, _ = cfg.projections
    if g is not None:
        gs, us = getattr(experts, g), getattr(experts, u)
        gb, ub = gs.bias, us.bias
        return (gs.kernel.get_value(), us.kernel.get_value(), None if gb is None else gb.get_value(),
                None if ub is None else ub.get_value())
    fused = getattr(experts, u)
    k = fused.kernel.get_value()
    b = None if fused.bias is None else fused.bias.get_value()
    return k[..., 0::2], k[..., 1::2], None if b is None else b[..., 0::2], None if b is None else b[..., 1::2]


def check_fused_experts(model_type: str, cfg, weights, weight_search: str) -> None:
    """ModelError, before any work, for a weight scheme that gpt-oss's fused gate_up_proj cannot hold as
    llm-compressor's separate gate_proj / up_proj would (scales per tensor or per 2-D block span both), and for an
    MSE search of NVFP4 weights (it picks each Linear's own global scale; the fused rows hold one per expert)."""
    if cfg is None or not cfg.fused_gate_up:
        return
    if weights.strategy == "tensor_group" and weight_search not in ("rtn", "gptq"):
        raise ModelError(f"calibrate_decoder: the {model_type} experts' fused gate_up_proj holds one NVFP4 global "
                         f"scale per expert for gate_proj and up_proj; weight_search {weight_search!r} would give "
                         "each its own; use 'gptq' or 'rtn' (the global scale shared, as llm-compressor fuses it)")
    if weights.strategy not in ROW_STRATEGIES:
        raise ModelError(f"calibrate_decoder: the {model_type} experts' fused gate_up_proj holds gate_proj and "
                         f"up_proj interleaved; weight scales of strategy {weights.strategy!r} span both, so the "
                         "per-expert gate_proj / up_proj llm-compressor quantizes apart cannot be stored in it; "
                         f"use a scheme with scales per output row ({', '.join(ROW_STRATEGIES)}), e.g. W4A16, "
                         "W8A8 or NVFP4")


def refuse_scaling(layer, index: int, what: str) -> None:
    """ModelError for AWQ / SmoothQuant (`what`) on a layer with gpt-oss's fused experts: llm-compressor 0.14 registers
    no AWQ or SmoothQuant mappings for GptOssForCausalLM (its AWQ_MAPPING_REGISTRY and smoothquant
    MAPPINGS_REGISTRY have no entry; its fallback default mappings name gate_proj / up_proj, which the fused
    gate_up_proj with biases and the clamped SwiGLU is not), so there are no scales to fold (GPTQ and static
    activation scales calibrate it). DeepSeek-V3's latent attention has its mappings (`calibration.MLA_AWQ_MAPPINGS`,
    `calibration._mla_smoothquant_mappings`)."""
    cfg = getattr(getattr(layer, getattr(layer, "ffn_name", "mlp"), None), "cfg", None)
    if cfg is not None and getattr(cfg, "fused_gate_up", False):
        raise ModelError(f"model/layers/{index}/{cfg.block_name}/experts: {what} on gpt-oss's fused gate_up_proj "
                         "experts (with biases and the clamped SwiGLU) is not supported: llm-compressor 0.14 has no "
                         f"{what} mapping for GptOssForCausalLM; use GPTQ")
