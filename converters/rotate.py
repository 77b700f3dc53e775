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
  The formulas are `qformats.rotation`'s (W' = W R on the input side, W' = R^T W, b' = R^T b on the output side,
  E' = E R, R = M / sqrt(n)). R1 and R2 leave the model's function unchanged (after steps 1-3); R3 / R4 need the
  stored online matrices `<module>.R3_q_attn.weight`, `<module>.R3_k_cache.weight`, `<module>.R4_input.weight`
  (M unnormalised, float64, as compressed-tensors saves them), which `converters.causal_lm.load_causal_lm` applies
  and transformers ignores (so checkpoints meant for transformers / vLLM take R1 and R2 only, the default).

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

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np

from converters.safetensors_io import open_checkpoint, read_json
from converters.shard_writer import ShardedWriter
from qformats.errors import CheckpointError, ModelError, QFormatsError
from qformats.hadamard import base_order, hadamard_matrix, is_pow2, sylvester
from qformats.rotation import center_rows, fuse_norm, random_signs, rotate_columns, rotate_rows

__all__ = ["KINDS", "ROTATIONS", "Rotated", "rotation_matrix", "rotate_checkpoint", "spinquant_transform_config"]

KINDS = ("hadamard", "random-hadamard")
ROTATIONS = ("R1", "R2", "R3", "R4")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_GROUP_INDEX = {"R1": 1, "R2": 2, "R3": 3, "R4": 4}  # the random-sign stream of each group

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.(?:[qkvo]_proj\.(?:weight|bias)|[qk]_norm\.weight)|"
                    r"mlp\.(?:gate|up|down)_proj\.(?:weight|bias)|(?:input|post_attention)_layernorm\.weight)$")
_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class Rotated:
    """What `rotate_checkpoint` did: the transform_config to record (compressed-tensors' JSON form) and the
    online transform tensors (name -> float64 matrix) that go into the quantized checkpoint beside the weights."""

    transform_config: Dict[str, Any]
    online: Dict[str, np.ndarray]
    kind: str
    rotations: tuple
    seed: int


def spinquant_transform_config(kind: str, head_dim: int, rotations: Sequence[str] = ("R1", "R2")) -> Dict[str, Any]:
    """The transform_config SpinQuantModifier(rotations, transform_type=kind) records, as compressed-tensors 0.20
    serialises it (TransformConfig.model_dump(mode="json"); targets are llm-compressor's default mappings)."""
    def args(targets, location, inverse=False):
        return {"targets": list(targets), "location": location, "inverse": inverse, "ignore": []}

    def scheme(hd, apply):
        return {"type": kind, "apply": apply, "randomize": False, "requires_grad": False, "head_dim": hd,
                "precision": "torch.float64"}

    groups = {}
    if "R1" in rotations:
        groups["R1"] = scheme(None, [
            args(["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"], "weight_output"),
            args(["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*up_proj$", "re:.*gate_proj$", "lm_head"],
                 "weight_input", True)])
    if "R2" in rotations:
        groups["R2"] = scheme(int(head_dim), [args(["re:.*v_proj$"], "weight_output"),
                                              args(["re:.*o_proj$"], "weight_input", True)])
    if "R3" in rotations:
        groups["R3"] = scheme(int(head_dim), [args(["re:.*self_attn$"], "q_attn"),
                                              args(["re:.*self_attn$"], "k_cache")])
    if "R4" in rotations:
        groups["R4"] = scheme(None, [args(["re:.*down_proj$"], "input"),
                                     args(["re:.*down_proj$"], "weight_input", True)])
    return {"config_groups": groups}


def rotation_matrix(n: int, kind: str, seed: int = 0, stream: int = 0, signs=None) -> np.ndarray:
    """The unnormalised matrix M [n, n] (float64, M M^T = n I) compressed-tensors' factory of `kind` makes for
    order n: "hadamard" -> Sylvester's H_n (n = 2^k only); "random-hadamard" -> diag(s) Had_n with
    s = random_signs(n, seed, stream), or the given `signs`. ModelError when compressed-tensors could not build it
    either."""
    from converters.transforms import ct_hadamard_bases

    if kind not in KINDS:
        raise ModelError(f"rotation kind {kind!r} is not supported; supported: {KINDS}")
    if kind == "hadamard":
        if not is_pow2(n):
            raise ModelError(f"a deterministic Hadamard rotation of order {n} does not exist in compressed-tensors "
                             f"(Sylvester's construction, n = 2^k only: 'Cannot construct deterministic hadamard of "
                             f"size != 2^n', which llm-compressor's SpinQuantModifier raises too); use "
                             f"'random-hadamard'")
        return sylvester(n)
    bases = ct_hadamard_bases()
    if bases:
        try:
            k = base_order(n, list(bases))
        except QFormatsError:
            raise ModelError(f"a random Hadamard rotation of order {n}: compressed-tensors has no stored Hadamard "
                             f"matrix of an order K with {n} = 2^k K ('Cannot construct random hadamard matrix of "
                             f"size {n}')") from None
        base = None if k == 1 else bases[k]
    elif is_pow2(n) and n != 32:  # the stored bases of these orders are Sylvester's
        base = None
    else:
        raise ModelError(f"a random Hadamard rotation of order {n} needs compressed-tensors' stored Hadamard "
                         f"matrices (transform/utils/hadamards.safetensors of the compressed-tensors package), "
                         f"which are not installed")
    s = random_signs(n, seed, stream) if signs is None else np.asarray(signs, np.float64)
    return s[:, None] * hadamard_matrix(n, base)


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
    rotations = tuple(rotations)
    bad = [r for r in rotations if r not in ROTATIONS]
    if bad or not rotations or len(set(rotations)) != len(rotations):
        raise ModelError(f"rotations: expected distinct names among {ROTATIONS}, found {list(rotations)}")
    if kind not in KINDS:
        raise ModelError(f"rotation kind {kind!r} is not supported; supported: {KINDS}")
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
    mats = {"R1": hidden, "R2": head_dim, "R3": head_dim, "R4": inter}
    m = {r: rotation_matrix(mats[r], kind, seed, _GROUP_INDEX[r]) for r in rotations}
    for r, s in (signs or {}).items():
        s = np.asarray(s, np.float64)
        if kind != "random-hadamard" or r not in m or s.shape != (mats[r],) or not np.all(np.abs(s) == 1):
            raise ModelError(f"signs[{r!r}]: expected {mats.get(r)} values in {{-1, +1}} for a random-hadamard group "
                             f"among {list(m)}, found shape {list(s.shape)}")
        m[r] = rotation_matrix(mats[r], kind, signs=s)
    tc = spinquant_transform_config(kind, head_dim, rotations)

    with open_checkpoint(src) as ck:
        names = ck.keys()
        for n in names:
            mm = _LAYER.match(n)
            if not (n in _TOP or (mm and int(mm.group(1)) < n_layers)):
                raise ModelError(f"{src}: tensor {n!r} is not one SpinQuant's mappings for {mt} know how to rotate "
                                 f"(embed_tokens, layers.i.self_attn / mlp projections and norms, norm, lm_head); "
                                 f"rotating the residual stream without it would change the model")
        tied = "lm_head.weight" not in names
        if tied and cfg.get("tie_word_embeddings") is False:
            raise CheckpointError(f"{src}: no lm_head.weight and tie_word_embeddings is false")

        def get64(name):
            return np.asarray(ck.get(name), np.float64)

        out_names = sorted(set(names) | {"lm_head.weight"})
        with ShardedWriter(Path(dst), max_shard_size, overwrite=overwrite) as w:
            for name in out_names:
                src_name = "model.embed_tokens.weight" if (name == "lm_head.weight" and tied) else name
                dtype = ck.info(src_name).numpy_dtype

                def cast(a):
                    return np.asarray(a).astype(dtype)

                a = np.asarray(ck.get(src_name))
                mod, _, local = name.rpartition(".")
                last = mod.rpartition(".")[2]
                layer = mod.rpartition(".")[0]
                if last in ("input_layernorm", "post_attention_layernorm") or name == "model.norm.weight":
                    a = np.ones(a.shape, dtype)  # folded into the Linears that read it
                elif name == "model.embed_tokens.weight":
                    if center_embeddings:
                        a = cast(center_rows(a))
                    if "R1" in m:
                        a = cast(rotate_columns(a, m["R1"]))
                elif local == "weight" and last in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") or \
                        name == "lm_head.weight":
                    norm = ("model.norm" if name == "lm_head.weight" else
                            layer.rpartition(".")[0] + (".input_layernorm" if last in ("q_proj", "k_proj", "v_proj")
                                                        else ".post_attention_layernorm"))
                    a = cast(fuse_norm(a, get64(norm + ".weight")))
                    if "R1" in m:
                        a = cast(rotate_columns(a, m["R1"]))
                    if last == "v_proj" and "R2" in m:
                        a = cast(rotate_rows(a, m["R2"]))
                elif last == "v_proj" and local == "bias" and "R2" in m:
                    a = cast(rotate_rows(a, m["R2"]))
                elif last in ("o_proj", "down_proj"):
                    if "R1" in m:
                        a = cast(rotate_rows(a, m["R1"]))
                    if local == "weight" and last == "o_proj" and "R2" in m:
                        a = cast(rotate_columns(a, m["R2"]))
                    if local == "weight" and last == "down_proj" and "R4" in m:
                        a = cast(rotate_columns(a, m["R4"]))
                w.add(name, np.ascontiguousarray(a))
                ck.drop_pages()
            w.add_json("config.json", {**cfg, "tie_word_embeddings": False})
            w.copy_extra_files(src)

    online: Dict[str, np.ndarray] = {}
    for i in range(n_layers):
        if "R3" in m:
            online[f"model.layers.{i}.self_attn.R3_q_attn.weight"] = m["R3"]
            online[f"model.layers.{i}.self_attn.R3_k_cache.weight"] = m["R3"]
        if "R4" in m:
            online[f"model.layers.{i}.mlp.down_proj.R4_input.weight"] = m["R4"]
    return Rotated(json.loads(json.dumps(tc)), online, kind, rotations, int(seed))
