"""Rotations of the decoder: online rotations installed on its modules, and SpinQuant's applied in memory.

`set_rotation` installs an online rotation (a dense matrix or the fast Hadamard transform) at a projection's input
or output or on post-RoPE queries / keys; `CausalLM` applies it in its forward pass.

`rotate_decoder(model, kind)` does to a dense `CausalLM` what `converters.pipelines.rotate.rotate_checkpoint` does to its
checkpoint -- the same steps, the same per-tensor function (`qformats.rotation.spinquant_tensor`, float64 fusing with
a cast back to the parameter dtype after every step), so that rotating in memory and then quantizing
(`rotate_decoder(model, kind, seed=seed)`, then `qformats.nn.quantize_model(model, rules)`) packs exactly what
rotate_checkpoint -> quantize_checkpoint -> load_causal_lm gives. The online R3 / R4 rotations are installed with
`set_rotation` as the fast Hadamard transform (`HadamardRotation`), as the checkpoint loader installs them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder.kv_cache import kv_cache_scheme
from qformats.models.decoder.layers import HadamardRotation, Rotation
from qformats.models.decoder.model import CausalLM
from qformats.models.decoder.params import hf_tensor_names, hf_tensors, resolve_path
from qformats.nn.nnx_layers import QuantizedMatmul
from qformats.rotation import (SPINQUANT_MODEL_TYPES, Rotated, factors_matrix, fused_norm_name, spinquant_matrices,
                               spinquant_online, spinquant_tensor, spinquant_transform_config)

__all__ = ["ROTATION_SITES", "ATTENTION_SITES", "set_rotation", "rotate_decoder"]

ROTATION_SITES = ("input", "output")
ATTENTION_SITES = ("q_attn", "k_cache")


def set_rotation(model: CausalLM, module: str, location: str, weight) -> None:
    """Apply the online rotation `weight` -- a dense M [n, n] (v -> v @ M, per block of n) or a
    `HadamardRotation` (the same map by the fast transform) -- at `location` of the HF
    module `module`: "input" / "output" of a projection ("model.layers.0.mlp.down_proj"), or "q_attn" /
    "k_cache" (post-RoPE queries / keys, per head) of an attention module ("model.layers.0.self_attn").
    ModelError for another module or location, or a size that does not divide the rotated axis."""
    parts = module.split(".")
    if model.config.mla is not None:
        raise ModelError(f"set_rotation {module} {location}: online rotations are not defined for the "
                         f"{model.config.model_type} model's multi-head latent attention")
    if isinstance(weight, HadamardRotation):
        order = int(weight.signs.get_value().shape[0])
    else:
        weight = jnp.asarray(weight)
        if weight.ndim != 2 or weight.shape[0] != weight.shape[1]:
            raise ModelError(f"set_rotation {module} {location}: expected a square matrix, found shape "
                             f"{tuple(weight.shape)}")
        order = int(weight.shape[0])
    ok = len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
        int(parts[2]) < model.config.num_layers
    if ok and len(parts) == 4 and parts[3] == "self_attn" and location in ATTENTION_SITES:
        owner, key, size = model.model.layers[int(parts[2])].self_attn, location, model.config.head_dim
    elif ok and len(parts) == 5 and parts[3] in ("self_attn", "mlp") and location in ROTATION_SITES:
        owner = getattr(model.model.layers[int(parts[2])], parts[3])
        lin = getattr(owner, parts[4], None)
        if parts[4] not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") or lin is None:
            raise ModelError(f"set_rotation: {module} is not a projection of the decoder")
        key = f"{parts[4]}/{location}"
        size = _features(lin, location)
    else:
        raise ModelError(f"set_rotation: online rotations at {location!r} of {module!r} are not supported (supported: "
                         f"{ROTATION_SITES} of the q/k/v/o/gate/up/down projections, {ATTENTION_SITES} of self_attn)")
    if size % order:
        raise ModelError(f"set_rotation {module} {location}: a rotation of order {order} does not divide {size}")
    rots = dict(owner.rotations or {})
    rots[key] = weight if isinstance(weight, HadamardRotation) else Rotation(weight)
    owner.rotations = nnx.data(nnx.Dict(rots))


def _features(lin, location: str) -> int:
    k = lin.kernel.get_value()
    shape = k.shape
    return int(shape[0] if location == "input" else shape[1])


def _refuse(model, where: str) -> None:
    """ModelError for a model the rotation cannot keep the function of (anything but a dense, unrotated CausalLM)."""
    if not isinstance(model, CausalLM):
        raise ModelError(f"{where}: SpinQuant rotations are defined for the decoder family {SPINQUANT_MODEL_TYPES} "
                         f"(qformats.models.decoder.CausalLM, llm-compressor's default mappings), found "
                         f"{type(model).__module__}.{type(model).__name__}")
    if model.config.model_type not in SPINQUANT_MODEL_TYPES:
        raise ModelError(f"{where}: SpinQuant rotations are defined for {SPINQUANT_MODEL_TYPES}, found model_type "
                         f"{model.config.model_type!r}")
    packed = [p for p, m in nnx.iter_modules(model) if isinstance(m, QuantizedMatmul)]
    if packed:
        raise ModelError(f"{where}: rotate the dense model before quantizing it; "
                         f"{'/'.join(map(str, packed[0]))} is already quantized")
    rotated = [p for p, m in nnx.iter_modules(model) if getattr(m, "rotations", None) is not None]
    if rotated:
        raise ModelError(f"{where}: {'/'.join(map(str, rotated[0]))} already carries online rotations")
    if kv_cache_scheme(model) is not None:
        raise ModelError(f"{where}: rotate before enabling KV-cache quantization (R2 changes the values, so "
                         f"calibrated v_scale would no longer fit)")
    if model.sharding is not None:
        raise ModelError(f"{where}: rotate before placing the model on a mesh (untying lm_head adds a parameter)")


def rotate_decoder(model: CausalLM, kind: str = "random-hadamard", *, seed: int = 0,
                   rotations: Sequence[str] = ("R1", "R2"), center_embeddings: bool = True,
                   signs: Optional[Mapping[str, Any]] = None,
                   hadamard_bases: Optional[Mapping[int, np.ndarray]] = None) -> Rotated:
    """SpinQuant's `rotations` of `kind` applied to the dense decoder `model` in place (`qformats.rotation`):

      lm_head untied (a new nnx.Linear holding the embedding; config.tie_word_embeddings becomes False), the
      embedding centred (center_embeddings), norm gains folded into the projections that read them, then per HF
      tensor `spinquant_tensor` (R1: W' = W R on the input side of q/k/v/gate/up/lm_head, W' = R^T W on the output
      side of o/down and the embedding E' = E R; R2 per head on v_proj's output and o_proj's input; R4's fused
      half on down_proj's input), R = M / sqrt(n), M = diag(s) Had_n; and R3 (q_attn, k_cache) / R4 (down_proj
      input) installed online (`set_rotation`, fast Hadamard transform).

    R1, R2 (and R3, R4 together with their online halves) keep the model's function up to float32 rounding;
    centring the embedding changes an RMSNorm model slightly, as llm-compressor's SpinQuantModifier does.

    Args:
      model: a dense `qformats.models.decoder.CausalLM` (not quantized, no online rotations, no KV-cache
        quantization, not yet on a mesh).
      kind: "hadamard" (Sylvester, power-of-two orders only) or "random-hadamard".
      seed: the random signs' seed (`qformats.rotation.random_signs(n, seed, GROUP_STREAMS[group])`), the same
        draw as `converters.pipelines.rotate.rotate_checkpoint(seed=...)`.
      rotations: a subset of ("R1", "R2", "R3", "R4").
      signs: random-hadamard only: group -> signs [n] to use instead of the seeded draw.
      hadamard_bases: compressed-tensors' stored Hadamard matrices (`converters.formats.compressed_tensors.transforms.ct_hadamard_bases()`),
        needed for orders that are not a power of two (SmolLM2's 576 = 4 * 144) and for 32.

    Returns:
      the `qformats.rotation.Rotated` record: transform_config (for `converters.pipelines.flax_io.save_compressed`'s
      transform_config; save with tie_word_embeddings false in the HF config) and the online matrices.

    Raises:
      ModelError: another model class or model type, a quantized / rotated / KV-quantized / sharded model, an
        unsupported kind or rotation set, a size with no such rotation. The model is unchanged then.
    """
    _refuse(model, "rotate_decoder")
    c = model.config
    factors = spinquant_matrices(c.hidden_size, c.head_dim, c.intermediate_size, kind, seed=seed,
                                 rotations=rotations, signs=signs, bases=hadamard_bases)
    m = {r: factors_matrix(s, base) for r, (s, base) in factors.items()}

    orig = hf_tensors(model)
    tied = c.tie_word_embeddings
    if tied:
        orig["lm_head.weight"] = orig["model.embed_tokens.weight"]
    new = {}
    for name, a in orig.items():
        norm = fused_norm_name(name)
        gain = None if norm is None else orig[norm].astype(np.float64)
        new[name] = spinquant_tensor(name, a, m, gain, center_embeddings)

    if tied:
        emb = model.model.embed_tokens.embedding.get_value()
        # a tied CausalLM holds lm_head = None as a static attribute: the new Linear is marked as data
        model.lm_head = nnx.data(nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=model.dtype,
                                            param_dtype=emb.dtype, rngs=nnx.Rngs(0)))
        model.config = dataclasses.replace(c, tie_word_embeddings=False)
    for name, slot in hf_tensor_names(model.config).items():
        var = resolve_path(model, slot.path)
        value = jnp.asarray(new[name], dtype=var.get_value().dtype)
        var.set_value(value.T if slot.transpose else value)

    for i in range(c.num_layers):
        if "R3" in factors:
            for location in ("q_attn", "k_cache"):
                set_rotation(model, f"model.layers.{i}.self_attn", location, HadamardRotation(*factors["R3"]))
        if "R4" in factors:
            set_rotation(model, f"model.layers.{i}.mlp.down_proj", "input", HadamardRotation(*factors["R4"]))
    tc = spinquant_transform_config(kind, c.head_dim, tuple(rotations))
    return Rotated(tc, spinquant_online(m, c.num_layers), kind, tuple(rotations), int(seed))
