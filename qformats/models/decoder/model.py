"""The llama / mistral / qwen2 / qwen3 causal-LM family (and its MoE kin) in Flax NNX, from an HF config.json, with a KV cache.

One skeleton covers the four HF families (they differ only in config switches):

    embed_tokens -> L x [x + o(attn(rope(q), rope(k), v)); x + down(silu(gate(x)) * up(x))] -> norm -> lm_head

with RMSNorm before each sub-block, grouped-query attention (`num_key_value_heads` <= `num_attention_heads`),
q/k/v biases (qwen2, or `attention_bias`), per-head q/k RMSNorm (qwen3), sliding-window layers (mistral,
qwen2/qwen3 with `use_sliding_window`) and tied input/output embeddings. The mixture-of-experts kin (qwen2_moe,
qwen3_moe, mixtral, gpt_oss) share this skeleton: their sparse layers put a `moe.MoEBlock` (router, stacked experts,
shared expert) in place of the MLP, and gpt_oss adds attention sinks and YaRN RoPE. Every module sits at its HF path
(`model/layers/{i}/self_attn/q_proj`, `model/layers/{i}/mlp/gate_proj`, `lm_head`, ...), so HF tensor names,
compressed-tensors module names and `qformats.nn` rules map 1:1 ('.' <-> '/').

The KV cache is an explicit pytree (`KVCache`) passed in and out of `CausalLM.__call__`; prefill and decode are
the same function (positions start at `cache.length`), so both jit and `qformats.models.generate` runs them in one
compiled loop. This module is the model alone (no file I/O, no HF names): `params` maps HF state-dict tensors
onto it, and `kv_cache`, `rotate`, `sharding` and `rules` adapt it (KV-cache quantization, online rotations, the
tensor-parallel layout, the `qformats.nn` rules of its projections).

deepseek_v3 shares the skeleton with `mla.MLAttention` (multi-head latent attention, its latent cache) in place
of `Attention`, dense MLPs on the first `first_k_dense_replace` layers and `moe.MoEBlock` ("sigmoid_grouped"
routing, shared experts) on the others; YaRN is a `RopeConfig` type of the whole family.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.kv_cache import KVCacheScheme, dequantize_kv, dynamic_scale, quantize_kv
from qformats.models.decoder.layers import (RMSNorm, RopeConfig, _project, _rotate, apply_rope, rope_tables,
                                             write_cache)
from qformats.models.decoder.moe import MOE_MODEL_TYPES, MoEBlock, MoEConfig, moe_from_hf
from qformats.models.decoder.scan import ScannedLayers
from qformats.models.decoder.sharding import KV_CACHE_AXES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3") + MOE_MODEL_TYPES + ("deepseek_v3",)
ROPE_TYPES = ("default", "llama3", "yarn")
# transformers' config-class defaults for keys a config.json may leave out (others are required)
_HEAD_DIM_DEFAULT = {"qwen3": 128, "gpt_oss": 64}
_KV_HEADS_DEFAULT = {"mistral": 8, "mixtral": 8, "gpt_oss": 8, "qwen3_moe": 4, "qwen2_moe": 16}
_RMS_EPS_DEFAULT = {"mixtral": 1e-5, "gpt_oss": 1e-5}
_THETA_DEFAULT = {"mixtral": 1e6, "gpt_oss": 150000.0}
_MISTRAL_SLIDING_WINDOW_DEFAULT = 4096
_QWEN_SLIDING_WINDOW_DEFAULT = 4096
_QWEN_MAX_WINDOW_LAYERS_DEFAULT = 28


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The hyper-parameters of one llama / mistral / qwen2 / qwen3 model (frozen, hashable).

    `sliding_windows[i]` is layer i's attention window (None: full causal attention): query position p sees
    key positions s with p - window < s <= p. `qkv_bias` / `o_bias` / `mlp_bias`: which projections have a
    bias. `qk_norm`: per-head RMSNorm on queries and keys before RoPE (qwen3). `dtype`: the checkpoint's stored
    dtype name from config.json ("bfloat16", ...), informational (the model's dtype is chosen at construction).
    `moe`: the sparse block of mixture-of-experts models (`moe.MoEConfig`), used on the layers flagged in
    `moe_layers` (the others have a dense MLP of `intermediate_size`). `attention_sinks`: a learned per-head
    logit joins each softmax and is dropped after it (gpt_oss).
    `mla`: a `qformats.models.decoder.mla.MLAConfig` for multi-head latent attention (deepseek_v3; `head_dim` is
    then its rotary head dim, qk_rope_head_dim, as in transformers). `mtp_layers`: DeepSeek's multi-token-prediction
    layers (num_nextn_predict_layers) the checkpoint holds after the last layer; not part of this model (next-token
    logits do not use them) and their tensors are skipped by name, with a warning, when loading.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: Tuple[Optional[int], ...] = ()
    max_position_embeddings: int = 2048
    dtype: Optional[str] = None
    moe: Optional[MoEConfig] = None
    moe_layers: Tuple[bool, ...] = ()
    attention_sinks: bool = False
    mla: Optional[Any] = None
    mtp_layers: int = 0

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if not self.moe_layers or (self.moe is None and not any(self.moe_layers)):  # dense: one flag per layer
            object.__setattr__(self, "moe_layers", (self.moe is not None,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers or (any(self.moe_layers) and self.moe is None):
            raise ModelError(f"DecoderConfig: moe_layers {self.moe_layers} must flag each of the {self.num_layers} "
                             "layers, sparse ones only with a MoEConfig")
        if len(self.sliding_windows) != self.num_layers:
            raise ModelError(f"DecoderConfig: {len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"DecoderConfig: num_attention_heads = {self.num_heads} is not a multiple of "
                             f"num_key_value_heads = {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelError(f"DecoderConfig: head_dim = {self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "DecoderConfig":
        """Read an HF `config.json` dict of model_type llama, mistral, qwen2, qwen3, or the mixture-of-experts
        qwen2_moe, qwen3_moe, mixtral, gpt_oss (transformers' defaults for keys it leaves out). Anything this
        model would not compute as transformers does is a ModelError: another model_type, an activation other
        than silu, a rope type it lacks, a partial rotary factor, unknown layer types."""
        mt = cfg.get("model_type")
        if mt == "deepseek_v3":
            return _deepseek_v3_from_hf(cls, cfg)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelError(f"config.json: model_type {mt!r} is not supported; supported model types: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")

        def need(key):
            if cfg.get(key) is None:
                raise ModelError(f"config.json ({mt}): missing {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None:
            kv_heads = _KV_HEADS_DEFAULT.get(mt, heads)
        head_dim = cfg.get("head_dim") or _HEAD_DIM_DEFAULT.get(mt) or hidden // heads
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"config.json ({mt}): hidden_act {act!r} is not supported (only 'silu')")
        max_pos = int(cfg.get("max_position_embeddings") or 2048)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        moe, sparse = (None, ())
        if mt in MOE_MODEL_TYPES:
            moe, sparse = moe_from_hf(cfg, mt, layers)
        attn_bias = bool(cfg.get("attention_bias", mt == "gpt_oss"))
        return cls(
            model_type=mt, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=layers, num_heads=heads,
            num_kv_heads=int(kv_heads), head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", _RMS_EPS_DEFAULT.get(mt, 1e-6))),
            rope=_rope_from_hf(cfg, mt, max_pos),
            qkv_bias=mt == "qwen2" or (mt == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
            or (mt in ("llama", "qwen3", "qwen3_moe", "gpt_oss") and attn_bias),
            o_bias=mt in ("llama", "qwen3", "qwen3_moe", "gpt_oss") and attn_bias,
            mlp_bias=mt == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=_windows_from_hf(cfg, mt, layers),
            max_position_embeddings=max_pos, dtype=None if dtype is None else str(dtype),
            moe=moe, moe_layers=sparse, attention_sinks=mt == "gpt_oss")


def _deepseek_v3_from_hf(cls, cfg: Mapping[str, Any]) -> "DecoderConfig":
    """A deepseek_v3 config.json (transformers' DeepseekV3Config defaults for absent keys). Refused: keys of the
    original DeepSeek code that transformers ignores but which would change the computation if not their
    DeepSeek-V3 values (scoring_func 'sigmoid', topk_method 'noaux_tc', moe_layer_freq 1), and
    num_key_value_heads != num_attention_heads (transformers' MLA only works with one key/value head per query)."""
    from qformats.models.decoder.mla import MLAConfig  # mla builds on this module's layers

    mt = "deepseek_v3"
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1),
                      ("hidden_act", "silu")):
        if key in cfg and cfg[key] != want:
            raise ModelError(f"config.json ({mt}): {key} = {cfg[key]!r} is not supported (transformers' DeepSeek-V3 "
                             f"computes {key} = {want!r})")
    hidden = int(cfg.get("hidden_size", 7168))
    heads = int(cfg.get("num_attention_heads", 128))
    kv_heads = cfg.get("num_key_value_heads") or heads
    if int(kv_heads) != heads:
        raise ModelError(f"config.json ({mt}): num_key_value_heads = {kv_heads} differs from num_attention_heads = "
                         f"{heads}; multi-head latent attention expands one key and value per query head")
    layers = int(cfg.get("num_hidden_layers", 61))
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    rope = _rope_from_hf(cfg, mt, max_pos)
    mla = MLAConfig.from_hf(cfg, rope)
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1)) or 0
    moe, sparse = _deepseek_moe_from_hf(cfg, layers)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return cls(
        model_type=mt, vocab_size=int(cfg.get("vocab_size", 129280)), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size", 18432)), num_layers=layers, num_heads=heads,
        num_kv_heads=heads, head_dim=mla.qk_rope_head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos, dtype=None if dtype is None else str(dtype), mla=mla, mtp_layers=int(mtp),
        moe=moe, moe_layers=sparse)


def _deepseek_moe_from_hf(cfg: Mapping[str, Any], layers: int) -> Tuple[Optional[MoEConfig], Tuple[bool, ...]]:
    """DeepSeek-V3's sparse block and schedule: layers i >= first_k_dense_replace are sparse; n_routed_experts
    experts of moe_intermediate_size, num_experts_per_tok of them per token by group-limited sigmoid routing
    (n_group, topk_group, norm_topk_prob, routed_scaling_factor), plus n_shared_experts fused into one ungated
    MLP of n_shared_experts x moe_intermediate_size ("shared_experts")."""
    def count(key, default):
        v = cfg.get(key, default)
        if v is None or int(v) < 0:
            raise ModelError(f"config.json (deepseek_v3): {key} must be a non-negative integer, got {v!r}")
        return int(v)

    first = count("first_k_dense_replace", 3)
    sparse = tuple(i >= first for i in range(layers))
    if not any(sparse):
        return None, sparse
    inter = count("moe_intermediate_size", 2048)
    return MoEConfig(
        count("n_routed_experts", 256), count("num_experts_per_tok", 8), inter, routing="sigmoid_grouped",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), weights_float32=True,
        n_group=count("n_group", 8), topk_group=count("topk_group", 4),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        shared_expert_intermediate_size=inter * count("n_shared_experts", 1), shared_expert_gated=False,
        shared_name="shared_experts"), sparse


def _rope_from_hf(cfg: Mapping[str, Any], mt: str, max_pos: int) -> RopeConfig:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rp, Mapping):
        raise ModelError(f"config.json ({mt}): rope_parameters must be a dict, got {rp!r}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelError(f"config.json ({mt}): rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf is not None and float(prf) != 1.0:
        raise ModelError(f"config.json ({mt}): partial_rotary_factor {prf} is not supported (only 1.0)")
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", _THETA_DEFAULT.get(mt, 10000.0))))
    if rope_type == "default":
        return RopeConfig("default", theta)
    if rope_type == "yarn":
        return _yarn_from_hf(cfg, rp, mt, theta, max_pos)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if rp.get(k) is None]
    if missing:
        raise ModelError(f"config.json ({mt}): llama3 rope parameters lack {', '.join(missing)}")
    return RopeConfig("llama3", theta, float(rp["factor"]), float(rp["low_freq_factor"]),
                      float(rp["high_freq_factor"]), int(rp.get("original_max_position_embeddings") or max_pos))


def _yarn_from_hf(cfg: Mapping[str, Any], rp: Mapping[str, Any], mt: str, theta: float, max_pos: int) -> RopeConfig:
    """YaRN parameters as transformers reads them: `factor` may be null (then max_position_embeddings /
    original_max_position_embeddings), a top-level `original_max_position_embeddings` wins over the rope dict's,
    which defaults to max_position_embeddings; beta_fast / beta_slow default (also when 0 or null) to 32 / 1."""
    if "factor" not in rp:
        raise ModelError(f"config.json ({mt}): yarn rope parameters lack 'factor'")
    unknown = sorted(set(rp) - {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                "truncate", "partial_rotary_factor"})
    if unknown:
        raise ModelError(f"config.json ({mt}): yarn rope parameters {', '.join(unknown)} are not supported")
    original = cfg.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or max_pos
    factor = rp["factor"]
    factor = float(max_pos / int(original) if factor is None else factor)
    if factor < 1.0:
        raise ModelError(f"config.json ({mt}): yarn rope factor {factor} must be >= 1")

    def opt(key):
        return None if rp.get(key) is None else float(rp[key])

    return RopeConfig("yarn", theta, factor, original_max_position_embeddings=int(original),
                      beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
                      mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
                      attention_factor=opt("attention_factor"), truncate=bool(rp.get("truncate", True)))


def _windows_from_hf(cfg: Mapping[str, Any], mt: str, layers: int) -> Tuple[Optional[int], ...]:
    """Per-layer attention windows as transformers computes them (masking_utils' sliding_window_overlay)."""
    if mt == "llama":
        return (None,) * layers
    if mt in ("mistral", "mixtral"):  # every layer windowed unless sliding_window is null
        w = cfg.get("sliding_window", _MISTRAL_SLIDING_WINDOW_DEFAULT if mt == "mistral" else None)
        return (None if w is None else int(w),) * layers
    if mt == "qwen3_moe":  # every layer windowed with use_sliding_window (its attention ignores layer_types)
        w = cfg.get("sliding_window", _QWEN_SLIDING_WINDOW_DEFAULT) if cfg.get("use_sliding_window", False) else None
        return (None if w is None else int(w),) * layers
    if mt == "gpt_oss":
        w = cfg.get("sliding_window", 128)
    else:
        w = cfg.get("sliding_window", _QWEN_SLIDING_WINDOW_DEFAULT) if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS_DEFAULT))
        if mt == "gpt_oss":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif mt == "qwen2_moe":
            types = ["sliding_attention" if w is not None and (i + 1) % 2 and i < first else "full_attention"
                     for i in range(layers)]
        else:
            types = ["sliding_attention" if w is not None and i >= first else "full_attention"
                     for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ModelError(f"config.json ({mt}): layer_types must list 'full_attention' / 'sliding_attention' for each "
                         f"of the {layers} layers, got {types!r}")
    return tuple(int(w) if t == "sliding_attention" and w is not None else None for t in types)


# ----------------------------------------------------------------------------------------------- cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for positions 0 .. length-1, in buffers of `max_len` positions.

    keys[i], values[i]: [batch, num_kv_heads, max_len, head_dim] (after RoPE, for keys); length: the number of
    positions filled, i.e. the position of the next token: an int32 scalar (the same for every row) or int32
    [batch] (per row: a ragged batch, each row's tokens at cache places 0 .. length[b] - 1, as it would be alone).

    A model whose layers were grouped by `qformats.models.decoder.scan.scan_layers` holds one entry per run of
    layers instead, stacked on a leading axis: keys[r], values[r] [layers_in_run, batch, num_kv_heads, max_len,
    head_dim] (`CausalLM.init_cache` makes the right kind).

    With KV-cache quantization (`enable_kv_cache_quantization`) keys/values hold uint8 fp8_e4m3fn codes
    (`qformats.kv_cache`); a dynamic scheme adds key_scales[i] / value_scales[i]: float32 [max_len, 1] (stacked:
    [layers_in_run, max_len, 1]), the scale of the block each position was written in (scalar length only: the
    block's scale is shared by its rows). Static scales live on the attention modules.

    Multi-head latent attention (deepseek_v3, `mla`): keys[i] holds the normed latent [batch, 1, max_len,
    kv_lora_rank] and values[i] the post-RoPE shared rope key [batch, 1, max_len, qk_rope_head_dim], as
    transformers caches them.
    """

    keys: Tuple[jax.Array, ...]
    values: Tuple[jax.Array, ...]
    length: jax.Array
    key_scales: Optional[Tuple[jax.Array, ...]] = None
    value_scales: Optional[Tuple[jax.Array, ...]] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (codes or values, plus per-position scales)."""
        leaves = jax.tree_util.tree_leaves((self.keys, self.values, self.key_scales, self.value_scales))
        return int(sum(a.size * a.dtype.itemsize for a in leaves))

    @property
    def max_len(self) -> int:
        return int(self.keys[0].shape[-2])


SEQUENCE_LOOP_BACKENDS = ("cpu",)
"""JAX backends on which `Attention` over several sequences of several tokens (a prefill, a calibration or
perplexity batch) runs one sequence after the other (`jax.lax.map`) instead of all at once. The same products: the
results differ by float32 roundoff only (XLA compiles the loop body apart from the batch; ~3e-6 at most on a
SmolLM2 layer's output; tests/qformats/models/decoder/test_attention_loop.py). Why, on XLA:CPU: a whole batch's
scores and probabilities ([B, G, r * T, S] float32, 18 MiB for 8 x 256 tokens of SmolLM2) are mapped and zeroed
afresh by every run; one sequence's fit under malloc's mmap threshold and stay in the heap and in cache. Measured
(2 cores): SmolLM2's attention for 8 x 256 tokens 44-52 -> 21-26 ms, page faults 4x fewer; BENCHMARKS.md for a
whole calibration. Elsewhere (GPU: a loop would serialize what the device runs side by side) the batch stays
whole; an empty tuple turns the loop off."""


CAUSAL_BLOCK = 64
"""Query block of `Attention` without a cache on `SEQUENCE_LOOP_BACKENDS` (`_attend`'s `block`): the queries of
columns [c0, c0 + CAUSAL_BLOCK) take the keys of columns [0, c0 + CAUSAL_BLOCK) only, about 5/8 of the score and
value products for T = 256 (the keys left out would get probability exactly 0). Measured (2 cores, SmolLM2, 8 x 256
tokens): attention 15.6 -> 10.6 ms a batch; a Python-docs GPTQ calibration's bytes unchanged (`cmp`). None: off."""


def _attend_all(q, k, v, mask, scale, sink, dtype, rows: str):
    """`_attend` on all its keys; `rows` names the query axes before D ("bgm", or "bgrc" for [B, G, r, T, D])."""
    scores = jnp.einsum(f"{rows}d,bgsd->{rows}s", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * scale, jnp.finfo(jnp.float32).min)
    if sink is not None:
        full = jnp.concatenate([scores, jnp.broadcast_to(sink, scores.shape[:-1] + (1,))], axis=-1)
        probs = jax.nn.softmax(full, axis=-1)[..., :-1].astype(dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum(f"{rows}s,bgsd->{rows}d", probs, v.astype(dtype))


def _attend(q, k, v, mask, *, scale, sink, dtype, block: Optional[int] = None):
    """softmax(q k^T * scale, masked) v for query rows q [B, G, M, D] (M = r * T: the r query heads of each KV head
    stacked), keys / values k, v [B, G, S, D], mask [B, 1, M, S] or [M, S] (True = visible; masked logits ->
    float32's minimum). Scores and softmax in float32; `sink` [1, G, M, 1] (or None): one more logit per row that
    joins each softmax and whose probability is dropped after it. Returns [B, G, M, D] in `dtype`.

    `block` (S = T, and a mask causal by column: query column c sees no key column > c): the queries of columns
    [c0, c1) (c1 = min(c0 + block, T)) against the keys of columns [0, c1) only; the keys left out are masked for
    them, so the same softmax (they would get probability exactly 0) for fewer products."""
    s = k.shape[2]
    if block is None or s <= block or q.shape[2] != s * (q.shape[2] // s):
        return _attend_all(q, k, v, mask, scale, sink, dtype, "bgm")
    b, g, m, d = q.shape
    r = m // s
    q5 = q.reshape(b, g, r, s, d)  # rows (r, t)
    mask5 = mask.reshape(mask.shape[:-2] + (r, s, s))
    sink5 = None if sink is None else sink.reshape(sink.shape[:2] + (r, s, 1))
    outs = []
    for c0 in range(0, s, block):
        c1 = min(c0 + block, s)
        outs.append(_attend_all(q5[:, :, :, c0:c1], k[:, :, :c1], v[:, :, :c1], mask5[..., c0:c1, :c1], scale,
                                None if sink5 is None else sink5[..., c0:c1, :], dtype, "bgrc"))
    return jnp.concatenate(outs, axis=3).reshape(b, g, m, d)


# ----------------------------------------------------------------------------------------------- modules

class Attention(nnx.Module):
    """Grouped-query attention with RoPE: softmax(q k^T / sqrt(head_dim) + mask) v; num_heads / num_kv_heads query
    heads share each key/value head; optional per-head q/k RMSNorm (qwen3) and q/k/v(/o) biases."""

    def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        def lin(i, o, bias):
            return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        hd = cfg.head_dim
        self.q_proj = lin(cfg.hidden_size, cfg.num_heads * hd, cfg.qkv_bias)
        self.k_proj = lin(cfg.hidden_size, cfg.num_kv_heads * hd, cfg.qkv_bias)
        self.v_proj = lin(cfg.hidden_size, cfg.num_kv_heads * hd, cfg.qkv_bias)
        self.o_proj = lin(cfg.num_heads * hd, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.qk_norm = cfg.qk_norm
        # attention sinks (gpt_oss): one learned logit per head joins the softmax, its probability dropped after
        self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), param_dtype)) if cfg.attention_sinks else None
        # KV-cache quantization (enable_kv_cache_quantization): the scheme, and static k_scale / v_scale
        self.kv_scheme: Optional[KVCacheScheme] = None
        self.k_scale = nnx.data(None)
        self.v_scale = nnx.data(None)
        # online rotations (set_rotation): "<proj>/input", "<proj>/output", "q_attn", "k_cache" -> Rotation
        self.rotations = nnx.data(None)

    def __call__(self, x, cos, sin, mask, kv=None, start=0):
        """x [B, T, d]; cos/sin [T, D] or [B, T, D]; mask [T, S] or [B, T, S] (True = visible; without a cache
        causal by column: token t sees no later column, as `attention_mask` and `packed_mask` give); kv: this
        layer's (keys, values) cache buffers [B, G, S, D] (written at `start`: a scalar, or [B] per row) or None
        (S = T).
        Returns (output [B, T, d], (keys, values))."""
        b, t, _ = x.shape
        g, hd = self.num_kv_heads, self.head_dim
        q = _project(self, "q_proj", x).reshape(b, t, self.num_heads, hd)
        k = _project(self, "k_proj", x).reshape(b, t, g, hd)
        v = _project(self, "v_proj", x).reshape(b, t, g, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.rotations is not None:  # compressed-tensors' q_attn / k_cache transforms act on post-RoPE states
            if "q_attn" in self.rotations:
                q = _rotate(self.rotations["q_attn"], q)
            if "k_cache" in self.rotations:
                k = _rotate(self.rotations["k_cache"], k)
        # cache layout [B, G, S, D]: the (B, G) batch axes lead, so neither dot transposes the cache
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if self.kv_scheme is not None and (kv is None or kv[0].dtype == jnp.uint8):
            k, v, kv = self._quantized_kv(k, v, kv, start)
        elif kv is not None:
            k = write_cache(kv[0], k.astype(kv[0].dtype), start)
            v = write_cache(kv[1], v.astype(kv[1].dtype), start)
            kv = (k, v)
        r = self.num_heads // g
        q = q.reshape(b, t, g, r, hd).transpose(0, 2, 3, 1, 4).reshape(b, g, r * t, hd)  # rows (r, t)
        mask = jnp.tile(mask, (r, 1)) if mask.ndim == 2 else jnp.tile(mask, (1, r, 1))[:, None]  # rows (r, t)
        sink = None
        if self.sinks is not None:  # head g * r + j owns rows (j, t) of group g
            sink = self.sinks.get_value().astype(jnp.float32).reshape(g, r, 1, 1)
            sink = jnp.broadcast_to(sink, (g, r, t, 1)).reshape(1, g, r * t, 1)
        attend = functools.partial(_attend, scale=hd ** -0.5, sink=sink, dtype=x.dtype)
        loop = t > 1 and jax.default_backend() in SEQUENCE_LOOP_BACKENDS
        if loop and kv is None:  # no cache: S = T and the mask causal by column (the docstring above)
            attend = functools.partial(attend, block=CAUSAL_BLOCK)
        if b > 1 and loop:
            shared = mask.ndim == 2
            out = jax.lax.map(lambda a: attend(a[0][None], a[1][None], a[2][None], mask if shared else a[3][None])[0],
                              (q, k, v) if shared else (q, k, v, mask))
        else:
            out = attend(q, k, v, mask)
        out = out.reshape(b, g, r, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, self.num_heads * hd)
        return _project(self, "o_proj", out), (kv if kv is not None else (k, v))

    def _quantized_kv(self, k, v, kv, start):
        """Quantize the new states k, v [B, G, T, D] to fp8 codes (static scales, or this block's dynamic scale),
        write them into the code buffers of `kv` at `start`; return the dequantized keys, values attention reads
        (the whole buffers, or the new block without a cache) and the updated cache entries."""
        if self.kv_scheme.dynamic:
            ks, vs = dynamic_scale(k), dynamic_scale(v)
        else:
            ks, vs = self.k_scale.get_value(), self.v_scale.get_value()
        kc, vc = quantize_kv(k, ks), quantize_kv(v, vs)
        if kv is None:
            return dequantize_kv(kc, ks), dequantize_kv(vc, vs), None
        kc, vc = write_cache(kv[0], kc, start), write_cache(kv[1], vc, start)
        if not self.kv_scheme.dynamic:
            return dequantize_kv(kc, ks), dequantize_kv(vc, vs), (kc, vc)
        t = k.shape[2]
        kp = jax.lax.dynamic_update_slice(kv[2], jnp.broadcast_to(ks.astype(jnp.float32), (t, 1)), (start, 0))
        vp = jax.lax.dynamic_update_slice(kv[3], jnp.broadcast_to(vs.astype(jnp.float32), (t, 1)), (start, 0))
        return (dequantize_kv(kc, kp.astype(ks.dtype)), dequantize_kv(vc, vp.astype(vs.dtype)), (kc, vc, kp, vp))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), of `intermediate_size` hidden units (default the config's)."""

    def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
                 intermediate_size: Optional[int] = None):
        def lin(i, o):
            return nnx.Linear(i, o, use_bias=cfg.mlp_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = lin(cfg.hidden_size, inter)
        self.up_proj = lin(cfg.hidden_size, inter)
        self.down_proj = lin(inter, cfg.hidden_size)
        self.rotations = nnx.data(None)  # online rotations (set_rotation): "<proj>/input", "<proj>/output"

    def __call__(self, x):
        h = jax.nn.silu(_project(self, "gate_proj", x)) * _project(self, "up_proj", x)
        return _project(self, "down_proj", h)


class DecoderLayer(nnx.Module):
    """x + attn(norm(x)), then h + ffn(norm(h)) (pre-norm residual block); ffn is the dense MLP (`mlp`), or on
    a sparse layer of an MoE model the `MoEBlock` at the checkpoint's name (`mlp`, mixtral's `block_sparse_moe`)."""

    def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs, sparse: bool = False):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if cfg.mla is None:
            self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        else:
            from qformats.models.decoder.mla import MLAttention  # mla builds on this module's layers

            self.self_attn = MLAttention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.ffn_name = "mlp"
        if sparse:
            m = cfg.moe
            shared = None
            if m.shared_expert_intermediate_size:
                shared = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                             intermediate_size=m.shared_expert_intermediate_size)
            self.ffn_name = m.block_name
            setattr(self, m.block_name, MoEBlock(m, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                                 shared=shared))
        else:
            self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask, kv=None, start=0):
        with jax.named_scope("self_attn"):
            h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, start)
        x = x + h
        with jax.named_scope(self.ffn_name):
            x = x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))
        return x, kv


class DecoderModel(nnx.Module):
    """HF's `model`: embed_tokens, layers, norm."""

    def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                             sparse=cfg.moe_layers[i]) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)


class PackedEmbed(nnx.Module):
    """A token embedding E [vocab, hidden] kept packed (a GGUF file's Q8_0 `token_embd`, say), in place of the
    model's `nnx.Embed`: `kernel` is a `PackedParam` holding q, the QArray of E^T (logical [hidden, vocab],
    quantized along hidden: codes [vocab, packed hidden]; the layout, and the sharding rule, of an lm_head's Flax
    kernel), so that

        embed(ids)[..., :] = E[ids] = dequantize(q's rows at ids).T   (only the gathered rows are decoded; a row's
                                                                       scale groups are its own, so bit for bit
                                                                       dequantize(q).T[ids])
        attend(h)          = h E^T  = qdot(h, q)                        (decode rows: `qformats.packed_dot`'s GEMV
                                                                       over the codes, never a dense E)

    `attend` equals the dense `nnx.Embed.attend` on E = dequantize(q).T up to float32 summation order.

    Raises:
      ModelError: q is not 2-D along axis 0, or its scales are not per row (tensor / block strategies).
    """

    def __init__(self, q, *, dtype):
        from qformats.nn import PackedParam

        if q.ndim != 2 or q.axis != 0 or q.scheme.strategy not in ("channel", "group", "tensor_group"):
            raise ModelError(f"PackedEmbed: expected a [hidden, vocab] QArray along axis 0 with per-row (channel / "
                             f"group) scales, found {q!r}")
        self.kernel = PackedParam(q)
        self.features, self.num_embeddings = q.shape
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        from qformats.qarray import QArray
        from qformats.quantize import dequantize

        q = self.kernel.get_value()
        flat = jnp.asarray(ids, jnp.int32).reshape(-1)
        take = lambda a: a if a is None or a.ndim < 2 else jnp.take(a, flat, axis=0)  # noqa: E731  per-row parts
        rows = QArray(take(q.codes), take(q.scale), take(q.zero_point), q.global_scale, scheme=q.scheme,
                      shape=(self.features, flat.shape[0]), dtype=q.dtype, axis=0, offset=take(q.offset),
                      compute_dtype=q.compute_dtype)
        return dequantize(rows, jnp.float32).T.astype(self.dtype).reshape(tuple(ids.shape) + (self.features,))

    def attend(self, h: jax.Array) -> jax.Array:
        from qformats.dispatch import qdot

        return qdot(h.astype(self.dtype), self.kernel.get_value())


def attention_mask(q_pos: jax.Array, s: int, window: Optional[int]) -> jax.Array:
    """[T, S] visibility (or [B, T, S] for per-row query positions q_pos [B, T]): key position k is seen by query
    position p iff k <= p and (no window or k > p - window)."""
    k_pos = jnp.arange(s)
    mask = k_pos <= q_pos[..., None]
    if window is not None:
        mask &= k_pos > q_pos[..., None] - window
    return mask


@functools.lru_cache(maxsize=None)
def inv_freq(config: DecoderConfig) -> np.ndarray:
    """The config's RoPE inverse frequencies [head_dim / 2] (float32, a compile-time constant)."""
    return config.rope.inv_freq(config.head_dim)


def _concrete_int(x) -> Optional[int]:
    try:
        return int(x)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return None


class CausalLM(nnx.Module):
    """HF's *ForCausalLM: token ids [B, T] -> logits [B, T, vocab] (float32), with an optional KV cache.

    Args:
      config: a DecoderConfig (`DecoderConfig.from_hf(config_json_dict)`).
      dtype: the compute dtype of activations, projections and the cache (float32 by default).
      param_dtype: the dtype of the parameters (float32 by default).
      rngs: initialisers' randomness (the weights are random until `load_hf_tensors` fills them).

    Tied embeddings (`config.tie_word_embeddings`): there is no `lm_head` module (None); logits = h E^T with
    the embedding E (`embed_tokens.attend`: an `nnx.Embed`, or a `PackedEmbed` whose GEMV reads the codes).
    Otherwise `lm_head` is an nnx.Linear, left dense by `quantization_rules`.
    """

    def __init__(self, config: DecoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.model = DecoderModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.sharding = None  # (mesh, ShardingRules) once placed by qformats.nn.sharding.shard_model

    def set_sharding(self, mesh, rules) -> None:
        """Called by `qformats.nn.sharding.shard_model`: the KV cache buffers `init_cache` makes are laid out on
        `mesh` by the logical axes `KV_CACHE_AXES` (split by KV heads under `tensor_parallel_rules`), and, when the
        rules split the "expert" axis (`expert_parallel_rules`), the MoE blocks compute expert-parallel
        (`moe.set_expert_parallel`)."""
        from qformats.models.decoder.moe import set_expert_parallel

        set_expert_parallel(self, mesh, dict(rules.mesh_axes).get("expert"))
        self.sharding = (mesh, rules)

    def init_cache(self, batch: int, max_len: int, dtype=None, *, per_row: bool = False) -> KVCache:
        """An empty KVCache for `batch` rows and up to `max_len` positions (dtype: the compute dtype by default);
        its length is an int32 scalar 0, or zeros [batch] with `per_row` (a ragged batch: each row advances on its
        own, see `KVCache`). A model grouped by `scan_layers` gets one stacked buffer per run of layers.

        With KV-cache quantization enabled the buffers hold uint8 fp8 codes (plus float32 per-position scales
        for a dynamic scheme) unless `dtype` asks for a float cache, which then holds the unquantized states."""
        c = self.config
        layers = self.model.layers
        scanned = isinstance(layers, ScannedLayers)
        first = layers.runs[0].layer if scanned else layers[0]
        scheme = first.self_attn.kv_scheme  # the same on every layer (kv_cache_scheme)
        if scheme is not None and dtype is None:
            dtype = jnp.uint8
        dtype = dtype or self.dtype
        counts = [run.count for run in layers.runs] if scanned else [None] * c.num_layers
        lead = lambda n: () if n is None else (n,)  # noqa: E731
        dynamic = dtype == jnp.uint8 and scheme is not None and scheme.dynamic
        if dynamic and per_row:
            raise ModelError("CausalLM.init_cache: a dynamic fp8 KV-cache scheme shares one scale per written block "
                             "across the rows, so a cache with per-row lengths (a ragged batch) cannot be kept; "
                             "run the rows one at a time or use a static KV-cache scheme")
        scales = tuple(jnp.zeros(lead(n) + (max_len, 1), jnp.float32) for n in counts) if dynamic else None

        kshape = vshape = (batch, c.num_kv_heads, max_len, c.head_dim)
        if c.mla is not None:  # the latent and the rope key (mla.py)
            kshape, vshape = (batch, 1, max_len, c.mla.kv_lora_rank), (batch, 1, max_len, c.mla.qk_rope_head_dim)

        def zeros(n, per_layer):
            shape = lead(n) + per_layer
            if self.sharding is None or c.mla is not None:
                return jnp.zeros(shape, dtype)
            # placed on a mesh: pin the buffers' layout (XLA would pick its own)
            from jax.sharding import NamedSharding, PartitionSpec

            from qformats.sharding import logical_spec

            spec = logical_spec(KV_CACHE_AXES, self.sharding[1])
            layout = NamedSharding(self.sharding[0], PartitionSpec(*((None,) * len(lead(n))), *spec))
            return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), layout)

        length = jnp.zeros((batch,) if per_row else (), jnp.int32)
        return KVCache(tuple(zeros(n, kshape) for n in counts), tuple(zeros(n, vshape) for n in counts), length,
                       scales, scales)

    def __call__(self, ids: jax.Array, cache: Optional[KVCache] = None, *, last_only: bool = False,
                 logit_index: Optional[jax.Array] = None) -> Tuple[jax.Array, Optional[KVCache]]:
        """ids [B, T] at positions cache.length .. cache.length + T - 1 (0 .. T - 1 without a cache; per row for a
        per-row length [B]) -> (logits [B, T, vocab] float32, the cache with these T positions written and
        length + T; None without a cache).

        `last_only`: logits [B, 1, vocab] of the last position only; `logit_index` [B] (int): logits [B, 1, vocab]
        of position logit_index[b] of each row only (the last real token of a right-padded prompt).

        Attention is causal (and windowed on sliding-window layers) by position; the cache buffers have a fixed
        size, so prefill and decode steps compile once per (B, T, max_len). The cache must hold length + T
        positions (checked when length is concrete; under jit it is the caller's contract). A model grouped by
        `scan_layers` runs each run of layers with one `jax.lax.scan` (the same operations, so the same values).
        """
        if ids.ndim != 2:
            raise ModelError(f"CausalLM: expected token ids [batch, time], got shape {tuple(ids.shape)}")
        b, t = ids.shape
        if cache is None:
            start, s = 0, t
        else:
            start, s = cache.length, cache.max_len
            n = _concrete_int(jnp.max(start)) if jnp.ndim(start) else _concrete_int(start)
            if n is not None and n + t > s:
                raise ModelError(f"CausalLM: the cache holds {s} positions; {n} are filled and {t} more were given")
            if jnp.ndim(start) and (jnp.shape(start) != (b,) or cache.key_scales is not None):
                raise ModelError(f"CausalLM: a per-row cache length needs shape ({b},) and no dynamic KV-cache "
                                 f"scales, got shape {jnp.shape(start)}"
                                 + (" with dynamic scales" if cache.key_scales is not None else ""))
        positions = (start[:, None] if jnp.ndim(start) else start) + jnp.arange(t, dtype=jnp.int32)
        cos, sin = rope_tables(positions, inv_freq(self.config), self.config.rope.attention_scaling)
        masks = {w: attention_mask(positions, s, w) for w in set(self.config.sliding_windows)}
        x = self.model.embed_tokens(ids)
        layers = self.model.layers
        if isinstance(layers, ScannedLayers):
            kv = None
            if cache is not None:
                kv = [(k, v) if cache.key_scales is None else (k, v, ks, vs)
                      for k, v, ks, vs in zip(cache.keys, cache.values, cache.key_scales or cache.keys,
                                              cache.value_scales or cache.values)]
            x, entries = layers(x, cos, sin, masks, kv, start)
        else:
            entries = []
            for i, layer in enumerate(layers):
                kv = None
                if cache is not None:
                    kv = (cache.keys[i], cache.values[i])
                    if cache.key_scales is not None:
                        kv += (cache.key_scales[i], cache.value_scales[i])
                with jax.named_scope(f"layers_{i}"):
                    x, kv = layer(x, cos, sin, masks[self.config.sliding_windows[i]], kv, start)
                entries.append(kv)
        h = self.model.norm(x)
        if logit_index is not None:
            h = jnp.take_along_axis(h, jnp.asarray(logit_index, jnp.int32)[:, None, None], axis=1)
        elif last_only:
            h = h[:, -1:]
        with jax.named_scope("lm_head"):
            logits = self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        new_cache = None
        if cache is not None:
            cols = tuple(zip(*entries))
            new_cache = KVCache(cols[0], cols[1], start + t, *(cols[2:] if len(cols) == 4 else (None, None)))
        return logits.astype(jnp.float32), new_cache
