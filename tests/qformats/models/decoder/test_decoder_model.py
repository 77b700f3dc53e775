"""qformats.models.decoder.model: the llama / mistral / qwen2 / qwen3 decoder against transformers on the same random
weights: float32 logits, cached decoding, greedy generation token for token; config parsing, packed layers."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder import (  # noqa: E402
    CausalLM, DecoderConfig, RopeConfig, hf_tensor_names, load_hf_tensors, module_path, quantization_rules
)
from qformats.models.generate import generate  # noqa: E402
from qformats.nn import QLinear, quantize_model, quantized_layers  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

# Measured max |logits - transformers'| over these configs: 1.8e-6 .. 2.3e-6 (float32, logits up to 3.6 in
# magnitude). The bound allows for accumulation order only.
LOGITS_ATOL = 1e-5
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, eos_token_id=None,
             bos_token_id=None, pad_token_id=None)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3_rope_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24, attention_bias=True)),
}
IDS = np.random.RandomState(0).randint(0, 256, (2, 20))
forward = nnx.jit(lambda m, ids: m(ids)[0])


def hf_model(family):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**SMALL, **extra})).eval()
    # non-trivial norm weights and biases (HF initialises them to ones / zeros)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return hf


def abstract_model(cfg_dict):
    """A CausalLM without initialised weights (what a loader builds before filling it)."""
    return nnx.eval_shape(lambda: CausalLM(DecoderConfig.from_hf(cfg_dict), rngs=nnx.Rngs(0)))


def flax_model(hf):
    return load_hf_tensors(abstract_model(hf.config.to_dict()), {k: v.numpy() for k, v in hf.state_dict().items()})


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    hf = hf_model(request.param)
    return request.param, hf, flax_model(hf)


def test_config_fields(pair):
    family, hf, model = pair
    c = model.config
    assert (c.num_heads, c.num_kv_heads, c.num_layers) == (4, 2, 2)
    assert c.head_dim == (24 if family == "qwen3" else 16)
    assert c.tie_word_embeddings == (family in ("llama3_rope_tied", "qwen2"))
    assert (model.lm_head is None) == c.tie_word_embeddings
    assert c.qk_norm == (family == "qwen3")
    assert c.qkv_bias == (family in ("llama3_rope_tied", "qwen2", "qwen3"))
    assert c.sliding_windows == ((8, 8) if family == "mistral_window" else (None, None))
    assert c.rope.rope_type == ("llama3" if family == "llama3_rope_tied" else "default")
    # the RoPE frequencies equal transformers' own
    np.testing.assert_allclose(c.rope.inv_freq(c.head_dim), hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    # every HF parameter has exactly one slot, and every Linear sits at its HF module path
    tied_copy = {"lm_head.weight"} if c.tie_word_embeddings else set()  # HF lists the tied table twice
    assert set(hf_tensor_names(c)) == set(hf.state_dict()) - tied_copy
    linears = {module_path(n) for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    flax_linears = {"/".join(map(str, p)) for p, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)}
    assert flax_linears == linears - ({"lm_head"} if c.tie_word_embeddings else set())


def test_logits_match_transformers(pair):
    _, hf, model = pair
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(IDS)))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # logits far from uniform, so the bound below is meaningful
    np.testing.assert_allclose(got, ref, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("family", ["mistral_window", "qwen3"])  # greedy parity covers the others' caches
def test_cached_prefill_and_decode_equal_full_forward(family):
    model = flax_model(hf_model(family))
    ids = jnp.asarray(IDS)
    full = forward(model, ids)
    step = nnx.jit(lambda m, ids, c: m(ids, c))
    cache = model.init_cache(2, 24)
    logits, cache = step(model, ids[:, :12], cache)
    parts = [logits]
    for i in range(12, 20):  # one token at a time: the decode path (windowed layers see past the window)
        logits, cache = step(model, ids[:, i:i + 1], cache)
        parts.append(logits)
    assert int(cache.length) == 20
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, axis=1)), np.asarray(full), rtol=0, atol=1e-5)
    with pytest.raises(ModelError, match="cache holds 24 positions"):
        model(ids[:, :5], cache)


def test_greedy_generation_matches_transformers(pair):
    _, hf, model = pair
    prompt = IDS[:, :10]
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          pad_token_id=0)[:, 10:].numpy()
    got = np.asarray(generate(model, prompt, 32))
    assert got.shape == (2, 32) and got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)


# ---------------------------------------------------------------------------------------------- config

def test_from_hf_reads_legacy_keys_and_defaults():
    base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    c = DecoderConfig.from_hf(base)
    assert c.num_kv_heads == 4 and c.head_dim == 16 and c.rope == RopeConfig("default", 10000.0)
    assert c.rms_norm_eps == 1e-6 and not c.tie_word_embeddings and c.dtype is None
    legacy = DecoderConfig.from_hf({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16", "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert legacy.rope == RopeConfig("llama3", 5e5, 8.0, 1.0, 4.0, 2048) and legacy.dtype == "bfloat16"
    # transformers' per-family defaults: qwen3 head_dim 128, mistral 8 KV heads and a 4096 window
    assert DecoderConfig.from_hf({**base, "model_type": "qwen3"}).head_dim == 128
    m = DecoderConfig.from_hf({**base, "model_type": "mistral", "num_attention_heads": 8})
    assert m.num_kv_heads == 8 and m.sliding_windows == (4096, 4096)
    q = DecoderConfig.from_hf({**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
                               "max_window_layers": 1})
    assert q.sliding_windows == (None, 16) and q.qkv_bias and not q.o_bias
    assert DecoderConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 16}).sliding_windows == (None,) * 2


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gemma"), "model_type 'gemma' is not supported; supported model types: llama, mistral, qwen2"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope type 'longrope' is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "llama3 rope parameters lack"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    (dict(hidden_size=None), "missing 'hidden_size'"),
    (dict(model_type="qwen2", layer_types=["full_attention", "chunked"]), "layer_types"),
])
def test_from_hf_refuses_what_it_cannot_compute(change, message):
    base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    with pytest.raises(ModelError, match=message.replace("(", r"\(")):
        DecoderConfig.from_hf({**base, **change})


# ---------------------------------------------------------------------------------------------- packed

PACKABLE = dict(SMALL, hidden_size=128, intermediate_size=256, num_hidden_layers=1)


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_packed_forward_equals_float_model_on_dequantized_weights(scheme):
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**PACKABLE)).eval()
    packed = flax_model(hf)
    quantize_model(packed, quantization_rules(scheme))
    layers = quantized_layers(packed)
    assert len(layers) == 7 and all(isinstance(m, QLinear) for m in layers.values())
    assert "lm_head" not in layers and isinstance(packed.lm_head, nnx.Linear)
    # the float model with each kernel replaced by its dequantized packed weight
    ref = flax_model(hf)
    for path, q in layers.items():
        node = ref
        for p in path.split("/"):
            node = node[int(p)] if p.isdigit() else getattr(node, p)
        node.kernel.set_value(dequantize(q.kernel.get_value(), jnp.float32))
    got = np.asarray(forward(packed, jnp.asarray(IDS)))
    want = np.asarray(forward(ref, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # accumulation order only
