"""qformats.models.decoder.calibration's AWQ adapter: the fold leaves the float model's outputs unchanged (float
rounding only), the grid search on the decoder picks what a direct reimplementation of llm-compressor's formulas
picks, and AWQ lowers the W4 output error."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.algorithms.awq import grid
from qformats.errors import ModelError
from qformats.models.decoder import CausalLM, DecoderConfig, attention_mask, inv_freq, rope_tables
from qformats.models.decoder.calibration import AWQ_MAPPINGS, awq_transform, calibrate_decoder
from qformats.nn import resolve_scheme
from qformats.quantize import dequantize, quantize
from qformats.schemes import QuantScheme

# num_kv_heads == num_heads: v_proj's outputs equal o_proj's inputs, so all four mappings apply
CFG = DecoderConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=4, head_dim=16)
GQA = DecoderConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=16)
SCHEME = "W4A16:g16"


def _model(cfg=CFG, seed=0):
    m = CausalLM(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for layer in m.model.layers:  # outlier channels in the norms, as in real LMs
        w = (1 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)
        w[rng.permutation(cfg.hidden_size)[:3]] *= 15.0
        layer.input_layernorm.weight.set_value(jnp.asarray(w))
        layer.post_attention_layernorm.weight.set_value(jnp.asarray(w[::-1].copy()))
    return m


def _inputs(m, ids):
    t = ids.shape[1]
    pos = jnp.arange(t)
    cos, sin = rope_tables(pos, inv_freq(m.config))
    return [m.model.embed_tokens(ids)], [jnp.ones(ids.shape, bool)], (lambda _: (cos, sin, attention_mask(pos, t, None)))


def _ids(seed, shape=(4, 16)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 128, shape).astype(np.int32))


def test_fold_leaves_float_outputs_unchanged():
    m = _model()
    ids = _ids(1)
    ref = m(ids)[0]
    xs, valid, li = _inputs(m, ids)
    rec = []
    before = np.asarray(m.model.layers[0].input_layernorm.weight.get_value())
    awq_transform(SCHEME, n_grid=8, record=rec)(m.model.layers[0], 0, xs, valid, li)
    assert [r["smooth"] for r in rec] == [mp.smooth for mp in AWQ_MAPPINGS]
    after = np.asarray(m.model.layers[0].input_layernorm.weight.get_value())
    assert np.max(np.abs(after / before - 1)) > 0.05  # scales were folded
    # float32 rounding of the rescaled weights only (outputs of magnitude ~4): measured 1.2e-5 (fully optimized
    # programs), 2.6e-5 (the suite's lean compile: no fused multiply-adds, tests/conftest.py)
    np.testing.assert_allclose(np.asarray(m(ids)[0]), np.asarray(ref), atol=5e-5, rtol=0)


def _direct_search(layer, x, cos, sin, mask, mp, ws, points, x_mean):
    """The grid search written directly from llm-compressor's formulas, on one batch of real tokens."""
    def get(rel):
        mod = layer
        for p in rel.split("/"):
            mod = getattr(mod, p)
        return mod

    a = layer.input_layernorm(x)
    if mp.smooth == "input_layernorm":
        inp = a
        run = lambda: layer.self_attn(inp, cos, sin, mask)[0]  # noqa: E731
    else:
        h = x + layer.self_attn(a, cos, sin, mask)[0]
        inp = layer.post_attention_layernorm(h)
        run = lambda: layer.mlp(inp)  # noqa: E731
        if mp.smooth == "mlp/up_proj":
            inp = jax.nn.silu(layer.mlp.gate_proj(inp)) * layer.mlp.up_proj(inp)
            run = lambda: layer.mlp.down_proj(inp)  # noqa: E731
    # x_mean as the transform recorded it (its formula: test_activation_means_ignore_padding): a 1-ulp difference
    # (another summation order, or inputs computed outside jit) flips a few 4-bit codes and moves a loss by ~1%
    xm = x_mean
    origs = [np.asarray(get(b).kernel.get_value()) for b in mp.balances]
    wt = [np.abs(k.T).reshape(-1, ws.group_size) for k in origs]
    wt = [(c / (c.max(axis=1, keepdims=True) + np.float32(1e-6))).reshape(k.T.shape) for c, k in zip(wt, origs)]
    wm = sum(c.sum(axis=0, dtype=np.float64) for c in wt) / sum(c.shape[0] for c in wt)
    fp = np.asarray(run())
    errs = []
    for r, duo in points:
        if duo:
            s = np.maximum(np.power(xm, np.float32(r)).astype(np.float64) / (wm ** (1 - r) + 1e-4), 1e-4)
        else:
            s = np.maximum(np.power(xm, np.float32(r)), np.float32(1e-4))
        s = s / np.sqrt(s.max() * s.min())
        for b, k in zip(mp.balances, origs):
            sk = (k.astype(np.float64) * s[:, None]).astype(np.float32)
            q = np.asarray(dequantize(quantize(jnp.asarray(sk), ws, 0)))
            get(b).kernel.set_value(jnp.asarray((q.astype(np.float64) / s[:, None]).astype(np.float32)))
        errs.append(float(np.mean((np.asarray(run()) - fp) ** 2)))
    for b, k in zip(mp.balances, origs):
        get(b).kernel.set_value(jnp.asarray(k))
    return errs


@pytest.mark.parametrize("mapping", [0, 2, 3])
def test_grid_search_matches_direct_formulas(mapping):
    mp = AWQ_MAPPINGS[mapping]
    ws = resolve_scheme(SCHEME).weights
    points = grid(8, True)
    ids = _ids(2)
    m = _model(seed=3)
    layer = m.model.layers[0]
    xs, valid, li = _inputs(m, ids)
    cos, sin, mask = li(ids.shape[1])
    rec = []
    awq_transform(SCHEME, n_grid=8, prune=False, record=rec)(_model(seed=3).model.layers[0], 0, xs, valid, li)
    r = next(r for r in rec if r["smooth"] == mp.smooth)
    errs = _direct_search(layer, xs[0], cos, sin, mask, mp, ws, points, r["x_mean"])
    best = int(np.argmin(errs))
    assert sorted(errs)[1] > errs[best] * (1 + 1e-4)  # a clear winner: the choice is not decided by rounding
    assert (r["ratio"], r["duo"]) == points[best]
    assert math.isclose(r["initial_error"], errs[0], rel_tol=1e-4)
    assert math.isclose(r["best_error"], errs[best], rel_tol=1e-4)


def test_race_chooses_as_every_point_evaluated(monkeypatch):
    """The race (prune=True: chunks of 8 tokens, 16 rows, largest |x| first; packed rows of varying samples) picks
    the grid points and so the codes that evaluating every point picks, evaluating fewer terms."""
    import qformats.models.decoder.calibration as cal

    monkeypatch.setattr(cal, "AWQ_CHUNK_TOKENS", 8)
    rng = np.random.default_rng(7)
    samples = [rng.integers(0, 128, n).astype(np.int32) for n in (16, 13, 9, 16, 5, 11, 16, 7)]
    recs, codes = {}, {}
    for prune in (False, True):
        m = _model(seed=4)
        recs[prune] = []
        calibrate_decoder(m, samples, SCHEME, weight_search="rtn", propagate="float", bucket=4,
                          transform=awq_transform(SCHEME, n_grid=10, prune=prune, record=recs[prune]))
        codes[prune] = [np.asarray(m.model.layers[i].mlp.down_proj.kernel.get_value().codes) for i in range(2)] + \
            [np.asarray(m.model.layers[i].self_attn.q_proj.kernel.get_value().codes) for i in range(2)]
    for a, b in zip(recs[False], recs[True]):
        assert (a["layer"], a["smooth"], a["ratio"], a["duo"], a["best_error"]) == \
            (b["layer"], b["smooth"], b["ratio"], b["duo"], b["best_error"])
        np.testing.assert_array_equal(a["scales"], b["scales"])
        assert all(y is None or x == y for x, y in zip(a["errors"], b["errors"]))
    assert all(r["evaluated"] == 1 for r in recs[False])
    assert min(r["evaluated"] for r in recs[True]) < 0.9
    for a, b in zip(codes[False], codes[True]):
        np.testing.assert_array_equal(a, b)


def test_gqa_skips_v_to_o():
    m = _model(GQA)
    ids = _ids(4)
    xs, valid, li = _inputs(m, ids)
    rec = []
    awq_transform(SCHEME, n_grid=4, record=rec)(m.model.layers[0], 0, xs, valid, li)
    assert [r["smooth"] for r in rec] == ["input_layernorm", "post_attention_layernorm", "mlp/up_proj"]


def test_awq_lowers_w4_output_error():
    samples = list(np.asarray(_ids(5, (8, 16))))
    ids = jnp.stack(samples)
    ref = _model()(ids)[0]
    errs = {}
    for awq in (False, True):
        m = _model()
        tf = awq_transform(SCHEME, n_grid=8) if awq else None
        calibrate_decoder(m, samples, SCHEME, weight_search="rtn", propagate="float", transform=tf)
        errs[awq] = float(jnp.mean((m(ids)[0] - ref) ** 2))
    assert errs[True] < 0.95 * errs[False], errs  # measured 0.91x on this random model


def test_bad_input():
    with pytest.raises(ModelError, match="per tensor"):
        awq_transform(QuantScheme(format="int8", strategy="tensor"))
    with pytest.raises(ModelError, match="no weights"):
        awq_transform(None)
    m = _model()
    layer = m.model.layers[0]
    layer.mlp.up_proj = nnx.Linear(64, 128, use_bias=False, rngs=nnx.Rngs(0))
    del layer.post_attention_layernorm
    ids = _ids(6)
    xs, valid, li = _inputs(m, ids)
    with pytest.raises(ModelError, match="model/layers/0/post_attention_layernorm"):
        awq_transform(SCHEME)(layer, 0, xs, valid, li)


def test_reference_outputs_from_the_capture_unless_a_mapping_changed_the_parent(monkeypatch):
    """The attention's and the MLP's reference outputs come from the float pass that captures the inputs; a parent
    that an earlier mapping of the layer rescaled (here up_proj -> down_proj applied before the MLP's mapping) is
    run again for them, and its search still matches the direct formulas on the rescaled layer."""
    import qformats.models.decoder.calibration as cal

    calls = []
    run = cal._parent_out
    monkeypatch.setattr(cal, "_parent_out", lambda *a, **k: calls.append(a[-1]) or run(*a, **k))
    ids = _ids(2)
    m = _model(seed=3)
    xs, valid, li = _inputs(m, ids)
    awq_transform(SCHEME, n_grid=8)(m.model.layers[0], 0, xs, valid, li)
    assert calls == []
    monkeypatch.setattr(cal, "AWQ_MAPPINGS", (AWQ_MAPPINGS[0], AWQ_MAPPINGS[3], AWQ_MAPPINGS[2]))
    rec = []
    m = _model(seed=3)
    awq_transform(SCHEME, n_grid=8, prune=False, record=rec)(m.model.layers[0], 0, xs, valid, li)
    assert calls and set(calls) == {"mlp"}
    assert [r["smooth"] for r in rec] == ["input_layernorm", "mlp/up_proj", "post_attention_layernorm"]
    # the direct search on a layer with the first two mappings' scales folded in
    monkeypatch.setattr(cal, "AWQ_MAPPINGS", (AWQ_MAPPINGS[0], AWQ_MAPPINGS[3]))
    layer = _model(seed=3).model.layers[0]
    awq_transform(SCHEME, n_grid=8)(layer, 0, xs, valid, li)
    cos, sin, mask = li(ids.shape[1])
    errs = _direct_search(layer, xs[0], cos, sin, mask, AWQ_MAPPINGS[2], resolve_scheme(SCHEME).weights, grid(8, True),
                          rec[2]["x_mean"])
    assert [math.isclose(a, b, rel_tol=1e-4) for a, b in zip(rec[2]["errors"], errs)] == [True] * len(errs)


def test_rtn_after_awq_propagates_the_captured_outputs(monkeypatch):
    """AWQ + round-to-nearest with float propagation: the next layer's inputs are the float outputs of AWQ's own
    capture pass (before the fold), so no calibration pass runs; the scales chosen are those of propagating through
    the folded layer, the codes too but for float32 rounding. Round-to-nearest with quantized propagation skips the
    pass that would record nothing too."""
    import qformats.models.decoder.calibration as cal

    calls = []
    run = cal._calibration_pass
    monkeypatch.setattr(cal, "_calibration_pass", lambda *a, **k: calls.append(1) or run(*a, **k))
    samples = list(np.asarray(_ids(6, (4, 16))))
    codes, recs, errs = {}, {True: [], False: []}, {}
    ids = jnp.stack(samples)
    ref = _model()(ids)[0]
    for hand_back in (True, False):
        tf = awq_transform(SCHEME, n_grid=6, record=recs[hand_back])
        m = _model()
        calibrate_decoder(m, samples, SCHEME, weight_search="rtn", propagate="float",
                          transform=tf if hand_back else (lambda *a: tf(*a) and None))
        errs[hand_back] = float(jnp.mean((m(ids)[0] - ref) ** 2))
        codes[hand_back] = [np.asarray(m.model.layers[i].mlp.down_proj.kernel.get_value().codes) for i in range(2)] + \
            [np.asarray(m.model.layers[i].self_attn.q_proj.kernel.get_value().codes) for i in range(2)]
        assert len(calls) == (0 if hand_back else 2)
        calls.clear()
    # layer 0 sees the same inputs: the same scales and codes
    first = [(r["smooth"], r["ratio"], r["duo"]) for r in recs[True] if r["layer"] == 0]
    assert first == [(r["smooth"], r["ratio"], r["duo"]) for r in recs[False] if r["layer"] == 0]
    np.testing.assert_array_equal(codes[True][0], codes[False][0])
    np.testing.assert_array_equal(codes[True][2], codes[False][2])
    # layer 1's inputs differ by float32 rounding (measured: 3e-5 at outputs of magnitude 56, x_mean by 2.4e-7):
    # the scales move in their last bits and flip the codes sitting on a rounding boundary, so on this tiny model the
    # grid's losses move by up to ~10% (grid points 0 and 1 do not depend on x_mean: theirs are equal) and a choice
    # can change; the models stay as close to the float one (measured: output MSE 0.2255 against 0.2327)
    assert abs(errs[True] / errs[False] - 1) < 0.1, errs
    calibrate_decoder(_model(), samples, SCHEME, weight_search="rtn", propagate="quantized")
    assert calls == []
    calibrate_decoder(_model(), samples, SCHEME, weight_search="gptq", propagate="quantized")
    assert len(calls) == 2
