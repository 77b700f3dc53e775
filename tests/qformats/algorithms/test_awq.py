"""qformats.algorithms.awq: the grid, the weight and activation means, the candidate scales and the scaled fake
quantization follow llm-compressor 0.14's formulas."""

import math
import time

import jax.numpy as jnp
import numpy as np
import pytest

from qformats.algorithms.awq import activation_means, candidate_scales, fake_quantize_scaled, grid, weight_means
from qformats.errors import ModelError
from qformats.presets import parse_scheme
from qformats.quantize import dequantize, quantize

SCHEME = "W4A16:g16"


def test_grid_points():
    g = grid(20, True)
    assert len(g) == 20 and g[0] == (0.0, False) and g[1] == (0.0, True) and g[-1] == (1.0, True)
    assert all(d for _, d in g[1:]) and math.isclose(g[2][0], 1 / 18)
    assert grid(5, False) == [(0.0, False), (0.25, False), (0.5, False), (0.75, False), (1.0, False)]
    assert grid(6, "both") == [(0.0, False), (0.0, True), (0.5, False), (0.5, True), (1.0, False), (1.0, True)]
    with pytest.raises(ModelError, match="duo_scaling"):
        grid(20, "yes")
    with pytest.raises(ModelError, match="n_grid"):
        grid(2, True)


def test_weight_means_and_scales_formula():
    ws = parse_scheme("W4A16:g2").weights
    w = np.asarray([[1.0, -2.0, 0.5, 0.25], [4.0, 0.0, -1.0, 3.0]], np.float32)  # torch layout [N=2, K=4]
    # chunks of 2 along K: |w| / (chunk amax + 1e-6), then the mean over the rows
    e = np.asarray([[1 / (2 + 1e-6), 2 / (2 + 1e-6), 0.5 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6)],
                    [4 / (4 + 1e-6), 0.0, 1 / (3 + 1e-6), 3 / (3 + 1e-6)]]).mean(axis=0)
    wm = weight_means([jnp.asarray(w.T)], ws)
    assert wm.dtype == np.float64
    np.testing.assert_allclose(wm, e, rtol=1e-6)
    x = np.asarray([0.5, 2.0, 8.0, 1.0], np.float32)
    s = candidate_scales(x, wm, 0.5, True)
    raw = np.maximum(np.sqrt(x).astype(np.float64) / (wm ** 0.5 + 1e-4), 1e-4)
    np.testing.assert_array_equal(s, raw / np.sqrt(raw.max() * raw.min()))
    assert candidate_scales(x, wm, 0.0, False).dtype == np.float32
    np.testing.assert_array_equal(candidate_scales(x, wm, 0.0, False), np.ones(4, np.float32))
    p = candidate_scales(x, None, 1.0, False)
    np.testing.assert_allclose(p, x / np.sqrt(8.0 * 0.5), rtol=1e-6)


def test_activation_means_ignore_padding():
    x = jnp.asarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 10)
    v = jnp.asarray([[True, True, False], [True, False, False]])
    e = np.abs(np.asarray(x))[np.asarray(v)].mean(axis=0)
    np.testing.assert_allclose(activation_means([x], [v]), e, rtol=1e-6)


def test_fake_quantize_scaled_is_q_of_ws_over_s():
    ws = parse_scheme(SCHEME).weights
    k = jnp.asarray(np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    s = candidate_scales(np.random.default_rng(1).uniform(0.1, 3, 32).astype(np.float32),
                         weight_means([k], ws), 0.4, True)
    scaled = (np.asarray(k, np.float64) * s[:, None]).astype(np.float32)
    q = np.asarray(dequantize(quantize(jnp.asarray(scaled), ws, 0)))
    np.testing.assert_array_equal(np.asarray(fake_quantize_scaled(k, s, ws)),
                                  (q.astype(np.float64) / s[:, None]).astype(np.float32))


def _table_race(table, prune, chunks, workers=1, jitter=None):
    """race_scales over a grid of 8 points whose chunk sums are table[i][c] (each point told apart by its scales);
    jitter: a random generator, each term then returns after a random few milliseconds (threads finish in any
    order)."""
    from qformats.algorithms.awq import race_scales

    ws = parse_scheme(SCHEME).weights
    k = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32))
    x = np.random.default_rng(1).uniform(0.1, 3, 16).astype(np.float32)
    points = grid(8, True)
    wm = weight_means([k], ws)
    keys = [np.asarray(fake_quantize_scaled(k, candidate_scales(x, wm, r, d), ws)).tobytes() for r, d in points]
    assert len(set(keys)) == len(keys)
    calls = []

    def chunk_sse(ks, c):
        i = keys.index(np.asarray(ks[0]).tobytes())
        calls.append((i, c))
        if jitter is not None:
            time.sleep(float(jitter.uniform(0, 0.004)))
        return table[i][c]

    return race_scales(x, wm, [k], ws, points, chunk_sse, chunks, 4.0, prune=prune, workers=workers), calls


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_race_picks_what_every_point_evaluated_picks(seed, workers):
    rng = np.random.default_rng(seed)
    chunks = 5
    # chunk sums >= 0, heavier first; seed 1: exact ties between points (the first grid index wins); seed 2: a NaN
    # and an inf point
    table = [list(rng.uniform(0, 1, chunks) * np.linspace(4, 1, chunks) * rng.uniform(1, 3)) for _ in range(8)]
    if seed == 1:
        table[6] = list(table[2])
        table[4] = list(table[2])
    if seed == 2:
        table[0][3] = math.nan
        table[5][1] = math.inf
    jitter = None if workers == 1 else np.random.default_rng(100 + seed)
    full, n_full = _table_race(table, False, chunks, workers, jitter)
    fast, n_fast = _table_race(table, True, chunks, workers, jitter)
    totals = []
    for row in table:
        t = 0.0
        for v in row:
            t += v
        totals.append(t / 4.0)
    ok = [i for i, t in enumerate(totals) if math.isfinite(t)]
    best = min(ok, key=lambda i: (totals[i], i))
    for r in (full, fast):
        assert (r.ratio, r.duo) == grid(8, True)[best] and r.best_error == totals[best]
    assert [e if e is None or math.isfinite(e) else None for e in full.errors] == \
        [t if math.isfinite(t) else None for t in totals]
    assert all(e is None or e == t for e, t in zip(fast.errors, totals))
    # a non-finite partial sum stops its point (the first point's chunks run `workers` at a time: up to workers - 1
    # past it)
    lost = 1 + 3 if seed == 2 else 0
    assert 8 * chunks - lost <= len(n_full) <= 8 * chunks - lost + (workers - 1 if seed == 2 else 0)
    assert len(n_fast) < len(n_full) and fast.evaluated == len(n_fast) / (8 * chunks)
    assert sorted(set(n_fast)) == sorted(n_fast)  # no term evaluated twice


def test_race_without_finite_loss():
    with pytest.raises(ModelError, match="no finite loss"):
        _table_race([[math.nan] * 2] * 8, True, 2)
