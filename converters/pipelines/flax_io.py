"""Checkpoint glue for Flax NNX models: load_compressed / save_compressed between a model and a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np

from converters.formats.safe_files import read_json
from qformats.errors import CheckpointError

# HF tensor name -> (Flax variable path, transposed [out, in] <-> [in, out]), or for one expert's tensor of a stacked
# [E, ...] parameter (mixture-of-experts layers) (path, transposed, expert index)
NameMap = Mapping[str, Tuple]


def variable(model, path: str):
    """The NNX variable (or module) at a "/"-joined path; integer parts index lists."""
    node = model
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def default_name_map(model) -> Dict[str, Tuple[str, bool]]:
    """HF names for an NNX model by the usual convention: `a/b/kernel` -> `a.b.weight` (2-D: transposed),
    `a/b/bias` -> `a.b.bias`, `a/b/scale` and `a/b/embedding` -> `a.b.weight` (LayerNorm, Embed)."""
    from flax import nnx

    out = {}
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable) or not path:
            continue
        *mod, leaf = [str(p) for p in path]
        local = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}.get(leaf)
        if local is None:
            continue
        value = var.get_value()
        transpose = leaf == "kernel" and getattr(value, "ndim", 0) == 2
        out[".".join(mod + [local])] = ("/".join(mod + [leaf]), transpose)
    return out


def load_compressed(path, model, name_map: Optional[NameMap] = None, *, ignore: Iterable[str] = ()):
    """Fill an NNX model in place from a compressed-tensors (or dense) checkpoint; returns the model.

    Every tensor is mapped by `name_map` (HF name -> (Flax variable path, transpose); default
    `default_name_map(model)`). Quantized Linear weights (QArrays of logical shape [in, out], read zero-copy
    by `converters.formats.compressed_tensors.read`) become packed `qformats.nn.QLinear` layers with the checkpoint's
    static input scales and activation schemes (`qformats.nn.load_quantized`); dense tensors overwrite the model's
    values. Per-expert tensors (name map entries with an expert index) are stacked along a new leading axis: dense
    ones into the [E, ...] parameter, quantized ones (every expert's QArray of one scheme) into one packed QArray
    whose leaves carry the expert axis, for a `qformats.nn.QExperts`. Raises CheckpointError naming the file and
    the tensors the model does not have (except `ignore`), a tensor whose shape differs, or an incomplete expert
    stack; nothing is swapped unless everything fits.
    """
    import jax.numpy as jnp

    from converters.formats.quantized import read_quantized
    from qformats.nn import load_quantized
    from qformats.qarray import QArray

    cm = read_quantized(path)
    table = dict(name_map if name_map is not None else default_name_map(model))
    ignore = set(ignore)
    groups = {g.name: g for g in (cm.quant.groups if cm.quant is not None else ())}
    quantized: Dict[str, Dict[str, Any]] = {}
    schemes: Dict[str, Any] = {}
    dense, unknown = [], []
    stacked: Dict[str, Dict[int, Dict[str, Any]]] = {}  # expert stacks: module path -> expert -> local -> tensor
    dense_stacks: Dict[str, Dict[int, Any]] = {}  # dense expert slices: variable path -> expert -> [in, out] array
    for mod, tensors in cm.modules.items():
        for local, arr in tensors.items():
            full = f"{mod}.{local}" if mod else local
            if isinstance(arr, QArray) or local in ("input_scale", "input_global_scale"):
                entry = table.get(f"{mod}.weight")
                if entry is None:
                    unknown.append(full)
                    continue
                fpath = entry[0].rsplit("/", 1)[0]
                key = "weight" if isinstance(arr, QArray) else local
                if len(entry) > 2:
                    stacked.setdefault(fpath, {}).setdefault(entry[2], {})[key] = arr
                else:
                    quantized.setdefault(fpath, {})[key] = arr
                g = groups.get(cm.groups.get(mod, ""))
                schemes[fpath] = g.input_activations if g is not None else None
            elif full in table:
                vpath, transpose, *expert = table[full]
                a = np.asarray(arr).T if transpose else np.asarray(arr)
                if expert:
                    dense_stacks.setdefault(vpath, {})[expert[0]] = a
                    continue
                var = variable(model, vpath)
                if tuple(a.shape) != tuple(var.get_value().shape):
                    raise CheckpointError(f"{path}: tensor {full!r}: expected shape "
                                          f"{tuple(var.get_value().shape)} for {vpath}, found {a.shape}")
                dense.append((var, a))
            elif full not in ignore:
                unknown.append(full)
    if unknown:
        raise CheckpointError(f"{path}: tensors the model has no place for: {sorted(unknown)[:8]}"
                              + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else ""))
    for vpath, parts in dense_stacks.items():
        if vpath.rsplit("/", 1)[0] in stacked and vpath.endswith("/kernel"):
            raise CheckpointError(f"{path}: {vpath.rsplit('/', 1)[0]}: some experts are quantized, others dense "
                                  f"(dense: {sorted(parts)[:8]})")
        var = variable(model, vpath)
        want = tuple(var.get_value().shape)
        if sorted(parts) != list(range(want[0])) or any(tuple(a.shape) != want[1:] for a in parts.values()):
            raise CheckpointError(f"{path}: expert stack {vpath}: expected {want[0]} experts of shape {want[1:]}, "
                                  f"found experts {sorted(parts)[:8]} of shapes "
                                  f"{sorted({tuple(a.shape) for a in parts.values()})}")
        dense.append((var, np.stack([parts[e] for e in range(want[0])])))
    for fpath, per_expert in stacked.items():
        quantized[fpath] = _stack_experts(path, fpath, per_expert, variable(model, fpath))
    for var, a in dense:
        var.set_value(jnp.asarray(a, var.get_value().dtype))
    for fpath, t in quantized.items():
        lin = variable(model, fpath)
        if getattr(lin, "bias", None) is not None and "bias" not in t:
            t["bias"] = lin.bias.get_value()
    load_quantized(model, quantized, schemes)
    return model


def _stack_experts(path, fpath: str, per_expert: Dict[int, Dict[str, Any]], module) -> Dict[str, Any]:
    """Every expert's packed tensors of one stacked projection -> {"weight": one QArray whose leaves carry the expert
    axis first, "input_scale"?...: [E, ...] stacks}; CheckpointError for missing experts or differing schemes."""
    import jax
    import jax.numpy as jnp

    from qformats.qarray import QArray

    n = getattr(module, "num_experts", None)
    where = f"{path}: expert stack {fpath}"
    if n is None or sorted(per_expert) != list(range(n)):
        raise CheckpointError(f"{where}: expected quantized weights of experts 0..{(n or 0) - 1}, found "
                              f"{sorted(per_expert)[:8]}{' ...' if len(per_expert) > 8 else ''}")
    qs = [per_expert[e].get("weight") for e in range(n)]
    if not all(isinstance(q, QArray) for q in qs):
        raise CheckpointError(f"{where}: every expert needs a quantized weight")
    meta = {(q.scheme, q.shape, q.axis, q.dtype) for q in qs}
    if len(meta) != 1:
        raise CheckpointError(f"{where}: the experts' quantized weights differ in scheme or shape: "
                              f"{sorted(map(str, meta))[:3]}")
    out: Dict[str, Any] = {"weight": jax.tree.map(lambda *leaves: jnp.stack(leaves), *qs)}
    for local in ("input_scale", "input_global_scale"):
        have = [local in per_expert[e] for e in range(n)]
        if any(have):
            if not all(have):
                raise CheckpointError(f"{where}: {local} on some experts only")
            out[local] = np.stack([np.asarray(per_expert[e][local]) for e in range(n)])
    return out


def save_compressed(model, dst, name_map: Optional[NameMap] = None, *, config: Optional[dict] = None,
                    copy_from=None, max_shard_size="5GB", overwrite: bool = False, ignore: Iterable[str] = (),
                    kv_cache_scheme=None, transform_config=None, extra_tensors=None):
    """Write an NNX model (packed `qformats.nn` layers + float parameters) as a compressed-tensors checkpoint.

    Packed layers go out as their QArrays (the writer picks the compressed-tensors format from each scheme)
    with their static `input_scale`s; float kernels are transposed back to torch's [out, in] per `name_map`.
    `config` (the model's HF config.json as a dict) gets the quantization_config; `copy_from` is a directory
    whose other files (tokenizer, ...) are copied; `ignore`: quantization_config.ignore (the Linear modules left
    dense, e.g. ["lm_head"]); `kv_cache_scheme`: quantization_config.kv_cache_scheme (its static scales come
    through `name_map`); `transform_config`: the rotations fused into the weights (`converters.pipelines.rotate`);
    `extra_tensors`: HF name -> array written as is beside the model's (e.g. the online rotation matrices of
    `qformats.rotation.Rotated.online`; a name the model also writes is a CheckpointError).
    Atomic (see converters.formats.compressed_tensors.write.write_compressed).
    """
    from converters.formats.compressed_tensors.write import write_compressed
    from qformats.nn import export_quantized
    from qformats.qarray import QArray

    packed = export_quantized(model)
    table = dict(name_map if name_map is not None else default_name_map(model))
    tensors: Dict[str, Any] = {}
    schemes: Dict[str, Any] = {}
    for name, (vpath, transpose, *expert) in table.items():
        try:
            value = variable(model, vpath).get_value()
        except (AttributeError, IndexError):
            continue  # e.g. a pooler the model was built without
        if expert:  # one expert's slice of a stacked [E, ...] parameter (packed: every leaf indexed)
            import jax

            value = jax.tree.map(lambda leaf: leaf[expert[0]], value)
        if isinstance(value, QArray):
            mod = name.rsplit(".", 1)[0]
            tensors[name] = value
            extra = packed[vpath.rsplit("/", 1)[0]]
            schemes[mod] = extra["schemes"]
            for local in ("input_scale", "input_global_scale"):
                if local in extra:
                    tensors[f"{mod}.{local}"] = np.asarray(extra[local])
        else:
            tensors[name] = np.asarray(value).T if transpose else np.asarray(value)
    for name, value in (extra_tensors or {}).items():
        if name in tensors:
            raise CheckpointError(f"{dst}: extra tensor {name!r} is also one of the model's tensors")
        tensors[name] = np.asarray(value)
    if config is None and copy_from is not None and (Path(copy_from) / "config.json").exists():
        config = read_json(Path(copy_from) / "config.json", copy_from)
    return write_compressed(dst, tensors, schemes, config=config, copy_from=copy_from,
                            max_shard_size=max_shard_size, overwrite=overwrite, ignore=list(ignore),
                            kv_cache_scheme=kv_cache_scheme, transform_config=transform_config)
