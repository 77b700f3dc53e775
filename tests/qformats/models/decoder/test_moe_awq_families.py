"""AWQ and SmoothQuant on Qwen2-MoE (shared expert + sigmoid gate) and DeepSeek-V3 (latent attention, dense first
layer, shared experts): llm-compressor 0.14's mappings (`_moe_default_mappings`, `_deepseek_mappings`,
DEEPSEEK_V2_SMOOTHQUANT_MAPPINGS), and the invariant of a smoothing transform: every Linear reading a smoothed output
compensated, so the transformed float model computes the original's logits (float32 accumulation order only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
import moe_tiny  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.algorithms import awq  # noqa: E402
from qformats.models.decoder.calibration import awq_transform, smoothquant_transform  # noqa: E402

SCHEME = "W4A16:g16"
# float32 logits of |logit| up to ~5: the transformed model differs from the original by rounding only (measured
# ~1e-6); a shared expert left uncompensated moves them by ~1e-1 (`test_qwen2_moe_awq`)
ATOL = 2e-5
N_GRID = 5
"""A short grid (ratios 0, 1/3, 2/3, 1 with duo scaling, and the identity): the mappings and the fold are under test,
not the search (tests/qformats/models/decoder/test_moe_awq.py, test_moe_awq_llmc.py)."""


def _gen():
    spec = importlib.util.spec_from_file_location(
        "gptq_llmc_families_fixture", Path(__file__).resolve().parents[4] / "bench" / "gptq_llmc_families_fixture.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def _samples(vocab: int, seed: int = 4):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(n)).astype(np.int32) for n in (5, 9, 12)]


_forward = nnx.jit(lambda m, ids: m(ids)[0])  # one program per model structure, shared by the original and its twin


def _logits(model, ids):
    return np.asarray(_forward(model, jnp.asarray(ids)))


def _transformed(path, transform, samples):
    """(the original float model, the float model as `transform` leaves it): calibrate_decoder's layer loop without
    its quantization (packed batches, each layer transformed, then its float outputs are the next layer's inputs)."""
    from qformats.algorithms.sequential import pack_batches
    from qformats.models.decoder.calibration import _embed, _forward, _layer_inputs

    orig, _, _ = load_causal_lm(path, tokenizer=False)
    work, _, _ = load_causal_lm(path, tokenizer=False)
    cfg = work.config
    batches = pack_batches(samples, tokens_per_batch=2048, bucket=32)
    xs = [_embed(work, jnp.asarray(ids)) for ids in batches.ids]
    valid = [jnp.asarray(v) for v in batches.valid]
    for i, layer in enumerate(work.model.layers):
        def inputs(j, w=cfg.sliding_windows[i]):
            return _layer_inputs(cfg, batches, j, w)

        transform(layer, i, xs, valid, inputs)
        xs = [_forward(layer, x, *inputs(j)) for j, x in enumerate(xs)]
    return orig, work


def _kernel(model, i, rel):
    m = model.model.layers[i]
    for part in rel.split("/"):
        m = getattr(m, part)
    return np.asarray(m.kernel.get_value())


@pytest.mark.slow  # AWQ compiles its searches for every kernel shape of the layer (~50 s on the busy 2-core machine)
def test_qwen2_moe_awq(tmp_path):
    """post_attention_layernorm balanced over the router and every expert's gate / up (their `_moe_default_mappings`),
    the shared expert's gate / up and its sigmoid gate compensated outside the search, the shared expert's
    up_proj -> down_proj after the experts'; the dense (mlp_only) layer takes the dense mappings; logits kept."""
    import torch

    src = tmp_path / "q2"
    hf = moe_tiny.hf_model("qwen2_moe", num_hidden_layers=2, mlp_only_layers=[1])
    with torch.no_grad():  # channels of unequal scale in the residual stream, so AWQ's scales are not the identity
        hf.model.embed_tokens.weight.mul_(torch.exp(torch.randn(hf.config.hidden_size, generator=torch.Generator()
                                                                .manual_seed(1))))
    hf.save_pretrained(src)
    ids = moe_tiny.ids(2, 12)
    rec = []
    orig, twin = _transformed(src, awq_transform(SCHEME, n_grid=N_GRID, record=rec), _samples(256))
    by = {(r["layer"], r["smooth"]): r for r in rec}
    # grouped-query attention: v_proj -> o_proj does not apply (llm-compressor's shape rule)
    assert [s for (i, s) in by if i == 0 and "/experts/" not in s] == [
        "input_layernorm", "post_attention_layernorm", "mlp/shared_expert/up_proj"]
    assert len([s for (i, s) in by if i == 0 and "/experts/up_proj/" in s]) == 10
    assert [s for (i, s) in by if i == 1] == ["input_layernorm", "post_attention_layernorm", "mlp/up_proj"]
    post = by[(0, "post_attention_layernorm")]
    assert post["balances"] == ("mlp/gate", "mlp/experts/gate_proj", "mlp/experts/up_proj")
    assert post["compensated"] == ("mlp/shared_expert/gate_proj", "mlp/shared_expert/up_proj",
                                   "mlp/shared_expert_gate")
    s = post["scales"]
    assert not np.allclose(s, 1.0)
    # rows * s, exactly as the fold (the shared up_proj's columns are then divided by its up -> down scales)
    for rel in ("mlp/gate", "mlp/shared_expert/gate_proj", "mlp/shared_expert_gate"):
        np.testing.assert_array_equal(_kernel(twin, 0, rel), np.asarray(awq.scale_rows(_kernel(orig, 0, rel), s)),
                                      err_msg=rel)
    ref, got = _logits(orig, ids), _logits(twin, ids)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    # llm-compressor's own fold leaves the shared expert and its gate reading the smoothed norm: the output moves
    for rel in post["compensated"]:
        m = twin.model.layers[0]
        for part in rel.split("/"):
            m = getattr(m, part)
        m.kernel.set_value(jnp.asarray(_kernel(orig, 0, rel)))
    assert np.max(np.abs(_logits(twin, ids) - ref)) > 100 * ATOL


@pytest.mark.slow  # as above (~50 s, then ~15 s for the second variant, compilations shared)
@pytest.mark.parametrize("q_lora", [True, False])
def test_deepseek_v3_awq(tmp_path, q_lora):
    """`_deepseek_mappings`: input_layernorm over q_a_proj (q_proj without query LoRA) and kv_a_proj_with_mqa, the
    LoRA norms over q_b_proj / kv_b_proj (no q_a_layernorm mapping without query LoRA: their regex matches nothing),
    post_attention_layernorm over the router, every expert's and the shared experts' gate / up (sparse layer) or the
    MLP's (the dense first layer), up_proj -> down_proj each; logits kept."""
    gen = _gen()
    fam = "deepseek_v3" if q_lora else "deepseek_v3_noq"
    if not q_lora:
        gen.FAMILIES[fam] = {**gen.FAMILIES["deepseek_v3"], "q_lora_rank": None}
    src = gen.write_checkpoint(fam, tmp_path / "ds", gen.tensors(fam))
    rec = []
    orig, twin = _transformed(src, awq_transform(SCHEME, n_grid=N_GRID, record=rec), _samples(128))
    by = {(r["layer"], r["smooth"]): r for r in rec}
    q = "self_attn/q_a_proj" if q_lora else "self_attn/q_proj"
    attn = ["input_layernorm"] + (["self_attn/q_a_layernorm"] if q_lora else []) + ["self_attn/kv_a_layernorm"]
    assert [s for (i, s) in by if i == 0] == attn + ["post_attention_layernorm", "mlp/up_proj"]
    assert [s for (i, s) in by if i == 1 and "/experts/" not in s] == attn + [
        "post_attention_layernorm", "mlp/shared_experts/up_proj"]
    assert len([s for (i, s) in by if i == 1 and "/experts/up_proj/" in s]) == 8
    assert by[(0, "input_layernorm")]["balances"] == (q, "self_attn/kv_a_proj_with_mqa")
    assert by[(0, "post_attention_layernorm")]["balances"] == ("mlp/gate_proj", "mlp/up_proj")
    post = by[(1, "post_attention_layernorm")]
    assert post["balances"] == ("mlp/gate", "mlp/experts/gate_proj", "mlp/experts/up_proj",
                                "mlp/shared_experts/gate_proj", "mlp/shared_experts/up_proj")
    assert post["compensated"] == ()
    assert not np.allclose(post["scales"], 1.0)
    np.testing.assert_array_equal(_kernel(twin, 1, "mlp/gate"),
                                  np.asarray(awq.scale_rows(_kernel(orig, 1, "mlp/gate"), post["scales"])))
    ids = np.asarray(_samples(128, 7)[2][None])
    np.testing.assert_allclose(_logits(twin, ids), _logits(orig, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("q_lora", [True, False])
def test_deepseek_v3_smoothquant(tmp_path, q_lora):
    """DEEPSEEK_V2_SMOOTHQUANT_MAPPINGS: input_layernorm over q_a_proj (q_proj without query LoRA: their
    `re:.*q(_a)?_proj$`) and kv_a_proj_with_mqa on every layer, nothing else; logits kept."""
    gen = _gen()
    fam = "deepseek_v3" if q_lora else "deepseek_v3_noq"
    if not q_lora:
        gen.FAMILIES[fam] = {**gen.FAMILIES["deepseek_v3"], "q_lora_rank": None}
    src = gen.write_checkpoint(fam, tmp_path / "ds", gen.tensors(fam))
    orig, twin = _transformed(src, smoothquant_transform(0.5, moe=True), _samples(128))
    q = "self_attn/q_a_proj" if q_lora else "self_attn/q_proj"
    lins = (q, "self_attn/kv_a_proj_with_mqa", "self_attn/kv_b_proj", "self_attn/o_proj") + (
        ("self_attn/q_b_proj",) if q_lora else ())
    for i in range(2):
        lo, lt = orig.model.layers[i], twin.model.layers[i]
        changed = {rel for rel in lins if not np.array_equal(_kernel(orig, i, rel), _kernel(twin, i, rel))}
        assert changed == {q, "self_attn/kv_a_proj_with_mqa"}, i
        norms = ("self_attn/kv_a_layernorm", "post_attention_layernorm") + (("self_attn/q_a_layernorm",) if q_lora
                                                                             else ())
        for n in norms:
            a, b = lo, lt
            for part in n.split("/"):
                a, b = getattr(a, part), getattr(b, part)
            np.testing.assert_array_equal(np.asarray(a.weight.get_value()), np.asarray(b.weight.get_value()))
        assert not np.array_equal(np.asarray(lo.input_layernorm.weight.get_value()),
                                  np.asarray(lt.input_layernorm.weight.get_value()))
    ids = np.asarray(_samples(128, 7)[2][None])
    np.testing.assert_allclose(_logits(twin, ids), _logits(orig, ids), atol=ATOL, rtol=0)
