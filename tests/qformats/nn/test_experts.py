"""qformats.nn.experts: a stacked [E, in, out] expert projection quantized by quantize_model is, expert by expert,
exactly what each expert's own nnx.Linear becomes; the grouped (tiled, ragged_dot) and gathered products agree
with a loop over experts; what is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats import presets
from qformats.errors import ModelError
from qformats.nn import Experts, QExperts, QLinear, Rule, quantize_model
import qformats.nn.experts as experts_module
from qformats.nn.experts import chunk_experts, chunked_ragged_grouped_matmul, tiled_grouped_matmul
from qformats.quantize import dequantize

E, D, I = 8, 64, 96


class StackFFN(nnx.Module):
    """gate/up/down as [E, in, out] stacks (how the MoE decoder holds them)."""

    def __init__(self, kernels, biases=None):
        rngs = nnx.Rngs(0)
        self.experts = nnx.Dict()
        for name, k in kernels.items():
            m = Experts(E, k.shape[1], k.shape[2], use_bias=biases is not None, rngs=rngs)
            m.kernel.set_value(jnp.asarray(k))
            if biases is not None:
                m.bias.set_value(jnp.asarray(biases[name]))
            self.experts[name] = m


class Expert(nnx.Module):
    def __init__(self, kernels, e, biases=None):
        rngs = nnx.Rngs(0)
        for name, k in kernels.items():
            lin = nnx.Linear(k.shape[1], k.shape[2], use_bias=biases is not None, rngs=rngs)
            lin.kernel.set_value(jnp.asarray(k[e]))
            if biases is not None:
                lin.bias.set_value(jnp.asarray(biases[name][e]))
            setattr(self, name, lin)


class LoopFFN(nnx.Module):
    """The same weights as E separate experts of three nnx.Linear each (how a torch checkpoint names them)."""

    def __init__(self, kernels, biases=None):
        self.experts = nnx.List([Expert(kernels, e, biases) for e in range(E)])


def kernels(seed=0):
    r = np.random.RandomState(seed)
    k = {"gate_proj": r.randn(E, D, I), "up_proj": r.randn(E, D, I) * 3.0, "down_proj": r.randn(E, I, D)}
    for e in range(E):  # each expert its own range, so per-expert scales (and NVFP4 global scales) differ
        for a in k.values():
            a[e] *= 0.1 * (e + 1)
    return {n: a.astype(np.float32) for n, a in k.items()}


@pytest.mark.parametrize("scheme", ["W4A16:g32", "W4A16_ASYM:g32", "W8A8", "NVFP4A16", "MXFP4A16", "FP8_DYNAMIC"])
def test_quantized_stack_equals_per_expert_quantization_exactly(scheme):
    ks = kernels()
    stack, loop = StackFFN(ks), LoopFFN(ks)
    quantize_model(stack, [Rule(".*", scheme)])
    quantize_model(loop, [Rule(".*", scheme)])
    for name in ks:
        q = stack.experts[name]
        assert isinstance(q, QExperts) and q.num_experts == E and q.weight_method == "rtn"
        for e in range(E):
            mine = q.expert_weight(e)
            theirs = getattr(loop.experts[e], name)
            assert isinstance(theirs, QLinear)
            ref = theirs.kernel.get_value()
            assert mine.shape == ref.shape and mine.scheme == ref.scheme
            for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}[{e}]")
    if scheme.startswith("NVFP4"):  # gate/up of one expert share a global scale; experts differ
        g = np.asarray(stack.experts["gate_proj"].kernel.get_value().global_scale)
        np.testing.assert_array_equal(g, np.asarray(stack.experts["up_proj"].kernel.get_value().global_scale))
        assert len(np.unique(g)) == E


def rows_and_experts(m, seed=1, empty=(2, 5)):
    r = np.random.RandomState(seed)
    experts = np.array([e for e in r.randint(0, E, m) if e not in empty] + [0] * 0, np.int32)
    x = r.randn(len(experts), D).astype(np.float32)
    return x, experts


def dense_rows(m, x, experts):
    """The reference `m.dense` for rows x [M, K] of experts [M]: row m of `m.dense(x, e_m)`, one call on all the
    rows per expert named (one shape: one compilation of each eager op). A row's result does not depend on the
    other rows of its call: the activation schemes here quantize per row (token) or with the expert's own static
    scale, and a row of a matmul is its row's product."""
    x, experts = jnp.asarray(x), np.asarray(experts)
    out = np.zeros((len(experts), m.out_features), np.float32)
    for e in np.unique(experts):
        rows = experts == e
        out[rows] = np.asarray(m.dense(x, int(e)))[rows]
    return out


@pytest.mark.parametrize("scheme", [None, "W4A16:g32", "NVFP4A16", "FP8_DYNAMIC"])
def test_grouped_and_gathered_products_agree_with_a_loop(scheme):
    ks = kernels(2)
    biases = {n: np.random.RandomState(3).randn(E, k.shape[2]).astype(np.float32) for n, k in ks.items()}
    model = StackFFN({"gate_proj": ks["gate_proj"]}, {"gate_proj": biases["gate_proj"]})
    if scheme is not None:
        quantize_model(model, [Rule(".*", scheme)])
    m = model.experts["gate_proj"]
    x, experts = rows_and_experts(70)
    order = np.argsort(experts, kind="stable")
    xs, es = x[order], experts[order]
    sizes = np.bincount(es, minlength=E)
    assert sizes[2] == sizes[5] == 0  # experts without rows
    want = dense_rows(m, xs, es)
    gathered = np.asarray(nnx.jit(lambda m, x, e: m.gathered(x, e))(m, xs, es))
    np.testing.assert_allclose(gathered, want, rtol=0, atol=2e-5)
    for method, tile in (("tiled", None), ("tiled", 8), ("tiled", 32), ("ragged", None)):
        got = np.asarray(nnx.jit(lambda m, x, s: m.grouped(x, s, method, tile))(m, xs, sizes))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=f"{method} tile {tile}")


@pytest.mark.parametrize("scheme", [None, "NVFP4A16"])
@pytest.mark.parametrize("rows", [6, 20])  # an unrolled loop of GEMVs (packed, <= GATHER_UNROLL rows) or lax.map
def test_gathered_rows_skip_invalid_rows(scheme, rows):
    """`gathered(x, e, valid)`: valid rows as without the flags, invalid rows not computed (only their bias)."""
    ks = kernels(2)
    bias = np.random.RandomState(3).randn(E, ks["gate_proj"].shape[2]).astype(np.float32)
    model = StackFFN({"gate_proj": ks["gate_proj"]}, {"gate_proj": bias})
    if scheme is not None:
        quantize_model(model, [Rule(".*", scheme)])
    m = model.experts["gate_proj"]
    x, experts = rows_and_experts(rows)
    valid = np.arange(len(experts)) % 3 != 1
    full = np.asarray(nnx.jit(lambda m, x, e: m.gathered(x, e))(m, x, experts))
    got = np.asarray(nnx.jit(lambda m, x, e, v: m.gathered(x, e, v))(m, x, experts, valid))
    np.testing.assert_array_equal(got[valid], full[valid])
    np.testing.assert_array_equal(got[~valid], bias[experts[~valid]])


def test_tiled_grouped_matmul_reads_only_experts_with_rows():
    """The tile loop asks for the weights of experts that have rows only (traced expert ids recorded)."""
    w = jnp.asarray(np.random.RandomState(0).randn(E, 16, 8).astype(np.float32))
    sizes = jnp.asarray([3, 0, 0, 20, 0, 0, 0, 1], jnp.int32)
    x = jnp.asarray(np.random.RandomState(1).randn(24, 16).astype(np.float32))
    seen = []

    def product_of(xt, e):
        jax.debug.callback(lambda v: seen.append(int(v)), e)
        return xt @ w[e]

    y = tiled_grouped_matmul(x, sizes, product_of, None, 8, tile=8)
    jax.effects_barrier()
    assert sorted(set(seen)) == [0, 3, 7] and len(seen) == 1 + 3 + 1  # ceil(3/8) + ceil(20/8) + ceil(1/8) tiles
    rows = np.repeat(np.arange(E), np.asarray(sizes))
    want = np.einsum("mk,mkn->mn", np.asarray(x), np.asarray(w)[rows])
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-5)



def test_chunked_ragged_skips_chunks_without_rows():
    """The chunk loop makes the dense weights of chunks that have rows only, chunk by chunk; the product is the
    whole-stack ragged_dot's up to summation order."""
    w = jnp.asarray(np.random.RandomState(0).randn(E, 16, 8).astype(np.float32))
    sizes = jnp.asarray([3, 0, 0, 0, 0, 0, 20, 1], jnp.int32)
    x = jnp.asarray(np.random.RandomState(1).randn(24, 16).astype(np.float32))
    seen = []

    def stack_of(lo):
        jax.debug.callback(lambda v: seen.append(int(v)), lo)
        return jax.lax.dynamic_slice_in_dim(w, lo, 2)

    y = chunked_ragged_grouped_matmul(x, sizes, stack_of, None, 8, 2)
    jax.effects_barrier()
    assert sorted(seen) == [0, 6]
    rows = np.repeat(np.arange(E), np.asarray(sizes))
    want = np.einsum("mk,mkn->mn", np.asarray(x), np.asarray(w)[rows])
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-5)
    assert [chunk_experts(e, 8) for e in (64, 60, 8, 7, 1)] == [8, 6, 8, 7, 1]


def _dense_buffers(fn, *args):
    """The element counts of every float32 array of the compiled HLO of fn(*args)."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    shapes = re.findall(r"f32\[([\d,]*)\]", text)
    return {int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for dims in shapes}


@pytest.mark.parametrize("scheme", ["W4A16:g32", "NVFP4A16"])
def test_packed_grouped_never_dequantizes_the_whole_stack(monkeypatch, scheme):
    """"ragged" (chunks of RAGGED_CHUNK experts) and "tiled" (one expert per tile): no float32 buffer of the compiled
    grouped matmul holds more experts' weights than a chunk / one expert; the QAT forward (fake-quantized by the
    same chunks) equals the packed one bit for bit, and its gradient flows through the chunk loop."""
    monkeypatch.setattr(experts_module, "RAGGED_CHUNK", 3)  # 8 experts: chunks of 2
    ks = kernels(4)
    qat, ptq = StackFFN({"up_proj": ks["up_proj"]}), StackFFN({"up_proj": ks["up_proj"]})
    quantize_model(qat, [Rule(".*", scheme)], mode="qat")
    quantize_model(ptq, [Rule(".*", scheme)])
    x, experts = rows_and_experts(40)
    xs, sizes = jnp.asarray(x[np.argsort(experts, kind="stable")]), jnp.asarray(np.bincount(experts, minlength=E))
    m = ptq.experts["up_proj"]
    g, st = nnx.split(m)
    one = D * ks["up_proj"].shape[2]
    for method, most in (("ragged", 2), ("tiled", 1)):
        sizes_seen = _dense_buffers(lambda s, x, n: nnx.merge(g, s).grouped(x, n, method), st, xs, sizes)
        assert max(sizes_seen) <= max(most * one, xs.shape[0] * ks["up_proj"].shape[2]), (method, max(sizes_seen))
    want = dense_rows(m, xs, np.sort(experts, kind="stable"))
    got = np.asarray(m.grouped(xs, sizes, "ragged"))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(got, np.asarray(qat.experts["up_proj"].grouped(xs, sizes, "ragged")))
    gq, sq = nnx.split(qat.experts["up_proj"], nnx.Param)
    grad = jax.grad(lambda p: jnp.sum(nnx.merge(gq, p).grouped(xs, sizes, "ragged") ** 2))(sq)
    gk = np.asarray(jax.tree.leaves(grad)[0])
    assert np.all(np.isfinite(gk)) and np.any(gk != 0)

@pytest.mark.parametrize("scheme", ["W4A16:g32", "NVFP4A16", "MXFP4A16"])
def test_packed_gathered_reads_each_experts_weight_in_place_exactly(scheme):
    """The decode path (`gathered`, one packed GEMV per row): with one-hot rows x_m = u_k, y_m is row k of
    dequantize(W[e_m]) bit for bit (the GEMV's weight elements are dequantize's); and no float32 buffer of the compiled
    product holds an expert's dense weight (each row's expert is read as packed codes and scales, in place)."""
    ks = kernels(5)
    model = StackFFN({"up_proj": ks["up_proj"]})
    quantize_model(model, [Rule(".*", scheme)])
    m = model.experts["up_proj"]
    experts = np.array([7, 0, 3, 3, 6, 1], np.int32)
    ks_hot = np.array([0, 1, 31, 32, 62, 63])
    x = np.zeros((len(experts), D), np.float32)
    x[np.arange(len(experts)), ks_hot] = 1.0
    g, st = nnx.split(m)
    f = lambda s, x, e: nnx.merge(g, s).gathered(x, e)  # noqa: E731
    got = np.asarray(jax.jit(f)(st, jnp.asarray(x), jnp.asarray(experts)))
    for i, (e, k) in enumerate(zip(experts, ks_hot)):
        np.testing.assert_array_equal(got[i], np.asarray(dequantize(m.expert_weight(int(e)), jnp.float32))[k],
                                      err_msg=f"row {i}: expert {e}, k {k}")
    assert max(_dense_buffers(f, st, jnp.asarray(x), jnp.asarray(experts))) < D * I


def test_qat_forward_is_the_packed_forward_and_converts():
    from qformats.nn import convert

    ks = kernels(4)
    qat, ptq = StackFFN({"up_proj": ks["up_proj"]}), StackFFN({"up_proj": ks["up_proj"]})
    quantize_model(qat, [Rule(".*", "W4A16:g32")], mode="qat")
    quantize_model(ptq, [Rule(".*", "W4A16:g32")])
    x, experts = rows_and_experts(20)
    a = np.asarray(qat.experts["up_proj"].gathered(jnp.asarray(x), experts))
    b = np.asarray(ptq.experts["up_proj"].gathered(jnp.asarray(x), experts))  # the packed GEMV: summation order
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    c = np.asarray(ptq.experts["up_proj"].grouped(jnp.asarray(x[np.argsort(experts, kind="stable")]),
                                                  np.bincount(experts, minlength=E), "ragged"))
    d = np.asarray(qat.experts["up_proj"].grouped(jnp.asarray(x[np.argsort(experts, kind="stable")]),
                                                  np.bincount(experts, minlength=E), "ragged"))
    np.testing.assert_array_equal(c, d)  # the same dequantized (fake-quantized) weights, the same product
    convert(qat)
    for u, v in zip(jax.tree.leaves(qat.experts["up_proj"].kernel.get_value()),
                    jax.tree.leaves(ptq.experts["up_proj"].kernel.get_value())):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_refused_with_typed_errors():
    ks = kernels()
    with pytest.raises(ModelError, match="calibration of stacked experts"):
        quantize_model(StackFFN(ks), [Rule(".*", "W4A16:g32")], calibration_data=[jnp.zeros((1, D))],
                       forward=lambda m, b: None)
    with pytest.raises(ModelError, match="block scales"):
        quantize_model(StackFFN(ks), [Rule(".*", "FP8_BLOCK")])
    with pytest.raises(ModelError, match="static activation scales"):
        QExperts(jnp.asarray(ks["up_proj"]), None, presets["W8A8"].__class__(
            "W8A8_STATIC", weights=presets["W8A8"].weights,
            input_activations=presets["W8A8"].input_activations.__class__(
                **{**presets["W8A8"].input_activations.__dict__, "dynamic": False})), mode="qat")
    q = StackFFN(ks)
    quantize_model(q, [Rule(".*", "W4A16:g32")])
    with pytest.raises(ModelError, match="call `grouped` or `gathered`"):
        q.experts["gate_proj"](jnp.zeros((1, D)))
    np.testing.assert_array_equal(  # the dequantized expert equals the dequantized slice of the stack
        np.asarray(dequantize(q.experts["gate_proj"].expert_weight(3))),
        np.asarray(q.experts["gate_proj"]._stack(jnp.float32)[3]))


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_static_input_scales_per_expert(scheme):
    """A static activation scheme: each row is quantized with its own expert's scale (FP8 input_scale, NVFP4 input
    global scale), exactly `quantize_acts` of that expert's rows with that scale; the grouped / gathered / dense
    products agree; a static scheme without per-expert scales is refused."""
    from qformats.nn.projection import quantize_acts

    ss = presets[scheme]
    a = ss.input_activations
    ks = kernels(5)
    model = StackFFN({"up_proj": ks["up_proj"]})
    with pytest.raises(ModelError, match="static activation scales"):
        quantize_model(model, [Rule(".*", scheme)])  # no calibration: no scales to give the experts
    ptq = StackFFN({"up_proj": ks["up_proj"]})
    quantize_model(ptq, [Rule(".*", scheme + ":w")])
    q = ptq.experts["up_proj"].kernel.get_value()
    scale = (0.004 * (1 + np.arange(E))).astype(np.float32).reshape(E, 1)
    kw = {"input_scale": scale} if scheme == "FP8" else {"input_global_scale": 448 * 6 / (1 + np.arange(E))}
    m = QExperts.from_packed(q, None, ss, **kw)
    with pytest.raises(ModelError, match="one scale per expert"):
        QExperts.from_packed(q, None, ss, **{k: v[:3] for k, v in kw.items()})
    with pytest.raises(ModelError, match="static input scales given"):
        QExperts.from_packed(q, None, presets["FP8_DYNAMIC"], input_scale=scale)
    x, experts = rows_and_experts(60)
    order = np.argsort(experts, kind="stable")
    xs, es_ = jnp.asarray(x[order]), experts[order]
    sizes = np.bincount(es_, minlength=E)
    got = np.asarray(m._input(xs, lambda: jnp.asarray(es_)))
    s = None if m.input_scale is None else m.input_scale.get_value()
    g = None if m.input_global_scale is None else m.input_global_scale.get_value()
    for e in set(es_.tolist()):  # all rows with expert e's scale (one shape), its own rows compared
        want = quantize_acts(xs, a, None if s is None else s[e], None if g is None else g[e])
        np.testing.assert_array_equal(got[es_ == e], np.asarray(want)[es_ == e], err_msg=f"expert {e}")
    dense = dense_rows(m, xs, es_)
    gathered = np.asarray(nnx.jit(lambda m, x, e: m.gathered(x, e))(m, xs, es_))
    tol = dict(rtol=1e-6, atol=2e-5)  # the packed GEMV against dequantize-then-dot: summation order only
    np.testing.assert_allclose(gathered, dense, **tol)
    for method in ("tiled", "ragged"):
        grouped = np.asarray(nnx.jit(lambda m, x, s: m.grouped(x, s, method))(m, xs, sizes))
        np.testing.assert_allclose(grouped, dense, **tol, err_msg=method)
