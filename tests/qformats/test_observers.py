"""qformats.observers: pure observers over batches, static scales, and the MSE clipping search for weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import dequantize, presets, quantize
from qformats.errors import SchemeError
from qformats.observers import (get_observer, minmax, moving_average, mse, mse_quantize, percentile,
                                static_scale)

BATCHES = [jnp.asarray(np.random.default_rng(i).standard_normal((16, 64)).astype(np.float32) * (i + 1))
           for i in range(3)]


def _run(obs):
    s = obs.init()
    for b in BATCHES:
        s = obs.update(s, b)
    return float(obs.result(s))


def test_minmax_and_moving_average_and_percentile():
    amaxes = [float(jnp.max(jnp.abs(b))) for b in BATCHES]
    assert _run(minmax()) == max(amaxes)
    m = amaxes[0]
    for a in amaxes[1:]:
        m = 0.5 * m + 0.5 * a
    np.testing.assert_allclose(_run(moving_average(0.5)), m, rtol=1e-6)
    p = np.mean([np.percentile(np.abs(np.asarray(b)), 99.0) for b in BATCHES])
    np.testing.assert_allclose(_run(percentile(99.0)), p, rtol=1e-5)
    # observers are pure: jit-able updates, state is a plain pytree
    obs = minmax()
    assert float(jax.jit(obs.update)(obs.init(), BATCHES[0])) == amaxes[0]


def test_mse_observer_clips_below_amax_and_lowers_error():
    scheme = presets["W4A8"].input_activations.__class__("int4", "tensor")
    a = _run(mse(scheme))
    assert 0 < a < _run(minmax())

    def err(amax):
        return sum(float(jnp.sum((b - dequantize(quantize(b, scheme, -1, scale=static_scale(amax, scheme)[0]))) ** 2))
                   for b in BATCHES)
    assert err(a) < err(_run(minmax()))
    with pytest.raises(SchemeError, match="unknown observer"):
        get_observer("nope", scheme)


def test_static_scale_follows_the_scheme_rule():
    fp8 = presets["FP8"].input_activations
    s, g = static_scale(7.0, fp8)
    assert g is None and s.shape == (1,)
    np.testing.assert_allclose(float(s[0]), 7.0 / 448.0, rtol=1e-7)
    s, g = static_scale(6.0, presets["NVFP4"].input_activations)
    assert s is None
    np.testing.assert_allclose(float(g[0]), 448.0 * 6.0 / 6.0, rtol=1e-6)
    with pytest.raises(SchemeError, match="static activation scales"):
        static_scale(1.0, presets["FP8_DYNAMIC"].input_activations)


W = jax.random.normal(jax.random.key(0), (256, 48)) * 0.02
W = W.at[5, 3].set(0.5)


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "NVFP4A16", "FP8_BLOCK"])
def test_mse_quantize_never_worse_per_group_and_same_layout(name):
    scheme = presets[name].weights
    imp = jnp.linspace(0.5, 2.0, 256)
    rtn = quantize(W, scheme, 0)
    q = mse_quantize(W, scheme, 0, importance=imp)
    assert q.nbytes == rtn.nbytes and q.scale.shape == rtn.scale.shape and q.scale.dtype == rtn.scale.dtype
    e_rtn = float(jnp.sum(imp[:, None] * (dequantize(rtn) - W) ** 2))
    e_mse = float(jnp.sum(imp[:, None] * (dequantize(q) - W) ** 2))
    assert e_mse <= e_rtn * (1 + 1e-6)
    if name in ("W4A16", "NVFP4A16"):
        assert e_mse < 0.97 * e_rtn


def test_mse_quantize_rejects_bad_importance():
    with pytest.raises(SchemeError, match="importance"):
        mse_quantize(W, presets["W4A16"].weights, 0, importance=jnp.ones(3))
