"""Shared global scales: the NVFP4 global scale that fused sibling projections (vLLM's qkv_proj, gate_up_proj) share."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import SchemeError
from qformats.quantize import quantize
from qformats.schemes import QuantScheme

__all__ = ["FUSED_GROUPS", "sibling_groups", "selected_groups", "group_amax", "shared_global_scale",
           "shared_global_scales", "fused_global_scales"]

#: Sibling modules (last path components under one parent) that vLLM fuses into one matmul, as llm-compressor
#: 0.14 lists them (`llmcompressor.observers.helpers.FUSED_LAYER_NAMES`): under TENSOR_GROUP weights (NVFP4)
#: the members of a group share one global scale.
FUSED_GROUPS: Tuple[Tuple[str, ...], ...] = (
    ("gate_proj", "up_proj"),               # MLP / experts: gate_up_proj
    ("q_proj", "k_proj", "v_proj"),         # attention: qkv_proj
    ("q_a_proj", "kv_a_proj_with_mqa"),     # DeepSeek multi-latent attention: fused_qkv_a_proj
    ("w1", "w3"),                           # MoE experts named w1 / w2 / w3
)


def sibling_groups(paths: Iterable[str], sep: str = ".",
                   groups: Sequence[Sequence[str]] = FUSED_GROUPS) -> List[Tuple[str, ...]]:
    """Every fused group whose members are all among `paths`: the module paths p_1..p_n (in the order of the
    group's names) with one parent P and p_i = P + sep + names_i for one entry `names` of `groups`.

    A module holding all the names of an entry is a fused group, whatever it is (llm-compressor's
    `fuse_weight_observers` asks `hasattr(module, name)` for every name); `sep` is "." for torch / checkpoint
    names and "/" for NNX paths. Groups are returned in the order of first appearance of their parent.
    """
    by_parent: Dict[str, Dict[str, str]] = {}
    for p in paths:
        parent, s, last = p.rpartition(sep)
        by_parent.setdefault(parent if s else "", {})[last] = p
    out = []
    for parent, kids in by_parent.items():
        for names in groups:
            if all(n in kids for n in names):
                out.append(tuple(kids[n] for n in names))
    return out


def selected_groups(paths: Iterable[str], selected: Collection[str], sep: str = ".",
                    groups: Sequence[Sequence[str]] = FUSED_GROUPS,
                    partial: Optional[Callable[[Tuple[str, ...], List[str]], None]] = None) -> List[Tuple[str, ...]]:
    """The fused groups among `paths` (`sibling_groups`) whose members are all in `selected` (the modules taking
    one TENSOR_GROUP weight scheme). For a group only partly selected (some members, not all),
    `partial(group, members_selected)` is called (the caller warns or refuses: vLLM fuses the whole group into one
    matmul, with one global scale); a group with no selected member is dropped silently."""
    selected = set(selected)
    out = []
    for g in sibling_groups(paths, sep=sep, groups=groups):
        inside = [p for p in g if p in selected]
        if len(inside) == len(g):
            out.append(g)
        elif inside and partial is not None:
            partial(g, inside)
    return out


def group_amax(weights: Sequence, lead: int = 0) -> jax.Array:
    """amax = max over the group's weights W_i of max |W_i|, reduced over every axis but the first `lead`
    (layers stacked for `nnx.scan`: one amax per stacked layer). Exact: a max of magnitudes, in the weights'
    dtype."""
    out = None
    for w in weights:
        w = jnp.asarray(w)
        a = jnp.max(jnp.abs(w), axis=tuple(range(lead, w.ndim)))
        out = a if out is None else jnp.maximum(out, a)
    if out is None:
        raise SchemeError("group_amax: expected at least one weight, got none")
    return out


def shared_global_scale(amax, scheme: QuantScheme, dtype) -> jax.Array:
    """The global scale that every member of a fused group takes under a TENSOR_GROUP `scheme` (NVFP4):
    g = 448 * 6 / amax with amax = `group_amax` of the group (compressed-tensors' `generate_gparam` over the
    group; llm-compressor's fused observers take max |W| over the members). g is non-increasing in amax, so
    this is the smallest of the members' own global scales, the one vLLM's fused matmul needs.

    Computed by `qformats.quantize` itself on a probe holding amax in `dtype` (the weights' dtype), so the
    arithmetic (dtype, order of operations, the torchao rule) is exactly that of a lone weight whose largest
    magnitude is amax. `amax` may have leading axes (stacked layers): g then has shape amax.shape + (1,).

    Raises:
      SchemeError: `scheme` is not TENSOR_GROUP (only NVFP4-style schemes have a global scale).
    """
    if scheme.strategy != "tensor_group":
        raise SchemeError(f"shared_global_scale: expected a tensor_group (NVFP4) weight scheme, got "
                          f"{scheme.describe()}")
    amax = jnp.asarray(amax).astype(dtype)

    def one(a):
        probe = jnp.zeros((1, scheme.group_size), dtype).at[0, 0].set(a)
        return quantize(probe, scheme, axis=-1).global_scale

    fn = one
    for _ in range(np.ndim(amax)):
        fn = jax.vmap(fn)
    return fn(amax)


def shared_global_scales(groups: Iterable[Sequence[str]], load: Callable[[str], Any],
                         members: Mapping[str, Tuple[QuantScheme, Any, Tuple[int, ...]]],
                         mismatch: Optional[Callable[[Tuple[str, ...]], None]] = None) -> Dict[str, jax.Array]:
    """path -> the global scale its fused group shares, for every group of `groups`:

        g = shared_global_scale(amax, scheme, dtype),   amax = max_i group_amax([load(p_i)], len(lead))

    `members[p]` = (weight scheme, weight dtype, leading stacked dims) of each member p (a TENSOR_GROUP scheme);
    `load(p)` gives p's weight, one member at a time (a checkpoint reader keeps one weight in memory). The max is
    taken in the weights' dtype, so amax is exact whatever the order. A group whose members differ in scheme,
    dtype or stacking shares nothing: `mismatch(group)` is called (default: a warning) and its members keep their
    own global scales.
    """
    out: Dict[str, jax.Array] = {}
    for g in groups:
        g = tuple(g)
        meta = {(members[p][0], np.dtype(members[p][1]), tuple(members[p][2])) for p in g}
        if len(meta) != 1:
            if mismatch is None:
                warnings.warn(f"{', '.join(g)} are fused siblings with different weight schemes, dtypes or "
                              "stacking; their global scales are not shared", stacklevel=2)
            else:
                mismatch(g)
            continue
        scheme, dtype, lead = meta.pop()
        amax = None
        for p in g:
            a = group_amax([load(p)], len(lead))
            amax = a if amax is None else jnp.maximum(amax, a)
        shared = shared_global_scale(amax, scheme, dtype)
        out.update((p, shared) for p in g)
    return out


def fused_global_scales(kernels: Mapping[str, Any], scheme: QuantScheme, sep: str = "/") -> Dict[str, jax.Array]:
    """path -> the global scale its fused group shares, for weights that are all at hand (`kernels`: path -> weight,
    e.g. one decoder layer's projections): the groups of `sibling_groups` among the paths, each sharing
    `shared_global_scale` of its `group_amax`. {} unless `scheme` is TENSOR_GROUP (NVFP4)."""
    if scheme.strategy != "tensor_group":
        return {}
    groups = selected_groups(list(kernels), kernels, sep=sep)
    return shared_global_scales(groups, kernels.__getitem__, {p: (scheme, kernels[p].dtype, ()) for p in kernels})
