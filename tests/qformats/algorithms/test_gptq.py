"""gptq_quantize: reduces to RTN for H = c I, beats RTN on correlated inputs, dead inputs, layouts, errors;
gptq_quantize_shared equals separate calls.

Parity with llm-compressor's own GPTQ (torch) is measured by bench/gptq_parity.py (it needs the llm-compressor
venv, whose compressed-tensors pin differs from this project's test extra).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import QuantScheme, SchemeError, dequantize, presets, quantize
from qformats.formats import FloatFormat
from qformats.algorithms.gptq import gptq_hinv, gptq_quantize, gptq_quantize_shared
from qformats.observers import mse_quantize

K, N = 128, 48
W = jax.random.normal(jax.random.key(0), (K, N), jnp.float32) * 0.05


def _inputs(k=K, tokens=1024, seed=1):
    """Calibration inputs with strongly correlated features (where GPTQ's error feedback pays off)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    mix = jnp.eye(k) + 0.8 * jax.random.normal(k1, (k, k)) / np.sqrt(k)
    x = jax.random.normal(k2, (tokens, k)) @ mix * jnp.exp(0.5 * jax.random.normal(k3, (k,)))
    return x, x.T @ x / tokens


X, H = _inputs()

SCHEMES = {
    "W4A16": presets["W4A16"].weights,
    "W4A16_ASYM": presets["W4A16_ASYM"].weights,
    "W8A16": presets["W8A16"].weights,
    "W8A8 (int8 channel)": presets["W8A8"].weights,
    "int4 g32": QuantScheme("int4", "group", group_size=32, scale_format="input"),
    "FP8_DYNAMIC (fp8 channel)": presets["FP8_DYNAMIC"].weights,
    "FP8 (tensor)": presets["FP8"].weights,
    "FP8_BLOCK": presets["FP8_BLOCK"].weights,
    "NVFP4A16": presets["NVFP4A16"].weights,
    "MXFP4A16": presets["MXFP4A16"].weights,
    "MXFP6A16": presets["MXFP6A16"].weights,
    "FP6_E3M2 (channel)": presets["FP6_E3M2"].weights,
}


def _codes_up_to_zero_sign(q, scheme):
    """Element codes with a float format's -0 code mapped to +0 (re-quantizing an exact -0 gives +0)."""
    c = np.asarray(q.element_codes()).astype(np.int32)
    if isinstance(scheme.format, FloatFormat):
        c = np.where(c == 1 << (scheme.bits - 1), 0, c)
    return c


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_identity_hessian_is_rtn(name):
    # H = c I: U is diagonal, so no error reaches another column and every column is rounded to nearest
    scheme = SCHEMES[name]
    rtn = quantize(W, scheme, 0)
    q = gptq_quantize(W, scheme, 3.0 * jnp.eye(K))
    q.check()
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(rtn.scale))
    for part in ("zero_point", "global_scale"):
        a, b = getattr(q, part), getattr(rtn, part)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(dequantize(q)), np.asarray(dequantize(rtn)))
    if not isinstance(scheme.format, FloatFormat):  # integer codes: bit-identical packed bytes
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(rtn.codes))
    # floats: RTN keeps the -0 code of tiny negatives; GPTQ's output -0.0 re-quantizes to +0, as
    # compressed-tensors compresses llm-compressor's GPTQ output
    np.testing.assert_array_equal(_codes_up_to_zero_sign(q, scheme), _codes_up_to_zero_sign(rtn, scheme))


def _out_err(wq):
    return float(jnp.sum((X @ W - X @ dequantize(wq, jnp.float32)) ** 2))


@pytest.mark.parametrize("name", ["int4 g32", "FP8_DYNAMIC (fp8 channel)", "W4A16_ASYM", "NVFP4A16"])
def test_gptq_beats_rtn_on_correlated_inputs(name):
    scheme = SCHEMES[name]
    e_rtn = _out_err(quantize(W, scheme, 0))
    e_gptq = _out_err(gptq_quantize(W, scheme, H))
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_hessian_scale_does_not_matter():
    # llm-compressor accumulates 2/n sum x x^T; the dampening is relative to mean(diag H)
    scheme = SCHEMES["W4A16"]
    a = np.asarray(gptq_quantize(W, scheme, H).element_codes())
    b = np.asarray(gptq_quantize(W, scheme, 2048.0 * H).element_codes())
    assert np.mean(a == b) > 0.999


@pytest.mark.parametrize("block_size", [16, 48, 128, 1000])
def test_block_size_only_reorders_the_arithmetic(block_size):
    # the lazy batch update is an exact rewrite of the column-by-column update (48: K padded to 144)
    scheme = SCHEMES["int4 g32"]
    ref = np.asarray(gptq_quantize(W, scheme, H, block_size=1).element_codes())
    got = np.asarray(gptq_quantize(W, scheme, H, block_size=block_size).element_codes())
    assert np.mean(ref == got) > 0.995


def test_dead_inputs_are_zeroed_and_scales_stay_those_of_the_original_weight():
    dead = np.zeros(K, bool)
    dead[[3, 40, 41, 127]] = True
    x = jnp.where(jnp.asarray(dead)[None, :], 0.0, X)
    h = x.T @ x / x.shape[0]
    for name in ("W4A16_ASYM", "FP8_DYNAMIC (fp8 channel)"):
        scheme = SCHEMES[name]
        q = gptq_quantize(W, scheme, h)
        y = np.asarray(dequantize(q))
        assert np.all(y[dead] == 0) and np.all(np.isfinite(y))
        np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(quantize(W, scheme, 0).scale))
        assert np.any(y[~dead] != 0)
    u, d, fallback = gptq_hinv(h)
    assert not bool(fallback) and np.array_equal(np.asarray(d), dead)


def test_hinv_is_upper_cholesky_of_dampened_inverse():
    u, _, _ = gptq_hinv(H, 0.01)
    u = np.asarray(u, np.float64)
    hd = np.asarray(H, np.float64) + 0.01 * np.mean(np.diag(np.asarray(H))) * np.eye(K)
    assert np.all(np.tril(u, -1) == 0)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(hd), rtol=2e-3, atol=1e-4 * np.abs(np.linalg.inv(hd)).max())


def test_host_hinv_is_the_traced_one_on_one_blas_thread():
    """gptq_hinv_host (LAPACK, one BLAS thread) agrees with the traced gptq_hinv; inside its thread limit every
    BLAS library threadpoolctl sees runs one thread, and the limit is lifted after."""
    from qformats.algorithms.gptq import _one_blas_thread, gptq_hinv_host

    u_host, d_host, fb_host = gptq_hinv_host(H, 0.01)
    u, d, fb = gptq_hinv(H, 0.01)
    assert not bool(fb_host) and not bool(fb) and np.array_equal(np.asarray(d_host), np.asarray(d))
    np.testing.assert_allclose(np.asarray(u_host), np.asarray(u), rtol=1e-3, atol=1e-3 * float(jnp.abs(u).max()))
    threadpoolctl = pytest.importorskip("threadpoolctl")
    before = [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    with _one_blas_thread():
        inside = [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    after = [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    assert inside and set(inside) == {1} and after == before


def test_axis_1_and_higher_rank_layouts():
    scheme = SCHEMES["W4A16_ASYM"]
    q0 = gptq_quantize(W, scheme, H)
    q1 = gptq_quantize(W.T, scheme, H, axis=1)  # torch layout [N, K]
    np.testing.assert_array_equal(np.asarray(q1.codes), np.asarray(q0.codes))
    q3 = gptq_quantize(W.reshape(K, 6, 8), scheme, H)  # DenseGeneral kernel [K, heads, dim]
    np.testing.assert_array_equal(np.asarray(q3.codes).reshape(q0.codes.shape), np.asarray(q0.codes))


def test_bf16_weights_keep_dtype_and_round_in_float32():
    # llm-compressor runs GPTQ on a float32 copy: x / s is divided in float32 with the bf16 scale, where
    # RTN on the bf16 weight divides in bf16 (a double rounding that moves a few ties). H = I therefore
    # gives RTN of the float32 upcast under the bf16 scales (bench/gptq_parity.py: 100% codes vs llm-compressor).
    wb = W.astype(jnp.bfloat16)
    scheme = SCHEMES["W4A16"]
    q = gptq_quantize(wb, scheme, jnp.eye(K))
    rtn = quantize(wb, scheme, 0)
    assert q.dtype == jnp.bfloat16 and q.scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(rtn.scale))
    rtn32 = quantize(wb.astype(jnp.float32), scheme, 0, scale=rtn.scale)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(rtn32.codes))
    assert np.mean(np.asarray(q.codes) == np.asarray(rtn.codes)) > 0.95
    assert _out_err(gptq_quantize(wb, scheme, H)) < _out_err(rtn)


def test_given_qparams_are_used():
    scheme = SCHEMES["int4 g32"]
    mq = mse_quantize(W, scheme, 0, importance=jnp.diagonal(H))
    q = gptq_quantize(W, scheme, H, qparams=mq)
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(mq.scale))
    with pytest.raises(SchemeError, match="qparams"):
        gptq_quantize(W, scheme, H, qparams=quantize(W, SCHEMES["W4A16"], 0))


def test_jit_matches_eager():
    scheme = SCHEMES["W4A16"]
    f = jax.jit(lambda w, h: gptq_quantize(w, scheme, h).codes)
    np.testing.assert_array_equal(np.asarray(f(W, H)), np.asarray(gptq_quantize(W, scheme, H).codes))


def test_not_positive_definite_falls_back_to_rtn_with_a_warning():
    scheme = SCHEMES["W4A16"]
    with pytest.warns(UserWarning, match="not positive definite"):
        q = gptq_quantize(W, scheme, -jnp.eye(K))
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(quantize(W, scheme, 0).codes))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gptq_quantize(W, scheme, H)


def test_bad_inputs():
    scheme = SCHEMES["W4A16"]
    with pytest.raises(SchemeError, match=r"shape \(128, 128\).*\(64, 128\)"):
        gptq_quantize(W, scheme, H[:64])
    with pytest.raises(SchemeError, match="non-finite"):
        gptq_quantize(W, scheme, H.at[3, 5].set(jnp.nan))
    with pytest.raises(SchemeError, match="non-finite"):
        gptq_quantize(W, scheme, H.at[0, 0].set(jnp.inf))
    with pytest.raises(SchemeError, match="block_size"):
        gptq_quantize(W, scheme, H, block_size=0)
    with pytest.raises(SchemeError, match="dampening_frac"):
        gptq_quantize(W, scheme, H, dampening_frac=-0.1)
    with pytest.raises(SchemeError, match="ndim >= 2"):
        gptq_quantize(W[:, 0], scheme, H)
    with pytest.raises(SchemeError, match="QuantScheme"):
        gptq_quantize(W, presets["W4A16"], H)
    with pytest.raises(SchemeError, match="does not divide"):
        gptq_quantize(W[:100], scheme, H[:100, :100])


# ---- activation order ("static" / "weight") ------------------------------------------------------------------
def _outlier_inputs(seed, k=K, n=N, tokens=1024):
    """W and correlated calibration inputs with k // 16 outlier input channels (x8): where act order pays."""
    ks = jax.random.split(jax.random.key(100 + seed), 5)
    w = jax.random.normal(ks[0], (k, n)) * 0.05
    mix = jnp.eye(k) + 0.8 * jax.random.normal(ks[1], (k, k)) / np.sqrt(k)
    fs = jnp.exp(0.5 * jax.random.normal(ks[2], (k,)))
    fs = fs.at[jax.random.choice(ks[3], k, (k // 16,), replace=False)].multiply(8.0)
    x = jax.random.normal(ks[4], (tokens, k)) @ mix * fs
    return w, x


def test_actorder_static_beats_column_order_on_outlier_inputs():
    # W4A16 group 32; measured per seed: static / off = 0.49-0.73 of the output error (mean 0.60)
    scheme = SCHEMES["int4 g32"]
    ratios = []
    for seed in range(4):
        w, x = _outlier_inputs(seed)
        h = x.T @ x / x.shape[0]

        def err(q):
            return float(jnp.sum((x @ w - x @ dequantize(q, jnp.float32)) ** 2))

        ratios.append(err(gptq_quantize(w, scheme, h, actorder="static")) / err(gptq_quantize(w, scheme, h)))
    assert np.mean(ratios) < 0.8 and max(ratios) < 0.95, ratios


@pytest.mark.parametrize("name", ["int4 g32", "W4A16_ASYM", "NVFP4A16", "FP8_BLOCK"])
def test_actorder_static_keeps_rtn_scales_and_weight_is_its_alias(name):
    # llm-compressor: the observer's scales of the original weight; each column keeps its own group (g_idx[perm])
    scheme = SCHEMES[name]
    w, x = _outlier_inputs(0)
    h = x.T @ x / x.shape[0]
    rtn = quantize(w, scheme, 0)
    q = gptq_quantize(w, scheme, h, actorder="static")
    q.check()
    for part in ("scale", "zero_point", "global_scale"):
        a, b = getattr(q, part), getattr(rtn, part)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(gptq_quantize(w, scheme, h, actorder="weight").codes),
                                  np.asarray(q.codes))
    # a different order from column order, same as column order where diag(H) is constant (perm = identity)
    assert np.mean(np.asarray(q.codes) != np.asarray(gptq_quantize(w, scheme, h).codes)) > 0.01
    np.testing.assert_array_equal(np.asarray(gptq_quantize(W, scheme, 3.0 * jnp.eye(K), actorder="static").codes),
                                  np.asarray(gptq_quantize(W, scheme, 3.0 * jnp.eye(K)).codes))


def test_actorder_static_is_column_order_on_the_permuted_problem_channel():
    # per-output-channel scales do not depend on the input index: static on (W, H) must be exactly column-order
    # GPTQ on (W[perm], H[perm][:, perm]), un-permuted, with perm = stable descending argsort of diag(H)
    scheme = SCHEMES["W8A8 (int8 channel)"]
    w, x = _outlier_inputs(1)
    h = x.T @ x / x.shape[0]
    perm = np.lexsort((np.arange(K), -np.asarray(jnp.diagonal(h))))
    assert not np.array_equal(perm, np.arange(K))
    q = gptq_quantize(w, scheme, h, actorder="static")
    qp = gptq_quantize(w[perm], scheme, h[perm][:, perm])
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(qp.scale))
    np.testing.assert_array_equal(np.asarray(dequantize(q))[perm], np.asarray(dequantize(qp)))


@pytest.mark.parametrize("name", ["int4 g32", "NVFP4A16"])
def test_actorder_static_rows_keep_the_scales_of_their_original_group(name):
    # H rescaled so that diag(H) orders whole groups (a shuffled group order; index order inside a group):
    # then static on (W, H) is column-order GPTQ on the group-permuted problem with the group-permuted scales
    scheme = SCHEMES[name]
    g = scheme.group_size
    ng = K // g
    gorder = np.random.default_rng(0).permutation(ng)
    assert not np.array_equal(gorder, np.arange(ng))
    perm = np.concatenate([np.arange(j * g, (j + 1) * g) for j in gorder])
    w, x = _outlier_inputs(2)
    h = np.asarray(x.T @ x / x.shape[0], np.float64)
    target = np.empty(K)
    target[perm] = 10.0 - 0.01 * np.arange(K)  # strictly decreasing along perm
    d = np.sqrt(target / np.diag(h))
    h = jnp.asarray(h * d[:, None] * d[None, :], jnp.float32)
    assert np.array_equal(np.asarray(jnp.argsort(jnp.diagonal(h), descending=True, stable=True)), perm)
    q = gptq_quantize(w, scheme, h, actorder="static")
    rtn = quantize(w, scheme, 0)
    sp = jnp.asarray(rtn.scale).reshape(N, ng, -1)[:, gorder].reshape(rtn.scale.shape)
    ref = quantize(w[perm], scheme, 0, scale=sp, global_scale=rtn.global_scale)
    qp = gptq_quantize(w[perm], scheme, h[perm][:, perm], qparams=ref)
    np.testing.assert_array_equal(np.asarray(dequantize(q))[perm], np.asarray(dequantize(qp)))


def test_actorder_dead_inputs_jit_and_bad_values():
    scheme = SCHEMES["W4A16_ASYM"]
    dead = np.zeros(K, bool)
    dead[[0, 40, 41, 127]] = True
    x = jnp.where(jnp.asarray(dead)[None, :], 0.0, X)
    h = x.T @ x / x.shape[0]
    q = gptq_quantize(W, scheme, h, actorder="static")
    y = np.asarray(dequantize(q))
    assert np.all(y[dead] == 0) and np.any(y[~dead] != 0)
    f = jax.jit(lambda w, h: gptq_quantize(w, scheme, h, actorder="static").codes)
    np.testing.assert_array_equal(np.asarray(f(W, h)), np.asarray(q.codes))
    for bad in ("group", "dynamic", "GROUP"):
        with pytest.raises(SchemeError, match="g_idx"):
            gptq_quantize(W, scheme, H, actorder=bad)
    for bad in ("Static", "descending", True, 1):
        with pytest.raises(SchemeError, match="actorder must be None"):
            gptq_quantize(W, scheme, H, actorder=bad)


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "int4 g32", "NVFP4A16"])
@pytest.mark.parametrize("actorder", [None, "static"])
def test_shared_hessian_equals_separate_calls(name, actorder):
    """Weights reading one input (q/k/v) quantized as one [K, sum N] problem: exactly the codes, scales and zero
    points of one gptq_quantize per weight (given qparams included; NVFP4 with a global scale the weights share,
    and with different ones, which are quantized one by one)."""
    scheme = SCHEMES[name] if name in SCHEMES else presets[name].weights
    ws = [W, W[:, :16] * 3.0, jax.random.normal(jax.random.key(5), (K, 32), jnp.float32) * 0.02]
    qps = None
    if name == "int4 g32":
        qps = [mse_quantize(w, scheme, 0, importance=jnp.diagonal(H)) for w in ws]
    if name == "NVFP4A16":  # a shared global scale (a fused group's), then each weight's own
        g = quantize(ws[1], scheme, 0).global_scale
        qps = [quantize(w, scheme, 0, global_scale=g) for w in ws]
    for given in ([qps] if qps is None or name != "NVFP4A16" else [qps, None]):
        got = gptq_quantize_shared(ws, scheme, H, actorder=actorder, qparams=given)
        for i, (w, q) in enumerate(zip(ws, got)):
            want = gptq_quantize(w, scheme, H, actorder=actorder, qparams=None if given is None else given[i])
            assert q.shape == w.shape and q.scheme == want.scheme
            for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"weight {i}")
    with pytest.raises(SchemeError, match="at least one weight"):
        gptq_quantize_shared([], scheme, H)
    with pytest.raises(SchemeError, match="qparams"):
        gptq_quantize_shared(ws, scheme, H, qparams=[None])
    with pytest.raises(SchemeError, match="Hessian h must have shape"):
        gptq_quantize_shared([W, W[:64]], scheme, H)
