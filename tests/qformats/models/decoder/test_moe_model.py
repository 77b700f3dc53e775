"""qformats.models.decoder with mixture-of-experts layers (qwen3_moe, qwen2_moe, mixtral, gpt_oss) against transformers 5
on the same random checkpoints (save_pretrained's on-disk names): float32 logits, greedy generation token for token,
the dispatch paths against each other and against a loop over experts, config parsing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from moe_tiny import ARCHS, hf_model, ids, read_checkpoint, write_checkpoint  # noqa: E402
from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensor_names, hf_tensors, load_hf_tensors  # noqa: E402
from qformats.models.decoder.moe import MoEBlock, route  # noqa: E402
from qformats.models.generate import generate  # noqa: E402
from qformats.nn import Experts  # noqa: E402

# The bound allows for accumulation order only (float32; logits of magnitude > 1).
LOGITS_ATOL = 1e-5
IDS = ids()
forward = nnx.jit(lambda m, ids: m(ids)[0])
step = nnx.jit(lambda m, ids, c: m(ids, c))
block_forward = nnx.jit(lambda b, x: b(x))


def flax_model(cfg, tensors):
    model = nnx.eval_shape(lambda: CausalLM(DecoderConfig.from_hf(cfg), rngs=nnx.Rngs(0)))
    return load_hf_tensors(model, tensors)


# 2 layers (moe_tiny's 3 less one): a sparse layer then, for qwen3_moe / qwen2_moe, a dense one (mlp_only_layers);
# gpt-oss alternates sliding and full attention
LAYERS = {"qwen3_moe": dict(num_hidden_layers=2), "qwen2_moe": dict(num_hidden_layers=2, mlp_only_layers=[1]),
          "mixtral": dict(num_hidden_layers=2), "gpt_oss": dict(num_hidden_layers=2)}


_PAIRS = {}


def make_pair(arch, tmp_path_factory):
    """(arch, the transformers model, ours on its checkpoint, the checkpoint's tensors), built once per module."""
    if arch not in _PAIRS:
        path = tmp_path_factory.mktemp(arch)
        hf = write_checkpoint(arch, path, **LAYERS[arch])
        cfg, tensors = read_checkpoint(path)
        _PAIRS[arch] = arch, hf, flax_model(cfg, tensors), tensors
    return _PAIRS[arch]


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    return make_pair(request.param, tmp_path_factory)


def moe_blocks(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, MoEBlock)]


def test_names_and_layout(pair):
    arch, hf, model, tensors = pair
    c = model.config
    # every on-disk tensor has exactly one slot, and hf_tensors gives them back unchanged
    assert set(hf_tensor_names(c)) == set(tensors)
    back = hf_tensors(model)
    for n, a in tensors.items():
        np.testing.assert_array_equal(back[n], a, err_msg=n)
    sparse = {"qwen3_moe": (True, False), "qwen2_moe": (True, False)}.get(arch, (True,) * 2)
    assert c.moe_layers == sparse
    assert len(moe_blocks(model)) == sum(sparse)
    # one stacked [E, in, out] parameter per projection
    stacks = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model) if isinstance(m, Experts)}
    e, inter = c.moe.num_experts, c.moe.intermediate_size
    for path, m in stacks.items():
        assert m.kernel.get_value().shape in ((e, 64, inter), (e, inter, 64), (e, 64, 2 * inter)), path
    if arch == "mixtral":
        assert "model/layers/0/block_sparse_moe/experts/w1" in stacks
    elif arch == "gpt_oss":  # the fused, interleaved gate/up stack as stored, with expert biases
        assert stacks["model/layers/0/mlp/experts/gate_up_proj"].bias.get_value().shape == (e, 2 * inter)
    else:
        assert "model/layers/0/mlp/experts/gate_proj" in stacks


def test_logits_match_transformers(pair):
    _, hf, model, _ = pair
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(IDS)))
    assert got.shape == ref.shape and np.abs(ref).max() > 1.0
    np.testing.assert_allclose(got, ref, rtol=0, atol=LOGITS_ATOL)


def test_greedy_generation_matches_transformers(pair):
    _, hf, model, _ = pair
    prompt = IDS[:, :10]
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          pad_token_id=0)[:, 10:].numpy()
    got = np.asarray(generate(model, prompt, 32))
    np.testing.assert_array_equal(got, ref)


def test_routing_matches_transformers(pair):
    """Top-k weights and experts of the first sparse layer equal transformers' router outputs."""
    arch, hf, model, _ = pair
    x = np.random.RandomState(1).randn(12, 64).astype(np.float32)
    layer = next(i for i, s in enumerate(model.config.moe_layers) if s)
    block = hf.model.layers[layer].mlp
    router = block.gate if hasattr(block, "gate") else block.router
    with torch.no_grad():
        _, w_ref, e_ref = router(torch.tensor(x))
    blk = moe_blocks(model)[0]
    w, e = route(blk.router_logits(jnp.asarray(x)), blk.cfg)
    np.testing.assert_array_equal(np.asarray(e), e_ref.numpy())
    np.testing.assert_allclose(np.asarray(w), w_ref.numpy(), rtol=0, atol=1e-6)
    assert np.asarray(w).dtype == w_ref.numpy().dtype


def naive_block(blk: MoEBlock, x):
    """The block by a loop over experts, each applied densely to the tokens routed to it (transformers' loop)."""
    c = blk.cfg
    xf = x.reshape(-1, x.shape[-1])
    w, e = route(blk.router_logits(xf), c)
    out = jnp.zeros_like(xf)
    gate, up, down = c.projections
    f = blk.experts
    for j in range(c.num_experts):
        if gate is None:
            gu = getattr(f, up).dense(xf, j)
            g, u = gu[..., ::2], gu[..., 1::2]
        else:
            g, u = getattr(f, gate).dense(xf, j), getattr(f, up).dense(xf, j)
        from qformats.models.decoder.moe import activation
        y = getattr(f, down).dense(activation(g, u, c), j)
        wj = jnp.sum(jnp.where(e == j, w, 0), axis=-1)
        out = out + y * wj[:, None].astype(y.dtype)
    if c.shared_expert_intermediate_size:
        out = out + jax.nn.sigmoid(blk.shared_expert_gate(xf)) * blk.shared_expert(xf)
    return out.reshape(x.shape)


# the expert stacks that dispatch differently: separate gate / up / down (qwen3_moe; mixtral's are the same kind,
# named w1 / w3 / w2), plus a shared expert (qwen2_moe), fused interleaved gate_up with biases (gpt_oss)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_dispatch_paths_agree_with_a_loop_over_experts(arch, tokens, tmp_path_factory):
    _, _, model, _ = make_pair(arch, tmp_path_factory)
    blk = moe_blocks(model)[0]
    x = jnp.asarray(np.random.RandomState(tokens).randn(1, tokens, 64).astype(np.float32))
    want = np.asarray(naive_block(blk, x))
    for dispatch, method in (("gathered", "auto"), ("grouped", "tiled"), ("grouped", "ragged")):
        blk.dispatch, blk.grouped_method = dispatch, method
        got = np.asarray(block_forward(blk, x))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=f"{dispatch}/{method}")
    blk.dispatch, blk.grouped_method = "auto", "auto"


# the sliding-window caches (mixtral's window of 12, gpt-oss's of 6 and its sinks) against the full forward; greedy
# parity with transformers covers the full-attention caches of qwen3_moe / qwen2_moe
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_cached_decode_equals_full_forward(arch, tmp_path_factory):
    _, _, model, _ = make_pair(arch, tmp_path_factory)
    x = jnp.asarray(IDS)
    full = forward(model, x)
    cache = model.init_cache(2, 24)
    logits, cache = step(model, x[:, :12], cache)
    parts = [logits]
    for i in range(12, 20):
        logits, cache = step(model, x[:, i:i + 1], cache)
        parts.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, axis=1)), np.asarray(full), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),  # gpt-oss
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=1.0, original_max_position_embeddings=4096),  # deepseek-v3 style, truncated
    dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768,
         attention_factor=0.8),
])
def test_yarn_rope_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                      max_position_embeddings=131072, rope_parameters=dict(rope))
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    c = DecoderConfig.from_hf({**hf_cfg.to_dict(), "model_type": "llama"})
    assert c.rope.rope_type == "yarn"
    np.testing.assert_allclose(c.rope.inv_freq(32), inv.numpy(), rtol=1e-6, atol=0)
    assert c.rope.attention_scaling == pytest.approx(scale, rel=1e-12)


MOE_BASE = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)


def test_from_hf_sparse_layers_and_defaults():
    q = DecoderConfig.from_hf({**MOE_BASE, "model_type": "qwen3_moe", "decoder_sparse_step": 2,
                               "mlp_only_layers": [3], "num_experts": 8, "num_experts_per_tok": 2})
    assert q.moe_layers == (False, True, False, False) and q.moe.num_experts == 8 and q.moe.top_k == 2
    assert q.num_kv_heads == 4 and q.qk_norm and not q.moe.norm_topk_prob and q.moe.intermediate_size == 768
    dense = DecoderConfig.from_hf({**MOE_BASE, "model_type": "qwen2_moe", "num_experts": 0, "num_key_value_heads": 2})
    assert dense.moe is None and dense.moe_layers == (False,) * 4
    m = DecoderConfig.from_hf({**MOE_BASE, "model_type": "mixtral", "num_attention_heads": 8})
    assert m.num_kv_heads == 8 and m.sliding_windows == (None,) * 4 and m.rope.theta == 1e6
    assert m.moe.block_name == "block_sparse_moe" and m.moe.norm_topk_prob and m.rms_norm_eps == 1e-5


@pytest.mark.parametrize("change, message", [
    (dict(model_type="qwen3_moe", hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5), "num_experts_per_tok = 5"),
    (dict(model_type="qwen2_moe", decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(model_type="deepseek_v2"), "model_type 'deepseek_v2' is not supported"),
])
def test_from_hf_refuses_what_it_cannot_compute(change, message):
    with pytest.raises(ModelError, match=message):
        DecoderConfig.from_hf({**MOE_BASE, **change})
