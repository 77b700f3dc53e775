"""Tiny random mixture-of-experts checkpoints written by transformers 5 (`save_pretrained`: the on-disk layout) for
the MoE decoder tests: >= 8 experts, top-k >= 2, grouped-query attention, 3 layers, hidden 64."""

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, initializer_range=0.1, eos_token_id=None, bos_token_id=None,
            pad_token_id=None)
ARCHS = {
    # layer 1 dense (mlp_only_layers), top-3 of 8 renormalised, q/k norms and attention biases
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
        mlp_only_layers=[1], attention_bias=True)),
    # shared expert and its sigmoid gate, top-2 of 10 not renormalised, layer 2 dense by decoder_sparse_step
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=10, num_experts_per_tok=2,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[2])),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                                 sliding_window=12)),
    "gpt_oss": (transformers.GptOssConfig, dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64))),
}


def hf_config(arch: str, **over):
    cfg_cls, extra = ARCHS[arch]
    return cfg_cls(**{**BASE, **extra, **over})


def hf_model(arch: str, seed: int = 0, **over):
    """A random transformers model (eager attention, eval mode) with non-trivial norms, biases and sinks."""
    torch.manual_seed(seed)
    cfg = hf_config(arch, **over)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.1 * torch.randn_like(p))
    return hf


def write_checkpoint(arch: str, path: Path, seed: int = 0, **over):
    """`hf_model(arch)` saved with save_pretrained to `path`; returns the model."""
    hf = hf_model(arch, seed, **over)
    hf.save_pretrained(path)
    return hf


def read_checkpoint(path: Path):
    """(config.json dict, {name: numpy tensor}) of a single-file checkpoint."""
    return json.loads((Path(path) / "config.json").read_text()), load_file(str(Path(path) / "model.safetensors"))


def ids(batch: int = 2, length: int = 20, seed: int = 0):
    return np.random.RandomState(seed).randint(0, BASE["vocab_size"], (batch, length))
