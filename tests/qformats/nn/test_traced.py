"""qformats.nn.traced: which params reach which dot_general (one abstract trace), and running them packed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.algorithms.weight_search import quantize_weight
from qformats.errors import ModelError
from qformats.matching import resolve_scheme
from qformats.nn import QEinsum
from qformats.nn import traced
from qformats.nn.projection import quantize_acts
from qformats.quantize import dequantize, quantize

K = jax.random.split(jax.random.key(0), 8)
P = {"w": jax.random.normal(K[0], (128, 32)), "e": jax.random.normal(K[1], (2, 128, 4, 16)),
     "tab": jax.random.normal(K[2], (50, 128)), "stk": jax.random.normal(K[3], (3, 128, 128)),
     "head": jax.random.normal(K[4], (40, 128))}
X = jax.random.normal(K[5], (2, 5, 128))
IDS = jnp.array([1, 2])


def f(p, x, ids):
    h = jnp.einsum("btd,sdnh->sbtnh", x, p["e"])
    y = h.sum((0, 3, 4))[..., None] * (x @ p["w"]).sum(-1, keepdims=True)
    z, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, p["stk"])
    return jnp.dot(z, p["head"].T) + y.sum() + p["tab"][ids].sum() + (z @ p["tab"].T).sum()


def usages():
    return {kp[0].key: u for kp, u in traced.find_matmul_weights(f, P, X, IDS).items()}


def test_the_trace_finds_each_weights_contraction_stacking_and_other_uses():
    u = usages()
    assert u["w"].reason() is None and u["w"].layout() == ((0, 1), 1) and u["w"].stacked == 0
    assert u["e"].reason() is None and u["e"].layout() == ((1, 0, 2, 3), 1) and traced.contracted_size(u["e"]) == 128
    assert u["stk"].reason() is None and u["stk"].stacked == 1 and u["stk"].per_layer == (128, 128)
    assert u["head"].layout() == ((1, 0), 1) and u["head"].plain()  # through .T: contracted axis 1
    assert u["tab"].reason() == "used in a matmul and outside one (gather)"


def test_packed_matrix_is_the_flax_einsum_layers_own():
    """A custom einsum param packs to the very QArray nnx.Einsum's QEinsum holds for the same kernel."""
    u = usages()["e"]
    ss = resolve_scheme("W4A16")
    mw = traced.pack(P["e"], u, ss)
    e = nnx.Einsum("btd,sdnh->sbtnh", (2, 128, 4, 16), rngs=nnx.Rngs(0))
    e.kernel.set_value(P["e"])
    q = QEinsum.from_module(e, ss).kernel.get_value()
    for a, b in zip(jax.tree.leaves(mw.q), jax.tree.leaves(q)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and dense() puts the dequantized matrix back in the param's own shape, exactly
    want = jnp.transpose(dequantize(q).reshape(128, 2, 4, 16), (1, 0, 2, 3))
    np.testing.assert_array_equal(np.asarray(mw.dense()), np.asarray(want))


def _packed(scheme, names=("w", "e", "stk", "head")):
    u = usages()
    ss = resolve_scheme(scheme)
    out = dict(P)
    for n in names:
        out[n] = traced.pack(P[n], u[n], ss)
    return out


def test_run_packed_computes_the_model_on_the_packed_weights():
    pk = _packed("W4A16")
    dense = {n: v.dense() if isinstance(v, traced.MatmulWeight) else v for n, v in pk.items()}
    want = f(dense, X, IDS)
    got = traced.run_packed(f, pk, X, IDS)
    got_jit = jax.jit(lambda p, x, i: traced.run_packed(f, p, x, i))(pk, X, IDS)
    # the same dequantized weights; only the accumulation order differs (x reshaped to [.., K])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    np.testing.assert_allclose(np.asarray(got_jit), np.asarray(got), rtol=1e-6, atol=1e-3)


def test_w_plus_a_quantizes_the_other_operand_along_its_contracted_axis():
    ss = resolve_scheme("W8A8")
    w = P["w"]
    u = traced.find_matmul_weights(lambda p, x: x @ p["w"], {"w": w}, X)
    mw = traced.pack(w, u[(jax.tree_util.DictKey("w"),)], ss)
    got = traced.run_packed(lambda p, x: x @ p["w"], {"w": mw}, X)
    want = quantize_acts(X, ss.input_activations) @ dequantize(quantize(w, ss.weights, 0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2 * float(jnp.abs(want).max()))
    assert not np.allclose(np.asarray(got), np.asarray(X @ dequantize(quantize(w, ss.weights, 0))), atol=1e-4)


def test_w_plus_a_on_a_two_axis_contraction_is_refused():
    u = traced.find_matmul_weights(lambda p, x: jnp.einsum("btnh,nhd->btd", x, p["o"]),
                                   {"o": jnp.ones((4, 32, 128))}, jnp.ones((2, 3, 4, 32)))
    (usage,) = u.values()
    assert usage.plain() and usage.layout()[1] == 2
    with pytest.raises(ModelError, match="o: a matmul of this weight does not contract the input's last axis alone"):
        traced.plan_traced({"o": ("o", usage)}, {"o": resolve_scheme("W8A8")})
    items, misfit = traced.plan_traced({"o": ("o", usage)}, {"o": resolve_scheme("W8A16")})
    assert [i[0] for i in items] == ["o"] and not misfit


def test_weight_names_follow_the_module_for_kernels():
    assert traced.weight_name("blocks/0/up/kernel") == "blocks/0/up"
    assert traced.weight_name("embedder/input_embedding") == "embedder/input_embedding"
    assert traced.weight_name("kernel") == "kernel"


@pytest.mark.parametrize("scheme", ["FP8_E4M3", "NVFP4A16", "FP6_E3M2"])
def test_pack_many_packs_bit_for_bit_as_one_weight_at_a_time_in_any_chunking(scheme):
    """Equal layers share one compiled function per round; the packed QArrays are those of the reference
    quantizer on each matrix W = transpose(param, perm).reshape(K, N), whatever the chunk budget."""
    u = usages()
    ss = resolve_scheme(scheme)
    w2 = P["w"] * 3.0  # a second weight of w's key: two rounds
    items = [(P["w"], u["w"], ss), (P["e"], u["e"], ss), (w2, u["w"], ss), (P["head"], u["head"], ss)]
    want = [quantize(traced.matrix_of(v, uu), ss.weights, 0) for v, uu, _ in items]
    for budget in (None, 0, 10**9):
        seen = []
        live = list(items)
        got = traced.pack_many(live, budget_bytes=budget, done=lambda i, mw: seen.append(i), release=True)
        assert sorted(seen) == [0, 1, 2, 3] and live == [None] * 4
        for mw, q, (_, uu, _) in zip(got, want, items):
            assert mw.perm == uu.layout()[0] and mw.shape == uu.per_layer
            for a, b in zip(jax.tree.leaves(mw.q), jax.tree.leaves(q)):
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_a_stacked_weight_is_packed_layer_by_layer_as_vmapped():
    """The jitted packer quantizes a scan stack one layer at a time (its transpose included): the bits of the
    vmapped reference quantizer on W = transpose(param, perm).reshape(K, N), with one layer's temporaries
    compiled instead of a float copy of the whole stack."""
    stk = jax.random.normal(K[6], (4, 8, 128, 16))  # [layers, heads, d, h]: contracted d, perm (1, 0, 2)

    def g(p, x):
        h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(jnp.einsum("btd,ndh->btnh", c, w)).reshape(c.shape), None),
                            x, p["q"])
        return h @ p["w"]

    u = {kp[0].key: v for kp, v in traced.find_matmul_weights(g, {"q": stk, "w": P["w"]}, X).items()}
    assert u["q"].stacked == 1 and u["q"].layout() == ((1, 0, 2), 1)
    ss = resolve_scheme("W4A16")  # not a host-path scheme: the jitted packer
    got = traced.pack_many([(stk, u["q"], ss), (P["w"], u["w"], ss)])
    for mw, v, uu in zip(got, (stk, P["w"]), (u["q"], u["w"])):
        want = quantize_weight(traced.matrix_of(v, uu), ss, "rtn")  # vmapped over the stacked axes
        for a, b in zip(jax.tree.leaves(mw.q), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    mem = traced._packer((traced._pack_key(stk, u["q"], ss, "rtn"),)).lower([stk]).compile().memory_analysis()
    if mem is not None:  # a backend without the analysis: nothing to compare
        assert mem.temp_size_in_bytes <= 2 * stk.nbytes // 4
