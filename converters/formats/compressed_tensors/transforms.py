"""compressed-tensors `transform_config` (Hadamard / random-Hadamard / random-matrix rotations): parse, check, apply.

A transform_config (inside quantization_config) is {"config_groups": {NAME: TransformScheme}}, a scheme being
{"type": "hadamard" | "random-hadamard" | "random-matrix", "apply": [TransformArgs], "randomize", "requires_grad",
"head_dim", "precision"} and TransformArgs {"targets", "location", "inverse", "ignore"}. compressed-tensors
(factory/base.py `_apply_to_module`) fuses the offline locations (weight_input, weight_output) into the weights
before they are saved and drops them, so the stored weights already carry them: nothing to do on load. The
online locations keep a module `<target>.<NAME>_<location>` whose `weight` (and `perm` when randomized) is
saved: `input` / `output` of a Linear (v -> v @ W / sqrt(n), per head_dim block), `q_attn` / `k_cache` of an
attention module (post-RoPE queries / keys, per head). Hadamard kinds: M = W[perm][:, perm] (randomized),
transposed when `inverse`, / sqrt(n) (`HadamardTransform.forward`); random-matrix: M = W as stored (the
factory stores the inverse itself for `inverse`, and does not normalise). The loader reads those tensors and installs them with
`qformats.models.decoder.set_rotation`.

Every stored transform tensor must belong to an online location of a config group targeting its module, and
every online (group, location, module) must have its tensor -- its own, or the one compressed-tensors shares
across the group's modules of the same size and saves once as a tied weight (`_tied_base`); anything else -- an unknown type or location,
`requires_grad`, a target the decoder cannot rotate -- is a CheckpointError. Nothing is skipped.

Since a fused rotation leaves no trace in the weights, a reader can only take them as the model's when the
config says the rotation is undone: every location of a group must be cancelled by another location of the same
group (`_check_cancelled`: weight_output with an inverse weight_input as SpinQuant R1/R2, an online input/output
with its opposite fused side as QuIP / R4, q_attn with k_cache as R3), and each offline side must name a module
the checkpoint stores (`check_targets_present`). A lone group -- a Hadamard weight_input added to a checkpoint
whose weights never carried it -- is a CheckpointError naming the group, in every reader.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from qformats.matching import pattern_matches, target_list
from qformats.errors import CheckpointError, QFormatsError

__all__ = ["TRANSFORM_TYPES", "LOCATIONS", "OnlineRotation", "TransformGroup", "applying_online_transforms",
           "check_targets_present", "check_transform_config", "ct_hadamard_bases", "fast_form", "online_rotations", "parse_transform_config"]

TRANSFORM_TYPES = ("hadamard", "random-hadamard", "random-matrix")
ONLINE = ("input", "output", "q_attn", "k_cache")
OFFLINE = ("weight_input", "weight_output")
LOCATIONS = ONLINE + OFFLINE
_SCHEME_KEYS = {"type", "apply", "randomize", "requires_grad", "head_dim", "precision"}
_ARGS_KEYS = {"targets", "location", "inverse", "ignore"}


@dataclasses.dataclass(frozen=True)
class TransformArgs:
    targets: Tuple[str, ...]
    location: str
    inverse: bool
    ignore: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TransformGroup:
    """One TransformScheme of a transform_config."""

    name: str
    type: str
    apply: Tuple[TransformArgs, ...]
    randomize: bool
    head_dim: Optional[int]
    precision: Optional[str]


@dataclasses.dataclass(frozen=True)
class OnlineRotation:
    """An online rotation to install: HF module, location, and the effective matrix M (v -> v @ M)."""

    module: str
    location: str
    weight: np.ndarray
    group: str
    fast: Optional[Tuple[np.ndarray, Optional[np.ndarray], bool]] = None  # (signs, base, transpose)


_APPLYING = contextvars.ContextVar("qformats_applying_online_transforms", default=False)


@contextlib.contextmanager
def applying_online_transforms():
    """Within this block a transform_config with online locations is accepted by the config parser: the caller
    (`converters.pipelines.causal_lm.load_causal_lm`) installs those rotations itself. Everywhere else (dequantize,
    inspect, generic Flax loading) such a checkpoint is refused, since reading it without them is wrong."""
    token = _APPLYING.set(True)
    try:
        yield
    finally:
        _APPLYING.reset(token)


def check_transform_config(tc: Any, where: str) -> List[TransformGroup]:
    """parse_transform_config, then refuse online locations unless inside `applying_online_transforms()`."""
    groups = parse_transform_config(tc, where)
    online = sorted({f"{g.name}:{a.location}" for g in groups for a in g.apply if a.location in ONLINE})
    if online and not _APPLYING.get():
        raise _err(where, f"online rotations {online} must be applied at run time; only "
                          f"converters.pipelines.causal_lm.load_causal_lm (the Flax decoder) applies them -- reading "
                          f"these weights without them would be wrong")
    return groups


def _err(where: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{where}: {msg}")


def parse_transform_config(tc: Any, where: str = "quantization_config.transform_config") -> List[TransformGroup]:
    """Validate a transform_config dict; [] for null / {} / no config groups. CheckpointError naming the key."""
    if tc in (None, {}):
        return []
    if not isinstance(tc, dict) or set(tc) - {"config_groups"}:
        raise _err(where, f"expected {{'config_groups': {{...}}}}, found {json.dumps(tc, default=str)[:120]}")
    groups = tc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _err(where, f"config_groups: expected an object, found {type(groups).__name__}")
    out = []
    for name, sc in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(sc, dict) or set(sc) - _SCHEME_KEYS:
            raise _err(at, f"expected a TransformScheme with keys among {sorted(_SCHEME_KEYS)}, found "
                           f"{json.dumps(sc, default=str)[:120]}")
        typ = sc.get("type")
        if typ not in TRANSFORM_TYPES:
            raise _err(at, f"transform type {typ!r} is not supported; supported: {TRANSFORM_TYPES}")
        if sc.get("requires_grad"):
            raise _err(at, "requires_grad transforms (trained rotations kept as parametrizations) are not supported")
        hd = sc.get("head_dim")
        if hd is not None and (isinstance(hd, bool) or not isinstance(hd, int) or hd <= 0):
            raise _err(at, f"head_dim: expected null or a positive int, found {hd!r}")
        rand = sc.get("randomize", False)
        if not isinstance(rand, bool):
            raise _err(at, f"randomize: expected a bool, found {rand!r}")
        apply = sc.get("apply") or []
        if not isinstance(apply, list):
            raise _err(at, f"apply: expected a list of TransformArgs, found {type(apply).__name__}")
        args = []
        for i, a in enumerate(apply):
            aat = f"{at}.apply[{i}]"
            if not isinstance(a, dict) or set(a) - _ARGS_KEYS:
                raise _err(aat, f"expected TransformArgs with keys among {sorted(_ARGS_KEYS)}, found "
                                f"{json.dumps(a, default=str)[:120]}")
            loc = a.get("location")
            if loc not in LOCATIONS:
                raise _err(aat, f"location {loc!r} is not supported; supported: {LOCATIONS}")
            inv = a.get("inverse", False)
            if not isinstance(inv, bool):
                raise _err(aat, f"inverse: expected a bool, found {inv!r}")
            args.append(TransformArgs(target_list(a.get("targets"), f"{aat}.targets"), loc, inv,
                                      target_list(a.get("ignore") or [], f"{aat}.ignore")))
        prec = sc.get("precision")
        _check_cancelled(str(name), args, at)
        out.append(TransformGroup(str(name), typ, tuple(args), rand, hd, None if prec is None else str(prec)))
    return out


SUPPORTED = ("rotations cancelled within their group: offline weight_output + inverse weight_input pairs (fused into "
             "the stored weights, as SpinQuant R1/R2), online input/output each with its opposite fused or online "
             "side, q_attn with k_cache (online ones applied by converters.pipelines.causal_lm.load_causal_lm)")


def _cancels(a: TransformArgs, b: TransformArgs) -> bool:
    """Whether b undoes a within one group: q_attn with k_cache (same direction: q M (k M)^T = q k^T), or two
    different Linear locations (input / output sides, online or fused) in opposite directions."""
    attn = ("q_attn", "k_cache")
    if a.location in attn or b.location in attn:
        return {a.location, b.location} == set(attn) and a.inverse == b.inverse
    return a.location != b.location and a.inverse != b.inverse


def _check_cancelled(name: str, args: Sequence[TransformArgs], at: str) -> None:
    """Every rotation of a group must be undone by another location of the same group; a lone one (e.g. a
    weight_input Hadamard added to a checkpoint whose weights never carried it) means the stored weights are not
    the model's, and no reader can tell whether it was fused: CheckpointError naming the group."""
    for i, a in enumerate(args):
        if not any(_cancels(a, b) for j, b in enumerate(args) if j != i):
            raise _err(at, f"applies {a.location!r} (inverse={a.inverse}) to "
                           f"{list(a.targets)} with nothing in the group to undo it, so the stored weights cannot be "
                           f"read as the model's; supported: {SUPPORTED}")


def _is_class_name(t: str) -> bool:
    return not t.startswith("re:") and "." not in t and t[:1].isupper()


def check_targets_present(groups: Sequence[TransformGroup], modules: Sequence[str], where: str) -> None:
    """Each offline (fused) apply of every group must name at least one of the checkpoint's `modules` (the
    modules storing a weight) -- by `re:` pattern or exact name; a class name ("Linear") stands for any of them --
    else the rotation it pairs with has nothing to cancel against: CheckpointError naming the group and its
    targets. (Online applies are matched against the model's modules by `online_rotations`.)"""
    for g in groups:
        for a in g.apply:
            if a.location not in OFFLINE:
                continue
            if any(_is_class_name(t) for t in a.targets) and modules:
                continue
            if not any(_matches(a.targets, m, None) and not _matches(a.ignore, m, None) for m in modules):
                raise CheckpointError(f"{where}: transform_config group {g.name!r}: {a.location!r} targets "
                                      f"{list(a.targets)} name no module of the checkpoint, so the rotation of its "
                                      f"other locations is not undone; supported: {SUPPORTED}")


def _matches(targets: Sequence[str], module: str, cls: Optional[str]) -> bool:
    for t in targets:
        if t.startswith("re:"):
            if pattern_matches(t[3:], module, "transform_config"):
                return True
        elif t == module or (cls is not None and t == cls):
            return True
    return False


def online_rotations(groups: Sequence[TransformGroup], tensors: Mapping[str, Any], modules: Mapping[str, str],
                     where: str, shapes: Optional[Mapping[str, Tuple[int, int]]] = None
                     ) -> Tuple[List[OnlineRotation], List[str]]:
    """The online rotations a checkpoint stores, checked against its transform_config.

    Args:
      groups: the parsed transform_config.
      tensors: the checkpoint's tensor names -> arrays (read on demand: only transform tensors are read).
      modules: HF module name -> class name ("Linear" for projections, "Attention" for self_attn), the modules
        the model has (targets name classes, as in compressed-tensors, or modules by `re:` / exact name).
      where: the checkpoint path, for errors.
      shapes: optional Linear module name -> (out_features, in_features) from the model's config; it sizes the
        shared rotation of a module without its own tensor when the checkpoint cannot (a packed NVFP4 / MXFP4
        weight stores no `weight_shape`).
    Returns:
      (rotations, names): the rotations to install and the tensor names they consumed.
    """
    rotations: List[OnlineRotation] = []
    used: List[str] = []
    stored = sorted({n.rpartition(".")[0] for n in tensors if n.rpartition(".")[2] in ("weight", "weight_packed")})
    check_targets_present(groups, stored, where)  # the offline (fused) sides name stored modules
    for g in groups:
        for a in g.apply:
            if a.location in OFFLINE:
                continue  # fused into the stored weights by compressed-tensors before saving
            matched = 0
            for mod, cls in modules.items():
                if not _matches(a.targets, mod, cls) or _matches(a.ignore, mod, cls):
                    continue
                want = "Attention" if a.location in ("q_attn", "k_cache") else "Linear"
                if cls != want:
                    raise CheckpointError(f"{where}: transform_config group {g.name!r} applies an online "
                                          f"{a.location!r} rotation to {mod!r} ({cls}); the decoder applies "
                                          f"{a.location!r} to {want} modules only")
                matched += 1
                base = f"{mod}.{g.name}_{a.location}"
                wname = base + ".weight"
                if wname not in tensors:
                    base = _tied_base(g, a.location, mod, tensors, shapes)
                    if base is None:
                        raise CheckpointError(f"{where}: transform_config group {g.name!r} applies an online "
                                              f"{g.type} rotation at {a.location!r} of {mod!r}, expected tensor "
                                              f"{wname!r} (or the group's shared one of its size), found none")
                    wname = base + ".weight"
                w = np.asarray(tensors[wname], np.float64)
                if w.ndim != 2 or w.shape[0] != w.shape[1] or not np.all(np.isfinite(w)):
                    raise CheckpointError(f"{where}: tensor {wname!r}: expected a finite square matrix, found shape "
                                          f"{list(w.shape)}")
                used.append(wname)
                if g.randomize and g.type != "random-matrix":  # random-matrix has no permutation
                    pname = base + ".perm"
                    if pname not in tensors:
                        raise CheckpointError(f"{where}: transform_config group {g.name!r} is randomized, expected "
                                              f"tensor {pname!r}, found none")
                    perm = np.asarray(tensors[pname])
                    if perm.shape != (w.shape[0],) or sorted(perm.tolist()) != list(range(w.shape[0])):
                        raise CheckpointError(f"{where}: tensor {pname!r}: expected a permutation of "
                                              f"0..{w.shape[0] - 1}")
                    w = w[perm][:, perm]
                    used.append(pname)
                fast = None
                if g.type == "random-matrix":
                    pass  # stored as is: the inverse itself when `inverse`, no normalisation
                else:
                    if not g.randomize:
                        fast = fast_form(w, a.inverse)
                    w = (w.T if a.inverse else w) / np.sqrt(w.shape[0])
                rotations.append(OnlineRotation(mod, a.location, w, g.name, fast))
            if not matched:
                raise CheckpointError(f"{where}: transform_config group {g.name!r}: online {a.location!r} targets "
                                      f"{list(a.targets)} name no module of the model, so the rotation of its other "
                                      f"locations is not undone; supported: {SUPPORTED}")
    stray = sorted(n for n in tensors if _is_transform_name(n, groups) and n not in used)
    if stray:
        raise CheckpointError(f"{where}: transform tensors no online transform_config location accounts for: "
                              f"{stray[:6]}")
    return rotations, used


def _rotated_size(g: TransformGroup, location: str, mod: str, tensors: Mapping[str, Any],
                  shapes: Optional[Mapping[str, Tuple[int, int]]] = None) -> Optional[int]:
    """The order of `g`'s matrix at `location` of `mod` (compressed-tensors' get_transform_size): head_dim when the
    group has one, else a Linear's in_features (input) / out_features (output), from the model's `shapes` when
    given, else from its stored weight's shape."""
    if g.head_dim is not None:
        return g.head_dim
    if shapes is not None and mod in shapes:
        shape = list(shapes[mod])
    elif f"{mod}.weight_shape" in tensors:
        shape = [int(v) for v in np.asarray(tensors[f"{mod}.weight_shape"]).reshape(-1)]
    elif f"{mod}.weight" in tensors:
        shape = list(np.shape(tensors[f"{mod}.weight"]))
    else:
        return None
    if len(shape) != 2:
        return None
    return shape[1] if location == "input" else shape[0]


def _tied_base(g: TransformGroup, location: str, mod: str, tensors: Mapping[str, Any],
               shapes: Optional[Mapping[str, Tuple[int, int]]] = None) -> Optional[str]:
    """The stored `<module>.<group>_<location>` prefix whose weight `mod` shares, or None.

    compressed-tensors' factories make one weight (and one permutation) per group and size, shared by every module
    they rotate (`TransformFactory.weights`, keyed by size), and register the copies as tied weights
    (`_register_tied_transform_weights`), so save_pretrained writes each shared tensor once, under the first module
    that holds it (llm-compressor's QuIPModifier checkpoints store `model.layers.0.self_attn.q_proj.v_input.weight`
    and `model.layers.0.mlp.down_proj.v_input.weight` only). A module without its own tensor takes the group's
    stored one of its size; None when there is no such tensor or its size cannot be told apart."""
    suffixes = tuple(f".{g.name}_{loc}.weight" for loc in ONLINE)
    cands = sorted(n for n in tensors if n.endswith(suffixes))
    size = _rotated_size(g, location, mod, tensors, shapes)
    stored = {n: tuple(np.shape(tensors[n])) for n in cands}
    if size is None:
        fits = cands if len(set(stored.values())) == 1 else []
    else:
        fits = [n for n in cands if stored[n] == (size, size)]
    return fits[0][:-len(".weight")] if fits else None


def _is_transform_name(name: str, groups: Sequence[TransformGroup]) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "perm"):
        return False
    return any(parts[-2] == f"{g.name}_{loc}" for g in groups for loc in LOCATIONS)


def ct_hadamard_bases() -> Dict[int, np.ndarray]:
    """compressed-tensors' stored Hadamard matrices (transform/utils/hadamards.safetensors, order -> [K, K]),
    read from the installed package's file without importing it (no torch); {} when it is not installed."""
    import importlib.util
    from pathlib import Path

    from converters.formats.safetensors_io import open_checkpoint

    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None or not spec.submodule_search_locations:
        return {}
    f = Path(list(spec.submodule_search_locations)[0]) / "transform" / "utils" / "hadamards.safetensors"
    if not f.is_file():
        return {}
    with open_checkpoint(f) as ck:
        return {int(k): np.asarray(ck.get(k), np.float64) for k in ck.keys()}


def fast_form(w: np.ndarray, inverse: bool) -> Optional[Tuple[np.ndarray, Optional[np.ndarray], bool]]:
    """(signs, base, transpose) when the stored Hadamard weight w equals diag(s) @ Had_n(base) exactly
    (`qformats.hadamard`), so that the decoder applies it by the fast transform; None otherwise (dense).
    Sylvester's Had_n (base None) first; else compressed-tensors' stored base for n. A transposed (inverse)
    form is fast only with Sylvester's symmetric Had_n."""
    from qformats.hadamard import base_order, is_pow2, random_hadamard_signs, reduce_base

    n = w.shape[0]
    if is_pow2(n):
        s = random_hadamard_signs(w, None)
        if s is not None:
            return s, None, inverse
    if inverse:
        return None
    bases = ct_hadamard_bases()
    if not bases:
        return None
    try:
        base = reduce_base(bases[base_order(n, list(bases))])
    except QFormatsError:
        return None
    s = random_hadamard_signs(w, base)
    return None if s is None else (s, base, False)
