"""qformats.algorithms.shared_scales: which modules are fused siblings, and the NVFP4 global scale they share."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qformats import presets, quantize
from qformats.algorithms.shared_scales import (FUSED_GROUPS, fused_global_scales, group_amax, selected_groups,
                                               shared_global_scale, shared_global_scales, sibling_groups)
from qformats.errors import SchemeError

NVFP4 = presets["NVFP4A16"].weights


def test_sibling_groups_complete_groups_only_in_group_order():
    paths = ["model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
             "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj",
             "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",  # v_proj missing
             "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "experts.3.w1", "experts.3.w3",
             "experts.3.w2", "attn.q_a_proj", "attn.kv_a_proj_with_mqa", "q_proj", "k_proj", "v_proj"]
    got = sibling_groups(paths, sep=".")
    assert got == [
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
        ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"),
        ("experts.3.w1", "experts.3.w3"),
        ("attn.q_a_proj", "attn.kv_a_proj_with_mqa"),
        ("q_proj", "k_proj", "v_proj"),  # siblings at the root
    ]
    nnx_paths = [p.replace(".", "/") for p in paths]
    assert sibling_groups(nnx_paths, sep="/") == [tuple(p.replace(".", "/") for p in g) for g in got]
    assert sibling_groups(["a.gate_proj", "b.up_proj"]) == []  # different parents
    assert ("q_proj", "k_proj", "v_proj") in FUSED_GROUPS and ("gate_proj", "up_proj") in FUSED_GROUPS


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_shared_global_scale_is_the_smallest_members_own(dtype):
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((64, 48)) * s).astype(dtype) for s in (0.02, 0.3, 0.07)]
    own = [float(quantize(w, NVFP4, 0).global_scale[0]) for w in ws]
    g = shared_global_scale(group_amax(ws), NVFP4, dtype)
    assert g.shape == (1,) and g.dtype == jnp.float32
    assert float(g[0]) == min(own) and len(set(own)) == 3  # the members' own scales differ
    assert float(group_amax(ws)) == max(float(np.max(np.abs(w.astype(np.float32)))) for w in ws)


def test_shared_global_scale_equals_compressed_tensors_generate_gparam():
    torch = pytest.importorskip("torch")
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    rng = np.random.default_rng(1)
    for dtype, tdt in ((np.float32, torch.float32), (ml_dtypes.bfloat16, torch.bfloat16)):
        ws = [(rng.standard_normal((32, 64)) * s).astype(dtype) for s in (0.5, 0.01)]
        t = [torch.from_numpy(w.astype(np.float32)).to(tdt) for w in ws]
        # llm-compressor's fused observers: one generate_gparam over the min / max of all members
        ref = generate_gparam(torch.min(torch.stack([x.min() for x in t])),
                              torch.max(torch.stack([x.max() for x in t])))
        ours = shared_global_scale(group_amax(ws), NVFP4, dtype)
        assert np.asarray(ours).view(np.uint32).tolist() == ref.float().reshape(1).numpy().view(np.uint32).tolist()


def test_stacked_layers_get_one_scale_each():
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((3, 32, 16)) * np.array([1.0, 5.0, 0.1])[:, None, None] for _ in range(2))
    a, b = a.astype(np.float32), (b * 0.5).astype(np.float32)
    amax = group_amax([a, b], lead=1)
    assert amax.shape == (3,)
    g = shared_global_scale(amax, NVFP4, np.float32)
    assert g.shape == (3, 1)
    for i in range(3):
        want = shared_global_scale(group_amax([a[i], b[i]]), NVFP4, np.float32)
        assert np.asarray(g[i]).tolist() == np.asarray(want).tolist()


def test_errors():
    with pytest.raises(SchemeError, match="tensor_group"):
        shared_global_scale(1.0, presets["W4A16"].weights, np.float32)
    with pytest.raises(SchemeError, match="at least one"):
        group_amax([])


def test_selected_groups_and_their_shared_global_scales():
    paths = ["l/q_proj", "l/k_proj", "l/v_proj", "l/o_proj", "m/gate_proj", "m/up_proj", "n/gate_proj", "n/up_proj"]
    partial = []
    groups = selected_groups(paths, ["l/q_proj", "l/k_proj", "l/v_proj", "m/gate_proj", "l/o_proj"], sep="/",
                             partial=lambda g, inside: partial.append((g, inside)))
    assert groups == [("l/q_proj", "l/k_proj", "l/v_proj")]
    assert partial == [(("m/gate_proj", "m/up_proj"), ["m/gate_proj"])]  # n/: no member selected, no call
    rng = np.random.default_rng(0)
    ws = {p: (rng.standard_normal((32, 16)) * (i + 1)).astype(np.float32) for i, p in enumerate(paths)}
    loaded = []
    got = shared_global_scales(groups, lambda p: loaded.append(p) or ws[p],
                               {p: (NVFP4, np.float32, ()) for p in groups[0]})
    assert loaded == list(groups[0]) and set(got) == set(groups[0])
    want = shared_global_scale(group_amax([ws[p] for p in groups[0]]), NVFP4, np.float32)
    for p in groups[0]:
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(want))
    by_layer = fused_global_scales({p: ws[p] for p in paths}, NVFP4)
    assert set(by_layer) == {"l/q_proj", "l/k_proj", "l/v_proj", "m/gate_proj", "m/up_proj", "n/gate_proj",
                             "n/up_proj"}
    np.testing.assert_array_equal(np.asarray(by_layer["l/k_proj"]), np.asarray(want))
    assert fused_global_scales(ws, presets["W4A16"].weights) == {}
    # members that differ (here in dtype) share nothing: the caller is told
    mismatched = []
    assert shared_global_scales(groups, ws.__getitem__, {"l/q_proj": (NVFP4, np.float32, ()),
                                                         "l/k_proj": (NVFP4, ml_dtypes.bfloat16, ()),
                                                         "l/v_proj": (NVFP4, np.float32, ())},
                                mismatch=mismatched.append) == {}
    assert mismatched == [groups[0]]

