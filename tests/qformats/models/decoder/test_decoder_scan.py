"""qformats.models.decoder.scan: a model whose layers are grouped into scanned runs computes the unrolled model's
values bit for bit (logits without and with a cache, greedy tokens), for dense, packed, fp8-KV-cache, sliding-window
and heterogeneous stacks; its traced program does not grow with depth; stacking releases the per-layer arrays."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.errors import ModelError
from qformats.kv_cache import KVCacheScheme
from qformats.matching import Rule
from qformats.models.decoder import CausalLM, DecoderConfig, enable_kv_cache_quantization, quantization_rules
from qformats.models.decoder.scan import ScannedLayers, layer_runs, scan_layers
from qformats.models.generate import generate
from qformats.nn import quantize_model

# 2 layers: the fewest a scanned run takes (the heterogeneous stack: 4, two runs of 2)
BASE = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": {},
    # layer 0 full attention, 1 a window of 4: one run, the window picked per layer as data
    "qwen2_windows": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3_tied": dict(model_type="qwen3", head_dim=8, tie_word_embeddings=True),
}
IDS = np.random.RandomState(0).randint(0, 96, (2, 9))
step = nnx.jit(lambda m, ids, cache: m(ids, cache))
forward = nnx.jit(lambda m, ids: m(ids)[0])


def build(extra=None, seed=0, layers=None):
    cfg = DecoderConfig.from_hf({**BASE, **(extra or {}), **({} if layers is None else {"num_hidden_layers": layers})})
    return CausalLM(cfg, rngs=nnx.Rngs(seed))


def scanned_copy(model):
    return scan_layers(nnx.clone(model))


def assert_same_values(a, b, tokens=False):
    """a (per-layer) and b (scanned): logits without a cache, a cached prefill then 2 decode steps (and with
    `tokens` generate's greedy tokens)."""
    np.testing.assert_array_equal(np.asarray(forward(a, IDS)), np.asarray(forward(b, IDS)))
    ca, cb = a.init_cache(2, 16), b.init_cache(2, 16)
    ids = jnp.asarray(IDS)
    for _ in range(3):
        (la, ca), (lb, cb) = step(a, ids, ca), step(b, ids, cb)
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
        ids = jnp.argmax(la[:, -1:], axis=-1).astype(jnp.int32)
    assert int(ca.length) == int(cb.length) == 11
    if tokens:
        np.testing.assert_array_equal(np.asarray(generate(a, IDS, 6)), np.asarray(generate(b, IDS, 6)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scanned_model_computes_the_unrolled_values(name):
    a = build(CONFIGS[name])
    b = scanned_copy(a)
    assert isinstance(b.model.layers, ScannedLayers) and layer_runs(b) == [(0, 2)]
    if name == "qwen2_windows":
        assert b.model.layers.runs[0].windows == (None, 4)
    assert_same_values(a, b, tokens=name == "qwen2_windows")


# packed layers with a float cache: the heterogeneous stack below (its first run is this W4A16:g16 stack)
@pytest.mark.parametrize("kv", ["tensor", "dynamic"])
def test_packed_layers_and_fp8_kv_cache(kv):
    a = build()
    quantize_model(a, quantization_rules("W4A16:g16"))
    if kv == "tensor":  # static scales
        rng = np.random.RandomState(1)
        enable_kv_cache_quantization(a, KVCacheScheme("tensor"),
                                     [(rng.uniform(0.01, 0.02, (1,)), rng.uniform(0.01, 0.02, (1,)))
                                      for _ in range(2)])
    else:
        enable_kv_cache_quantization(a, KVCacheScheme("tensor", dynamic=True))
    b = scanned_copy(a)
    cache = b.init_cache(2, 16)
    assert cache.keys[0].shape == (2, 2, 2, 16, 8)
    assert cache.keys[0].dtype == jnp.uint8
    assert (cache.key_scales is not None) == (kv == "dynamic")
    assert_same_values(a, b)


def test_heterogeneous_stack_forms_one_run_per_structure():
    a = build(layers=4)
    quantize_model(a, [Rule(r"model/layers/[01]/.*_proj", "W4A16:g16"), Rule(r"model/layers/[23]/.*_proj", "W8A16:g16")])
    assert layer_runs(a) == [(0, 2), (2, 2)]
    b = scanned_copy(a)
    assert [(r.first, r.count) for r in b.model.layers.runs] == [(0, 2), (2, 2)]
    cache = b.init_cache(2, 16)
    assert cache.keys[1].shape[0] == 2
    assert cache.keys[0].dtype == jnp.float32 and cache.key_scales is None  # packed layers, a float cache
    assert_same_values(a, b)


def test_traced_program_does_not_grow_with_depth():
    def equations(layers, scan):
        m = build(layers=layers)
        if scan:
            scan_layers(m)
        graphdef, state = nnx.split(m)
        f = lambda st, ids: nnx.merge(graphdef, st)(ids, nnx.merge(graphdef, st).init_cache(2, 16))[0]  # noqa: E731
        return len(str(jax.make_jaxpr(f)(state, jnp.asarray(IDS))).splitlines())

    assert equations(2, True) == equations(4, True)
    assert equations(4, False) > equations(2, False)


def test_stacking_releases_the_per_layer_arrays():
    m = build()
    quantize_model(m, quantization_rules("W4A16:g16"))
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    scan_layers(m)
    gc.collect()
    assert sum(a.nbytes for a in jax.live_arrays()) == before
    assert scan_layers(m) is m  # already scanned: unchanged


def test_dynamic_kv_cache_refuses_per_row_lengths():
    m = build()
    enable_kv_cache_quantization(m, KVCacheScheme("tensor", dynamic=True))
    with pytest.raises(ModelError, match="dynamic fp8 KV-cache scheme shares one scale"):
        m.init_cache(2, 16, per_row=True)
    with pytest.raises(ModelError, match="prompts of one length"):
        generate(m, [IDS[0, :3], IDS[1]], 4)


def test_float_projections_become_row_linears_with_one_row_within_summation_order():
    """On CPU the float projections of a scanned run are `RowLinear`s (kernel stacked transposed): several rows are
    the unrolled values bit for bit (the tests above), one row (a batch-1 decode step) equals them up to float32
    summation order; row_linear=False keeps nnx.Linear."""
    from qformats.models.decoder.scan import RowLinear

    a = build()
    b = scanned_copy(a)
    attn = b.model.layers.runs[0].layer.self_attn
    assert isinstance(attn.q_proj, RowLinear) and attn.q_proj.kernel_t.get_value().shape == (2, 32, 32)
    assert isinstance(b.model.layers.runs[0].layer.mlp.down_proj, RowLinear)
    assert type(scan_layers(nnx.clone(a), row_linear=False).model.layers.runs[0].layer.self_attn.q_proj) is nnx.Linear
    ids = jnp.asarray(IDS[:1])
    ca, cb = a.init_cache(1, 16), b.init_cache(1, 16)
    (_, ca), (_, cb) = step(a, ids, ca), step(b, ids, cb)
    tok = jnp.asarray([[3]], jnp.int32)
    (la, _), (lb, _) = step(a, tok, ca), step(b, tok, cb)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(generate(a, IDS[0], 6)), np.asarray(generate(b, IDS[0], 6)))


def test_row_linear_chunks_long_rows():
    """K over ROW_CHUNK: the one-row product is summed over chunks; equal to nnx.Linear up to summation order, and
    bit for bit for several rows."""
    from qformats.models.decoder.scan import ROW_CHUNK, RowLinear

    lin = nnx.Linear(ROW_CHUNK + 100, 8, rngs=nnx.Rngs(0))
    row = RowLinear(lin)
    x = jax.random.normal(jax.random.key(1), (3, ROW_CHUNK + 100))
    f = nnx.jit(lambda m, v: m(v))
    np.testing.assert_array_equal(np.asarray(f(row, x)), np.asarray(f(lin, x)))
    np.testing.assert_allclose(np.asarray(f(row, x[:1])), np.asarray(f(lin, x[:1])), rtol=1e-5, atol=1e-5)
