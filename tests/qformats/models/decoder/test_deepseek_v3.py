"""deepseek_v3 in qformats.models.decoder against transformers 5 on the same random weights: YaRN and DeepSeek's softmax
scale, the group-limited sigmoid router, multi-head latent attention and its latent cache, float32 logits, greedy
generation token for token, W4A16 quantization; config and checkpoint errors (MTP layers, unsupported options)."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensor_names, load_hf_tensors  # noqa: E402
from qformats.models.decoder.mla import softmax_scale  # noqa: E402
from qformats.models.decoder.moe import deepseek_route  # noqa: E402

# Measured max |logits - transformers'|: about 2e-6 (float32, logits up to ~3.5); the bound allows for
# accumulation order only.
LOGITS_ATOL = 1e-5
# float32 pow differs from torch's by up to one ulp (libm vs torch's vectorised pow): the inverse frequencies
ULP = 2.4e-7
YARN = dict(type="yarn", factor=4.0, mscale=0.9, mscale_all_dim=1.0, original_max_position_embeddings=64,
            beta_fast=32, beta_slow=1)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=256, initializer_range=0.1, rope_scaling=YARN, eos_token_id=None,
            bos_token_id=None, pad_token_id=None)
# no query LoRA, attention biases, rotate-half rope without scaling, unnormalised routing weights
VARIANT = dict(TINY, q_lora_rank=None, attention_bias=True, rope_interleave=False, rope_scaling=None,
               norm_topk_prob=False, num_hidden_layers=2, n_shared_experts=2)
# every layer dense (first_k_dense_replace = num_hidden_layers): attention and checkpoint tests without experts
DENSE = dict(TINY, num_hidden_layers=2, first_k_dense_replace=2)
# the models run against transformers: TINY's dense first layer and one sparse layer
MODEL = dict(TINY, num_hidden_layers=2)
IDS = np.random.RandomState(0).randint(0, 256, (2, 20))


def hf_model(cfg):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg)).eval()
    with torch.no_grad():  # non-trivial norms, biases and score-correction biases (HF initialises them trivially)
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return hf


def hf_checkpoint(hf):
    """The model's tensors under the names of an HF deepseek_v3 checkpoint on disk: per-expert projections
    (transformers 5 fuses them on load: gate_up_proj [E, 2I, d] = gate ++ up, down_proj [E, d, I])."""
    out = {}
    for name, t in hf.state_dict().items():
        a = t.detach().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = a[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = a[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(a.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = a[e]
        else:
            out[name] = a
    return out


def flax_model(hf, tensors=None):
    cfg = DecoderConfig.from_hf(hf.config.to_dict())
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    return load_hf_tensors(model, hf_checkpoint(hf) if tensors is None else tensors)


# ------------------------------------------------------------------------------------------------ rope

@pytest.mark.parametrize("rope", [
    YARN,
    dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=64, truncate=False),  # gpt-oss's
    dict(rope_type="yarn", factor=None, original_max_position_embeddings=32, attention_factor=0.8, beta_fast=16),
    dict(rope_type="yarn", factor=2.0, mscale=1.0, original_max_position_embeddings=64, beta_fast=0),
])
def test_yarn_matches_transformers_rope_init(rope):
    cfg = dict(TINY, rope_scaling=dict(rope, rope_theta=50000.0))
    hf = transformers.DeepseekV3Config(**cfg)
    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = DecoderConfig.from_hf(hf.to_dict())
    np.testing.assert_allclose(ours.rope.inv_freq(ours.head_dim), inv.numpy(), rtol=ULP, atol=0)
    assert ours.rope.attention_scaling == attention_factor
    # DeepSeek's softmax scale (mscale_all_dim correction)
    assert softmax_scale(ours.mla.qk_head_dim, ours.rope) == hf_ds.DeepseekV3Attention(hf, 0).scaling
    assert ours.mla.scale == hf_ds.DeepseekV3Attention(hf, 0).scaling


def test_yarn_on_the_llama_family_config():
    """YaRN is a RopeConfig type of the whole family (gpt-oss and qwen long-context configs use it)."""
    d = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, max_position_embeddings=512,
             rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=8.0, original_max_position_embeddings=64))
    inv, att = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**d))
    c = DecoderConfig.from_hf(d)
    np.testing.assert_allclose(c.rope.inv_freq(c.head_dim), inv.numpy(), rtol=ULP, atol=0)
    assert c.rope.attention_scaling == att


# ------------------------------------------------------------------------------------------------ router

@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers(norm):
    cfg = transformers.DeepseekV3Config(**dict(TINY, n_routed_experts=16, num_experts_per_tok=3, norm_topk_prob=norm))
    router = hf_ds.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
        logits, w, e = router(torch.randn(64, cfg.hidden_size))
    ow, oe = deepseek_route(jnp.asarray(logits.numpy()), jnp.asarray(router.e_score_correction_bias.numpy()),
                            top_k=3, n_group=4, topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    # the same experts per token (torch's top-k is unsorted: compare in expert order)
    order, our_order = np.argsort(e.numpy(), 1), np.argsort(np.asarray(oe), 1)
    np.testing.assert_array_equal(np.take_along_axis(e.numpy(), order, 1), np.take_along_axis(np.asarray(oe), our_order, 1))
    w, ow = np.take_along_axis(w.numpy(), order, 1), np.take_along_axis(np.asarray(ow), our_order, 1)
    if norm:  # the normaliser sums the k weights in top-k order, torch in its own: one ulp
        np.testing.assert_allclose(ow, w, rtol=ULP, atol=0)
    else:
        np.testing.assert_array_equal(ow, w)


def test_router_refuses_impossible_groups():
    with pytest.raises(ModelError, match="cannot be routed"):
        deepseek_route(jnp.zeros((2, 8)), jnp.zeros(8), top_k=5, n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=1.0)


# ------------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("change, match", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(YARN, extra_key=1.0)), "extra_key"),
])
def test_config_refusals(change, match):
    with pytest.raises(ModelError, match=match):
        DecoderConfig.from_hf(dict(TINY, model_type="deepseek_v3", **change))


def test_config_fields():
    c = DecoderConfig.from_hf(dict(TINY, model_type="deepseek_v3", num_nextn_predict_layers=1))
    m = c.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (48, 32, 16, 8, 12)
    assert c.head_dim == 8 and m.rope_interleave and c.mtp_layers == 1 and c.rope.rope_type == "yarn"
    assert DecoderConfig.from_hf(dict(VARIANT, model_type="deepseek_v3")).mla.q_lora_rank is None


def test_deepseek_v3_config_json():
    """DeepSeek-V3's own config.json (keys of its original code included): 58 sparse layers of 256 experts, the MTP
    layer, DeepSeek's softmax scale under YaRN factor 40, every tensor name of its checkpoint but layer 61's."""
    cfg = {"attention_bias": False, "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3,
           "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
           "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
           "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
           "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
           "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "weight_block_size": [128, 128]},
           "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"},
           "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
           "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
           "v_head_dim": 128, "vocab_size": 129280}
    c = DecoderConfig.from_hf(cfg)
    assert sum(c.moe_layers) == 58 and c.mtp_layers == 1 and c.moe.shared_expert_intermediate_size == 2048
    hf = transformers.DeepseekV3Config(**cfg)
    assert c.mla.scale == hf_ds.yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** (-0.5))
    names = hf_tensor_names(c)  # (the abstract 671.0e9-parameter model builds too, in ~50 s: not here)
    assert len(names) == 45395 and sum(".experts." in n for n in names) == 58 * 256 * 3


# ------------------------------------------------------------------------------------------------ checkpoints

def test_hf_tensors_give_back_the_checkpoint():
    """hf_tensors (the inverse of load_hf_tensors) gives every tensor of the HF checkpoint back, experts sliced out of
    their stacks and the router's float32 weight and score-correction bias as stored."""
    from qformats.models.decoder import hf_tensors

    hf = hf_model(TINY)
    want = hf_checkpoint(hf)
    got = hf_tensors(flax_model(hf, want))
    assert sorted(got) == sorted(want)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


def test_mtp_layer_tensors_are_skipped_by_name_with_a_warning():
    """DeepSeek-V3 checkpoints carry the multi-token-prediction layer as model.layers.{num_hidden_layers}.*: skipped,
    and said so; a tensor of a layer past the MTP layers is still an error."""
    cfg = dict(DENSE, num_nextn_predict_layers=1)
    hf = hf_model(cfg)
    tensors = hf_checkpoint(hf)
    mtp = {f"model.layers.{cfg['num_hidden_layers']}.{n}": np.zeros((4, 4), np.float32)
           for n in ("eh_proj.weight", "enorm.weight", "shared_head.head.weight")}
    with pytest.warns(UserWarning, match=r"skipped 3 tensors of the multi-token-prediction layer\(s\) model.layers.2"):
        flax_model(hf, {**tensors, **mtp})
    with pytest.raises(ModelError, match="1 unexpected: model.layers.3.eh_proj.weight"):
        flax_model(hf, {**tensors, "model.layers.3.eh_proj.weight": np.zeros((4, 4), np.float32)})
    no_mtp = hf_model(dict(cfg, num_nextn_predict_layers=0))
    with pytest.raises(ModelError, match="unexpected: model.layers.2.eh_proj.weight"):
        flax_model(no_mtp, {**tensors, **mtp})


# ------------------------------------------------------------------------------------------------ the model

forward = nnx.jit(lambda m, ids: m(ids)[0])
step = nnx.jit(lambda m, ids, c: m(ids, c))
_HF = {}


def shared_hf(name):
    """The transformers model of MODEL ("tiny") or VARIANT, built once per module (the tests below do not change it)."""
    if name not in _HF:
        _HF[name] = hf_model(MODEL if name == "tiny" else VARIANT)
    return _HF[name]


@pytest.fixture(scope="module", params=["tiny", "variant"])
def pair(request):
    hf = shared_hf(request.param)
    return hf, flax_model(hf)


def test_logits_match_transformers(pair):
    hf, model = pair
    with torch.no_grad():
        ref = hf(torch.from_numpy(IDS)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(IDS))), ref, rtol=0, atol=LOGITS_ATOL)


def test_cached_prefill_then_steps_match_transformers():
    """The latent cache: a prefill of 12 positions and single-token steps give the uncached logits (VARIANT: rotate-half
    rope, no query LoRA; TINY's cache is under greedy parity with transformers below)."""
    hf = shared_hf("variant")
    model = flax_model(hf)
    with torch.no_grad():
        ref = hf(torch.from_numpy(IDS)).logits.numpy()
    cache = model.init_cache(2, 24)
    assert cache.keys[0].shape == (2, 1, 24, 32) and cache.values[0].shape == (2, 1, 24, 8)
    logits, cache = step(model, jnp.asarray(IDS[:, :12]), cache)
    outs = [np.asarray(logits)]
    for t in range(12, IDS.shape[1]):
        logits, cache = step(model, jnp.asarray(IDS[:, t:t + 1]), cache)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, rtol=0, atol=LOGITS_ATOL)
    assert int(cache.length) == IDS.shape[1]


@pytest.mark.slow  # ~20-30 s on a busy 2-core machine (two compiled programs)
def test_greedy_generation_matches_transformers():
    from qformats.models.generate import generate

    hf = shared_hf("tiny")
    model = flax_model(hf)
    prompt = IDS[:, :8]
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    ours = np.asarray(generate(model, jnp.asarray(prompt), 32))
    np.testing.assert_array_equal(ours, ref.numpy()[:, 8:])


@pytest.mark.slow  # ~20-30 s on a busy 2-core machine (two compiled programs)
def test_w4a16_packed_forward_equals_float_model_on_dequantized_weights():
    """quantize_model W4A16 reaches every projection of MLA, the dense MLPs, the shared and the routed experts
    (each expert packed as its own Linear), not the float32 router; the packed model computes what the float model
    does with each kernel replaced by its dequantized packed weight."""
    from qformats.models.decoder import quantization_rules
    from qformats.nn import QExperts, quantize_model, quantized_layers
    from qformats.quantize import dequantize

    hf = shared_hf("tiny")
    packed = flax_model(hf)
    quantize_model(packed, quantization_rules("W4A16:g16"))
    layers = quantized_layers(packed)
    for p in ("model/layers/0/self_attn/q_a_proj", "model/layers/0/self_attn/q_b_proj",
              "model/layers/0/self_attn/kv_a_proj_with_mqa", "model/layers/0/self_attn/kv_b_proj",
              "model/layers/0/self_attn/o_proj", "model/layers/0/mlp/gate_proj", "model/layers/1/mlp/experts/gate_proj",
              "model/layers/1/mlp/experts/down_proj", "model/layers/1/mlp/shared_experts/up_proj"):
        assert p in layers, p
    assert len(layers) == 2 * 5 + 3 + 6  # MLA x 2 layers, 1 dense MLP, 3 expert stacks + 3 shared
    assert isinstance(layers["model/layers/1/mlp/experts/up_proj"], QExperts)
    ref = flax_model(hf)
    for path, q in layers.items():
        node = ref
        for p in path.split("/"):
            node = node[int(p)] if p.isdigit() else getattr(node, p)
        if isinstance(q, QExperts):
            w = jnp.stack([dequantize(q.expert_weight(e), jnp.float32) for e in range(q.num_experts)])
        else:
            w = dequantize(q.kernel.get_value(), jnp.float32)
        node.kernel.set_value(w)
    got = np.asarray(forward(packed, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, np.asarray(forward(ref, jnp.asarray(IDS))), rtol=0, atol=LOGITS_ATOL)
