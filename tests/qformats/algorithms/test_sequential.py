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
