"""Causal-LM checkpoints (dense HF safetensors, compressed-tensors, GGUF) into the Flax decoder `qformats.models.decoder`.

`load_causal_lm(src)` builds the model's structure without materialising random weights
(`nnx.eval_shape`), then fills every parameter from the checkpoint one tensor at a time:

- a dense HF directory (model.safetensors, or shards + model.safetensors.index.json): the memory-mapped
  tensors go through `decoder.load_hf_tensors` (HF names, Linear weights transposed to Flax kernels);
- a compressed-tensors directory (config.json with a compressed-tensors `quantization_config`, any format
  `converters.formats.compressed_tensors.read` reads): `converters.pipelines.flax_io.load_compressed` swaps every quantized projection for a
  packed `qformats.nn.QLinear` holding the checkpoint's codes and scales as they are (nothing dequantized);
  the rest (embedding, norms, dense layers such as lm_head) is filled dense; mixture-of-experts projections become
  stacked `qformats.nn.QExperts` (gpt_oss's per-expert Linears, e.g. its MXFP4 checkpoint, fused back into its
  interleaved gate_up / down stacks);
- a `.gguf` file: `converters.formats.gguf_convert.open_gguf`. By default every projection stored in a block type
  that is one of ours (`converters.formats.gguf_packed.PACKED_TYPES`: Q4_0/Q5_0/Q8_0, Q4_1/Q5_1 with their float
  minimum as the QArray's offset, the K-quants, IQ4_NL/IQ4_XS, MXFP4) becomes a packed `QLinear` holding the file's
  codes and exact float32 scales, nothing dequantized; a block-quantized token embedding becomes a
  `decoder.PackedEmbed` (the rows a step looks up are decoded; a tied lm_head is a packed GEMV over the codes), on one
  device (with `mesh` it is loaded dense); the norms and float (F32/F16/BF16) tensors are dequantized by gguf. `packed=False` dequantizes every tensor (the result equals loading `convert_gguf`'s output,
  without writing it).

With `mesh=` the same checkpoints load onto a jax Mesh: a directory shard by shard (every parameter a global
jax.Array laid out by sharding rules, each device's slice read from the memory map straight to it,
`converters.pipelines.mesh_load`; quantized weights decoded by the same `converters.formats.compressed_tensors.read.decode_weight`), a `.gguf`
file slice by slice from its memory map with its block types kept packed, and the other quantized formats from
their readers' QArrays, each device's slice placed.

A parameter the checkpoint does not fill, a tensor the model has no place for, or a shape that differs is an
error; nothing is left at an initial value.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from qformats.errors import CheckpointError, ModelError

__all__ = ["kv_scale_name_map", "kv_scale_names", "load_causal_lm", "load_tokenizer", "read_kv_scales",
           "save_causal_lm"]


class _LazyTensor:
    """An array read on demand: `.shape` from the header, `__array__` loads (np.shape and jnp.asarray use these)."""

    def __init__(self, shape: tuple[int, ...], load: Callable[[], np.ndarray]):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self._load = load

    def __array__(self, dtype=None, copy=None):
        a = self._load()
        return a if dtype is None else a.astype(dtype)


class _LazyTensors(Mapping):
    """HF name -> `_LazyTensor` over a checkpoint, so the loader holds one tensor's data at a time."""

    def __init__(self, names: list[str], shape: Callable[[str], tuple[int, ...]], get: Callable[[str], np.ndarray]):
        self._names = list(names)
        self._set = set(self._names)
        self._shape, self._get = shape, get

    def __getitem__(self, name: str) -> _LazyTensor:
        if name not in self._set:
            raise KeyError(name)
        return _LazyTensor(self._shape(name), lambda: self._get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._set


def _abstract_model(hf_config: Mapping[str, Any], dtype, param_dtype, where: str):
    from qformats.models import decoder
    from qformats.models.abstract import abstract_module

    try:
        cfg = decoder.DecoderConfig.from_hf(hf_config)
    except ModelError as e:
        raise CheckpointError(f"{where}: {e}") from None
    model = abstract_module(lambda rngs: decoder.CausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs))
    return model, cfg


def _check_filled(model, where: str) -> None:
    """Every parameter holds an array (none left as the abstract placeholder of eval_shape)."""
    import jax
    from flax import nnx

    empty = []
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable) and isinstance(var.get_value(), jax.ShapeDtypeStruct):
            empty.append("/".join(str(p) for p in path))
    if empty:
        raise CheckpointError(f"{where}: expected every parameter of the model in the checkpoint, found "
                              f"{len(empty)} not filled: {', '.join(empty[:6])}" + (" ..." if len(empty) > 6 else ""))


def _flax_name_map(cfg) -> dict[str, tuple]:
    """HF tensor name -> (Flax variable path, transposed), for converters.pipelines.flax_io; one expert's tensor of a
    stacked [E, ...] parameter (MoE layers) -> (path, transposed, expert index)."""
    from qformats.models import decoder

    return {name: ("/".join(str(p) for p in slot.path), slot.transpose)
            + (() if slot.expert is None else (slot.expert,))
            for name, slot in decoder.hf_tensor_names(cfg).items()}


def load_tokenizer(src: str | os.PathLike):
    """The `tokenizers.Tokenizer` of a checkpoint directory (its tokenizer.json) or of a .gguf file (built as
    `converters.formats.gguf_convert` writes it); None when the directory has no tokenizer.json.

    Raises CheckpointError when there is a tokenizer but the `tokenizers` package is not installed.
    """
    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        from converters.formats.gguf_convert import open_gguf

        return _gguf_tokenizer(open_gguf(p))
    f = p / "tokenizer.json"
    if not f.is_file():
        return None
    return _tokenizer_from_str(f.read_text(encoding="utf-8"), f)


def _gguf_tokenizer(g):
    return _tokenizer_from_str(json.dumps(g.tokenizer_files()["tokenizer.json"], ensure_ascii=False), g.path)


def _tokenizer_from_str(text: str, where: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CheckpointError(f"{where}: reading its tokenizer needs the 'tokenizers' package; found it not "
                              f"installed (pip install tokenizers), or pass tokenizer=False") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type for a bad file
        raise CheckpointError(f"{where}: expected a tokenizers tokenizer.json, found {e}") from None


def load_causal_lm(src: str | os.PathLike, *, dtype=None, param_dtype=None, tokenizer: bool = True, mesh=None,
                   rules=None, stats=None, packed: bool = True):
    """Loads a causal LM of the decoder family (llama, mistral, qwen2/3, the MoE decoders) as `qformats.models.decoder.CausalLM`, on one device or
    onto a mesh.

    Args:
      src: a dense HF checkpoint directory (single file or sharded), a compressed-tensors checkpoint
        directory, or a `.gguf` file.
      dtype: compute dtype of the model (default float32). param_dtype: dtype of the dense parameters
        (default: `dtype`); packed layers keep the checkpoint's codes and scales.
      tokenizer: also return the checkpoint's tokenizer (`load_tokenizer`).
      mesh: None (default): one device. A `jax.sharding.Mesh` (in a multi-process run, `jax.distributed`, the
        global mesh): every parameter is a global jax.Array laid out by `rules` (packed weights: the layout of
        the float weight they stand for), built from each device's slice of the stored tensor, read from the
        memory map straight to that device (`converters.pipelines.mesh_load`); a process reads only its own devices'
        slices. Compressed layouts whose values span slices (asymmetric pack-quantized zero points, the
        pre-0.18 int32 layout for 3/5/6/7 bits, int-quantized codes under 8 bits, activation-ordered g_idx) and
        online rotations are CheckpointErrors there: load them on one device and `qformats.nn.sharding.shard_model`.
        A `.gguf` file is placed slice by slice from its memory map, its block types kept packed (`packed`) as on
        one device (`mesh_load.load_gguf_on_mesh`); a checkpoint of another quantized format (HF FP8, ModelOpt,
        GPTQ, AWQ, torchao) is read by its reader and each device's slice of its QArrays placed
        (`mesh_load.load_native_on_mesh`). A split that would cut a scale group, block or packed byte is a
        ModelError naming the parameter.
      rules: with `mesh`, a `qformats.sharding.ShardingRules`; default `decoder.tensor_parallel_rules(config,
        axis)` for a 1-D mesh of axis `axis`, `decoder.sharding.decoder_parallel_rules` for a mesh with an "ep"
        axis (`mesh_load.parallel_setup`: expert stacks split by experts, each device reading only its own
        experts' tensors); ModelError for another mesh of several axes without rules.
      stats: with `mesh`, a `converters.pipelines.mesh_load.ReadStats` to fill with the bytes this process read (a
        directory of another quantized format: only the largest shard, its reader reads the files).
      packed: for a `.gguf` file, keep the block-quantized projections (and embedding) packed (default; module
        docstring); a projection in another quantized GGML type (the IQ1/IQ2/IQ3 grids, TQ, GGUF NVFP4) is then a
        CheckpointError naming it. False: dequantize every tensor to float. Directories ignore it.

    Returns:
      (model, hf_config, tokenizer or None): hf_config is the config.json dict (for a GGUF file, the one
      `convert_gguf` writes), with the token ids (`eos_token_id`, ...).

    Raises:
      CheckpointError: unreadable or unsupported checkpoint, missing / unexpected / misshapen tensors.
      ModelError: with `mesh`, a parameter the mesh cannot split (naming it).
    """
    import jax.numpy as jnp

    from converters.formats.compressed_tensors.read import is_quantized
    from converters.formats.safetensors_io import open_checkpoint, read_json
    from qformats.models import decoder

    dtype = jnp.float32 if dtype is None else dtype
    param_dtype = dtype if param_dtype is None else param_dtype
    p = Path(src)
    where = str(p)
    tok = None
    if p.is_file() and p.suffix == ".gguf":
        from converters.formats.gguf_convert import open_gguf

        g = open_gguf(p)
        tok = _gguf_tokenizer(g) if tokenizer else None  # before the weights: a bad tokenizer fails fast
        hf_config = dict(g.config)
        model, cfg = _abstract_model(hf_config, dtype, param_dtype, where)
        names = g.keys()
        if mesh is not None:
            from converters.pipelines.mesh_load import load_gguf_on_mesh

            load_gguf_on_mesh(g, model, cfg, mesh, _mesh_rules(cfg, mesh, rules), stats, packed)
            _check_filled(model, where)
            return model, hf_config, tok
        try:
            if packed:
                names = _load_gguf_packed(g, model, cfg, embedding=mesh is None)
            decoder.load_hf_tensors(model, _LazyTensors(names, g.shape, g.get))
        except ModelError as e:
            raise CheckpointError(f"{where}: {e}") from None
        _check_filled(model, where)
        return model, hf_config, tok
    if not p.is_dir():
        raise CheckpointError(f"{p}: expected a checkpoint directory or a .gguf file, found "
                              f"{'no such path' if not p.exists() else 'another kind of file'}")
    hf_config = read_json(p / "config.json")
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{p / 'config.json'}: expected a JSON object, found {type(hf_config).__name__}")
    model, cfg = _abstract_model(hf_config, dtype, param_dtype, str(p / "config.json"))
    from converters.formats.quantized import quant_method

    if mesh is not None and quant_method(hf_config) not in ("dense", "compressed-tensors", "sparseml"):
        from converters.pipelines.mesh_load import load_native_on_mesh

        load_native_on_mesh(p, model, cfg, mesh, _mesh_rules(cfg, mesh, rules), stats)
    elif mesh is not None:
        _load_on_mesh(p, hf_config, model, cfg, param_dtype, mesh, _mesh_rules(cfg, mesh, rules), stats)
    elif is_quantized(hf_config):
        from converters.formats.compressed_tensors.transforms import applying_online_transforms

        with applying_online_transforms():  # _load_compressed installs them
            _load_compressed(p, model, cfg)
    else:
        with open_checkpoint(p) as ck:
            try:
                decoder.load_hf_tensors(model, _LazyTensors(ck.keys(), lambda n: ck.info(n).shape, ck.get))
            except ModelError as e:
                raise CheckpointError(f"{where}: {e}") from None
    tok = load_tokenizer(p) if tokenizer else None
    _check_filled(model, where)
    return model, hf_config, tok


def _load_gguf_packed(g, model, cfg, embedding: bool = True) -> list[str]:
    """Swaps every Linear of `model` whose GGUF weight is block-quantized for a packed QLinear holding
    `g.get_packed(name)` (`qformats.nn.load_quantized`) and, with `embedding`, a block-quantized token embedding for
    a `decoder.PackedEmbed` (gathered rows decoded; a tied lm_head a packed GEMV, so tied only for the 4- and 8-bit
    types `qformats.packed_dot` takes); returns the names of the tensors
    left to load dense (norms, biases, weights stored as floats). A Linear weight in a quantized GGML type that is
    not packed exactly is a CheckpointError naming it (load with packed=False to dequantize it)."""
    from converters.formats.gguf_packed import DENSE_TYPES
    from qformats.nn import load_quantized

    slots = _flax_name_map(cfg)
    quantized: dict[str, dict[str, Any]] = {}
    dense = []
    for name in g.keys():
        kpath, transpose = slots.get(name, (None, False))
        if kpath is None or not transpose or g.tensor_type(name) in DENSE_TYPES:
            dense.append(name)
            continue
        quantized[kpath.rsplit("/", 1)[0]] = {"weight": g.get_packed(name)}
    for fpath, t in quantized.items():
        bias = fpath.replace("/", ".") + ".bias"
        if bias in g.keys():
            t["bias"] = g.get(bias)
            dense.remove(bias)
    load_quantized(model, quantized)
    from converters.formats.gguf_packed import GGUF_EMBEDDING, swap_packed_embedding

    if embedding and GGUF_EMBEDDING in dense and swap_packed_embedding(g, model, cfg, g.get_packed):
        dense.remove(GGUF_EMBEDDING)
    return dense


def _mesh_rules(cfg, mesh, rules):
    """`rules`, or the decoder's layout for `mesh` (`decoder.sharding.decoder_parallel_rules`: Megatron over the one
    axis of a 1-D mesh, experts split over an "ep" axis with attention over "tp")."""
    from qformats.models.decoder.sharding import decoder_parallel_rules

    if rules is not None:
        return rules
    if len(mesh.axis_names) != 1 and "ep" not in mesh.axis_names:
        raise ModelError(f"load_causal_lm: a mesh of axes {mesh.axis_names} needs explicit rules")
    return decoder_parallel_rules(cfg, mesh)


def _load_on_mesh(p: Path, hf_config, model, cfg, param_dtype, mesh, rules, stats) -> None:
    """Fills the abstract `model` from checkpoint directory `p` onto `mesh`, every parameter placed slice by slice
    (`converters.pipelines.mesh_load.place`): dense tensors from their stored rows / columns, quantized modules as decoded
    by `converters.formats.compressed_tensors.read.decode_weight` (`place_weight`), static KV-cache scales replicated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from converters.formats.compressed_tensors.config import parse_quantization_config
    from converters.formats.compressed_tensors.read import decode_weight, is_quantized, plan_modules
    from converters.pipelines.mesh_load import (SliceSource, dense_reader, equal_by_rows, place, place_expert_stack,
                                                place_expert_weights, place_weight)
    from converters.formats.safetensors_io import open_checkpoint
    from qformats.models import decoder
    from qformats.models.decoder.params import resolve_path
    from qformats.nn import load_quantized
    from qformats.sharding import spec_for

    slots = decoder.hf_tensor_names(cfg)
    qc = parse_quantization_config(hf_config["quantization_config"], str(p / "config.json")) \
        if is_quantized(hf_config) else None
    with open_checkpoint(p) as ck:
        src = SliceSource(ck, stats)
        quantized: dict[str, dict[str, Any]] = {}
        schemes: dict[str, Any] = {}
        consumed = set()
        experts: dict[str, dict[int, Any]] = {}  # expert stack path -> expert -> (module, decoded weight)
        for m in plan_modules(ck, qc) if qc is not None else ():
            if m.group is None:
                continue
            slot = slots.get(f"{m.name}.weight")
            if slot is None or not slot.transpose:
                raise CheckpointError(f"{p}: module {m.name!r} holds quantized tensors but the model has no Linear "
                                      f"there")
            fpath = "/".join(str(x) for x in slot.path[:-1])
            w = decode_weight(ck, m, qc, src)
            if slot.expert is not None:  # one expert of a stack: placed with the others below
                experts.setdefault(fpath, {})[slot.expert] = (m, w)
                consumed.update(n for local, n in m.tensors.items()
                                if local.startswith("weight") or local in ("input_scale", "input_global_scale", "bias"))
                continue
            entry: dict[str, Any] = {"weight": place_weight(w, mesh, rules, fpath, stats)}
            for local in ("input_scale", "input_global_scale"):
                if local in m.tensors:
                    entry[local] = np.asarray(src.read(m.tensors[local]))
            bias = f"{m.name}.bias"
            if bias in ck:
                bpath = "/".join(str(x) for x in slots[bias].path)
                shape = tuple(ck.info(bias).shape)
                entry["bias"] = place(shape, param_dtype, NamedSharding(mesh, spec_for(bpath, shape, mesh, rules)),
                                      dense_reader(src, bias, False), stats)
            consumed.update(n for local, n in m.tensors.items()
                            if local.startswith("weight") or local in ("input_scale", "input_global_scale", "bias"))
            quantized[fpath] = entry
            schemes[fpath] = m.group.input_activations
        packed_experts = set()
        for fpath, per in experts.items():
            quantized[fpath] = _expert_stack_entry(p, fpath, per, model, mesh, rules, src, stats)
            schemes[fpath] = per[0][0].group.input_activations
            packed_experts.update(f"{m.name}.weight" for m, _ in per.values())
        kv = qc.kv_cache if qc is not None else None
        kv_scales = None
        if kv is not None:
            kv_scales = read_kv_scales(ck, cfg, kv, str(p))
            if kv_scales is not None:
                consumed.update(kv_scale_names(cfg))
        packed = {f"{m.replace('/', '.')}.weight" for m in quantized}
        dense = {n: s for n, s in slots.items() if n not in packed and n not in consumed and n not in packed_experts}
        missing = [n for n in dense if n not in ck]
        extra = [n for n in ck.keys() if n not in dense and n not in consumed]
        checks = [n for n in extra if n.endswith(".rotary_emb.inv_freq")
                  or (n == "lm_head.weight" and cfg.tie_word_embeddings)]
        extra = [n for n in extra if n not in checks]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {', '.join(missing[:8])}")
        if extra:
            problems.append(f"{len(extra)} unexpected: {', '.join(extra[:8])}")
        variables = {n: resolve_path(model, slot.path) for n, slot in dense.items()}
        for n, slot in dense.items():
            if n in ck:
                want = tuple(variables[n].get_value().shape)[(0 if slot.expert is None else 1):]
                got = tuple(ck.info(n).shape)
                if (got[::-1] if slot.transpose else got) != want:
                    problems.append(f"{n} {got} (expected {want[::-1] if slot.transpose else want})")
        for n in checks:
            if n == "lm_head.weight":
                if "model.embed_tokens.weight" in ck and not equal_by_rows(ck, n, "model.embed_tokens.weight"):
                    problems.append("lm_head.weight differs from model.embed_tokens.weight but the config ties them")
            elif not np.allclose(np.asarray(ck.get(n), np.float32), decoder.inv_freq(cfg), rtol=1e-6, atol=0):
                problems.append(f"{n} does not equal the inverse frequencies of the config's rope")
        if problems:
            raise CheckpointError(f"{p}: " + "; ".join(problems))
        placed = []
        stacks: dict[str, dict[int, str]] = {}  # dense expert stacks: variable path -> expert -> stored name
        for n, slot in dense.items():
            v = variables[n]
            a = v.get_value()
            vpath = "/".join(str(x) for x in slot.path)
            if slot.expert is not None:
                stacks.setdefault(vpath, {})[slot.expert] = n
                continue
            sharding = NamedSharding(mesh, spec_for(vpath, a.shape, mesh, rules))
            placed.append((v, place(a.shape, a.dtype, sharding, dense_reader(src, n, slot.transpose), stats)))
        for vpath, names in stacks.items():  # each device reads only its own experts' tensors
            v = variables[names[0]]
            a = v.get_value()
            sharding = NamedSharding(mesh, spec_for(vpath, a.shape, mesh, rules))
            readers = [dense_reader(src, names[e], dense[names[e]].transpose) for e in range(a.shape[0])]
            placed.append((v, place_expert_stack(a.shape, a.dtype, sharding, readers, stats)))
    try:
        load_quantized(model, quantized, schemes)
    except ModelError as e:
        raise CheckpointError(f"{p}: {e}") from None
    for v, a in placed:
        v.set_value(a)
    if kv is not None:
        # KV-cache scales are replicated on every device, per-head ones included: kv_heads floats per layer, read
        # by attention wherever its heads live (the cache buffers themselves split by KV heads, set_sharding)
        rep = NamedSharding(mesh, PartitionSpec())
        scales = None if kv_scales is None else [tuple(jax.device_put(jnp.asarray(x), rep) for x in pair)
                                                 for pair in kv_scales]
        _enable_kv_cache(p, model, kv, scales)


def _expert_stack_entry(p: Path, fpath: str, per: dict, model, mesh, rules, src, stats) -> dict[str, Any]:
    """The `qformats.nn.load_quantized` entry of one quantized expert stack loaded onto `mesh`: {"weight": the
    stacked QArray placed shard by shard (`converters.pipelines.mesh_load.place_expert_weights`), "bias"?: the
    stacked per-expert biases, "input_scale"? / "input_global_scale"?: [E, ...] stacks (which QExperts refuses:
    static activation scales)}. CheckpointError naming the stack when experts are missing."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from converters.pipelines.mesh_load import dense_reader, place_expert_stack, place_expert_weights
    from qformats.models.decoder.params import resolve_path
    from qformats.sharding import spec_for

    module = resolve_path(model, tuple(int(x) if x.isdigit() else x for x in fpath.split("/")))
    n = int(module.num_experts)
    if sorted(per) != list(range(n)):
        raise CheckpointError(f"{p}: expert stack {fpath}: expected quantized weights of experts 0..{n - 1}, found "
                              f"{sorted(per)[:8]}{' ...' if len(per) > 8 else ''}")
    mods = [per[e][0] for e in range(n)]
    entry: dict[str, Any] = {"weight": place_expert_weights([per[e][1] for e in range(n)], mesh, rules, fpath, stats)}
    for local in ("input_scale", "input_global_scale"):
        have = [local in m.tensors for m in mods]
        if any(have):
            if not all(have):
                raise CheckpointError(f"{p}: expert stack {fpath}: {local} on some experts only")
            entry[local] = np.stack([np.asarray(src.read(m.tensors[local])) for m in mods])
    bias = [f"{m.name}.bias" for m in mods]
    if module.bias is not None:
        if not all(b in src.ck for b in bias):
            raise CheckpointError(f"{p}: expert stack {fpath}: expected every expert's bias ({bias[0]}, ...)")
        shape = tuple(module.bias.get_value().shape)
        sharding = NamedSharding(mesh, spec_for(f"{fpath}/bias", shape, mesh, rules))
        entry["bias"] = place_expert_stack(shape, jnp.dtype(module.bias.get_value().dtype), sharding,
                                           [dense_reader(src, b, False) for b in bias], stats)
    return entry


def kv_scale_names(cfg) -> list[str]:
    """compressed-tensors' names of the static KV-cache scales of a decoder config: model.layers.{i}.self_attn.
    k_scale / v_scale for every layer."""
    return [f"model.layers.{i}.self_attn.{n}_scale" for i in range(cfg.num_layers) for n in "kv"]


def _load_compressed(path: Path, model, cfg) -> None:
    """Fills `model` from a compressed-tensors checkpoint: quantized projections become packed QLinear layers;
    a `kv_cache_scheme` quantizes the model's KV cache (static `k_scale` / `v_scale` read from each attention
    module, as compressed-tensors names them)."""
    from converters.formats.compressed_tensors.config import parse_quantization_config
    from converters.pipelines.flax_io import load_compressed
    from qformats.models import decoder

    from converters.formats.quantized import quant_method

    table = _flax_name_map(cfg)
    ignore: tuple[str, ...] = ()
    if cfg.tie_word_embeddings:
        # A tied model saved with its (redundant) lm_head: accepted only when it equals the embedding.
        ignore = ("lm_head.weight",)
    hf_config = _read_config(path)
    qc = None  # another quantized format (converters.formats.quantized.READERS): weights only, no KV cache or
    if quant_method(hf_config) in ("compressed-tensors", "sparseml"):  # transform records
        qc = parse_quantization_config(hf_config["quantization_config"], str(path / "config.json"))
    kv = None if qc is None else qc.kv_cache
    if kv is not None and not kv.dynamic:
        ignore += tuple(kv_scale_names(cfg))
    rotations = ([], []) if qc is None else _online_rotations(path, cfg, qc)
    ignore += tuple(rotations[1])
    try:
        load_compressed(path, model, table, ignore=ignore, checkpoint=_fused_experts(path, cfg, table))
    except ModelError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if cfg.tie_word_embeddings:
        _check_tied_lm_head(path)
    if kv is not None:
        _load_kv_scales(path, model, cfg, kv)
    for r in rotations[0]:
        try:
            m = decoder.HadamardRotation(*r.fast) if r.fast is not None else r.weight.astype(np.float32)
            decoder.set_rotation(model, r.module, r.location, m)
        except ModelError as e:
            raise CheckpointError(f"{path}: transform_config group {r.group!r}: {e}") from None


def _fused_experts(path: Path, cfg, table: dict):
    """For gpt_oss, whose model holds fused gate_up / down expert stacks: the checkpoint read
    (`converters.formats.quantized.read_quantized`) with its per-expert Linears (llm-compressor's linearized
    layout, the MXFP4 reader's view) fused back into those stacks, packed weights staying packed
    (`decoder.params.fuse_linearized_experts`), and `table` extended with the fused stacks' names. None (read by
    `load_compressed` itself) for other families."""
    import dataclasses

    from converters.formats.quantized import read_quantized
    from qformats.models.decoder.params import fuse_linearized_experts, fused_expert_names

    extra = fused_expert_names(cfg)
    if not extra:
        return None
    cm = read_quantized(path)
    modules, sources = fuse_linearized_experts(cfg, cm.modules)
    formats, groups = dict(cm.formats), dict(cm.groups)
    for fused, parts in sources.items():
        for key, d in (("formats", formats), ("groups", groups)):
            vals = {d[p] for p in parts if p in d}
            if len(vals) > 1:
                raise CheckpointError(f"{path}: {fused}: its per-expert modules belong to different config {key} "
                                      f"{sorted(vals)}; expected one")
            for p in parts:
                d.pop(p, None)
            if vals:
                d[fused] = vals.pop()
    table.update({n: ("/".join(str(x) for x in slot.path), slot.transpose) for n, slot in extra.items()})
    return dataclasses.replace(cm, modules=modules, formats=formats, groups=groups)


def _online_rotations(path: Path, cfg, qc):
    """(rotations, consumed tensor names) of the checkpoint's transform_config (`converters.formats.compressed_tensors.transforms`)."""
    from converters.formats.safetensors_io import open_checkpoint
    from converters.formats.compressed_tensors.transforms import online_rotations, parse_transform_config

    groups = parse_transform_config(qc.raw.get("transform_config"), f"{path / 'config.json'}: transform_config")
    if not groups:
        return [], []
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    linear = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, q), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
    modules, shapes = {}, {}  # HF module -> class; Linear -> (out_features, in_features), from the config
    for i in range(cfg.num_layers):
        modules[f"model.layers.{i}.self_attn"] = "Attention"
        for rel, shape in linear.items():
            modules[f"model.layers.{i}.{rel}"] = "Linear"
            shapes[f"model.layers.{i}.{rel}"] = shape
    if not cfg.tie_word_embeddings:
        modules["lm_head"] = "Linear"
        shapes["lm_head"] = (cfg.vocab_size, d)
    with open_checkpoint(path) as ck:
        tensors = _LazyTensors(ck.keys(), lambda n: ck.info(n).shape, ck.get)
        return online_rotations(groups, tensors, modules, str(path), shapes)


def _check_tied_lm_head(path: Path) -> None:
    """A tied model saved with its (redundant) lm_head.weight: accepted only when it equals the embedding."""
    from converters.formats.safetensors_io import open_checkpoint

    with open_checkpoint(path) as ck:
        if "lm_head.weight" in ck:
            emb = np.asarray(ck.get("model.embed_tokens.weight"))
            if not np.array_equal(np.asarray(ck.get("lm_head.weight")), emb):
                raise CheckpointError(f"{path}: lm_head.weight differs from model.embed_tokens.weight but the "
                                      f"config ties them (tie_word_embeddings)")


def _read_config(path: Path) -> dict:
    from converters.formats.safe_files import read_json

    return read_json(path / "config.json", path)


def read_kv_scales(ck, cfg, kv, where: str) -> list | None:
    """The static k_scale / v_scale of every layer of an open checkpoint `ck` (`converters.formats.safetensors_io`),
    as compressed-tensors stores them under each attention module: float tensors of shape [1] (or a scalar) per
    tensor, [kv_heads, 1, 1] per head. Returns [(k_scale, v_scale)] float32 per layer (shapes
    `kv.scale_shape(kv_heads)`), or None for a dynamic scheme (which stores none).

    Raises:
      CheckpointError: a missing scale, or one of another dtype or shape (all named).
    """
    if kv.dynamic:
        return None
    want = kv.scale_shape(cfg.num_kv_heads)
    scales, problems = [], []
    for i in range(cfg.num_layers):
        pair = []
        for n in ("k", "v"):
            name = f"model.layers.{i}.self_attn.{n}_scale"
            if name not in ck:
                problems.append(f"{name} missing")
                continue
            info = ck.info(name)
            shape = tuple(info.shape)
            if info.dtype not in ("F32", "BF16", "F16") or shape not in (want, () if want == (1,) else want):
                problems.append(f"{name} {info.dtype} {list(shape)} (expected a float tensor of shape {list(want)})")
                continue
            pair.append(np.asarray(ck.get(name), np.float32).reshape(want))
        scales.append(tuple(pair))
    if problems:
        raise CheckpointError(f"{where}: kv_cache_scheme {kv.strategy} (static) needs k_scale / v_scale under every "
                              f"attention module: {'; '.join(problems[:6])}" + (" ..." if len(problems) > 6 else ""))
    return scales


def _load_kv_scales(path: Path, model, cfg, kv) -> None:
    """Static k_scale / v_scale of every layer (`read_kv_scales`) -> `decoder.enable_kv_cache_quantization`; a
    dynamic scheme takes none."""
    from converters.formats.safetensors_io import open_checkpoint

    with open_checkpoint(path) as ck:
        scales = read_kv_scales(ck, cfg, kv, str(path))
    _enable_kv_cache(path, model, kv, scales)


def _enable_kv_cache(path: Path, model, kv, scales) -> None:
    """`decoder.enable_kv_cache_quantization(model, kv, scales)`, its ModelError a CheckpointError naming `path`."""
    from qformats.models import decoder

    try:
        decoder.enable_kv_cache_quantization(model, kv, scales)
    except ModelError as e:
        raise CheckpointError(f"{path}: {e}") from None


def kv_scale_name_map(model) -> dict[str, tuple[str, bool]]:
    """compressed-tensors name -> (Flax variable path, transposed) of the static KV-cache scales of a
    `decoder.CausalLM` ("model.layers.{i}.self_attn.k_scale" / "v_scale"; {} without a static KV-cache scheme),
    for `converters.pipelines.flax_io.save_compressed`'s name map."""
    from qformats.models import decoder

    kv = decoder.kv_cache_scheme(model)
    if kv is None or kv.dynamic:
        return {}
    return {n: (decoder.module_path(n), False) for n in kv_scale_names(model.config)}


def save_causal_lm(model, dst: str | os.PathLike, hf_config: Mapping[str, Any], *, copy_from=None,
                   max_shard_size: str = "5GB", overwrite: bool = False, ignore=(), rotated=None) -> Path:
    """Write a `decoder.CausalLM` (dense, packed `QLinear` projections, and a quantized KV cache) as a
    compressed-tensors checkpoint: `converters.pipelines.flax_io.save_compressed` under HF names, plus, with KV-cache
    quantization, `model.layers.{i}.self_attn.k_scale` / `v_scale` (static scales, in the model's dtype, shapes
    [1] or [kv_heads, 1, 1]) and `quantization_config.kv_cache_scheme`; `ignore`: quantization_config.ignore.
    config.json is `hf_config` with the model's own `tie_word_embeddings` (False after a rotation untied lm_head).

    `rotated`: the `qformats.rotation.Rotated` record of the rotation applied to the model
    (`qformats.models.decoder.rotate_decoder`, called before `quantize_model`): its transform_config is recorded and
    its online matrices (R3 / R4) written. A model carrying online rotations without that record is refused
    (ModelError), since the checkpoint would silently lose them. Returns the path written."""
    from flax import nnx

    from converters.pipelines.flax_io import save_compressed
    from qformats.models import decoder

    online = [p for p, m in nnx.iter_modules(model) if getattr(m, "rotations", None)]
    if online and (rotated is None or not rotated.online):
        where = "/".join(map(str, online[0]))
        raise ModelError(f"save_causal_lm: {where} (and {len(online) - 1} more module(s)) carries online rotations; "
                         f"pass rotated= (the record rotate_decoder returned) so that transform_config and the "
                         f"online matrices are written, or the saved checkpoint would run without them")
    table = _flax_name_map(model.config)
    table.update(kv_scale_name_map(model))
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
    out = save_compressed(model, dst, table, config=config, copy_from=copy_from, max_shard_size=max_shard_size,
                          overwrite=overwrite, ignore=ignore, kv_cache_scheme=decoder.kv_cache_scheme(model),
                          transform_config=None if rotated is None else rotated.transform_config,
                          extra_tensors=None if rotated is None else rotated.online)
    return Path(out)
