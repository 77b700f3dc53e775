"""qformats.dispatch: kernel registration, selection, cached weight layouts (`prepare_weight`), the flag."""

import jax.numpy as jnp
import numpy as np
import pytest

import qformats
from qformats import KernelError, dispatch, presets, quantize


@pytest.fixture
def fake_kernel():
    """A CPU 'kernel' whose layout is the dequantized weight, recording how it was called."""
    calls = []

    def prep(q):
        calls.append("prepare")
        return qformats.dequantize(q, jnp.float32)

    def fn(x, q, payload):
        calls.append("fn+payload" if payload is not None else "fn")
        w = prep(q) if payload is None else payload
        return (x.astype(jnp.float32) @ w + 1.0).astype(x.dtype)  # +1: tell it from the XLA path

    dispatch.register_kernel("fake", lambda x, q, b: b == "cpu" and (x is None or x.dtype == jnp.float32),
                             fn, priority=99, prepare=prep)
    try:
        yield calls
    finally:
        dispatch._REGISTRY[:] = [e for e in dispatch._REGISTRY if e.name != "fake"]


def test_payload_is_prepared_once_and_used(fake_kernel):
    q = quantize(np.random.default_rng(0).normal(size=(128, 16)).astype(np.float32), presets["W4A16"].weights, 0)
    x = jnp.ones((3, 128), jnp.float32)
    p = qformats.prepare_weight(q)
    assert p.name == "fake" and fake_kernel == ["prepare"]
    y = qformats.qdot(x, q, p)
    assert fake_kernel == ["prepare", "fn+payload"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(dispatch.xla_qdot(x, q)) + 1.0, rtol=1e-6)
    # an activation dtype the kernel does not take: XLA, payload ignored
    yb = qformats.qdot(x.astype(jnp.bfloat16), q, p)
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(dispatch.xla_qdot(x.astype(jnp.bfloat16), q)))
    qformats.set_kernels_enabled(False)
    try:
        assert qformats.prepare_weight(q) is None
        np.testing.assert_array_equal(np.asarray(qformats.qdot(x, q, p)), np.asarray(dispatch.xla_qdot(x, q)))
    finally:
        qformats.set_kernels_enabled(True)
    assert fake_kernel == ["prepare", "fn+payload"]


def test_payload_of_an_unregistered_kernel_is_ignored(fake_kernel):
    q = quantize(np.ones((128, 8), np.float32), presets["W8A16"].weights, 0)
    x = jnp.ones((1, 128), jnp.float32)
    stale = dispatch.KernelWeight("gone", jnp.zeros((128, 8)))
    y = qformats.qdot(x, q, stale)  # falls through to normal selection: the fake kernel, repacking itself
    assert fake_kernel == ["fn", "prepare"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(dispatch.xla_qdot(x, q)) + 1.0, rtol=1e-6)


def test_qdot_shape_errors_name_shapes_and_scheme():
    q = quantize(np.ones((128, 8), np.float32), presets["W8A16"].weights, 0)
    with pytest.raises(KernelError, match=r"K = 16.*K = 128"):
        qformats.qdot(jnp.ones((2, 16)), q)


def test_layer_without_a_kernel_has_no_cache():
    from flax import nnx
    from qformats.nn import Rule, prepare_kernels, quantize_model
    lin = nnx.Linear(128, 8, rngs=nnx.Rngs(0))

    class M(nnx.Module):
        def __init__(self):
            self.lin = lin

    m = quantize_model(M(), [Rule(".*", "W4A16")])
    assert m.lin.kernel_cache is None and prepare_kernels(m) == 0


@pytest.mark.slow
def test_prefill_holds_about_one_layer_of_dense_weights():
    """A packed model's prefill dequantizes each weight for XLA's GEMM; the dense copies must not all be live at
    once. Bound on the compiled `generate`'s temporary buffer: the dense model's own, plus the float32 size of
    one decoder layer's projections (a dequantize scheduled ahead of its layer input would hold all layers')."""
    from flax import nnx

    from qformats.models import generate as gen
    from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
    from qformats.nn import quantize_model

    # 2 layers: a schedule holding every layer's dense copies (2 layers' worth) is over the bound already
    cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=384,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    prompt = jnp.zeros((1, 16), jnp.int32)

    def temp_bytes(scheme):
        model = CausalLM(cfg, rngs=nnx.Rngs(0))
        if scheme:
            quantize_model(model, quantization_rules(scheme))
        compiled = gen.lower_generate(model, prompt, 4).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = 4 * (2 * d * cfg.num_heads * hd + 2 * d * cfg.num_kv_heads * hd + 3 * d * f)  # q, o, k, v, gate/up/down
    dense = temp_bytes(None)
    for scheme in ("W4A16_ASYM:g32", "MXFP4A16"):
        assert temp_bytes(scheme) <= dense + layer, (scheme, temp_bytes(scheme), dense, layer)
