"""qformats.models.decoder.calibration: layer-by-layer calibration of the decoder equals quantize_model where the
two must agree, GPTQ lowers each layer's output error against round-to-nearest, padding changes nothing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
from qformats.models.decoder.calibration import PROJECTIONS, calibrate_decoder
from qformats.nn import QLinear, quantize_model, quantized_layers
from qformats.presets import parse_scheme
from qformats.quantize import dequantize

CFG = DecoderConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
SCHEME = "W4A16:g32"


forward = nnx.jit(lambda m, ids: m(ids)[0])


def model(cfg=CFG):
    return CausalLM(cfg, rngs=nnx.Rngs(0))


def samples(n=6, t=16, seed=0):
    return list(np.random.default_rng(seed).integers(0, CFG.vocab_size, (n, t)).astype(np.int32))


def weights(m):
    return {p: q.kernel.get_value() for p, q in quantized_layers(m).items()}


def same_codes(a, b):
    assert a.keys() == b.keys()
    for p in a:
        for x, y in zip(jax.tree.leaves(a[p]), jax.tree.leaves(b[p])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)


def test_rtn_equals_quantize_model():
    a, b = model(), model()
    calibrate_decoder(a, samples(), SCHEME, weight_search="rtn")
    quantize_model(b, quantization_rules(parse_scheme(SCHEME)))
    same_codes(weights(a), weights(b))
    assert set(weights(a)) == {f"model/layers/{i}/{r}" for i in range(2) for r in PROJECTIONS}


def test_float_propagation_equals_whole_model_gptq():
    """With float propagation every layer sees the float model's activations, as quantize_model's one pass does."""
    a, b = model(), model()
    s = samples()
    calibrate_decoder(a, s, SCHEME, weight_search="gptq", propagate="float", tokens_per_batch=1 << 20)
    quantize_model(b, quantization_rules(parse_scheme(SCHEME)), calibration_data=[jnp.stack(s)],
                   weight_search="gptq", compare_rtn=False, forward=lambda m, ids: m(ids)[0])
    same_codes(weights(a), weights(b))


def test_groups_searched_side_by_side_give_the_same_codes(monkeypatch):
    """SEARCH_WORKERS: a layer's projection groups searched from two threads give the codes of one after the other."""
    from qformats.models.decoder import calibration

    got = []
    for workers in (1, 2):
        monkeypatch.setattr(calibration, "SEARCH_WORKERS", workers)
        m = model()
        calibrate_decoder(m, samples(), SCHEME, weight_search="gptq")
        got.append(weights(m))
    same_codes(*got)


def test_host_sums_ahead_and_overlapped_give_the_same_codes(monkeypatch):
    """CALIBRATION_AHEAD (batches dispatched past the one the host sums) and the last batch's sums overlapped with
    the searches (`_search_as_summed`) give the codes of summing every batch first, then searching one group after
    the other."""
    from qformats.models.decoder import calibration

    def all_first(groups, last, sums, products, inside, search, workers, where, weight_search):
        if last is not None:
            calibration._host_moments(last, sums, products, inside)
        return [search(g) for g in groups]

    got = []
    for ahead, overlapped in ((1, False), (2, True), (3, True)):
        with monkeypatch.context() as mp:
            mp.setattr(calibration, "CALIBRATION_AHEAD", ahead)
            if not overlapped:
                mp.setattr(calibration, "_search_as_summed", all_first)
            m = model()
            calibrate_decoder(m, samples(8, 16), SCHEME, weight_search="gptq", tokens_per_batch=32)  # 4 batches
            got.append(weights(m))
    same_codes(got[0], got[1])
    same_codes(got[0], got[2])


def test_search_without_statistics_is_refused():
    from qformats.models.decoder.calibration import _search_as_summed

    with pytest.raises(ModelError, match="model/layers/3/mlp/down_proj: the calibration pass recorded no input"):
        _search_as_summed([("mlp/down_proj",)], None, {}, {}, None, lambda g: g, 2, "model/layers/3", "gptq")


def test_padding_changes_nothing():
    """Samples of mixed length, padded into buckets, give the codes of the same samples batched unpadded
    (different lengths in separate calls would compile separately; here: one length per batch)."""
    s = samples(4, 16) + samples(4, 8, seed=1)
    one = dataclasses.replace(CFG, num_layers=1, sliding_windows=())
    a, b = model(one), model(one)
    calibrate_decoder(a, s, SCHEME, weight_search="gptq", bucket=16, tokens_per_batch=1 << 20)  # 8-token rows padded
    calibrate_decoder(b, s, SCHEME, weight_search="gptq", bucket=8, tokens_per_batch=1 << 20)  # no padding
    wa, wb = weights(a), weights(b)
    # H's sums differ in accumulation order only (one [8, 16] batch vs [4, 16] + [4, 8]), which moves a few
    # GPTQ decisions: measured 0.2 % of the codes differ
    for p in wa:
        diff = np.abs(np.asarray(dequantize(wa[p])) - np.asarray(dequantize(wb[p])))
        assert (diff > 0).mean() < 0.01, p


def test_gptq_beats_rtn_on_layer_outputs():
    s = samples(8, 32)
    ids = jnp.stack(s)
    ref = model()
    logits_f = forward(ref, ids)
    errs = {}
    for ws in ("rtn", "gptq"):
        m = model()
        info = calibrate_decoder(m, s, "W4A16:g32", weight_search=ws)
        errs[ws] = float(jnp.mean((forward(m, ids) - logits_f) ** 2))
        if ws == "gptq":
            assert info["searched"] == info["projections"] == 14
    assert errs["gptq"] < 0.7 * errs["rtn"], errs


def test_errors():
    m = model()
    with pytest.raises(ModelError, match="propagate"):
        calibrate_decoder(m, samples(), SCHEME, propagate="x")
    with pytest.raises(ModelError, match="weight_search"):
        calibrate_decoder(m, samples(), SCHEME, weight_search="best")
    with pytest.raises(ModelError, match="at least one sample"):
        calibrate_decoder(m, [], SCHEME)
    with pytest.raises(ModelError, match="sample 0"):
        calibrate_decoder(m, [np.zeros((2, 2), np.int32)], SCHEME)
    with pytest.raises(ModelError, match="do not divide|divid"):
        calibrate_decoder(m, samples(), "W4A16:g48")
    calibrate_decoder(m, samples(), SCHEME, weight_search="rtn")
    with pytest.raises(ModelError, match="expected a float nnx.Linear"):
        calibrate_decoder(m, samples(), SCHEME)
    assert isinstance(m.model.layers[0].self_attn.q_proj, QLinear)


def test_packed_rows_equal_one_sample_a_row():
    """Several samples packed into each row (each attending to itself, positions restarting) give the codes of one
    sample a row, up to the accumulation order of H (a few near-tie GPTQ decisions)."""
    rng = np.random.default_rng(3)
    s = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (5, 11, 16, 3, 9, 7)]
    a, b = model(), model()
    calibrate_decoder(a, s, SCHEME, weight_search="gptq", bucket=8, pack=True)
    calibrate_decoder(b, s, SCHEME, weight_search="gptq", bucket=8, pack=False, tokens_per_batch=1 << 20)
    wa, wb = weights(a), weights(b)
    for p in wa:
        diff = np.abs(np.asarray(dequantize(wa[p])) - np.asarray(dequantize(wb[p])))
        assert (diff > 0).mean() < 0.01, p


@pytest.mark.parametrize("scheme", ["W4A16:g32", "W8A8"])
def test_propagation_on_weights_dequantized_once_is_bit_exact(scheme, monkeypatch):
    """The propagation pass runs packed projections on their weights dequantized once (`_Dequantized`): the same
    outputs, bit for bit, as each batch dequantizing them (W8A8: its activation scheme set aside, as propagating
    does); the packed projections are back in place after."""
    from qformats.models.decoder import calibration as C
    from qformats.models.decoder.layers import rope_tables

    m = model(dataclasses.replace(CFG, qkv_bias=True))
    calibrate_decoder(m, samples(), scheme, weight_search="rtn")
    layer = m.model.layers[0]
    t = 16
    inv = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    cos, sin = rope_tables(jnp.arange(t), inv)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool)))
    xs = [jax.random.normal(jax.random.PRNGKey(j), (3, t, 64)) for j in range(2)]
    swapped = []
    monkeypatch.setattr(C, "_Dequantized", lambda lin, dtype, cls=C._Dequantized: swapped.append(1) or cls(lin, dtype))
    once = list(xs)
    C._propagate(layer, once, lambda j: (cos, sin, mask))
    assert len(swapped) == len(PROJECTIONS)
    assert all(type(C._get(layer, r)) is QLinear for r in PROJECTIONS)
    monkeypatch.setattr(C, "_dequantizable", lambda lin, x: False)
    each_batch = list(xs)
    C._propagate(layer, each_batch, lambda j: (cos, sin, mask))
    for a, b in zip(once, each_batch):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("recipe", ["gptq", "awq", "smoothquant"])
def test_packed_last_batch_without_its_empty_rows_gives_the_same_codes(recipe, monkeypatch):
    """`pack_batches`' shape_cost: a last batch of its real rows only (a second shape) gives the codes of the same
    batch filled up with empty rows (every statistic adds zeros for them; its taps come back padded to a whole
    batch's rows, so the host's x^T x sums the same shapes); with a transform (AWQ, SmoothQuant) `calibrate_decoder`
    keeps one shape (AWQ's means would move by roundoff: their reductions span whole batches)."""
    from qformats.algorithms.sequential import pack_batches
    from qformats.models.decoder import calibration
    from qformats.models.decoder.calibration import awq_transform, smoothquant_transform

    summed = []
    add = calibration._add_moments
    monkeypatch.setattr(calibration, "_add_moments", lambda rel, var, *a: (
        summed.extend(x.shape for x in (var.get_value() if isinstance(var, nnx.Variable) else var)),
        add(rel, var, *a))[1])

    s = samples(13, 16)  # 13 rows of 16, 4 a batch: 4 batches, the last of 1 row (+ 3 empty rows)
    assert [a.shape[0] for a in pack_batches(s, tokens_per_batch=64, bucket=16, shape_cost=47).ids] == [4, 4, 4, 1]
    assert [a.shape[0] for a in pack_batches(s, tokens_per_batch=64, bucket=16, shape_cost=48).ids] == [4] * 4
    scheme = "W8A8" if recipe == "smoothquant" else SCHEME
    got = []
    for cost in (0, 1):
        m = model()
        transform = {"gptq": None, "awq": awq_transform(SCHEME, n_grid=8),
                     "smoothquant": smoothquant_transform(0.5)}[recipe]
        calibrate_decoder(m, s, scheme, weight_search="rtn" if recipe == "awq" else "gptq", transform=transform,
                          tokens_per_batch=64, bucket=16, shape_cost=cost)
        got.append(weights(m))
        if recipe != "awq":  # (AWQ + round-to-nearest sums no x^T x)
            assert {shape[0] for shape in summed} == {4}, summed  # every batch's taps: 4 rows
        summed.clear()
    same_codes(got[0], got[1])
