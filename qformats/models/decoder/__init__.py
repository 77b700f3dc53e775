"""The llama / mistral / qwen2 / qwen3 causal-LM family and its mixture-of-experts kin (qwen2_moe, qwen3_moe, mixtral, gpt_oss)
in Flax NNX: the model and its adapters.

Modules (each imports only those above it):
  `model`     the NNX model alone: `DecoderConfig` (from an HF config.json), RMSNorm, RoPE, attention, MLP,
              `CausalLM` with its explicit `KVCache`, and the online-rotation modules its forward pass applies;
  `mla`       multi-head latent attention of deepseek_v3 (`MLAttention`, `MLAConfig`) and its latent KV cache;
  `params`    HF parameter names (`hf_tensor_names`, one table), `load_hf_tensors` and its inverse `hf_tensors`;
  `kv_cache`  KV-cache quantization (`enable_kv_cache_quantization`, `calibrate_kv_cache`, ...);
  `rotate`    online rotations (`set_rotation`) and SpinQuant in memory (`rotate_decoder`);
  `moe`       the mixture-of-experts block (router, `qformats.nn.Experts` stacks, shared expert), `MoEConfig`;
  `sharding`  logical axes of parameters and KV cache, `tensor_parallel_rules`, `expert_parallel_rules`;
  `rules`     `quantization_rules`: the `qformats.nn` rules of the seven projections.

Rotate, then quantize (`qformats.nn.quantize_model` takes no rotation):

    rec = rotate_decoder(model, "random-hadamard", seed=0)
    quantize_model(model, quantization_rules("W4A16"))
"""

from qformats.models.decoder.kv_cache import (KVScale, calibrate_kv_cache, enable_kv_cache_quantization,
                                              kv_cache_scheme, kv_scale_tensors, kv_states)
from qformats.models.decoder.layers import (HadamardRotation, RMSNorm, RopeConfig, Rotation, apply_rope, rope_tables,
                                            rotate)
from qformats.models.decoder.model import (SUPPORTED_MODEL_TYPES, Attention, CausalLM, DecoderConfig, KVCache,
                                           PackedEmbed, attention_mask, inv_freq)
from qformats.models.decoder.params import TensorSlot, hf_tensor_names, hf_tensors, load_hf_tensors, module_path
from qformats.models.decoder.rotate import ATTENTION_SITES, ROTATION_SITES, rotate_decoder, set_rotation
from qformats.models.decoder.rules import quantization_rules
from qformats.models.decoder.moe import MoEBlock, MoEConfig, set_dispatch
from qformats.models.decoder.sharding import KV_CACHE_AXES, PARAM_AXES, expert_parallel_rules, tensor_parallel_rules

__all__ = [
    "SUPPORTED_MODEL_TYPES", "DecoderConfig", "RopeConfig", "CausalLM", "KVCache", "Attention", "RMSNorm", "PackedEmbed",
    "attention_mask", "inv_freq", "rope_tables", "apply_rope", "Rotation", "HadamardRotation", "rotate",
    "TensorSlot", "hf_tensor_names", "hf_tensors", "load_hf_tensors", "module_path",
    "KVScale", "kv_cache_scheme", "enable_kv_cache_quantization", "kv_states", "calibrate_kv_cache", "kv_scale_tensors",
    "ROTATION_SITES", "ATTENTION_SITES", "set_rotation", "rotate_decoder",
    "quantization_rules", "KV_CACHE_AXES", "PARAM_AXES", "tensor_parallel_rules", "expert_parallel_rules",
    "MoEConfig", "MoEBlock", "set_dispatch",
]
