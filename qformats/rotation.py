"""Orthogonal rotations fused into weights, as compressed-tensors fuses its offline (weight_input / weight_output) transforms.

A rotation of order k is an unnormalised matrix M [k, k] with M M^T = k I (a Hadamard matrix: Sylvester's H_k, or
diag(s) Had_k of `qformats.hadamard`); R = M / sqrt(k) is orthogonal. On an axis longer than k it acts per block of
k (block-diagonal, compressed-tensors' `head_dim`). For a torch Linear y = x W^T + b (W [out, in]):

  input side  (weight_input, inverse):  W' = W R            so that (x R) W'^T = x W^T
  output side (weight_output):          W' = R^T W, b' = R^T b  so that x W'^T + b' = (x W^T + b) R
  embedding   (weight_output):          E' = E R            (rows are the residual stream: e -> e R)

Everything here is float64 numpy (compressed-tensors fuses in float64 and casts back to the weight's dtype);
the caller casts, except in `spinquant_tensor`, which casts back after every step as llm-compressor does.

SpinQuant (llm-compressor 0.14's SpinQuantModifier) on a decoder of the llama family, by HF tensor name -- the one
home of its formulas, used by `converters.pipelines.rotate.rotate_checkpoint` (a checkpoint, tensor by tensor) and
`qformats.models.decoder.rotate_decoder` (a Flax decoder in memory):

  1. untie lm_head (lm_head.weight = the embedding);
  2. center the embedding rows, E <- E - mean(E, -1) (optional: it changes an RMSNorm model's function slightly);
  3. fold each norm's gain into the Linears reading it (input_layernorm -> q/k/v, post_attention_layernorm ->
     gate/up, model.norm -> lm_head; the gains become ones);
  4. R1 (order hidden_size): weight_output of embed_tokens, o_proj, down_proj; weight_input (inverse) of
     q/k/v/gate/up_proj and lm_head. R2 (order head_dim, per head): weight_output of v_proj, weight_input of
     o_proj. R3 (online, head_dim): q_attn and k_cache. R4 (online, intermediate_size): input of down_proj,
     with its weight_input fused.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from qformats.errors import ModelError, QFormatsError, SchemeError
from qformats.hadamard import base_order, hadamard_matrix, is_pow2, reduce_base

__all__ = ["GROUP_STREAMS", "KINDS", "ROTATIONS", "SPINQUANT_MODEL_TYPES", "Rotated", "center_rows", "fuse_norm",
           "factors_matrix", "fused_norm_name", "random_signs", "rotate_columns", "rotate_rows", "rotation_factors", "rotation_matrix",
           "spinquant_matrices", "spinquant_online", "spinquant_tensor", "spinquant_transform_config",
           "unknown_tensor_names"]

KINDS = ("hadamard", "random-hadamard")
ROTATIONS = ("R1", "R2", "R3", "R4")
SPINQUANT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GROUP_STREAMS = {"R1": 1, "R2": 2, "R3": 3, "R4": 4}  # the random-sign stream of each group

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.(?:[qkvo]_proj\.(?:weight|bias)|[qk]_norm\.weight)|"
                    r"mlp\.(?:gate|up|down)_proj\.(?:weight|bias)|(?:input|post_attention)_layernorm\.weight)$")
_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _check(m: np.ndarray, size: int, what: str) -> int:
    k = int(np.shape(m)[0])
    if np.shape(m) != (k, k) or k == 0 or size % k:
        raise SchemeError(f"{what}: a rotation of shape {list(np.shape(m))} does not divide an axis of {size}")
    return k


def rotate_columns(w, m) -> np.ndarray:
    """w @ blockdiag(M, ..., M) / sqrt(k) over the last axis of w (M [k, k], k dividing it): the input side of a
    Linear weight (compressed-tensors' weight_input with inverse=True) and the output of an embedding."""
    w = np.asarray(w, np.float64)
    m = np.asarray(m, np.float64)
    k = _check(m, w.shape[-1], "rotate_columns")
    lead = w.shape[:-1]
    return (w.reshape(*lead, w.shape[-1] // k, k) @ m).reshape(w.shape) / np.sqrt(k)


def rotate_rows(w, m) -> np.ndarray:
    """blockdiag(M, ..., M)^T @ w / sqrt(k) over the first axis of w (a Linear weight [out, in] or a bias [out]):
    the output side of a Linear (compressed-tensors' weight_output)."""
    w = np.asarray(w, np.float64)
    m = np.asarray(m, np.float64)
    k = _check(m, w.shape[0], "rotate_rows")
    blocks = w.reshape(w.shape[0] // k, k, -1)
    return np.einsum("ji,bjc->bic", m, blocks).reshape(w.shape) / np.sqrt(k)


def center_rows(e) -> np.ndarray:
    """e - mean(e, axis=-1): every embedding row shifted to mean zero (llm-compressor's `center_embeddings`)."""
    e = np.asarray(e, np.float64)
    return e - e.mean(axis=-1, keepdims=True)


def fuse_norm(w, gain) -> np.ndarray:
    """W * g: a norm's gain g [in] folded into the Linear weight W [out, in] that reads the norm's output
    (llm-compressor's `fuse_norm_linears`; the norm's gain becomes ones, so the norm commutes with a rotation)."""
    return np.asarray(w, np.float64) * np.asarray(gain, np.float64)


def random_signs(n: int, seed: int, stream: int = 0) -> np.ndarray:
    """n signs in {-1, +1} (float64), s_i = 2 b_i - 1 with b_i uniform bits from numpy's PCG64 seeded by
    (seed, stream): the diagonal of a random Hadamard matrix diag(s) Had_n."""
    rng = np.random.Generator(np.random.PCG64([int(seed), int(stream)]))
    return rng.integers(0, 2, size=int(n)).astype(np.float64) * 2 - 1


# ------------------------------------------------------------------------------------------------- SpinQuant


@dataclasses.dataclass(frozen=True)
class Rotated:
    """What a SpinQuant rotation did: the transform_config to record (compressed-tensors' JSON form) and the
    online transform tensors (HF name -> float64 matrix M) that go into a quantized checkpoint beside the weights."""

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


def rotation_factors(n: int, kind: str, seed: int = 0, stream: int = 0, signs=None,
                     bases: Optional[Mapping[int, np.ndarray]] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """(s, base) with M = diag(s) Had_n(base) the unnormalised matrix compressed-tensors' factory of `kind` makes
    for order n (`qformats.hadamard`; base None: Sylvester's H_n, base reduced to None where it is Sylvester's):
    "hadamard" -> s = 1, Sylvester's H_n (n = 2^k only); "random-hadamard" -> s = random_signs(n, seed, stream)
    or the given `signs`, Had_n of compressed-tensors' stored base of order K for n = 2^k K.

    bases: compressed-tensors' stored Hadamard matrices (order -> [K, K]; `converters.formats.compressed_tensors.transforms.ct_hadamard_bases`
    reads them from the installed package); without them only power-of-two orders other than 32 are built (the
    stored bases of those orders are Sylvester's). ModelError when compressed-tensors could not build it either."""
    if kind not in KINDS:
        raise ModelError(f"rotation kind {kind!r} is not supported; supported: {KINDS}")
    if kind == "hadamard":
        if not is_pow2(n):
            raise ModelError(f"a deterministic Hadamard rotation of order {n} does not exist in compressed-tensors "
                             f"(Sylvester's construction, n = 2^k only: 'Cannot construct deterministic hadamard of "
                             f"size != 2^n', which llm-compressor's SpinQuantModifier raises too); use "
                             f"'random-hadamard'")
        return np.ones(n), None
    if bases:
        try:
            k = base_order(n, list(bases))
        except QFormatsError:
            raise ModelError(f"a random Hadamard rotation of order {n}: compressed-tensors has no stored Hadamard "
                             f"matrix of an order K with {n} = 2^k K ('Cannot construct random hadamard matrix of "
                             f"size {n}')") from None
        base = None if k == 1 else reduce_base(np.asarray(bases[k], np.float64))
    elif is_pow2(n) and n != 32:
        base = None
    else:
        raise ModelError(f"a random Hadamard rotation of order {n} needs compressed-tensors' stored Hadamard "
                         f"matrices (transform/utils/hadamards.safetensors of the compressed-tensors package, read "
                         f"by converters.formats.compressed_tensors.transforms.ct_hadamard_bases()), none were given")
    s = random_signs(n, seed, stream) if signs is None else np.asarray(signs, np.float64)
    if s.shape != (n,) or not np.all(np.abs(s) == 1):
        raise ModelError(f"random-hadamard signs of order {n}: expected {n} values in {{-1, +1}}, found shape "
                         f"{list(s.shape)}")
    return s, base


def rotation_matrix(n: int, kind: str, seed: int = 0, stream: int = 0, signs=None,
                    bases: Optional[Mapping[int, np.ndarray]] = None) -> np.ndarray:
    """M = diag(s) Had_n(base) [n, n] float64 (M M^T = n I) of `rotation_factors` (same arguments)."""
    return factors_matrix(*rotation_factors(n, kind, seed, stream, signs, bases))


def factors_matrix(s, base: Optional[np.ndarray] = None) -> np.ndarray:
    """diag(s) Had_n(base) (float64, exact: entries +-1 and sums of them) for signs s [n]."""
    s = np.asarray(s, np.float64)
    return s[:, None] * hadamard_matrix(s.shape[0], base)


def spinquant_matrices(hidden: int, head_dim: int, intermediate: int, kind: str, *, seed: int = 0,
                       rotations: Sequence[str] = ("R1", "R2"), signs: Optional[Mapping[str, Any]] = None,
                       bases: Optional[Mapping[int, np.ndarray]] = None) -> Dict[str, Tuple[np.ndarray, Any]]:
    """Group name -> (s, base) of each of `rotations` (orders R1 hidden, R2 / R3 head_dim, R4 intermediate; signs
    from (seed, GROUP_STREAMS[group]) or `signs[group]`, random-hadamard only). ModelError for an unknown or
    repeated group, an unsupported kind, signs of the wrong shape or for a group not rotated."""
    rotations = tuple(rotations)
    bad = [r for r in rotations if r not in ROTATIONS]
    if bad or not rotations or len(set(rotations)) != len(rotations):
        raise ModelError(f"rotations: expected distinct names among {ROTATIONS}, found {list(rotations)}")
    if kind not in KINDS:
        raise ModelError(f"rotation kind {kind!r} is not supported; supported: {KINDS}")
    orders = {"R1": hidden, "R2": head_dim, "R3": head_dim, "R4": intermediate}
    signs = dict(signs or {})
    for r, v in signs.items():
        shape = list(np.shape(v))
        if kind != "random-hadamard" or r not in rotations or shape != [orders.get(r)] or \
                not np.all(np.abs(np.asarray(v, np.float64)) == 1):
            raise ModelError(f"signs[{r!r}]: expected {orders.get(r)} values in {{-1, +1}} for a random-hadamard group "
                             f"among {list(rotations)}, found shape {shape}")
    return {r: rotation_factors(orders[r], kind, seed, GROUP_STREAMS[r], signs.get(r), bases) for r in rotations}


def unknown_tensor_names(names: Sequence[str], num_layers: int) -> list:
    """The HF tensor names SpinQuant's mappings do not know how to rotate (rotating the residual stream without
    them would change the model): anything but embed_tokens, norm, lm_head and layers.i's projections and norms."""
    out = []
    for n in names:
        m = _LAYER.match(n)
        if not (n in _TOP or (m and int(m.group(1)) < num_layers)):
            out.append(n)
    return out


def fused_norm_name(name: str) -> Optional[str]:
    """The HF name of the norm gain step 3 folds into the weight `name` (None for other tensors):
    layers.i.self_attn.{q,k,v}_proj.weight <- layers.i.input_layernorm.weight, layers.i.mlp.{gate,up}_proj.weight
    <- layers.i.post_attention_layernorm.weight, lm_head.weight <- model.norm.weight."""
    if name == "lm_head.weight":
        return "model.norm.weight"
    mod, _, local = name.rpartition(".")
    layer, _, last = mod.rpartition(".")
    if local != "weight" or last not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return None
    norm = "input_layernorm" if last in ("q_proj", "k_proj", "v_proj") else "post_attention_layernorm"
    return f"{layer.rpartition('.')[0]}.{norm}.weight"


def spinquant_tensor(name: str, a, m: Mapping[str, np.ndarray], gain=None, center_embeddings: bool = True
                     ) -> np.ndarray:
    """The HF tensor `name` [torch layout: Linear weights [out, in]] after SpinQuant steps 2-4 (module docstring),
    in a's dtype, cast back after every fused step as compressed-tensors does (each in float64):

      norm gains                         -> ones
      embed_tokens  E                    -> (E - mean(E, -1)) R1                       (rotate_columns)
      q/k/v/gate/up_proj, lm_head  W     -> (W * g) R1, and for v_proj R2^T (W * g) R1  (fuse_norm, rotate_*)
      v_proj bias   b                    -> R2^T b
      o_proj / down_proj  W, b           -> R1^T W (R2 for o_proj, R4 for down_proj), R1^T b

    m: group name -> unnormalised matrix M (`rotation_matrix`) of the groups applied; gain: the norm gain of
    `fused_norm_name(name)` (required for those weights). An lm_head.weight of a tied model is the embedding."""
    a = np.asarray(a)
    dtype = a.dtype

    def cast(x):
        return np.asarray(x).astype(dtype)

    mod, _, local = name.rpartition(".")
    last = mod.rpartition(".")[2]
    if last in _NORMS or name == "model.norm.weight":
        return np.ones(a.shape, dtype)  # folded into the Linears that read it
    if name == "model.embed_tokens.weight":
        if center_embeddings:
            a = cast(center_rows(a))
        return cast(rotate_columns(a, m["R1"])) if "R1" in m else a
    if fused_norm_name(name) is not None:
        if gain is None:
            raise ModelError(f"spinquant_tensor: {name} needs the gain of {fused_norm_name(name)}")
        a = cast(fuse_norm(a, gain))
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
    return a


def spinquant_online(m: Mapping[str, np.ndarray], num_layers: int) -> Dict[str, np.ndarray]:
    """The online transform tensors of R3 / R4 as compressed-tensors saves them (HF name -> M, float64):
    layers.i.self_attn.R3_q_attn.weight, layers.i.self_attn.R3_k_cache.weight, layers.i.mlp.down_proj.R4_input.weight."""
    online: Dict[str, np.ndarray] = {}
    for i in range(num_layers):
        if "R3" in m:
            online[f"model.layers.{i}.self_attn.R3_q_attn.weight"] = m["R3"]
            online[f"model.layers.{i}.self_attn.R3_k_cache.weight"] = m["R3"]
        if "R4" in m:
            online[f"model.layers.{i}.mlp.down_proj.R4_input.weight"] = m["R4"]
    return online
