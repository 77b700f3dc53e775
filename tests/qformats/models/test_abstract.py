"""qformats.models.abstract.abstract_module: the same graph, shapes and dtypes as `nnx.eval_shape` with `nnx.Rngs(0)`,
for the decoder families (dense, MoE, MLA) and MiniLM, and no values."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from qformats.models import minilm
from qformats.models.abstract import abstract_module
from qformats.models.decoder import CausalLM, DecoderConfig

ATTN = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
CONFIGS = {
    "llama": dict(ATTN, model_type="llama", tie_word_embeddings=True),
    "qwen3_moe": dict(ATTN, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "deepseek_v3": dict(ATTN, model_type="deepseek_v3", moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=48,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
}


def _same(a, b):
    assert nnx.graphdef(a) == nnx.graphdef(b)
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert isinstance(x, jax.ShapeDtypeStruct), type(x)  # abstract: no value, no memory
        assert (x.shape, x.dtype) == (y.shape, y.dtype)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_decoder_equals_eval_shape_with_rngs(family):
    cfg = DecoderConfig.from_hf(CONFIGS[family])
    assert (cfg.moe is not None, cfg.mla is not None) == (family != "llama", family == "deepseek_v3")
    got = abstract_module(lambda rngs: CausalLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs))
    want = nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    _same(got, want)


def test_minilm_equals_eval_shape_with_rngs():
    cfg = minilm.MiniLMConfig()
    got = abstract_module(lambda rngs: minilm.MiniLM(cfg, rngs=rngs))
    want = nnx.eval_shape(lambda: minilm.MiniLM(cfg, rngs=nnx.Rngs(0)))
    _same(got, want)


def test_a_module_that_keeps_rngs_is_refused():
    """The stand-in only draws keys; a layer that would keep it (dropout) fails loudly rather than reusing one key."""
    with pytest.raises(TypeError, match="rngs must be"):
        abstract_module(lambda rngs: nnx.Dropout(0.1, rngs=rngs))
