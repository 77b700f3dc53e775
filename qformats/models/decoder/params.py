"""HF parameter names of the decoder family and loading: one table from HF state-dict names to `CausalLM` slots.

Mixture-of-experts layers: per-expert tensors (qwen2_moe / qwen3_moe "mlp.experts.{e}.gate_proj.weight", mixtral
"block_sparse_moe.experts.{e}.w1.weight") are slices of one stacked [E, in, out] kernel (`TensorSlot.expert`);
gpt_oss's fused 3-D tensors ("mlp.experts.gate_up_proj" [E, hidden, 2 inter], already [E, in, out]) are the stack.
gpt_oss checkpoints whose experts are per-expert Linears (llm-compressor's linearized layout, and qformats' reading of
the MXFP4 checkpoint) are put back into those fused stacks, packed weights staying packed (`fuse_linearized_experts`).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder.model import CausalLM, DecoderConfig, PackedEmbed, inv_freq
from qformats.nn import QuantizedMatmul
from qformats.qarray import QArray


class TensorSlot(NamedTuple):
    """Where an HF state-dict tensor goes: the Flax parameter path, whether it is transposed (torch Linear
    weight [out, in] -> Flax kernel [in, out]) and, for one expert's tensor of a stacked [E, ...] parameter, the
    expert index (None: the whole parameter)."""

    path: Tuple[Union[str, int], ...]
    transpose: bool = False
    expert: Optional[int] = None


def hf_tensor_names(config: DecoderConfig) -> Dict[str, TensorSlot]:
    """HF tensor name -> TensorSlot for every parameter of `CausalLM(config)`.

    Module paths are HF's with '.' -> '/': "model.layers.0.self_attn.q_proj.weight" is the kernel of
    `model/layers/0/self_attn/q_proj` (transposed); a norm's "weight" is the norm's `weight`;
    "model.embed_tokens.weight" is the embedding table [vocab, d] as is. Sparse layers of MoE models: the
    router ("mlp.gate", mixtral "block_sparse_moe.gate", gpt_oss "mlp.router" with its bias), each expert's
    projection e as slice e of the stacked kernel ("mlp.experts.{e}.gate_proj.weight" -> `mlp/experts/gate_proj`
    kernel[e], transposed), gpt_oss's fused stacks as they are, the shared expert and its gate (qwen2_moe).
    """
    out: Dict[str, TensorSlot] = {"model.embed_tokens.weight": TensorSlot(("model", "embed_tokens", "embedding"))}

    def linear(prefix: Tuple, bias: bool):
        name = ".".join(str(p) for p in prefix)
        out[name + ".weight"] = TensorSlot(prefix + ("kernel",), True)
        if bias:
            out[name + ".bias"] = TensorSlot(prefix + ("bias",))

    def norm(prefix: Tuple):
        out[".".join(str(p) for p in prefix) + ".weight"] = TensorSlot(prefix + ("weight",))

    def mla_attention(prefix: Tuple):
        m = config.mla
        if m.q_lora_rank is None:
            linear(prefix + ("q_proj",), False)
        else:
            linear(prefix + ("q_a_proj",), m.bias)
            norm(prefix + ("q_a_layernorm",))
            linear(prefix + ("q_b_proj",), False)
        linear(prefix + ("kv_a_proj_with_mqa",), m.bias)
        norm(prefix + ("kv_a_layernorm",))
        linear(prefix + ("kv_b_proj",), False)
        linear(prefix + ("o_proj",), m.bias)

    c = config
    for i in range(c.num_layers):
        lp = ("model", "layers", i)
        norm(lp + ("input_layernorm",))
        norm(lp + ("post_attention_layernorm",))
        if c.mla is not None:
            mla_attention(lp + ("self_attn",))
            names = ()
        else:
            names = ("q_proj", "k_proj", "v_proj")
        for name in names:
            linear(lp + ("self_attn", name), c.qkv_bias)
        if c.mla is None:
            linear(lp + ("self_attn", "o_proj"), c.o_bias)
        if c.qk_norm:
            norm(lp + ("self_attn", "q_norm"))
            norm(lp + ("self_attn", "k_norm"))
        if c.attention_sinks:
            out[".".join(str(p) for p in lp) + ".self_attn.sinks"] = TensorSlot(lp + ("self_attn", "sinks"))
        if c.moe_layers[i]:
            _moe_names(out, c, lp, linear)
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear(lp + ("mlp", name), c.mlp_bias)
    norm(("model", "norm"))
    if not c.tie_word_embeddings:
        linear(("lm_head",), False)
    return out


def _moe_names(out: Dict[str, TensorSlot], c: DecoderConfig, lp: Tuple, linear) -> None:
    m = c.moe
    bp = lp + (m.block_name,)
    base = ".".join(str(p) for p in bp)
    linear(bp + (m.router_name,), m.router_bias)
    if m.routing == "sigmoid_grouped":  # deepseek_v3's router also holds the score-correction bias
        out[f"{base}.{m.router_name}.e_score_correction_bias"] = TensorSlot(
            bp + (m.router_name, "e_score_correction_bias"))
    xp = bp + ("experts",)
    for proj in m.projections:
        if proj is None:
            continue
        if m.fused_gate_up:  # gpt_oss: [E, in, out] stacks (+ [E, out] biases) as stored
            out[f"{base}.experts.{proj}"] = TensorSlot(xp + (proj, "kernel"))
            if m.expert_bias:
                out[f"{base}.experts.{proj}_bias"] = TensorSlot(xp + (proj, "bias"))
            continue
        for e in range(m.num_experts):
            out[f"{base}.experts.{e}.{proj}.weight"] = TensorSlot(xp + (proj, "kernel"), True, e)
            if m.expert_bias:
                out[f"{base}.experts.{e}.{proj}.bias"] = TensorSlot(xp + (proj, "bias"), False, e)
    if m.shared_expert_intermediate_size:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear(bp + (m.shared_name, proj), c.mlp_bias)
        if m.shared_expert_gated:
            linear(bp + ("shared_expert_gate",), False)


def fused_expert_names(config: DecoderConfig) -> Dict[str, TensorSlot]:
    """gpt_oss: the names `fuse_linearized_experts` gives its fused stacks, as a Linear's ->
    "<P>.experts.gate_up_proj.weight" / ".bias" (and down_proj's) -> the stacked kernel [E, in, out] as is (no
    transpose) and the bias [E, out]. {} for other families."""
    m = config.moe
    if m is None or not m.fused_gate_up:
        return {}
    out: Dict[str, TensorSlot] = {}
    for i in range(config.num_layers):
        if not config.moe_layers[i]:
            continue
        xp = ("model", "layers", i, m.block_name, "experts")
        for proj in m.projections[1:]:
            base = ".".join(str(p) for p in xp + (proj,))
            out[base + ".weight"] = TensorSlot(xp + (proj, "kernel"))
            if m.expert_bias:
                out[base + ".bias"] = TensorSlot(xp + (proj, "bias"))
    return out


#: QArray strategies whose leaves (codes, scale, zero point, offset) hold one row per output feature (axis 0 of a
#: Flax kernel [in, out]: the leaves' leading axis), so rows of two such arrays interleave exactly.
_ROW_STRATEGIES = ("channel", "group", "tensor_group")


def _interleave_rows(gate: QArray, up: QArray, where: str) -> QArray:
    """The QArray of the kernel [K, 2N] whose column 2j is gate's column j and 2j+1 up's (gpt_oss's interleaved
    gate_up): every per-row leaf interleaved along its leading axis (bytes copied, nothing decoded); per-tensor
    leaves (a "tensor" scale, a tensor_group global scale) must be equal in gate and up."""
    s = gate.scheme
    if (s, gate.shape, gate.axis, gate.dtype) != (up.scheme, up.shape, up.axis, up.dtype) or gate.ndim != 2 \
            or gate.axis != 0:
        raise ModelError(f"{where}: gate_proj and up_proj must be packed alike (same scheme, [in, out] along axis "
                         f"0) to fuse into gate_up_proj; found {gate!r} and {up!r}")
    block_rows = s.strategy == "block" and tuple(s.block)[0] == 1
    if s.strategy not in _ROW_STRATEGIES + ("tensor",) and not block_rows:
        raise ModelError(f"{where}: strategy {s.strategy!r} (block {s.block}) scales span output rows, so gate_proj "
                         f"and up_proj cannot be interleaved into gpt_oss's fused gate_up_proj exactly; supported: "
                         f"{', '.join(_ROW_STRATEGIES)}, tensor (equal scales), block with one-row blocks")

    def rows(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return np.stack([a, b], axis=1).reshape((2 * a.shape[0],) + a.shape[1:])

    def same(a, b, what):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise ModelError(f"{where}: gate_proj and up_proj have different {what}s ({np.asarray(a).ravel()[:4]} "
                             f"vs {np.asarray(b).ravel()[:4]}); gpt_oss's fused gate_up_proj holds one")
        return np.asarray(a)

    per_tensor_scale = s.strategy == "tensor"
    scale = same(gate.scale, up.scale, "per-tensor scale") if per_tensor_scale else rows(gate.scale, up.scale)
    zp = None if gate.zero_point is None else (same(gate.zero_point, up.zero_point, "per-tensor zero point")
                                               if per_tensor_scale else rows(gate.zero_point, up.zero_point))
    gs = None if gate.global_scale is None else same(gate.global_scale, up.global_scale, "global scale")
    off = None if gate.offset is None else rows(gate.offset, up.offset)
    return QArray(rows(gate.codes, up.codes), scale, zp, gs, scheme=s, shape=(gate.shape[0], 2 * gate.shape[1]),
                  dtype=gate.dtype, axis=0, offset=off, compute_dtype=gate.compute_dtype)


def fuse_gpt_oss_experts(base: str, experts, expert_bias: bool) -> Dict[str, Dict[str, Any]]:
    """The one fuser of gpt_oss's experts: per-expert (gate_proj, up_proj, down_proj) modules of block `base`
    ("<P>.experts"), expert e at experts[e], each {"weight": QArray [in, out] along axis 0, or a dense torch
    [out, in] array; "bias": [out] when `expert_bias`} -> {"<base>.gate_up_proj": {"weight": [E, in, 2 out],
    "bias"?: [E, 2 out]}, "<base>.down_proj": {"weight": [E, in, out], "bias"?: [E, out]}}:

        gate_up[e][:, 2j] = gate_e[:, j],  gate_up[e][:, 2j + 1] = up_e[:, j],  down[e] = down_e   (biases alike)

    Packed weights stay packed (QArray leaves' rows interleaved and stacked along a new leading expert axis into
    jax arrays, bytes copied; `_interleave_rows`); dense weights are transposed to [in, out], interleaved and
    stacked (numpy, their dtype kept). Raises ModelError naming the module: packed and dense experts mixed, experts
    packed differently or of different shapes, a packed layout whose rows cannot interleave exactly."""
    packed = {isinstance(t["weight"], QArray) for g, u, d in experts for t in (g, u, d)}
    if len(packed) != 1:
        raise ModelError(f"{base}: some experts are packed, others dense; expected all of one kind")
    fused_gu, fused_dn, bias_gu, bias_dn = [], [], [], []
    for e, (g, u, d) in enumerate(experts):
        if True in packed:
            fused_gu.append(_interleave_rows(g["weight"], u["weight"], f"{base}.{e}"))
            fused_dn.append(d["weight"])
        else:
            gt, ut = np.asarray(g["weight"]).T, np.asarray(u["weight"]).T  # [in, out]
            if gt.shape != ut.shape:
                raise ModelError(f"{base}.{e}: gate_proj {gt.shape[::-1]} and up_proj {ut.shape[::-1]} differ")
            fused_gu.append(np.stack([gt, ut], axis=2).reshape(gt.shape[0], 2 * gt.shape[1]))
            fused_dn.append(np.asarray(d["weight"]).T)
        if expert_bias:
            gb, ub = np.asarray(g["bias"]), np.asarray(u["bias"])
            if gb.shape != ub.shape or gb.ndim != 1:
                raise ModelError(f"{base}.{e}: gate_proj bias {gb.shape} and up_proj bias {ub.shape}: expected "
                                 f"two [out] vectors")
            bias_gu.append(np.stack([gb, ub], axis=1).reshape(-1))
            bias_dn.append(np.asarray(d["bias"]))
    out: Dict[str, Dict[str, Any]] = {}
    for proj, parts, biases in (("gate_up_proj", fused_gu, bias_gu), ("down_proj", fused_dn, bias_dn)):
        name = f"{base}.{proj}"
        if True in packed:
            metas = {(q.scheme, q.shape, q.axis, q.dtype) for q in parts}
            if len(metas) != 1:
                raise ModelError(f"{name}: the experts' packed weights differ in scheme or shape: "
                                 f"{sorted(map(str, metas))[:3]}")
            w = jax.tree.map(lambda *leaves: jnp.asarray(np.stack([np.asarray(x) for x in leaves])), *parts)
        else:
            if len({p.shape for p in parts}) != 1:
                raise ModelError(f"{name}: the experts' weights differ in shape: {sorted({p.shape for p in parts})}")
            w = np.stack(parts)
        out[name] = {"weight": w}
        if biases:
            if len({b.shape for b in biases}) != 1:
                raise ModelError(f"{name}: the experts' biases differ in shape")
            out[name]["bias"] = np.stack(biases)
    return out


_INPUT_SCALES = ("input_scale", "input_global_scale")


def fuse_linearized_experts(config: DecoderConfig, modules: Mapping[str, Mapping[str, Any]]
                            ) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, List[str]]]:
    """gpt_oss: per-expert Linear modules (llm-compressor's linearized names "<P>.experts.{e}.gate_proj" /
    "up_proj" / "down_proj", each {"weight": QArray [in, out] along axis 0, or a dense torch [out, in] array;
    "bias"?: [out]}) -> the fused stacks of the model, "<P>.experts.gate_up_proj" and "<P>.experts.down_proj"
    (`fused_expert_names`), each {"weight": [E, in, out], "bias"?: [E, out]}:

        gate_up[e][:, 2j] = gate_e[:, j],  gate_up[e][:, 2j + 1] = up_e[:, j],  down[e] = down_e

    gpt_oss's interleaved gate / up columns (transformers' `gate_up[..., ::2]` / `[..., 1::2]`), per layer by
    `fuse_gpt_oss_experts` (packed weights stay packed: a `qformats.nn.QExperts` stack). Returns (modules with the
    per-expert entries replaced, fused module -> the per-expert modules it
    came from). Other families, and layers whose experts are stored fused already, are returned unchanged.

    Static input scales (`input_scale`, `input_global_scale`: FP8 / NVFP4 checkpoints) are stacked per fused module
    ([E, ...]; gate's and up's must be equal, they observe one input).

    Raises ModelError naming the module: some but not all 3·E per-expert modules of a layer, tensors other than
    weight / bias / static input scales, packed and dense experts mixed, experts packed differently, or a packed layout whose rows
    cannot interleave exactly (`_interleave_rows`)."""
    m = config.moe
    out = {k: dict(v) for k, v in modules.items()}
    sources: Dict[str, List[str]] = {}
    if m is None or not m.fused_gate_up:
        return out, sources
    e_n = m.num_experts
    for i in range(config.num_layers):
        if not config.moe_layers[i]:
            continue
        base = f"model.layers.{i}.{m.block_name}.experts"
        want = [f"{base}.{e}.{p}" for e in range(e_n) for p in ("gate_proj", "up_proj", "down_proj")]
        have = [n for n in want if n in out]
        stray = sorted(n for n in out if n.startswith(base + ".") and n not in want
                       and n.split(".")[len(base.split("."))].isdigit())
        if stray:
            raise ModelError(f"{base}: per-expert modules {stray[:4]} are not gpt_oss experts (expected "
                             f"experts 0..{e_n - 1} with gate_proj, up_proj, down_proj)")
        if not have:
            continue
        if len(have) != len(want):
            miss = [n for n in want if n not in out]
            raise ModelError(f"{base}: {len(miss)} of its {len(want)} per-expert modules missing: {miss[:6]}")
        for n in want:
            extra = sorted(set(out[n]) - {"weight", "bias"} - set(_INPUT_SCALES))
            if extra or "weight" not in out[n] or (("bias" in out[n]) != m.expert_bias):
                raise ModelError(f"{n}: expected tensors weight{' and bias' if m.expert_bias else ''} (a gpt_oss "
                                 f"expert; static input_scale / input_global_scale allowed), found {sorted(out[n])}")
        experts = [tuple(out.pop(f"{base}.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
                   for e in range(e_n)]
        out.update(fuse_gpt_oss_experts(base, experts, m.expert_bias))
        for local in _INPUT_SCALES:  # static input scales: gate's and up's must agree (one input), stacked [E, ...]
            have = [local in t for g, u, d in experts for t in (g, u, d)]
            if not any(have):
                continue
            if not all(have):
                raise ModelError(f"{base}: {local} on some experts' projections only")
            for e, (g, u, _) in enumerate(experts):
                if not np.array_equal(np.asarray(g[local]), np.asarray(u[local])):
                    raise ModelError(f"{base}.{e}: gate_proj and up_proj have different {local}s; gpt_oss's fused "
                                     "gate_up_proj reads one input with one scale")
            out[f"{base}.gate_up_proj"][local] = np.stack([np.asarray(g[local]) for g, _, _ in experts])
            out[f"{base}.down_proj"][local] = np.stack([np.asarray(d[local]) for _, _, d in experts])
        for proj, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            sources[f"{base}.{proj}"] = [f"{base}.{e}.{p}" for e in range(e_n) for p in projs]
    return out, sources


def module_path(hf_module: str) -> str:
    """HF module name -> Flax module path ("model.layers.0.mlp.up_proj" -> "model/layers/0/mlp/up_proj")."""
    return hf_module.replace(".", "/")


def resolve_path(model: nnx.Module, path: Tuple[Union[str, int], ...]):
    """The node of `model` at `path` (attribute names and list indices, as in `TensorSlot.path`)."""
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def hf_tensors(model: CausalLM) -> Dict[str, np.ndarray]:
    """HF tensor name -> the value of a dense `model`'s parameter in HF layout (the inverse of `load_hf_tensors`):
    for each `hf_tensor_names(model.config)` slot, W = kernel^T (a view) where the slot is transposed (torch Linear
    weight [out, in] from the Flax kernel [in, out]), the value as is otherwise."""
    out = {}
    for name, slot in hf_tensor_names(model.config).items():
        a = np.asarray(resolve_path(model, slot.path).get_value())
        if slot.expert is not None:
            a = a[slot.expert]
        out[name] = a.T if slot.transpose else a
    return out


def _rotary_name(name: str) -> bool:
    return name.endswith(".rotary_emb.inv_freq")


def load_hf_tensors(model: CausalLM, tensors: Mapping[str, Any]) -> CausalLM:
    """Fill `model` in place from HF state-dict tensors (numpy or jax arrays by HF name); returns `model`.

    Every parameter named by `hf_tensor_names` must be given with its HF shape (Linear weights [out, in], stored
    transposed as the [in, out] kernel; cast to the parameter's dtype). Layers already swapped for packed
    `QLinear`s (e.g. by `qformats.nn.load_quantized` from a compressed-tensors checkpoint), or an embedding already
    swapped for a packed `model.PackedEmbed`, take no dense weight or bias here. Tensors the model has no place for
    are an error, except two that carry no information and are checked instead: a tied model's "lm_head.weight"
    must equal the embedding, and old checkpoints' "*.rotary_emb.inv_freq" must equal the config's inverse
    frequencies. DeepSeek's multi-token-prediction layers
    (`config.mtp_layers`, "model.layers.61.*" in DeepSeek-V3) are skipped with a warning that names them.

    Raises ModelError naming the missing, unexpected or misshapen tensors; the model is unchanged then.
    """
    slots = hf_tensor_names(model.config)
    expected: Dict[str, Tuple[TensorSlot, nnx.Variable]] = {}
    packed = []
    for name, slot in slots.items():
        owner = resolve_path(model, slot.path[:-1])
        if isinstance(owner, (QuantizedMatmul, PackedEmbed)):
            packed.append(name)
            continue
        expected[name] = (slot, getattr(owner, slot.path[-1]))
    missing = [n for n in expected if n not in tensors]
    unexpected, checks, skipped_mtp = [], [], []
    for n in tensors:
        if n in expected:
            continue
        if n in packed:
            unexpected.append(f"{n} (its module is already packed)")
        elif n == "lm_head.weight" and model.config.tie_word_embeddings:
            checks.append(n)
        elif _rotary_name(n):
            checks.append(n)
        elif mtp_layer(model.config, n) is not None:
            skipped_mtp.append(n)
        else:
            unexpected.append(n)
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
    bad_shape = []
    for n, (slot, var) in expected.items():
        if n not in tensors:
            continue
        want = tuple(var.get_value().shape)[(0 if slot.expert is None else 1):]
        want = want[::-1] if slot.transpose else want
        got = tuple(np.shape(tensors[n]))
        if got != want:
            bad_shape.append(f"{n} {got} (expected {want})")
    if bad_shape:
        problems.append(f"{len(bad_shape)} with the wrong shape: {_listing(bad_shape)}")
    for n in checks:
        if n == "lm_head.weight":
            if "model.embed_tokens.weight" in tensors and not np.array_equal(
                    np.asarray(tensors[n]), np.asarray(tensors["model.embed_tokens.weight"])):
                problems.append("lm_head.weight differs from model.embed_tokens.weight but the config ties them "
                                "(tie_word_embeddings)")
        else:
            want = inv_freq(model.config)
            got = np.asarray(tensors[n], np.float32)
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=0):
                problems.append(f"{n} does not equal the inverse frequencies of the config's rope "
                                f"({model.config.rope})")
    if problems:
        raise ModelError(f"load_hf_tensors ({model.config.model_type}): " + "; ".join(problems))
    stacks: Dict[int, Tuple[nnx.Variable, Dict[int, str]]] = {}
    for n, (slot, var) in expected.items():
        if slot.expert is not None:  # one expert's slice: set once the stack is complete
            stacks.setdefault(id(var), (var, {}))[1][slot.expert] = n
            continue
        value = jnp.asarray(tensors[n], dtype=var.get_value().dtype)
        var.set_value(value.T if slot.transpose else value)
    for var, names in stacks.values():
        dt = var.get_value().dtype
        parts = []
        for e in range(len(names)):
            a = np.asarray(tensors[names[e]])
            parts.append(a.T if slots[names[e]].transpose else a)
        var.set_value(jnp.asarray(np.stack(parts), dtype=dt))
    if skipped_mtp:
        c = model.config
        warnings.warn(f"load_hf_tensors ({c.model_type}): skipped {len(skipped_mtp)} tensors of the "
                      f"multi-token-prediction layer(s) model.layers.{c.num_layers}"
                      f"{'' if c.mtp_layers == 1 else f'..{c.num_layers + c.mtp_layers - 1}'} "
                      f"(num_nextn_predict_layers = {c.mtp_layers}): next-token logits do not use them and this "
                      "model does not run speculative multi-token prediction", stacklevel=2)
    return model


def mtp_layer(config: DecoderConfig, name: str):
    """The index of the multi-token-prediction layer (num_hidden_layers .. + num_nextn_predict_layers - 1) whose
    tensor `name` is ("model.layers.61.eh_proj.weight" -> 61 for DeepSeek-V3), or None."""
    if not config.mtp_layers or not name.startswith("model.layers."):
        return None
    head = name[len("model.layers."):].split(".", 1)[0]
    if not head.isdigit():
        return None
    i = int(head)
    return i if config.num_layers <= i < config.num_layers + config.mtp_layers else None


def _listing(names: List[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def interleave_gate_up(gate: QArray, up: QArray, where: str) -> QArray:
    """gpt_oss's fused gate_up QArray [K, 2N] of gate_proj's and up_proj's [K, N] ones: column 2j = gate's j,
    2j + 1 = up's j (`_interleave_rows`: per-row leaves interleaved, per-tensor leaves equal in both)."""
    return _interleave_rows(gate, up, where)


def split_gate_up(q: QArray, where: str) -> Tuple[QArray, QArray]:
    """The inverse of `interleave_gate_up`: (gate_proj's, up_proj's) QArray [K, N] of a fused gate_up QArray [K, 2N]
    (axis 0): every per-row leaf's even rows and odd rows (bytes copied), per-tensor leaves (a "tensor" scale, a
    tensor_group global scale) given to both. ModelError for a layout whose scales span rows (`_ROW_STRATEGIES`)."""
    s = q.scheme
    if q.ndim != 2 or q.axis != 0 or q.shape[1] % 2 or s.strategy not in _ROW_STRATEGIES + ("tensor",):
        raise ModelError(f"{where}: expected a fused gate_up QArray [in, 2 out] along axis 0 with scales per output "
                         f"row ({', '.join(_ROW_STRATEGIES)}) or per tensor, found {q!r}")

    def part(j):
        rows = lambda a: None if a is None else np.asarray(a)[j::2]  # noqa: E731
        per_tensor = s.strategy == "tensor"
        zp = None if q.zero_point is None else (np.asarray(q.zero_point) if per_tensor else rows(q.zero_point))
        return QArray(rows(q.codes), np.asarray(q.scale) if per_tensor else rows(q.scale), zp,
                      None if q.global_scale is None else np.asarray(q.global_scale), scheme=s,
                      shape=(q.shape[0], q.shape[1] // 2), dtype=q.dtype, axis=0, offset=rows(q.offset),
                      compute_dtype=q.compute_dtype)

    return part(0), part(1)
