"""qformats.algorithms.weight_search: the one list of weight-search names, round-to-nearest, the output error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats import dequantize, presets, quantize
from qformats.algorithms.gptq import GPTQOptions, gptq_quantize
from qformats.algorithms.weight_search import (NEEDS_HESSIAN, WEIGHT_SEARCHES, output_error, quantize_projection,
                                               quantize_weight, search_name)
from qformats.errors import ModelError
from qformats.nn import Rule, quantize_linen, quantize_model
from qformats.presets import parse_scheme

W = jax.random.normal(jax.random.key(0), (128, 32)) * 0.1


def _leaves_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_names():
    assert WEIGHT_SEARCHES == ("rtn", "mse", "gptq", "mse+gptq")
    assert set(NEEDS_HESSIAN) == {"gptq", "mse+gptq"}
    assert search_name(None) == "rtn" and search_name("gptq") == "gptq"
    with pytest.raises(ModelError, match=r"here must be one of \('rtn', 'mse'\), got 'gptq'"):
        search_name("gptq", ("rtn", "mse"), where="here")


def test_rtn_is_quantize_and_none_is_its_alias():
    ss = presets["W4A16"]
    want = quantize(W, ss.weights, 0)
    _leaves_equal(quantize_weight(W, ss, "rtn"), want)
    _leaves_equal(quantize_weight(W, ss, None), want)
    _leaves_equal(quantize_weight(W, ss), want)
    with pytest.raises(ModelError, match="needs the layer inputs' second moments"):
        quantize_weight(W, ss, "gptq")


def test_quantize_model_takes_rtn_and_none_alike():
    def model():
        class One(nnx.Module):
            def __init__(self):
                self.lin = nnx.Linear(128, 32, rngs=nnx.Rngs(1))
        return One()

    a, b = model(), model()
    quantize_model(a, [Rule(".*", "W4A16")], weight_search="rtn")
    quantize_model(b, [Rule(".*", "W4A16")], weight_search=None)
    assert a.lin.weight_method == b.lin.weight_method == "rtn"
    _leaves_equal(a.lin.kernel.get_value(), b.lin.kernel.get_value())


def test_quantize_linen_takes_rtn_and_mse_only():
    import flax.linen as nn
    x = jnp.ones((2, 128))
    module = nn.Dense(32)
    params = module.init(jax.random.key(2), x)
    _, q1 = quantize_linen(module, params, [Rule(".*", "W4A16")], weight_search="rtn")
    _, q2 = quantize_linen(module, params, [Rule(".*", "W4A16")], weight_search=None)
    _leaves_equal(q1, q2)
    with pytest.raises(ModelError, match="weight_search must be one of \\('rtn', 'mse'\\)"):
        quantize_linen(module, params, [Rule(".*", "W4A16")], weight_search="gptq")


def test_output_error_is_the_trace_formula():
    ss = presets["W4A16"]
    q = quantize(W, ss.weights, 0)
    x = np.asarray(jax.random.normal(jax.random.key(3), (64, 128)), np.float64)
    h = x.T @ x / 64
    d = np.asarray(dequantize(q, jnp.float32), np.float64) - np.asarray(W, np.float64)
    want = np.trace(d.T @ h @ d)
    # float32 accumulation in the library against float64 here
    np.testing.assert_allclose(output_error(q, W, jnp.asarray(h, jnp.float32)), want, rtol=1e-4)


def test_guard_is_the_output_error_comparison():
    """_search_wins (one product by H: sum((Q - R) * H (dq + dr)) < 0) decides as comparing the two output errors
    tr(dW^T H dW) in float64 does, both ways round and on a tie (the same QArray: RTN kept)."""
    from qformats.algorithms.weight_search import _search_wins

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    x = rng.standard_normal((256, 64)) * np.linspace(0.1, 3, 64)
    h = x.T @ x / 256
    ss = parse_scheme("W4A16:g32")
    rtn = quantize(w, ss.weights, 0)
    g = gptq_quantize(w, ss.weights, jnp.asarray(h, jnp.float32), actorder="static")

    def err(q):
        d = np.asarray(dequantize(q, jnp.float32), np.float64) - np.asarray(w, np.float64)
        return np.trace(d.T @ h @ d)

    assert err(g) < err(rtn)
    hf = jnp.asarray(h, jnp.float32)
    assert bool(_search_wins(g, rtn, w, hf)) and not bool(_search_wins(rtn, g, w, hf))
    assert not bool(_search_wins(rtn, rtn, w, hf))


def test_quantize_projection_options():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((256, 64)) * np.linspace(0.1, 3, 64), jnp.float32)
    h = x.T @ x / 256
    ss = parse_scheme("W4A16:g32")
    for opts in (GPTQOptions(), GPTQOptions(block_size=16, dampening_frac=0.1, actorder=None)):
        q, method = quantize_projection(w, ss, h, "gptq", opts, guard=False)
        ref = gptq_quantize(w, ss.weights, h, block_size=opts.block_size, dampening_frac=opts.dampening_frac,
                            actorder=opts.actorder)
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(ref.codes))
        assert method == "gptq"


def test_search_text_says_how_weights_were_quantized():
    from qformats.algorithms.weight_search import search_text

    assert search_text(210, 0, "rtn") == "round-to-nearest"  # not "(0 by rtn)"
    assert search_text(210, 200, "gptq") == "200 by gptq, 10 round-to-nearest"
