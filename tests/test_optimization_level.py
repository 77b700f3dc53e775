"""The suite compiles lean (tests/conftest.py: JAX's jax_disable_most_optimizations, i.e. LLVM at -O0 without its
expensive passes, XLA:CPU's classic emitters, each program's code as one LLVM module). Exact numerics do not change:
quantize / dequantize of 13 presets' weights on every finite bfloat16 value, the packed and scaled matmuls and GPTQ's
inverse Hessian factor compute, bit for bit, what the fully optimized programs compute. Fused floating-point code may
change in its last bits: at full optimization XLA:CPU contracts a * b + c into one fused multiply-add (and computes
rsqrt and tanh otherwise); a tiny packed decoder's logits, stated bound."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from qformats import dequantize, presets, qdot, quantize, scaled_dot
from qformats.algorithms.gptq import gptq_hinv

# What each compilation gets on top of the process's defaults: explicit both ways (LEAN is what tests/conftest.py
# sets for the suite), so the comparison holds whatever the environment sets.
# XLA's defaults: backend optimization level 3, codegen split into 32 parts (xla/debug_options_flags.cc).
LEAN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
        "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
FULL = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
        "xla_cpu_use_fusion_emitters": True, "xla_cpu_parallel_codegen_split_count": 32}


def both(fn, *args):
    """fn(*args) compiled lean and fully optimized, the outputs as numpy trees."""
    lowered = jax.jit(fn).lower(*args)
    return [jax.tree.map(np.asarray, lowered.compile(opts)(*args)) for opts in (LEAN, FULL)]


def assert_bit_equal(a, b):
    """Same tree of arrays: dtypes, shapes and bytes (NaN payloads and signed zeros included)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        np.testing.assert_array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8))


def finite_bf16():
    """Every finite bfloat16 value (65,280), shuffled, as a [256, 255] weight (groups along the 256 rows)."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    v = bits[np.isfinite(bits.astype(np.float32))]
    return jnp.asarray(np.random.RandomState(0).permutation(v).reshape(256, 255))


WEIGHT_PRESETS = ["W4A16", "W4A16_ASYM", "W3A16", "W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16",
                  "MXFP6A16", "MXFP8A16", "FP6_E3M2", "FP5_E2M2_G32"]


@pytest.mark.parametrize("name", WEIGHT_PRESETS)
def test_quantize_and_dequantize_every_finite_bf16(name):
    scheme = presets[name].weights
    w = finite_bf16()
    lean, full = both(lambda w: (lambda q: (jax.tree.leaves(q), dequantize(q)))(quantize(w, scheme, axis=0)), w)
    assert_bit_equal(lean, full)


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "NVFP4A16", "MXFP4A16", "FP8_BLOCK", "FP6_E3M2"])
def test_packed_dot(name):
    w = jax.random.normal(jax.random.key(1), (256, 96), jnp.float32) * 0.05
    q = quantize(w, presets[name].weights, axis=0)
    for m in (1, 7):
        x = jax.random.normal(jax.random.key(m), (m, 256), jnp.bfloat16)
        lean, full = both(qdot, x, q)
        assert_bit_equal(lean, full)


@pytest.mark.parametrize("name", ["W8A8", "FP8_DYNAMIC", "FP8"])
def test_scaled_dot(name):
    s = presets[name]
    w = jax.random.normal(jax.random.key(1), (256, 96), jnp.float32) * 0.05
    q = quantize(w, s.weights, axis=0)
    x = jax.random.normal(jax.random.key(2), (5, 256), jnp.float32)
    lean, full = both(lambda x, q: scaled_dot(quantize(x, s.input_activations, axis=-1), q), x, q)
    assert_bit_equal(lean, full)


def test_gptq_inverse_hessian_factor():
    x = jax.random.normal(jax.random.key(3), (512, 96), jnp.float32)
    lean, full = both(gptq_hinv, x.T @ x)
    assert_bit_equal(lean, full)


def test_the_options_take_effect_a_times_b_plus_c():
    """Lean: a * b + c rounded twice, as numpy computes it; full: one fused multiply-add (rounded once), which
    differs somewhere in 4096 random products."""
    a, b, c = (np.asarray(jax.random.normal(jax.random.key(i), (4096,), jnp.float32)) for i in range(3))
    lean, full = both(lambda a, b, c: a * b + c, a, b, c)
    np.testing.assert_array_equal(lean, a * b + c)
    fma = (a.astype(np.float64) * b + c).astype(np.float32)  # a * b exact in float64; rounded twice only on ties
    assert np.mean(full == fma) > 0.999 and np.any(full != lean)


def test_tiny_packed_decoder_logits_and_cache_step():
    """A 2-layer llama with W4A16:g16 packed projections, prefill logits and one cached decode step: within a few
    float32 ulps of the fully optimized program (fused multiply-adds in the norms, attention and dequantize):
    measured 4.7e-7 of the largest |logit|, bounded at 1e-5."""
    from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
    from qformats.nn import quantize_model

    cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=128))
    model = quantize_model(CausalLM(cfg, rngs=nnx.Rngs(0)), quantization_rules("W4A16:g16"))
    graph, state = nnx.split(model)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 96, (2, 9)))

    def run(state, ids):
        m = nnx.merge(graph, state)
        logits, cache = m(ids, m.init_cache(2, 16))
        return logits, m(jnp.argmax(logits[:, -1:], -1).astype(jnp.int32), cache)[0]

    lean, full = both(run, state, ids)
    for x, y in zip(lean, full):
        print(f"max |lean - full| / max |full|: {np.max(np.abs(x - y)) / np.max(np.abs(y)):.2e}")
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * float(np.max(np.abs(y))))
