"""SpinQuant rotations written as llm-compressor 0.14's SpinQuantModifier writes them (R1/R2 fused, R3/R4 online).

`rotate_checkpoint(src, dst, kind)` turns a dense HF decoder checkpoint (llama / mistral / qwen2 / qwen3) into the
dense checkpoint SpinQuantModifier(rotations=..., transform_type=kind) leaves in memory before quantization, and
returns the `transform_config` it records. Its steps, in its order (llmcompressor/modifiers/transform/spinquant):

  1. untie lm_head from the embedding (lm_head.weight = the embedding, written; tie_word_embeddings = false);
  2. center the embedding rows: E <- E - mean(E, -1) (`center_embeddings`; unlike the rotations this changes
     the function of an RMSNorm model slightly -- `center_embeddings=False` leaves it out);
  3. fold each norm's gain into the Linears that read it (input_layernorm -> q/k/v, post_attention_layernorm ->
     gate/up, model.norm -> lm_head; the gains become ones: `fuse_norm_linears`);
  4. compressed-tensors' `apply_transform_config`, group by group, each fused in float64 and cast back:
     R1 (order hidden_size, the residual stream): weight_output of embed_tokens, o_proj, down_proj and
        weight_input (inverse) of q/k/v/gate/up_proj and lm_head;
     R2 (order head_dim, per head): weight_output of v_proj, weight_input (inverse) of o_proj;
     R3 (online, order head_dim): q_attn and k_cache of each self_attn (post-RoPE queries and keys);
     R4 (online, order intermediate_size): input of down_proj, with its weight_input (inverse) fused.
  The formulas (and this order) are `qformats.rotation`'s, shared with the in-memory
  `qformats.models.decoder.rotate_decoder` (W' = W R on the input side, W' = R^T W, b' = R^T b on the output side,
  E' = E R, R = M / sqrt(n)). R1 and R2 leave the model's function unchanged (after steps 1-3); R3 / R4 need the
  stored online matrices `<module>.R3_q_attn.weight`, `<module>.R3_k_cache.weight`, `<module>.R4_input.weight`
  (M unnormalised, float64, as compressed-tensors saves them), which `converters.pipelines.causal_lm.load_causal_lm`
  applies and transformers ignores (so checkpoints meant for transformers / vLLM take R1 and R2 only, the default).

Matrices (compressed-tensors' factories; one matrix per group and order, shared by every module):
  "hadamard": Sylvester's H_n. compressed-tensors builds it for n = 2^k only and raises "Cannot construct
    deterministic hadamard of size != 2^n" otherwise (so llm-compressor refuses SmolLM2's 576); so do we
    (ModelError), rather than substitute another matrix under the same name.
  "random-hadamard": diag(s) Had_n, Had_n of `qformats.hadamard` (compressed-tensors' stored base of order K for
    n = 2^k K: 576 = 4 * 144), s random signs. compressed-tensors draws s with torch's generator; we draw them
    with numpy from (seed, group index) (`qformats.rotation.random_signs`), so the matrices are of the same
    family, reproducible from the seed, but not torch's draw. Fused rotations leave no trace of s in the
    checkpoint; online ones store diag(s) Had_n itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np

from converters.formats.safetensors_io import open_checkpoint, read_json
from converters.formats.shard_writer import ShardedWriter
from qformats.errors import CheckpointError, ModelError
from qformats.rotation import (KINDS, ROTATIONS, SPINQUANT_MODEL_TYPES, Rotated, factors_matrix, fused_norm_name,
                               spinquant_matrices, spinquant_online, spinquant_tensor, spinquant_transform_config,
                               unknown_tensor_names)

__all__ = ["KINDS", "ROTATIONS", "Rotated", "rotate_checkpoint", "spinquant_transform_config"]

MODEL_TYPES = SPINQUANT_MODEL_TYPES


def _dims(cfg: Dict[str, Any], where: str):
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        inter = int(cfg["intermediate_size"])
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: expected hidden_size, num_attention_heads, intermediate_size and "
                              f"num_hidden_layers as integers ({e})") from None
    head_dim = cfg.get("head_dim") or hidden // heads
    return hidden, int(head_dim), inter, layers


def rotate_checkpoint(src: "str | os.PathLike", dst: "str | os.PathLike", kind: str = "random-hadamard", *,
                      seed: int = 0, rotations: Sequence[str] = ("R1", "R2"), center_embeddings: bool = True,
                      signs: Optional[Dict[str, Any]] = None, max_shard_size: "int | str" = "5GB",
                      overwrite: bool = False) -> Rotated:
    """Write at `dst` the dense checkpoint `src` after SpinQuant's `rotations` of `kind` (module docstring), one
    tensor at a time; returns the Rotated record (transform_config and online tensors) for the quantized checkpoint.

    Args:
      src: a dense HF checkpoint directory of the decoder family (llama / mistral / qwen2 / qwen3).
      kind: "hadamard" or "random-hadamard"; seed: the random signs' seed (random-hadamard).
      rotations: a subset of ("R1", "R2", "R3", "R4") (SpinQuantModifier's names).
      center_embeddings: step 2 of the module docstring (llm-compressor always does it).
      signs: random-hadamard only: group name -> the signs s of diag(s) Had_n to use instead of the seeded draw
        (e.g. the ones torch's generator gives compressed-tensors' factories, to reproduce an llm-compressor run).

    Raises:
      ModelError: an unsupported kind, rotation set, model type or tensor, or a size with no such rotation.
      CheckpointError: src unreadable or not dense, dst exists (without overwrite).
    """
    from converters.formats.compressed_tensors.transforms import ct_hadamard_bases

    rotations = tuple(rotations)
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: rotating needs a dense HF checkpoint directory (config.json + safetensors); "
                              f"convert a .gguf file first (qformats convert)")
    cfg = read_json(src / "config.json", src)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{src / 'config.json'}: expected a JSON object")
    if cfg.get("quantization_config"):
        raise CheckpointError(f"{src / 'config.json'}: expected a dense checkpoint to rotate, found a "
                              f"quantization_config")
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise ModelError(f"{src}: SpinQuant rotations are written for the decoder family {MODEL_TYPES} "
                         f"(llm-compressor's default mappings), found model_type {mt!r}")
    hidden, head_dim, inter, n_layers = _dims(cfg, str(src / "config.json"))
    factors = spinquant_matrices(hidden, head_dim, inter, kind, seed=seed, rotations=rotations, signs=signs,
                                 bases=ct_hadamard_bases())
    m = {r: factors_matrix(s, base) for r, (s, base) in factors.items()}
    tc = spinquant_transform_config(kind, head_dim, rotations)

    with open_checkpoint(src) as ck:
        names = ck.keys()
        unknown = unknown_tensor_names(names, n_layers)
        if unknown:
            raise ModelError(f"{src}: tensor {unknown[0]!r} is not one SpinQuant's mappings for {mt} know how to "
                             f"rotate (embed_tokens, layers.i.self_attn / mlp projections and norms, norm, lm_head); "
                             f"rotating the residual stream without it would change the model")
        tied = "lm_head.weight" not in names
        if tied and cfg.get("tie_word_embeddings") is False:
            raise CheckpointError(f"{src}: no lm_head.weight and tie_word_embeddings is false")

        out_names = sorted(set(names) | {"lm_head.weight"})
        with ShardedWriter(Path(dst), max_shard_size, overwrite=overwrite, sources=(src,)) as w:
            for name in out_names:
                src_name = "model.embed_tokens.weight" if (name == "lm_head.weight" and tied) else name
                norm = fused_norm_name(name)
                gain = None if norm is None else np.asarray(ck.get(norm), np.float64)
                a = spinquant_tensor(name, ck.get(src_name), m, gain, center_embeddings)
                w.add(name, np.ascontiguousarray(a))
                ck.drop_pages()
            w.add_json("config.json", {**cfg, "tie_word_embeddings": False})
            w.copy_extra_files(src)
    return Rotated(json.loads(json.dumps(tc)), spinquant_online(m, n_layers), kind, rotations, int(seed))
