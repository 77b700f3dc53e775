"""Checkpoint glue for Flax models: load_compressed / save_compressed (NNX), load_linen / save_linen (linen).

A packed weight that is a plain 2-D Linear / Dense kernel is written as llm-compressor names a Linear
(`a.b.weight_packed`, ... in torch's [out, in]). Any other packed matmul weight (an einsum kernel, a
LinearGeneral kernel, a custom layer's param, layers stacked by scan / vmap) is written as the Linear its
[K, N] matrix is (`qformats.nn.traced.MatmulWeight`), one module per stacked layer, and config.json's
"qformats_layouts" records, per module, the Flax param path, its per-layer shape, the axis order that made the
matrix (perm, contracted axes first), and the stacked layers' module names: what a loader needs to put it back
where it was. A tree with nothing quantized, or a param that is neither an array nor a packed weight, is
refused (CheckpointError), never written as an empty checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from converters.formats.safe_files import read_json
from qformats.errors import CheckpointError

# HF tensor name -> (Flax variable path, transposed [out, in] <-> [in, out]), or for one expert's tensor of a stacked
# [E, ...] parameter (mixture-of-experts layers) (path, transposed, expert index)
NameMap = Mapping[str, Tuple]
LAYOUTS_KEY = "qformats_layouts"


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
        named = hf_name([str(p) for p in path], getattr(var.get_value(), "ndim", 0))
        if named is not None:
            out[named[0]] = ("/".join(str(p) for p in path), named[1])
    return out


def hf_name(path: Sequence[str], ndim: int) -> Optional[Tuple[str, bool]]:
    """(HF tensor name, transposed) of a Flax param by the usual convention (`default_name_map`), or None."""
    *mod, leaf = path
    local = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}.get(leaf)
    if local is None:
        return None
    return ".".join(mod + [local]), leaf == "kernel" and ndim == 2


def load_compressed(path, model, name_map: Optional[NameMap] = None, *, ignore: Iterable[str] = (), checkpoint=None):
    """Fill an NNX model in place from a compressed-tensors (or dense) checkpoint; returns the model.

    Every tensor is mapped by `name_map` (HF name -> (Flax variable path, transpose); default
    `default_name_map(model)`). Quantized Linear weights (QArrays of logical shape [in, out], read zero-copy
    by `converters.formats.compressed_tensors.read`) become packed `qformats.nn.QLinear` layers with the checkpoint's
    static input scales and activation schemes (`qformats.nn.load_quantized`); dense tensors overwrite the model's
    values. Per-expert tensors (name map entries with an expert index) are stacked along a new leading axis: dense
    ones into the [E, ...] parameter, quantized ones (every expert's QArray of one scheme) into one packed QArray
    whose leaves carry the expert axis, for a `qformats.nn.QExperts`. Raises CheckpointError naming the file and
    the tensors the model does not have (except `ignore`), a tensor whose shape differs, or an incomplete expert
    stack; nothing is swapped unless everything fits. `checkpoint`: the `CompressedModel` of `path` already read (e.g.
    with its experts re-laid out by the caller); default `converters.formats.quantized.read_quantized(path)`.
    """
    import jax.numpy as jnp

    from converters.formats.quantized import read_quantized
    from qformats.nn import load_quantized
    from qformats.qarray import QArray

    cm = read_quantized(path) if checkpoint is None else checkpoint
    entries = _read_entries(cm, path)
    table = dict(name_map if name_map is not None else default_name_map(model))
    if name_map is None:  # every other param, under its own path (as save_compressed writes them)
        from flax import nnx

        mapped = {vpath for vpath, _ in table.values()}
        for p, var in nnx.iter_graph(model):
            ps = "/".join(str(x) for x in p)
            if isinstance(var, nnx.Param) and ps not in mapped and ps not in entries:
                table.setdefault(ps.replace("/", "."), (ps, False))
    ignore = set(ignore)
    groups = {g.name: g for g in (cm.quant.groups if cm.quant is not None else ())}
    installs = []
    for param, e in entries.items():
        from qformats.nn.nnx_traced import variable_at

        var = variable_at(model, param)
        if var is None:
            raise CheckpointError(f"{path}: {LAYOUTS_KEY}[{e['module']!r}] is the packed weight of {param!r}, which "
                                  "the model does not have")
        want = tuple(e["stacked"]) + tuple(e["shape"])
        have = tuple(getattr(var.get_value(), "shape", ()))
        if have != want:
            raise CheckpointError(f"{path}: {param!r} has shape {have} in the model, the checkpoint's packed weight "
                                  f"{e['module']!r} is {want}")
        g = groups.get(e["group"])
        installs.append((var, _matmul_weight(e, var.get_value().dtype, g.input_activations if g else None), param))
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
    from qformats.nn.nnx_traced import install

    for var, mw, param in installs:
        install(model, var, mw, param)
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

    if isinstance(model, Mapping):
        raise CheckpointError(f"{dst}: save_compressed takes an NNX model; a linen params tree is saved with "
                              "save_linen(wrapper, qparams, dst) (the wrapper from quantize_linen knows the layouts)")
    packed = export_quantized(model)
    entries = _nnx_packed_entries(model)
    by_param = {e["param"] for e in entries}
    table = dict(name_map if name_map is not None else default_name_map(model))
    tensors: Dict[str, Any] = {}
    schemes: Dict[str, Any] = {}
    for name, (vpath, transpose, *expert) in table.items():
        if vpath in by_param:
            continue  # written below, with its layout
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
                if local in extra:  # one expert's of a stacked QExperts: indexed as its weight
                    tensors[f"{mod}.{local}"] = np.asarray(extra[local][expert[0]] if expert else extra[local])
        else:
            a = _dense_array(value, vpath, dst)
            tensors[name] = a.T if transpose else a
    if name_map is None:  # every other param, under its own path
        from flax import nnx

        mapped = {entry[0] for entry in table.values()} | by_param
        for path, var in nnx.iter_graph(model):
            ps = "/".join(str(p) for p in path)
            if isinstance(var, nnx.Param) and ps not in mapped:
                tensors.setdefault(ps.replace("/", "."), _dense_array(var.get_value(), ps, dst))
    layouts = _add_entries(entries, tensors, schemes, dst)
    for name, value in (extra_tensors or {}).items():
        if name in tensors:
            raise CheckpointError(f"{dst}: extra tensor {name!r} is also one of the model's tensors")
        tensors[name] = np.asarray(value)
    if kv_cache_scheme is None:  # a KV-cache scheme alone is a quantized checkpoint (its scales are the point)
        _refuse_unquantized(tensors, dst)
    if config is None and copy_from is not None and (Path(copy_from) / "config.json").exists():
        config = read_json(Path(copy_from) / "config.json", copy_from)
    if layouts:
        config = dict(config or {}, **{LAYOUTS_KEY: layouts})
    return write_compressed(dst, tensors, schemes, config=config, copy_from=copy_from,
                            max_shard_size=max_shard_size, overwrite=overwrite, ignore=list(ignore),
                            kv_cache_scheme=kv_cache_scheme, transform_config=transform_config)


# ---- packed matmul weights beyond plain Linears: one record per weight ------------------------------------------
def _dense_array(value, where: str, dst) -> np.ndarray:
    from qformats.nn.traced import MatmulWeight
    from qformats.qarray import QArray

    if isinstance(value, (QArray, MatmulWeight)) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise CheckpointError(f"{dst}: param {where!r} holds a {type(value).__name__}, which this writer cannot "
                              "save (expected an array, or a packed weight of a qformats layer)")
    return np.asarray(value)


def _refuse_unquantized(tensors: Mapping[str, Any], dst) -> None:
    from qformats.qarray import QArray

    if not any(isinstance(v, QArray) for v in tensors.values()):
        raise CheckpointError(f"{dst}: nothing in this model is quantized ({len(tensors)} dense tensors); a "
                              "compressed checkpoint of it would be a dense one: quantize it first (and check "
                              "the summary of quantize_model / quantize_linen), or save it as a dense checkpoint")


def layer_names(module: str, stacked: Sequence[int]) -> List[str]:
    """The module names of the layers of a stacked weight: "layers.q" with 2 layers -> "layers.0.q",
    "layers.1.q" (the index after the first component, as HF numbers decoder layers; flattened row-major when
    several axes are stacked); unstacked: [module]."""
    n = int(np.prod(stacked)) if len(stacked) else 0
    if not len(stacked):
        return [module]
    head, _, rest = module.partition(".")
    return [".".join(p for p in (head, str(i), rest) if p) for i in range(n)]


def _layers_of(q, stacked: Sequence[int]) -> list:
    """A QArray whose leaves have `stacked` leading axes → one QArray per layer (row-major)."""
    import jax

    if not len(stacked):
        return [q]
    n = int(np.prod(stacked))
    flat = jax.tree.map(lambda a: a.reshape((n,) + a.shape[len(stacked):]), q)
    return [jax.tree.map(lambda a, i=i: a[i], flat) for i in range(n)]


def _entry(param: str, q, shape, perm, n_contracted: int, stacked, schemes) -> Dict[str, Any]:
    from qformats.nn.traced import weight_name

    return {"param": param, "q": q, "schemes": schemes, "module": weight_name(param).replace("/", "."),
            "shape": [int(d) for d in shape], "perm": [int(p) for p in perm], "contracted": int(n_contracted),
            "stacked": [int(d) for d in stacked]}


def _n_contracted(shape, perm, k: int) -> int:
    prod = 1
    for i, a in enumerate(perm):
        if prod == k:
            return i
        prod *= int(shape[a])
    return len(perm)


def _nnx_packed_entries(model) -> List[Dict[str, Any]]:
    """The packed weights of an NNX model that are not a plain 2-D QLinear: traced MatmulWeights, QEinsum /
    QLinearGeneral layers, QLinears stacked for nnx.scan."""
    from qformats.nn import QEinsum, QLinear, QLinearGeneral
    from qformats.nn.nnx_traced import packed_weights
    from qformats.nn.graph import module_references
    from qformats.nn.experts import QExperts
    from qformats.nn.nnx_layers import QuantizedMatmul

    out = [_entry(p, mw.q, mw.shape, mw.perm, mw.n_contracted, mw.stacked, mw.schemes)
           for p, mw in packed_weights(model).items()]
    for path, m, _ in module_references(model, QuantizedMatmul).values():
        if m.mode != "ptq" or (isinstance(m, QLinear) and not m.stacked) or isinstance(m, QExperts):
            continue  # plain Linears and expert stacks are written per module / per expert by the name map
        if m.input_scale is not None or m.input_global_scale is not None:
            raise CheckpointError(f"{path}: a {type(m).__name__} with static input scales cannot be saved yet (only "
                                  "plain 2-D Linears carry them in the checkpoint)")
        q = m.kernel.get_value()
        if isinstance(m, QEinsum):
            shape, perm = m.kernel_shape, m.perm
        elif isinstance(m, QLinearGeneral):
            shape, perm = m.in_shape + m.out_shape, tuple(range(len(m.in_shape) + len(m.out_shape)))
        else:
            shape, perm = (m.k_dim, m.n_dim), (0, 1)
        out.append(_entry(f"{path}/kernel", q, shape, perm, _n_contracted(shape, perm, m.k_dim), m.stacked,
                          m.schemes))
    return out


def _add_entries(entries, tensors: Dict[str, Any], schemes: Dict[str, Any], dst) -> Dict[str, Any]:
    """Write each entry's layers as Linear modules into `tensors` / `schemes`; return the layouts record."""
    layouts = {}
    for e in entries:
        names = layer_names(e["module"], e["stacked"])
        for name, q in zip(names, _layers_of(e["q"], e["stacked"])):
            if f"{name}.weight" in tensors:
                raise CheckpointError(f"{dst}: {name}.weight would be written twice (the packed weight of "
                                      f"{e['param']!r} and another tensor)")
            tensors[f"{name}.weight"] = q
            schemes[name] = e["schemes"]
        layouts[e["module"]] = {k: e[k] for k in ("param", "shape", "perm", "contracted", "stacked")}
        layouts[e["module"]]["layers"] = names
    return layouts


def _read_entries(cm, path) -> Dict[str, Dict[str, Any]]:
    """param path -> {"q": the packed QArray with its stacked axes in front, layout fields} of the checkpoint's
    "qformats_layouts"; the modules they use are removed from `cm.modules`."""
    import jax
    import jax.numpy as jnp

    from qformats.qarray import QArray

    out = {}
    for module, rec in (cm.config.get(LAYOUTS_KEY) or {}).items():
        try:
            names, stacked = list(rec["layers"]), tuple(int(d) for d in rec["stacked"])
            shape, perm, nc = tuple(int(d) for d in rec["shape"]), tuple(int(p) for p in rec["perm"]), \
                int(rec["contracted"])
            param = str(rec["param"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: config.json {LAYOUTS_KEY}[{module!r}] is malformed ({e})") from e
        want_layers = int(np.prod(stacked)) if stacked else 1
        if sorted(perm) != list(range(len(shape))) or not 0 < nc <= len(shape) or len(names) != want_layers:
            raise CheckpointError(f"{path}: config.json {LAYOUTS_KEY}[{module!r}]: perm {perm}, contracted {nc}, "
                                  f"{len(names)} layers do not fit shape {shape}, stacked {stacked}")
        k = int(np.prod([shape[a] for a in perm[:nc]]))
        qs = []
        for n in names:
            q = cm.modules.get(n, {}).get("weight")
            if not isinstance(q, QArray):
                raise CheckpointError(f"{path}: {LAYOUTS_KEY} names module {n!r} for {param!r}, but the checkpoint "
                                      "has no quantized weight there")
            if tuple(q.shape) != (k, int(np.prod(shape)) // k):
                raise CheckpointError(f"{path}: {n}.weight has shape {q.shape} (Flax [in, out]); the layout of "
                                      f"{param!r} needs [{k}, {int(np.prod(shape)) // k}]")
            qs.append(q)
        for n in names:
            cm.modules.pop(n)
        q = qs[0] if not stacked else jax.tree.map(lambda *a: jnp.stack(a).reshape(stacked + a[0].shape), *qs)
        out[param] = {"q": q, "shape": shape, "perm": perm, "contracted": nc, "stacked": stacked, "module": module,
                      "group": cm.groups.get(names[0], "")}
    return out


def _matmul_weight(entry, dtype, input_activations):
    from qformats.nn.traced import MatmulWeight
    from qformats.schemes import SchemeSet

    q = entry["q"]
    ss = SchemeSet(q.scheme.describe(), weights=q.scheme, input_activations=input_activations)
    return MatmulWeight(q, shape=entry["shape"], perm=entry["perm"], n_contracted=entry["contracted"], dtype=dtype,
                        schemes=ss)


# ---- linen ------------------------------------------------------------------------------------------------------
def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _flat(v, prefix + (str(k),))
        else:
            yield prefix + (str(k),), v


def save_linen(qmodel, qparams: Mapping, dst, *, config: Optional[dict] = None, copy_from=None,
               max_shard_size="5GB", overwrite: bool = False, ignore: Iterable[str] = ()):
    """Write a linen model quantized by `qformats.nn.quantize_linen` (`qmodel`: its QuantizedLinen, `qparams`: its
    params) as a compressed-tensors checkpoint. Packed 2-D Dense kernels go out as llm-compressor's Linears
    (`a.b.weight`, [out, in]); packed Einsum / DenseGeneral kernels, stacked ones (nn.scan) and traced matmul
    weights as the Linear of their [K, N] matrix with their layout in config.json (see the module docstring);
    float params by `hf_name` (kernel -> weight, transposed when 2-D; scale / embedding -> weight) or under
    their own "."-joined path. Refused (CheckpointError) when nothing is quantized or a leaf is not an array."""
    from converters.formats.compressed_tensors.write import write_compressed
    from qformats.nn.traced import MatmulWeight
    from qformats.qarray import QArray

    root = qparams["params"] if isinstance(qparams.get("params"), Mapping) else qparams
    tensors: Dict[str, Any] = {}
    schemes: Dict[str, Any] = {}
    entries = []
    layouts = qmodel.layouts or {}
    for keys, v in _flat(root):
        ps = "/".join(keys)
        mod = "/".join(keys[:-1])
        if isinstance(v, MatmulWeight):
            entries.append(_entry(ps, v.q, v.shape, v.perm, v.n_contracted, v.stacked, v.schemes))
        elif isinstance(v, QArray):
            ss = qmodel.schemes.get(mod)
            lay = layouts.get(mod)
            if ss is None or keys[-1] != "kernel":
                raise CheckpointError(f"{dst}: param {ps!r} is packed but the wrapper has no scheme for it")
            stacked = tuple(v.codes.shape[:-2])
            if lay is None or (lay.kind == "Dense" and not stacked):
                tensors[mod.replace("/", ".") + ".weight"] = v
                schemes[mod.replace("/", ".")] = ss
            else:
                entries.append(_entry(ps, v, lay.kernel_shape, lay.perm,
                                      _n_contracted(lay.kernel_shape, lay.perm, lay.k), stacked, ss))
        else:
            named = hf_name(list(keys), getattr(v, "ndim", 0))
            name, transpose = named if named is not None else (ps.replace("/", "."), False)
            a = _dense_array(v, ps, dst)
            tensors[name] = a.T if transpose else a
    layout_rec = _add_entries(entries, tensors, schemes, dst)
    _refuse_unquantized(tensors, dst)
    if config is None and copy_from is not None and (Path(copy_from) / "config.json").exists():
        config = read_json(Path(copy_from) / "config.json", copy_from)
    if layout_rec:
        config = dict(config or {}, **{LAYOUTS_KEY: layout_rec})
    return write_compressed(dst, tensors, schemes, config=config, copy_from=copy_from, max_shard_size=max_shard_size,
                            overwrite=overwrite, ignore=list(ignore))


def load_linen(path, module, params: Mapping):
    """(QuantizedLinen, params) from a checkpoint `save_linen` wrote (or any compressed-tensors checkpoint whose
    names follow the same convention), for the linen `module` whose float `params` (e.g. from `module.init` or
    `jax.eval_shape` of it) give the tree and shapes. Every checkpoint tensor must have a place and every shape
    must match (CheckpointError naming the file and the tensor otherwise); float params the checkpoint lacks
    are kept."""
    import jax.numpy as jnp

    from converters.formats.quantized import read_quantized
    from qformats.nn.linen_transform import QuantizedLinen
    from qformats.qarray import QArray
    from qformats.schemes import SchemeSet

    cm = read_quantized(path)
    entries = _read_entries(cm, path)
    has_params = isinstance(params.get("params"), Mapping)
    root = params["params"] if has_params else params
    leaves = {"/".join(k): v for k, v in _flat(root)}
    groups = {g.name: g for g in (cm.quant.groups if cm.quant is not None else ())}
    new: Dict[str, Any] = {}
    schemes: Dict[str, Any] = {}
    for param, e in entries.items():
        if param not in leaves:
            raise CheckpointError(f"{path}: {LAYOUTS_KEY}[{e['module']!r}] is the packed weight of {param!r}, which "
                                  "the params do not have")
        want = tuple(e["stacked"]) + tuple(e["shape"])
        if tuple(jnp.shape(leaves[param])) != want:
            raise CheckpointError(f"{path}: {param!r} has shape {tuple(jnp.shape(leaves[param]))} in the params, "
                                  f"the checkpoint's packed weight {e['module']!r} is {want}")
        g = groups.get(e["group"])
        new[param] = _matmul_weight(e, jnp.result_type(leaves[param]), g.input_activations if g else None)
    by_name = {}
    for ps, v in leaves.items():
        named = hf_name(ps.split("/"), getattr(v, "ndim", 0))
        by_name[named[0] if named is not None else ps.replace("/", ".")] = (ps, named is not None and named[1])
    unknown = []
    for mod, tensors in cm.modules.items():
        for local, arr in tensors.items():
            full = f"{mod}.{local}" if mod else local
            if full not in by_name:
                unknown.append(full)
                continue
            ps, transpose = by_name[full]
            if isinstance(arr, QArray):
                want = tuple(jnp.shape(leaves[ps]))
                if tuple(arr.shape) != want or arr.axis != 0:
                    raise CheckpointError(f"{path}: {full}: expected a [in, out] weight of shape {want}, found "
                                          f"{arr.shape}")
                g = groups.get(cm.groups.get(mod, ""))
                schemes[ps.rsplit("/", 1)[0]] = SchemeSet(arr.scheme.describe(), weights=arr.scheme,
                                                          input_activations=g.input_activations if g else None)
                new[ps] = arr
            elif local in ("input_scale", "input_global_scale"):
                raise CheckpointError(f"{path}: {full}: static activation scales are not supported by load_linen")
            else:
                a = np.asarray(arr).T if transpose else np.asarray(arr)
                if tuple(a.shape) != tuple(jnp.shape(leaves[ps])):
                    raise CheckpointError(f"{path}: tensor {full!r}: expected shape {tuple(jnp.shape(leaves[ps]))} "
                                          f"for {ps}, found {a.shape}")
                new[ps] = jnp.asarray(a, jnp.result_type(leaves[ps]))
    if unknown:
        raise CheckpointError(f"{path}: tensors the params have no place for: {sorted(unknown)[:8]}"
                              + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else ""))

    def rebuild(tree, prefix=()):
        return {k: rebuild(v, prefix + (str(k),)) if isinstance(v, Mapping) else new.get("/".join(prefix + (str(k),)), v)
                for k, v in tree.items()}

    out = rebuild(root)
    return QuantizedLinen(module, schemes), (dict(params, params=out) if has_params else out)
