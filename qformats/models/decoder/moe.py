"""The mixture-of-experts block of the decoder family (qwen2_moe, qwen3_moe, mixtral, gpt_oss, deepseek_v3): router, experts, shared expert.

    logits = x W_r (+ b_r)                                         [M, E], M = batch x time tokens
    (w, e) = route(logits)                                         top_k weights and experts per token
    y_t   = sum_j w_tj * FFN_{e_tj}(x_t)  (+ sigmoid(x_t w_g) * FFN_shared(x_t))

Routing, as transformers 5 computes it per architecture:
  "softmax_topk" (qwen2_moe, qwen3_moe, mixtral): p = softmax(logits) in float32, (w, e) = top_k(p), and with
    `norm_topk_prob` w /= sum_j w_j (mixtral always); w is cast to the logits' dtype (qwen) or kept float32
    (mixtral, `weights_float32`).
  "topk_softmax" (gpt_oss): (v, e) = top_k(logits + b_r), w = softmax(v) over the k chosen, in the logits' dtype.
  "sigmoid_grouped" (deepseek_v3): float32 router (`DeepseekRouter`), sigmoid scores, group-limited top-k on the
    scores plus `e_score_correction_bias`, w = the chosen scores (normalised with `norm_topk_prob`) times
    `routed_scaling_factor`, float32 (`deepseek_route`); shared experts ungated: y_t += FFN_shared(x_t).
Expert FFNs: "silu": down(silu(gate(x)) * up(x)); "swiglu_oai" (gpt_oss): one fused gate_up projection with
interleaved columns (gate = even columns, up = odd), g = min(g, limit), u = clip(u, -limit, limit),
down((u + 1) * g * sigmoid(alpha g)), with expert biases.

Expert weights are `qformats.nn.experts.Experts` stacks, one [E, in, out] parameter per projection, at the
checkpoint's module paths (`mlp/experts/gate_proj`, `block_sparse_moe/experts/w1`, `mlp/experts/gate_up_proj`).
Dispatch scales with the routed experts: with fewer routed rows (tokens x top_k) than experts (decode) each row
gathers its expert's weights (`Experts.gathered`); otherwise the rows are sorted by expert and each projection
is one grouped matmul (`Experts.grouped`) whose result is scattered back, weighted, to its token.

Expert parallelism (`set_expert_parallel`, called by `CausalLM.set_sharding` when the sharding rules map the
"expert" axis to a mesh axis of n devices): each device holds experts [r E/n, (r+1) E/n) and computes, inside a
`jax.shard_map`, the rows routed to its own experts only (the others are zero); one all-reduce (psum) over the
mesh of those [tokens x top_k, d] rows gives every device every row, which is then weighted and summed exactly
as on one device. The devices of the other mesh axes (tensor parallelism), which hold the same experts, split
those rows between them, so each expert row is computed once on the whole mesh. Only activations cross devices,
never expert weights; each row is non-zero on exactly one device, so the psum adds zeros and the result equals
the single-device computation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.errors import ModelError
from qformats.nn.experts import Experts

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")
DISPATCHES = ("auto", "gathered", "grouped")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The sparse block of an MoE decoder (frozen, hashable).

    num_experts E, top_k k, intermediate_size (per expert); routing "softmax_topk" | "topk_softmax" (see the
    module docstring), norm_topk_prob, weights_float32 (routing weights kept float32, mixtral); router_bias,
    expert_bias (gpt_oss); activation "silu" | "swiglu_oai" with swiglu_alpha / swiglu_limit;
    shared_expert_intermediate_size (0: no shared expert; qwen2_moe: a SwiGLU MLP gated by
    sigmoid(shared_expert_gate(x))). Names: block_name (the layer attribute, "mlp" or "block_sparse_moe"),
    router_name ("gate" or "router"), projections (gate, up, down) expert projection names, gate None when up
    is one fused interleaved gate_up projection. DeepSeek ("sigmoid_grouped"): n_group, topk_group,
    routed_scaling_factor (`deepseek_route`); its shared experts are one ungated MLP (shared_expert_gated False)
    at shared_name "shared_experts".
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    weights_float32: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_intermediate_size: int = 0
    block_name: str = "mlp"
    router_name: str = "gate"
    projections: Tuple[Optional[str], str, str] = ("gate_proj", "up_proj", "down_proj")
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    shared_name: str = "shared_expert"

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ModelError(f"MoEConfig: num_experts_per_tok = {self.top_k} must be in [1, num_experts = "
                             f"{self.num_experts}]")
        e, g = self.num_experts, self.n_group
        if self.routing == "sigmoid_grouped" and (g < 1 or e % g or e // g < 2 or not 0 < self.topk_group <= g
                                                  or self.top_k > self.topk_group * (e // g)):
            raise ModelError(f"MoEConfig: {e} experts in n_group = {g} groups (>= 2 experts each, as the group score "
                             f"sums the two best), topk_group = {self.topk_group} and num_experts_per_tok = "
                             f"{self.top_k} cannot be routed (transformers' DeepseekV3TopkRouter would fail)")
        if self.routing not in ("softmax_topk", "topk_softmax", "sigmoid_grouped"):
            raise ModelError(f"MoEConfig: unknown routing {self.routing!r}")
        if self.activation not in ("silu", "swiglu_oai"):
            raise ModelError(f"MoEConfig: unknown expert activation {self.activation!r}")

    @property
    def fused_gate_up(self) -> bool:
        return self.projections[0] is None


def moe_from_hf(cfg: Mapping[str, Any], mt: str, layers: int) -> Tuple[MoEConfig, Tuple[bool, ...]]:
    """(MoEConfig, per-layer sparse flags) of an HF config.json of an MoE model_type, as transformers 5 reads it.

    qwen2_moe / qwen3_moe: layer i is sparse iff i not in `mlp_only_layers`, num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0 (the others are dense MLPs of `intermediate_size`); mixtral and gpt_oss:
    every layer. ModelError for options this block would not compute as transformers does (router jitter is
    training-only and ignored; an activation other than silu, num_experts = 0 with sparse layers asked for).
    """
    def need(key):
        if cfg.get(key) is None:
            raise ModelError(f"config.json ({mt}): missing {key!r}")
        return cfg[key]

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"config.json ({mt}): hidden_act {act!r} is not supported (only 'silu')")
    if mt in ("qwen2_moe", "qwen3_moe"):
        # transformers 5 writes num_local_experts (its attribute_map), older configs num_experts
        e = cfg.get("num_experts", cfg.get("num_local_experts"))
        e = int((60 if mt == "qwen2_moe" else 128) if e is None else e)
        step = int(cfg.get("decoder_sparse_step", 1))
        only = set(int(i) for i in (cfg.get("mlp_only_layers") or []))
        if step < 1:
            raise ModelError(f"config.json ({mt}): decoder_sparse_step must be >= 1, got {step}")
        sparse = tuple(i not in only and e > 0 and (i + 1) % step == 0 for i in range(layers))
        shared = int(cfg.get("shared_expert_intermediate_size", 5632)) if mt == "qwen2_moe" else 0
        k = int(cfg.get("num_experts_per_tok", 4 if mt == "qwen2_moe" else 8))
        inter = int(cfg.get("moe_intermediate_size", 1408 if mt == "qwen2_moe" else 768))
        if not any(sparse):
            return None, sparse
        return MoEConfig(e, k, inter, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                         shared_expert_intermediate_size=shared), sparse
    if mt == "mixtral":
        return MoEConfig(int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2)),
                         int(need("intermediate_size")), norm_topk_prob=True, weights_float32=True,
                         block_name="block_sparse_moe", projections=("w1", "w3", "w2")), (True,) * layers
    if mt == "gpt_oss":
        return MoEConfig(int(cfg.get("num_local_experts", 128)), int(cfg.get("num_experts_per_tok", 4)),
                         int(need("intermediate_size")), routing="topk_softmax", router_bias=True, expert_bias=True,
                         activation="swiglu_oai", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), router_name="router",
                         projections=(None, "gate_up_proj", "down_proj")), (True,) * layers
    raise ModelError(f"config.json: model_type {mt!r} is not a mixture-of-experts type ({', '.join(MOE_MODEL_TYPES)})")


def route(logits: jax.Array, cfg: MoEConfig, bias: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array]:
    """(weights [M, k], experts [M, k] int32) of router logits [M, E] (see the module docstring); `bias`: the
    score-correction bias of "sigmoid_grouped" routing."""
    if cfg.routing == "sigmoid_grouped":
        return deepseek_route(logits, bias, top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                              norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    if cfg.routing == "softmax_topk":
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w, e = jax.lax.top_k(probs, cfg.top_k)
        if cfg.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return (w if cfg.weights_float32 else w.astype(logits.dtype)), e.astype(jnp.int32)
    v, e = jax.lax.top_k(logits, cfg.top_k)
    return jax.nn.softmax(v.astype(jnp.float32), axis=-1).astype(logits.dtype), e.astype(jnp.int32)


class ExpertFFNs(nnx.Module):
    """The E expert FFNs of a block: one `Experts` stack per projection, named as in the checkpoint."""

    def __init__(self, cfg: MoEConfig, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        def stack(i, o):
            return Experts(cfg.num_experts, i, o, use_bias=cfg.expert_bias, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)

        gate, up, down = cfg.projections
        inter = cfg.intermediate_size
        if gate is None:
            setattr(self, up, stack(hidden, 2 * inter))
        else:
            setattr(self, gate, stack(hidden, inter))
            setattr(self, up, stack(hidden, inter))
        setattr(self, down, stack(inter, hidden))
        self.cfg = cfg

    def __call__(self, x, experts=None, group_sizes=None, method: str = "auto", valid=None):
        """FFN_{e_m}(x_m) [M, d] for rows x [M, d]: with `experts` [M] (gathered weights; rows whose `valid` [M]
        flag is False are not computed and their output is meaningless), or rows sorted by expert with
        `group_sizes` [E] (grouped matmuls, `method` as `Experts.grouped`)."""
        c = self.cfg
        gate, up, down = c.projections

        def proj(name, h):
            m = getattr(self, name)
            return m.gathered(h, experts, valid) if experts is not None else m.grouped(h, group_sizes, method)

        if gate is None:
            gu = proj(up, x)
            g, u = gu[..., ::2], gu[..., 1::2]
        else:
            g, u = proj(gate, x), proj(up, x)
        return proj(down, activation(g, u, c))


def activation(g, u, cfg: MoEConfig):
    """silu(g) * u, or gpt-oss's clamped SwiGLU (u' + 1) * g' * sigmoid(alpha g'), g' = min(g, limit),
    u' = clip(u, -limit, limit)."""
    if cfg.activation == "silu":
        return jax.nn.silu(g) * u
    lim = cfg.swiglu_limit
    g = jnp.minimum(g, lim)
    u = jnp.clip(u, -lim, lim)
    return (u + 1) * (g * jax.nn.sigmoid(g * cfg.swiglu_alpha))


class DeepseekRouter(nnx.Module):
    """DeepSeek-V3's router (`mlp.gate`): logits = float32(x) @ kernel [M, E], kernel [d, E] (the HF weight
    transposed), and the score-correction bias `e_score_correction_bias` [E] that `deepseek_route` adds for the
    choice. Both are float32 whatever the model's dtype (transformers keeps them so: `_keep_in_fp32_modules_strict`);
    not an nnx.Linear, so quantization rules never reach it."""

    def __init__(self, hidden: int, experts: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (hidden, experts), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((experts,), jnp.float32))

    def __call__(self, x):
        return jnp.dot(x.astype(jnp.float32), self.kernel.get_value().astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)


def deepseek_route(logits: jax.Array, bias: jax.Array, *, top_k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, routed_scaling_factor: float) -> Tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's group-limited sigmoid routing (transformers' `DeepseekV3TopkRouter`), all in float32.

    s = sigmoid(logits) [M, E]; c = s + bias (`e_score_correction_bias`, used for choosing only);
    group score_g = sum of the two largest c in group g (E / n_group consecutive experts per group);
    the topk_group best groups stay, the other experts' c become -inf; experts e = top_k(c);
    w = s[e], w /= sum(w) + 1e-20 when norm_topk_prob; w *= routed_scaling_factor.
    Returns (w [M, k] float32, e [M, k] int32).
    """
    m, n = logits.shape
    if n % n_group or n // n_group < 2 or not 0 < topk_group <= n_group or top_k > topk_group * (n // n_group):
        raise ModelError(f"deepseek_route: {n} experts in n_group = {n_group} groups (>= 2 experts each), "
                         f"topk_group = {topk_group}, top_k = {top_k} cannot be routed")
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(m, n_group, n // n_group), 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, topk_group)
    keep = jnp.zeros((m, n_group), bool).at[jnp.arange(m)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(keep, n // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    w = jnp.take_along_axis(scores, experts, axis=1)
    if norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * jnp.float32(routed_scaling_factor), experts.astype(jnp.int32)


class MoEBlock(nnx.Module):
    """Router + experts (+ the shared expert and its gate): x [B, T, d] -> [B, T, d] (see the module docstring).

    `shared`: the shared expert's MLP module (built by the caller, qwen2_moe) or None. `dispatch`: "auto"
    (gathered weights when tokens x top_k < num_experts, else sorted rows and grouped matmuls), "gathered" or
    "grouped"; `grouped_method`: "auto" | "ragged" | "tiled" (`qformats.nn.experts.Experts.grouped`).
    """

    def __init__(self, cfg: MoEConfig, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs,
                 shared: Optional[nnx.Module] = None):
        if cfg.routing == "sigmoid_grouped":
            router = DeepseekRouter(hidden, cfg.num_experts, rngs=rngs)
        else:
            router = nnx.Linear(hidden, cfg.num_experts, use_bias=cfg.router_bias, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)
        setattr(self, cfg.router_name, router)
        self.experts = ExpertFFNs(cfg, hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.shared_expert_intermediate_size:
            if shared is None:
                raise ModelError("MoEBlock: the config has a shared expert; pass its MLP module")
            setattr(self, cfg.shared_name, shared)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nnx.Linear(hidden, 1, use_bias=False, dtype=dtype,
                                                     param_dtype=param_dtype, rngs=rngs)
        self.cfg = cfg
        self.dispatch = "auto"
        self.grouped_method = "auto"
        self.expert_parallel = None  # (mesh, mesh axis) when the expert stacks are split by experts

    def router_logits(self, xf):
        """[M, E] router logits of tokens xf [M, d]."""
        return getattr(self, self.cfg.router_name)(xf)

    def __call__(self, x):
        c = self.cfg
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        m, k = xf.shape[0], c.top_k
        router = getattr(self, c.router_name)
        w, idx = route(self.router_logits(xf), c, getattr(router, "e_score_correction_bias", None))
        e = idx.reshape(-1)
        dispatch = self.dispatch
        if dispatch not in DISPATCHES:
            raise ModelError(f"MoEBlock: dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        if dispatch == "auto":
            dispatch = "gathered" if m * k < c.num_experts else "grouped"
        pt = jnp.promote_types(x.dtype, w.dtype)
        ep = self.expert_parallel
        if dispatch == "gathered":
            rows = jnp.repeat(xf, k, axis=0)
            y = (self.experts(rows, experts=e) if ep is None else
                 expert_parallel_rows(self.experts, rows, e, None, ep, self.grouped_method)).reshape(m, k, d)
            out = jnp.sum((y.astype(pt) * w[..., None]).astype(x.dtype), axis=1)
        else:
            order = jnp.argsort(e, stable=True)
            tok = order // k
            sizes = jnp.bincount(e, length=c.num_experts)
            y = (self.experts(xf[tok], group_sizes=sizes, method=self.grouped_method) if ep is None else
                 expert_parallel_rows(self.experts, xf[tok], e[order], sizes, ep, self.grouped_method))
            contrib = (y.astype(pt) * w.reshape(-1)[order][:, None]).astype(x.dtype)
            out = jnp.zeros_like(xf).at[tok].add(contrib)
        if c.shared_expert_intermediate_size:
            shared = getattr(self, c.shared_name)(xf)
            out = out + (jax.nn.sigmoid(self.shared_expert_gate(xf)) * shared if c.shared_expert_gated else shared)
        return out.reshape(b, t, d)


def expert_parallel_rows(experts: ExpertFFNs, rows, row_experts, group_sizes, placement, method: str = "auto"):
    """FFN_{e_m}(x_m) [M, d] for rows x [M, d] with their experts e [M], computed expert-parallel: `placement` =
    (mesh, axis), the expert stacks of `experts` split by experts over mesh axis `axis` (n devices, E / n experts
    each) and replicated over the other mesh axes (t devices in all, e.g. the tensor-parallel axis). Inside
    `jax.shard_map`, device (r, s) (r along `axis`, s the index over the other axes) holds experts [o, o + E/n),
    o = r E / n, and computes only its share of its own experts' rows:

        own_m  = o <= e_m < o + E/n
        mine_m = own_m and (its rank among the own rows) mod t == s          (gathered weights, `group_sizes` None)
        mine_m = own_m and its position among the own rows is in [s C / t, (s+1) C / t), C = the own rows' count
                                                                              (rows sorted by expert: one grouped
                                                                               matmul over that contiguous range)
        y^{r,s}_m = FFN_{e_m}(x_m) if mine_m else 0                           (rows not mine are not computed)

    then y = psum over all mesh axes of y^{r,s} (one all-reduce of [M, d] activations). Each row is mine on
    exactly one device, so each expert row is computed once on the whole mesh and y equals the single-device
    result (the psum adds zeros)."""
    import math

    from jax.sharding import PartitionSpec as P

    mesh, axis = placement
    n = mesh.shape[axis]
    e_total = experts.cfg.num_experts
    if e_total % n:
        raise ModelError(f"expert parallelism: {e_total} experts do not split over {n} devices of mesh axis "
                         f"{axis!r} (num_experts must be a multiple of the expert-parallel size)")
    local = e_total // n
    others = tuple(a for a in mesh.axis_names if a != axis and mesh.shape[a] > 1)
    t_count = math.prod(mesh.shape[a] for a in others)
    gdef, state = nnx.split(experts)

    def spec(leaf):  # expert stacks (and packed leaves) carry the expert axis first; anything else replicated
        return P(axis) if getattr(leaf, "ndim", 0) >= 1 and leaf.shape[0] == e_total else P()

    state_specs = jax.tree.map(spec, state)

    def body(st, x, ex, gs):
        ffn = nnx.merge(gdef, st)
        lo = jax.lax.axis_index(axis) * local
        s = jnp.int32(0)
        for a in others:  # row-major index over the other axes
            s = s * mesh.shape[a] + jax.lax.axis_index(a)
        own = (ex >= lo) & (ex < lo + local)
        if gs is None:
            rank = jnp.cumsum(own.astype(jnp.int32)) - 1
            mine = own & (rank % t_count == s)
            y = ffn(x, experts=jnp.where(own, ex - lo, 0), valid=mine)
        else:
            start = jnp.sum(jnp.where(jnp.arange(e_total) < lo, gs, 0))
            own_gs = jax.lax.dynamic_slice_in_dim(gs, lo, local)
            count = jnp.sum(own_gs)
            a0, a1 = s * count // t_count, (s + 1) * count // t_count
            ends = jnp.cumsum(own_gs)
            sub = jnp.maximum(jnp.minimum(ends, a1) - jnp.maximum(ends - own_gs, a0), 0)
            first = start + a0
            y = jnp.roll(ffn(jnp.roll(x, -first, axis=0), group_sizes=sub, method=method), first, axis=0)
            pos = jnp.arange(x.shape[0])
            mine = (pos >= first) & (pos < start + a1)
        return jax.lax.psum(jnp.where(mine[:, None], y, jnp.zeros_like(y)), (axis,) + others)

    return jax.shard_map(body, mesh=mesh, in_specs=(state_specs, P(), P(), P()), out_specs=P(),
                         check_vma=False)(state, rows, row_experts, group_sizes)


def set_expert_parallel(model: nnx.Module, mesh, axis) -> int:
    """Make every `MoEBlock` of `model` compute expert-parallel over mesh axis `axis` of `mesh`
    (`expert_parallel_rows`), or on the global arrays as they lie (GSPMD) with `axis` None; returns the number of
    blocks. ModelError when a block's num_experts is not a multiple of the axis size."""
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoEBlock)]
    if axis is not None:
        if not isinstance(axis, str) or axis not in mesh.shape:
            raise ModelError(f"set_expert_parallel: expected one axis of the mesh {dict(mesh.shape)}, got {axis!r}")
        for b in blocks:
            if b.cfg.num_experts % mesh.shape[axis]:
                raise ModelError(f"set_expert_parallel: {b.cfg.num_experts} experts do not split over "
                                 f"{mesh.shape[axis]} devices of mesh axis {axis!r}")
    for b in blocks:
        b.expert_parallel = None if axis is None else (mesh, axis)
    return len(blocks)


def set_dispatch(model: nnx.Module, dispatch: str = "auto", grouped_method: str = "auto") -> int:
    """Set how every `MoEBlock` of `model` runs its experts (`MoEBlock.dispatch`, `MoEBlock.grouped_method`);
    returns the number of blocks. ModelError for an unknown name."""
    from qformats.nn.experts import GROUPED_METHODS

    if dispatch not in DISPATCHES or grouped_method not in GROUPED_METHODS:
        raise ModelError(f"set_dispatch: dispatch must be one of {DISPATCHES} and grouped_method one of "
                         f"{GROUPED_METHODS}, got {dispatch!r}, {grouped_method!r}")
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoEBlock)]
    for b in blocks:
        b.dispatch, b.grouped_method = dispatch, grouped_method
    return len(blocks)
