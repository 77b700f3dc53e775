"""HF parameter names of the decoder family and loading: one table from HF state-dict names to `CausalLM` slots.

Mixture-of-experts layers: per-expert tensors (qwen2_moe / qwen3_moe "mlp.experts.{e}.gate_proj.weight", mixtral
"block_sparse_moe.experts.{e}.w1.weight") are slices of one stacked [E, in, out] kernel (`TensorSlot.expert`);
gpt_oss's fused 3-D tensors ("mlp.experts.gate_up_proj" [E, hidden, 2 inter], already [E, in, out]) are the stack.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder.model import CausalLM, DecoderConfig, PackedEmbed, inv_freq
from qformats.nn import QuantizedMatmul


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
