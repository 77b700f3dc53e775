"""qformats.algorithms.sequential: calibration samples padded into batches by length bucket; projections grouped
by the input they read."""

import numpy as np

from qformats.algorithms.sequential import input_groups, make_batches


def test_make_batches_pads_by_bucket():
    s = [np.arange(1, 4), np.arange(1, 40), np.arange(1, 6)]
    b = make_batches(s, tokens_per_batch=64, bucket=8)
    assert [a.shape for a in b.ids] == [(2, 8), (1, 40)]
    assert b.tokens == 3 + 39 + 5
    np.testing.assert_array_equal(b.ids[0][1, :5], np.arange(1, 6))
    assert b.valid[0].sum() == 8 and not b.valid[0][0, 3:].any() and b.valid[1].sum() == 39
    c = make_batches([np.arange(1, 4)] * 5, tokens_per_batch=16, bucket=8)  # 2 rows a batch, the last one padded
    assert [a.shape for a in c.ids] == [(2, 8)] * 3 and c.valid[2].sum() == 3
    # max_padding: buckets merge into longer ones while padding <= max_padding * real tokens (47 here)
    assert [a.shape for a in make_batches(s, tokens_per_batch=64, bucket=8, max_padding=1.0).ids] == [(2, 8), (1, 40)]
    m = make_batches(s, tokens_per_batch=64, bucket=8, max_padding=2.0)  # padding 9 + 2 * 32 = 73 <= 94
    assert [a.shape for a in m.ids] == [(1, 40)] * 3 and m.tokens == 47
    assert [int(v.sum()) for v in m.valid] == [3, 5, 39]
    np.testing.assert_array_equal(m.ids[1][0, :5], np.arange(1, 6))


def test_input_groups_of_a_decoder_layer():
    projs = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj", "mlp/gate_proj",
             "mlp/up_proj", "mlp/down_proj")
    assert input_groups(projs) == [projs[:3], (projs[3],), projs[4:6], (projs[6],)]


def test_make_batches_shape_cost_is_the_cheapest_partition():
    """shape_cost: the buckets split into runs minimising positions computed + shape_cost * shapes, checked against
    every partition of the sorted bucket lengths."""
    import itertools

    from qformats.algorithms.sequential import _positions

    rng = np.random.default_rng(0)
    s = [np.arange(1, int(n) + 1) for n in rng.integers(1, 200, 40)]
    buckets = {}
    for x in s:
        t = 32 * -(-x.size // 32)
        buckets[t] = buckets.get(t, 0) + 1
    lengths = sorted(buckets)
    for cost in (1, 64, 512, 4096, 1 << 20):
        best = None
        for k in range(len(lengths)):
            for cuts in itertools.combinations(range(1, len(lengths)), k):
                edges = (0,) + cuts + (len(lengths),)
                c = sum(_positions(lengths[b - 1], sum(buckets[t] for t in lengths[a:b]), 256) + cost
                        for a, b in zip(edges, edges[1:]))
                best = c if best is None else min(best, c)
        got = make_batches(s, tokens_per_batch=256, bucket=32, shape_cost=cost)
        assert sum(a.size for a in got.ids) + cost * len({a.shape for a in got.ids}) == best
        assert got.tokens == sum(x.size for x in s) and sum(int(v.sum()) for v in got.valid) == got.tokens
    assert len({a.shape for a in make_batches(s, tokens_per_batch=256, bucket=32, shape_cost=1 << 20).ids}) == 1


def test_pack_batches_rows_positions_segments():
    from qformats.algorithms.sequential import pack_batches, packed_mask

    s = [np.arange(1, 4), np.arange(1, 40), np.arange(1, 6), np.arange(1, 30)]
    b = pack_batches(s, tokens_per_batch=80, bucket=8)  # rows of 40; first-fit decreasing: [39], [29, 5, 3]
    assert [a.shape for a in b.ids] == [(2, 40)] and b.tokens == 3 + 39 + 5 + 29
    ids, pos, seg = b.ids[0], b.positions[0], b.segments[0]
    np.testing.assert_array_equal(ids[0, :39], np.arange(1, 40))
    np.testing.assert_array_equal(ids[1, :37], np.concatenate([np.arange(1, 30), np.arange(1, 6), np.arange(1, 4)]))
    np.testing.assert_array_equal(pos[1, 29:34], np.arange(5))
    np.testing.assert_array_equal(seg[1, [0, 28, 29, 34, 36, 37]], [0, 0, 1, 2, 2, -1])
    assert b.valid[0].sum() == b.tokens and not b.valid[0][0, 39] and not b.valid[0][1, 37:].any()
    m = packed_mask(pos, seg)
    assert m[1, 30, 29] and m[1, 30, 30] and not m[1, 30, 31] and not m[1, 29, 28] and m[1, 28, 0]
    w = packed_mask(pos, seg, window=2)
    assert w[1, 31, 30] and not w[1, 31, 29]
    cols = np.arange(40)
    assert not (m & (cols[None, :] > cols[:, None])).any()  # causal by column, padding's queries included
    assert m[1, 38, 37] and m[1, 38, 38] and not m[1, 37, 38]  # padding sees the padding up to its own column
    c = pack_batches([np.arange(1, 9)] * 5, tokens_per_batch=16, bucket=8)  # 5 rows, 2 a batch -> 3 batches of 2
    assert [a.shape for a in c.ids] == [(2, 8)] * 3 and c.valid[2].sum() == 8
