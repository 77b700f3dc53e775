"""Calibration of mixture-of-experts decoders (`calibrate_decoder` on qwen3_moe / qwen2_moe / mixtral): every expert's
statistics against a naive per-expert computation on transformers 5's own activations and routing, each expert's
codes exactly GPTQ's for its own kernel and H, routed-only statistics refusing an expert without tokens (or taking
every token for it when asked), static activation ranges per expert over the same tokens, gpt-oss's fused experts
(biases, the clamped SwiGLU, gate / up quantized apart) and the refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
import moe_tiny  # noqa: E402

from qformats.algorithms.gptq import GPTQOptions  # noqa: E402
from qformats.algorithms.weight_search import quantize_group, quantize_projection  # noqa: E402
from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder.calibration import calibrate_decoder, expert_moments, expert_ranges  # noqa: E402
from qformats.models.decoder.moe import MoEConfig, activation  # noqa: E402
from qformats.nn import resolve_scheme  # noqa: E402
from qformats.nn.experts import QExperts  # noqa: E402

SCHEME = "W4A16:g16"


def _logits(model, ids):
    """The model's float32 logits, jitted (one program, not an eager dispatch of every op)."""
    from flax import nnx

    global _forward
    if _forward is None:
        _forward = nnx.jit(lambda m, x: m(x)[0])
    return np.asarray(_forward(model, ids))


_forward = None


def _naive(x, valid, experts, gate, up, cfg, routed: bool):
    """Per expert, in float64 numpy, a loop over the experts: the rows it sees (all real tokens, or those routed to
    it), H_in = X^T X and H_mid = A^T A with A = act(X Wg, X Wu)."""
    x, gate, up = (np.asarray(a, np.float64) for a in (x, gate, up))
    real = np.asarray(valid) > 0
    h_in, h_mid, tokens = [], [], []
    for e in range(gate.shape[0]):
        sel = real & (np.asarray(experts) == e).any(-1) if routed else real
        xe = x[sel]
        a = np.asarray(activation(jnp.asarray(xe @ gate[e]), jnp.asarray(xe @ up[e]), cfg), np.float64)
        h_in.append(xe.T @ xe)
        h_mid.append(a.T @ a)
        tokens.append(int(np.sum(real & (np.asarray(experts) == e).any(-1))))
    return np.stack(h_in), np.stack(h_mid), np.asarray(tokens)


@pytest.mark.parametrize("statistics", ["all", "routed", "routed-or-all"])
def test_expert_moments_equal_a_naive_per_expert_loop(statistics):
    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=12)
    rng = np.random.default_rng(0)
    m, d = 40, 16
    x = rng.standard_normal((m, d)).astype(np.float32)
    valid = (np.arange(m) < 33).astype(np.float32)  # the last rows are padding
    # real tokens are routed among experts 0..4 only; expert 5 is chosen by padding rows alone
    experts = np.stack([rng.permutation(5)[:2] for _ in range(33)] + [[5, 0]] * (m - 33)).astype(np.int32)
    gate = rng.standard_normal((6, d, 12)).astype(np.float32)
    up = rng.standard_normal((6, d, 12)).astype(np.float32)
    got = expert_moments(jnp.asarray(x), jnp.asarray(valid), jnp.asarray(experts), jnp.asarray(gate), jnp.asarray(up),
                         cfg, statistics)
    all_in, all_mid, tokens = _naive(x, valid, experts, gate, up, cfg, routed=False)
    r_in, r_mid, _ = _naive(x, valid, experts, gate, up, cfg, routed=True)
    np.testing.assert_array_equal(np.asarray(got["tokens"]), tokens)
    assert tokens[5] == 0 and tokens.sum() == 2 * 33
    tol = dict(rtol=2e-5, atol=1e-3)  # float32 sums of 33 products against float64: accumulation order only
    if statistics == "all":
        np.testing.assert_allclose(np.asarray(got["h_in"]), all_in[0], **tol)
        np.testing.assert_allclose(np.asarray(got["h_mid"]), all_mid, **tol)
    else:
        np.testing.assert_allclose(np.asarray(got["h_in"]), r_in, **tol)
        np.testing.assert_allclose(np.asarray(got["h_mid"]), r_mid, **tol)
        assert not np.any(np.asarray(got["h_in"])[5]) and not np.any(np.asarray(got["h_mid"])[5])
    if statistics == "routed-or-all":
        np.testing.assert_allclose(np.asarray(got["h_in_all"]), all_in[0], **tol)
        np.testing.assert_allclose(np.asarray(got["h_mid_all"]), all_mid, **tol)


@pytest.mark.parametrize("statistics", ["all", "routed", "routed-or-all"])
def test_expert_ranges_equal_a_naive_per_expert_loop(statistics):
    """Each expert's static activation range: max |x| over the tokens it observes (gate / up input) and max |a_e|
    (down_proj input), padding excluded; an expert without routed tokens has range 0 under "routed" (the driver
    refuses it, or takes the all-token range under "routed-or-all")."""
    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=12)
    rng = np.random.default_rng(0)
    m, d = 40, 16
    x = rng.standard_normal((m, d)).astype(np.float32)
    x[35] *= 100.0  # a padding row larger than every real one
    valid = (np.arange(m) < 33).astype(np.float32)
    experts = np.stack([rng.permutation(5)[:2] for _ in range(33)] + [[5, 0]] * (m - 33)).astype(np.int32)
    gate = rng.standard_normal((6, d, 12)).astype(np.float32)
    up = rng.standard_normal((6, d, 12)).astype(np.float32)
    got = {k: np.asarray(v) for k, v in expert_ranges(jnp.asarray(x), jnp.asarray(valid), jnp.asarray(experts),
                                                       jnp.asarray(gate), jnp.asarray(up), cfg, statistics).items()}
    real = valid > 0

    def naive(routed):
        amax_in, amax_mid = [], []
        for e in range(6):
            sel = real & (experts == e).any(-1) if routed else real
            xe = jnp.asarray(x[sel])
            act = np.asarray(activation(xe @ jnp.asarray(gate[e]), xe @ jnp.asarray(up[e]), cfg))
            amax_in.append(np.max(np.abs(x[sel]), initial=0.0))
            amax_mid.append(np.max(np.abs(act), initial=0.0))
        return np.asarray(amax_in, np.float32), np.asarray(amax_mid, np.float32)

    all_in, all_mid = naive(False)
    r_in, r_mid = naive(True)
    want = {"all": {"amax_in": all_in, "amax_mid": all_mid}, "routed": {"amax_in": r_in, "amax_mid": r_mid},
            "routed-or-all": {"amax_in": r_in, "amax_mid": r_mid, "amax_in_all": all_in, "amax_mid_all": all_mid}}
    assert set(got) == set(want[statistics])
    for k, v in want[statistics].items():  # a max is exact: equal up to the activations' matmul order
        if k.startswith("amax_in"):
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        else:
            np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=0, err_msg=k)
    assert np.all(all_in == np.max(np.abs(x[:33])))
    if statistics != "all":
        assert got["amax_in"][5] == 0 and got["amax_mid"][5] == 0


def _samples(n, lo, hi, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]


def _hf_block_inputs(hf, samples):
    """transformers' layer-0 MoE block inputs for every sample (each run alone, unpadded) and its router's choice."""
    mlp = hf.model.layers[0].mlp  # transformers 5 names the block "mlp" in memory (mixtral too)
    seen = []
    h = mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for s in samples:
            hf(torch.tensor(s[None].astype(np.int64)))
        h.remove()
        x = torch.cat(seen)
        idx = mlp.gate(x)[2]
    return x.numpy(), idx.numpy()


def _expert_weights(path, block, names, n):
    _, t = moe_tiny.read_checkpoint(path)
    g, u, dn = names
    stack = lambda p: np.stack([t[f"model.layers.0.{block}.experts.{e}.{p}.weight"].T for e in range(n)])  # noqa: E731
    return stack(g), stack(u), stack(dn)


@pytest.mark.slow  # 50-80 s on the loaded 2-core machine: two calibrations of a one-layer model, a transformers run
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_calibration_statistics_and_codes_follow_transformers(arch, tmp_path):
    """Layer 0's expert statistics recorded by `calibrate_decoder` equal the naive per-expert sums over transformers'
    block inputs and routing; every expert's packed weight is exactly GPTQ's for its own kernel and H."""
    from converters.pipelines.causal_lm import load_causal_lm

    over = dict(num_hidden_layers=1)
    hf = moe_tiny.write_checkpoint(arch, tmp_path / "src", **over)
    samples = _samples(5, 6, 30)
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    c = model.config.moe
    block = c.block_name
    floats = _expert_weights(tmp_path / "src", block, c.projections, c.num_experts)
    rec = []
    calibrate_decoder(model, samples, SCHEME, moe_statistics="routed-or-all", moe_record=rec, guard=False)
    x, idx = _hf_block_inputs(hf, samples)
    valid = np.ones(len(x), np.float32)
    all_in, all_mid, tokens = _naive(x, valid, idx, floats[0], floats[1], c, routed=False)
    r_in, r_mid, _ = _naive(x, valid, idx, floats[0], floats[1], c, routed=True)
    got = rec[0]
    assert got["layer"] == 0 and got["statistics"] == "routed-or-all"
    np.testing.assert_array_equal(got["tokens"], tokens)
    tol = dict(rtol=1e-4, atol=1e-3)  # float32 sums against float64 and torch's attention against XLA's
    np.testing.assert_allclose(got["h_in_all"], all_in[0], **tol)
    np.testing.assert_allclose(got["h_mid_all"], all_mid, **tol)
    np.testing.assert_allclose(got["h_in"], r_in, **tol)
    np.testing.assert_allclose(got["h_mid"], r_mid, **tol)

    # the default ("all"): each expert's codes = GPTQ of its own kernels with H = the all-token statistics / tokens
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    rec = []
    calibrate_decoder(model, samples, SCHEME, moe_record=rec, guard=False)
    got = rec[0]
    n = float(sum(len(s) for s in samples))
    np.testing.assert_allclose(got["h_in"], all_in[0], **tol)
    ss = resolve_scheme(SCHEME)
    ex = getattr(model.model.layers[0], block).experts
    g, u, dn = c.projections
    for e in range(c.num_experts):
        want = quantize_group({g: jnp.asarray(floats[0][e]), u: jnp.asarray(floats[1][e])}, ss,
                              jnp.asarray(got["h_in"] / n), "gptq", GPTQOptions(), False)
        want[dn] = quantize_projection(jnp.asarray(floats[2][e]), ss, jnp.asarray(got["h_mid"][e] / n), "gptq",
                                       GPTQOptions(), False)
        for p in (g, u, dn):
            mod = getattr(ex, p)
            assert isinstance(mod, QExperts) and mod.weight_method == "gptq"
            mine, ref = mod.expert_weight(e), want[p][0]
            for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"expert {e} {p}")


@pytest.mark.slow  # ~30 s on the loaded 2-core machine: two calibrations of a one-layer model
def test_routed_statistics_refuse_an_expert_without_tokens(tmp_path):
    """16 experts, top-2, 3 tokens: at least 10 experts get no token. "routed" names them (layer and experts);
    "routed-or-all" calibrates them from every token, never from an empty H."""
    from converters.pipelines.causal_lm import load_causal_lm

    moe_tiny.write_checkpoint("qwen3_moe", tmp_path / "src", num_hidden_layers=1, num_experts=16,
                              num_experts_per_tok=2)
    samples = [np.array([5, 17, 200], np.int32)]
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    c = model.config.moe
    floats = _expert_weights(tmp_path / "src", "mlp", c.projections, c.num_experts)
    rec = []
    calibrate_decoder(model, samples, SCHEME, moe_statistics="routed-or-all", moe_record=rec, guard=False)
    empty = [e for e in range(16) if rec[0]["tokens"][e] == 0]
    assert len(empty) >= 10
    ex = model.model.layers[0].mlp.experts
    ss = resolve_scheme(SCHEME)
    for e in empty[:2]:  # an empty expert: GPTQ with the all-token H (divided by all 3 tokens)
        want = quantize_projection(jnp.asarray(floats[2][e]), ss, jnp.asarray(rec[0]["h_mid_all"][e] / 3.0), "gptq",
                                   GPTQOptions(), False)[0]
        for a, b in zip(jax.tree.leaves(ex.down_proj.expert_weight(e)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    with pytest.raises(ModelError, match=r"model/layers/0/mlp/experts: experts " + ", ".join(map(str, empty)) +
                       r" of 16 received no calibration tokens"):
        calibrate_decoder(model, samples, SCHEME, moe_statistics="routed")
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)  # static activation ranges: the same refusal
    with pytest.raises(ModelError, match=r"model/layers/0/mlp/experts: experts " + ", ".join(map(str, empty)) +
                       r" of 16 received no calibration tokens .* their static activation ranges would be empty"):
        calibrate_decoder(model, samples, "FP8", weight_search="rtn", moe_statistics="routed")


@pytest.mark.slow  # one calibration of a two-layer model
def test_qwen2_moe_shared_expert_and_dense_layers_calibrated(tmp_path):
    """qwen2_moe: the shared expert's projections are calibrated QLinears, the router and the shared expert's gate
    stay float, the dense layer (mlp_only_layers) is calibrated as in a dense decoder; the output stays close."""
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.nn import QLinear

    # layer 0 sparse (shared expert), layer 1 dense (mlp_only_layers)
    moe_tiny.write_checkpoint("qwen2_moe", tmp_path / "src", num_hidden_layers=2, mlp_only_layers=[1])
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    ids = jnp.asarray(moe_tiny.ids(1, 12))
    ref = _logits(model, ids)
    info = calibrate_decoder(model, _samples(4, 8, 24), SCHEME, guard=False)
    c = model.config.moe
    assert model.config.moe_layers == (True, False)
    assert info["projections"] == (4 + 3 + 3 * c.num_experts) + 7
    blk = model.model.layers[0].mlp
    assert type(blk.gate) is nnx.Linear and type(blk.shared_expert_gate) is nnx.Linear
    assert all(isinstance(getattr(blk.shared_expert, p), QLinear) for p in ("gate_proj", "up_proj", "down_proj"))
    assert isinstance(model.model.layers[1].mlp.down_proj, QLinear)
    out = _logits(model, ids)
    assert np.all(np.isfinite(out))
    assert np.corrcoef(out.ravel(), ref.ravel())[0, 1] > 0.95


def test_refusals(tmp_path):
    """An unknown moe_statistics: a typed error before any work (AWQ's: test_moe_awq.py; gpt-oss's and DeepSeek-V3's:
    tests/converters/pipelines/test_calibrate_moe_families.py)."""
    from converters.pipelines.causal_lm import load_causal_lm
    moe_tiny.write_checkpoint("qwen3_moe", tmp_path / "q", num_hidden_layers=1)
    model, _, _ = load_causal_lm(tmp_path / "q", tokenizer=False)
    samples = [np.arange(8, dtype=np.int32)]
    with pytest.raises(ModelError, match="moe_statistics must be one of"):
        calibrate_decoder(model, samples, SCHEME, moe_statistics="some")


def test_expert_moments_with_biases_follow_the_clamped_swiglu():
    """gpt-oss: a_e = act(x W_g + b_g, x W_u + b_u) with the clamped SwiGLU; padding rows (whose a_e = act(b) is not
    zero) add nothing."""
    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, activation="swiglu_oai", expert_bias=True,
                    routing="topk_softmax", projections=(None, "gate_up_proj", "down_proj"))
    rng = np.random.default_rng(1)
    m, d = 20, 8
    x = 3 * rng.standard_normal((m, d)).astype(np.float32)
    valid = (np.arange(m) < 17).astype(np.float32)
    experts = np.stack([rng.permutation(4)[:2] for _ in range(m)]).astype(np.int32)
    gate, up = (rng.standard_normal((4, d, 8)).astype(np.float32) for _ in range(2))
    gb, ub = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    args = [jnp.asarray(a) for a in (x, valid, experts, gate, up, gb, ub)]
    got = jax.jit(lambda x, v, i, g, u, gb, ub: expert_moments(x, v, i, g, u, cfg, "routed-or-all", gate_bias=gb,
                                                               up_bias=ub))(*args)
    ranges = jax.jit(lambda x, v, i, g, u, gb, ub: expert_ranges(x, v, i, g, u, cfg, "all", gate_bias=gb,
                                                             up_bias=ub))(*args)
    for e in range(4):
        for routed in (False, True):
            sel = (valid > 0) & ((experts == e).any(-1) if routed else True)
            g = np.minimum(x[sel] @ gate[e] + gb[e], 7.0).astype(np.float64)  # the clamped SwiGLU, numpy float64
            u = np.clip(x[sel] @ up[e] + ub[e], -7.0, 7.0).astype(np.float64)
            a = (u + 1) * g / (1 + np.exp(-1.702 * g))
            key = "h_mid" if routed else "h_mid_all"
            np.testing.assert_allclose(np.asarray(got[key][e]), a.T @ a, rtol=2e-5, atol=1e-3)  # float32 sums
            if not routed:
                np.testing.assert_allclose(np.asarray(ranges["amax_mid"][e]), np.max(np.abs(a)), rtol=1e-6)


# 24 CPU s for the whole pytest process (imports included; 75 s wall call at load 40): one calibration of a
# one-layer model plus the per-expert GPTQ references (split between them not measured).
@pytest.mark.slow
def test_gpt_oss_fused_experts_quantized_as_separate_gate_and_up(tmp_path):
    """gpt-oss: each expert's fused gate_up_proj holds exactly the interleaved codes of its gate (even columns) and up
    (odd columns) quantized as two Linears with the expert's input H (llm-compressor's linearized experts), and its
    down_proj GPTQ's with H of the biased clamped-SwiGLU activation (routed-or-all statistics); the router stays
    float."""
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.decoder.params import split_gate_up

    moe_tiny.write_checkpoint("gpt_oss", tmp_path / "src", num_hidden_layers=1)
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    ex = model.model.layers[0].mlp.experts
    k = np.asarray(ex.gate_up_proj.kernel.get_value())
    dk = np.asarray(ex.down_proj.kernel.get_value())
    samples = _samples(4, 6, 20)
    n = float(sum(len(s) for s in samples))
    rec = []
    info = calibrate_decoder(model, samples, SCHEME, moe_record=rec, guard=False, moe_statistics="routed-or-all")
    assert info["projections"] == 4 + 3 * 8
    assert type(model.model.layers[0].mlp.router) is nnx.Linear
    ss = resolve_scheme(SCHEME)
    tokens = rec[0]["tokens"]
    assert tokens.sum() == 2 * n
    for e in range(8):  # routed statistics: H over the expert's own tokens (every token for an expert with none)
        c = tokens[e] if tokens[e] else n
        h_in = rec[0]["h_in"][e] if tokens[e] else rec[0]["h_in_all"]
        h_mid = rec[0]["h_mid"][e] if tokens[e] else rec[0]["h_mid_all"][e]
        want = quantize_group({"gate_proj": jnp.asarray(k[e][:, 0::2]), "up_proj": jnp.asarray(k[e][:, 1::2])}, ss,
                              jnp.asarray(h_in / c), "gptq", GPTQOptions(), False)
        down = quantize_projection(jnp.asarray(dk[e]), ss, jnp.asarray(h_mid / c), "gptq", GPTQOptions(), False)[0]
        got_g, got_u = split_gate_up(ex.gate_up_proj.expert_weight(e), "gate_up")
        for mine, ref in ((got_g, want["gate_proj"][0]), (got_u, want["up_proj"][0]),
                          (ex.down_proj.expert_weight(e), down)):
            for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"expert {e}")


@pytest.mark.slow  # ~60 s on the loaded 2-core machine: one calibration of a one-layer model
def test_smoothquant_w8a8_on_moe_smooths_the_attention_only(tmp_path):
    """SmoothQuant on an MoE layer follows llm-compressor's Qwen-MoE / Mixtral mappings: input_layernorm -> q/k/v
    smoothed, post_attention_layernorm (feeding the router and every expert) left alone; W8A8's dynamic per-token
    activation quantization is kept on the experts, and the output stays close to the float model's."""
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.decoder.calibration import smoothquant_transform

    moe_tiny.write_checkpoint("qwen3_moe", tmp_path / "src", num_hidden_layers=1)
    model, _, _ = load_causal_lm(tmp_path / "src", tokenizer=False)
    ids = jnp.asarray(moe_tiny.ids(1, 12))
    ref = _logits(model, ids)
    layer = model.model.layers[0]
    pre = np.asarray(layer.input_layernorm.weight.get_value())
    post = np.asarray(layer.post_attention_layernorm.weight.get_value())
    # round-to-nearest weights: the smoothing and the activation scheme are under test, not the weight search
    calibrate_decoder(model, _samples(4, 8, 24), "W8A8", weight_search="rtn", transform=smoothquant_transform(0.5),
                      guard=False)
    assert not np.array_equal(np.asarray(layer.input_layernorm.weight.get_value()), pre)
    np.testing.assert_array_equal(np.asarray(layer.post_attention_layernorm.weight.get_value()), post)
    gp = layer.mlp.experts.gate_proj
    assert isinstance(gp, QExperts) and gp.schemes.input_activations.dynamic is True
    out = _logits(model, ids)
    assert np.all(np.isfinite(out)) and np.corrcoef(out.ravel(), ref.ravel())[0, 1] > 0.99
