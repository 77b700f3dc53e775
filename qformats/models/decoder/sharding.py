"""Sharding axes of the decoder family: logical axes of every parameter and of the KV cache, and the Megatron rules."""

from __future__ import annotations

from qformats.errors import ModelError
from qformats.sharding import ShardingRules

#: Logical axes of a KV cache buffer [batch, num_kv_heads, max_len, head_dim].
KV_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")

#: Logical axes of every parameter of the family (by module path; the float parameter's layout, which packed
#: weights inherit): the Megatron tensor-parallel layout once "heads", "kv_heads", "mlp" and "vocab" map to a
#: mesh axis — q/k/v/gate/up column-parallel, o/down row-parallel, embedding and lm_head split by vocabulary.
PARAM_AXES = (
    (r"model/embed_tokens/embedding", ("vocab", "embed")),
    (r"model/embed_tokens/kernel", ("embed", "vocab")),  # a PackedEmbed: E^T, laid out as lm_head's kernel
    # mixture-of-experts layers: expert stacks [E, in, out] split by "expert" (expert parallelism), routers replicated
    (r"model/layers/\d+/(mlp|block_sparse_moe)/experts/(gate_proj|up_proj|gate_up_proj|w1|w3)/kernel",
     ("expert", "embed", "expert_mlp")),
    (r"model/layers/\d+/(mlp|block_sparse_moe)/experts/(down_proj|w2)/kernel", ("expert", "expert_mlp", "embed")),
    (r"model/layers/\d+/(mlp|block_sparse_moe)/experts/(gate_proj|up_proj|gate_up_proj|w1|w3)/bias",
     ("expert", "expert_mlp")),
    (r"model/layers/\d+/(mlp|block_sparse_moe)/experts/(down_proj|w2)/bias", ("expert", "embed")),
    (r"model/layers/\d+/(mlp|block_sparse_moe)/(gate|router)/kernel", ("embed", None)),
    (r"model/layers/\d+/(mlp|block_sparse_moe)/(gate|router)/bias", (None,)),
    (r"model/layers/\d+/mlp/shared_expert/(gate|up)_proj/kernel", ("embed", "mlp")),
    (r"model/layers/\d+/mlp/shared_expert/down_proj/kernel", ("mlp", "embed")),
    (r"model/layers/\d+/mlp/shared_expert_gate/kernel", ("embed", None)),
    (r"model/layers/\d+/self_attn/sinks", ("sink_heads",)),  # one value per attention head
    (r"model/layers/\d+/self_attn/q_proj/kernel", ("embed", "heads")),
    (r"model/layers/\d+/self_attn/q_proj/bias", ("heads",)),
    (r"model/layers/\d+/self_attn/[kv]_proj/kernel", ("embed", "kv_heads")),
    (r"model/layers/\d+/self_attn/[kv]_proj/bias", ("kv_heads",)),
    (r"model/layers/\d+/self_attn/o_proj/kernel", ("heads", "embed")),
    (r"model/layers/\d+/mlp/(gate|up)_proj/kernel", ("embed", "mlp")),
    (r"model/layers/\d+/mlp/(gate|up)_proj/bias", ("mlp",)),
    (r"model/layers/\d+/mlp/down_proj/kernel", ("mlp", "embed")),
    (r"model/layers/\d+/self_attn/[qk]_norm/weight", ("head_dim",)),
    (r".*(layernorm|norm)/weight", ("embed",)),
    (r".*/bias", ("embed",)),
    (r"lm_head/kernel", ("embed", "vocab")),
)


def expert_parallel_rules(config, axis: str = "ep", tensor_axis=None):
    """`qformats.sharding.ShardingRules` splitting every expert stack of an MoE `config` by experts over mesh axis
    `axis` (E / n experts per device; packed stacks leaf by leaf), and, with `tensor_axis`, attention, dense MLPs,
    the shared expert and the vocabulary Megatron-style over that axis (`tensor_parallel_rules`); without it they are
    replicated. The expert FFNs' hidden units ("expert_mlp") stay whole. `qformats.nn.sharding.shard_model` with
    these rules also makes the MoE blocks compute expert-parallel (`moe.expert_parallel_rows`: each device its own
    experts' rows, one all-reduce of activations). ModelError (at placement) when the mesh does not divide
    num_experts; ModelError for `tensor_axis` with multi-head latent attention (deepseek_v3: no
    tensor-parallel layout of it; its expert stacks split by experts with everything else replicated)."""
    t = tensor_axis
    if t is not None and getattr(config, "mla", None) is not None:
        raise ModelError(f"expert_parallel_rules: no tensor-parallel layout is defined for the {config.model_type} "
                         "model's multi-head latent attention; leave tensor_axis None (attention replicated)")
    return ShardingRules(PARAM_AXES, (("expert", axis), ("expert_mlp", None), ("vocab", t), ("heads", t),
                                      ("sink_heads", t), ("kv_heads", t), ("mlp", t), ("embed", None),
                                      ("head_dim", None)),
                         units=(("heads", config.head_dim), ("kv_heads", config.head_dim)))


def tensor_parallel_rules(config, axis: str = "tp"):
    """`qformats.sharding.ShardingRules` of the Megatron layout of `config` (a `DecoderConfig`) on mesh axis `axis`:
    `PARAM_AXES`, with heads, KV heads, the MLP's hidden units and the vocabulary split over `axis` (heads cut at
    whole heads), the model dimension replicated. With these rules the KV cache is split by KV heads too
    (`CausalLM.init_cache`). ModelError for multi-head latent attention (deepseek_v3), which has no layout here."""
    if getattr(config, "mla", None) is not None:
        raise ModelError(f"tensor_parallel_rules: no tensor-parallel layout is defined for the {config.model_type} "
                         "model's multi-head latent attention")
    return ShardingRules(PARAM_AXES, (("vocab", axis), ("heads", axis), ("sink_heads", axis), ("kv_heads", axis),
                                      ("mlp", axis), ("embed", None), ("head_dim", None)),
                         units=(("heads", config.head_dim), ("kv_heads", config.head_dim)))


def decoder_parallel_rules(config, mesh):
    """The sharding rules of `config` (a `DecoderConfig`) on a mesh made by
    `converters.pipelines.mesh_load.parallel_setup`: with an "ep" axis, `expert_parallel_rules(config, "ep",
    "tp" when that axis has more than one device)` (expert stacks split by experts, attention / dense MLPs /
    vocabulary Megatron-style over "tp"); otherwise `tensor_parallel_rules` over the mesh's one axis.

    Raises ModelError, before anything is placed: an "ep" axis for a model without experts, or a num_experts
    that the "ep" size n does not divide (E mod n != 0, numbers named); MLA models with "tp" > 1
    (`expert_parallel_rules` / `tensor_parallel_rules`)."""
    shape = dict(mesh.shape)
    if "ep" not in shape:
        if len(shape) != 1:
            raise ModelError(f"decoder_parallel_rules: expected a mesh of axes ('tp',) or ('ep', 'tp'), found "
                             f"{tuple(mesh.axis_names)}")
        return tensor_parallel_rules(config, mesh.axis_names[0])
    n = shape["ep"]
    moe = getattr(config, "moe", None)
    if moe is None:
        if n > 1:
            raise ModelError(f"expert parallel {n}: the {config.model_type} model has no experts (not a "
                             "mixture-of-experts decoder); use tensor parallelism")
    elif moe.num_experts % n:
        raise ModelError(f"expert parallel {n}: the {config.model_type} model has num_experts = {moe.num_experts}, "
                         f"which {n} devices cannot split evenly ({moe.num_experts} mod {n} = "
                         f"{moe.num_experts % n}); use an expert-parallel size that divides {moe.num_experts}")
    tp = shape.get("tp", 1)
    return expert_parallel_rules(config, "ep", "tp" if tp > 1 else None)
