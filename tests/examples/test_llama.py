"""The small LLaMA-style decoder: KV-cache decoding equals the full forward pass; jit generate, quantized."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.llama import LlamaConfig, generate, small_llama
from qformats.nn import QLinear, Rule, param_bytes, quantize_model, quantized_layers

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=32)
PROMPT = jax.random.randint(jax.random.key(0), (2, 8), 0, CFG.vocab_size)
fwd = nnx.jit(lambda m, toks, start, cache: m(toks, start, cache))


@pytest.fixture(scope="module")
def dense():
    return small_llama(0, CFG)


def test_cached_decoding_equals_full_forward(dense):
    seq = jnp.concatenate([PROMPT, PROMPT[:, :3]], axis=1)
    full, _ = fwd(dense, seq, 0, dense.init_cache(2))
    _, cache = fwd(dense, PROMPT, 0, dense.init_cache(2))
    step, _ = fwd(dense, seq[:, 8:], 8, cache)
    np.testing.assert_allclose(np.asarray(step), np.asarray(full[:, 8:]), rtol=1e-4, atol=1e-4)


def test_generate_is_greedy_argmax_of_full_forward(dense):
    toks = generate(dense, PROMPT, 4)
    assert toks.shape == (2, 4) and toks.dtype == jnp.int32
    # teacher-forced: the full forward over prompt + generated tokens predicts each generated token
    logits, _ = fwd(dense, jnp.concatenate([PROMPT, toks[:, :3]], axis=1), 0, dense.init_cache(2))
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, 7:], -1)), np.asarray(toks))
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(dense, PROMPT, 30)


def test_quantized_generate(dense):
    model = small_llama(0, CFG)
    quantize_model(model, [Rule("lm_head", None), Rule(".*", "W8A16")])
    paths = sorted(quantized_layers(model))
    assert len(paths) == 2 * 7 and "lm_head" not in paths
    assert paths[0] == "layers/0/mlp/down_proj"
    assert isinstance(model.layers[1].self_attn.q_proj, QLinear)
    assert param_bytes(model) < param_bytes(dense)
    toks = generate(model, PROMPT, 4)
    assert toks.shape == (2, 4)
    ref, _ = fwd(dense, PROMPT, 0, dense.init_cache(2))
    got, _ = fwd(model, PROMPT, 0, model.init_cache(2))
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 0.02
