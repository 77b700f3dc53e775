"""qformats.models.decoder.params.fuse_linearized_experts: gpt_oss's per-expert Linears (llm-compressor's linearized
layout) fused back into the interleaved gate_up / down stacks, packed weights staying packed: the fused QArray
decodes exactly to the interleave of the experts' own decodings; layouts whose scales span rows, differing
per-tensor scales and incomplete experts are refused by name."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_tiny import hf_config  # noqa: E402

from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder import DecoderConfig  # noqa: E402
from qformats.models.decoder.params import fuse_linearized_experts, fused_expert_names  # noqa: E402
from qformats.presets import parse_scheme, presets  # noqa: E402
from qformats.qarray import QArray  # noqa: E402
from qformats.quantize import dequantize, quantize  # noqa: E402

CFG = DecoderConfig.from_hf(hf_config("gpt_oss").to_dict())
E, H, I = CFG.moe.num_experts, CFG.hidden_size, CFG.moe.intermediate_size
X = "model.layers.0.mlp.experts"


def _modules(scheme, seed=0):
    """Layer 0's per-expert modules: torch-layout dense weights [out, in] (scheme None), or QArrays [in, out] along
    axis 0 of `scheme` (each projection's experts quantized in one call, then split per expert)."""
    rng = np.random.default_rng(seed)
    out = {}
    for proj, (k, n) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
        w = rng.standard_normal((E, k, n)).astype(np.float32)
        blocks = scheme is not None and scheme.strategy == "block"  # 2-D only: one call per expert
        q = None if scheme is None or blocks else jax.tree.map(np.asarray, quantize(jnp.asarray(w), scheme, axis=1))
        for e in range(E):
            if scheme is None:
                weight = w[e].T
            elif blocks:
                weight = quantize(jnp.asarray(w[e]), scheme, axis=0)
            else:
                pick = lambda a: None if a is None else a[e]  # noqa: E731
                gs = q.global_scale  # one per projection (all experts): [1]
                scale = q.scale if scheme.strategy == "tensor" else q.scale[e]  # tensor: one per projection
                weight = QArray(q.codes[e], scale, pick(q.zero_point), gs, scheme=scheme, shape=(k, n),
                                dtype=q.dtype, axis=0)
            out[f"{X}.{e}.{proj}"] = {"weight": weight, "bias": rng.standard_normal(n).astype(np.float32)}
    return out


def _interleave(g, u):
    return np.stack([g, u], axis=-1).reshape(g.shape[0], -1)


@pytest.mark.parametrize("preset", ["MXFP4A16", "W4A16_ASYM:g32", "W8A8"])
def test_packed_experts_fuse_exactly(preset):
    scheme = parse_scheme(preset).weights
    mods = _modules(scheme)
    fused, sources = fuse_linearized_experts(CFG, mods)
    assert sorted(sources) == [f"{X}.down_proj", f"{X}.gate_up_proj"] and len(sources[f"{X}.gate_up_proj"]) == 2 * E
    assert not any(n.startswith(f"{X}.0.") for n in fused)
    assert set(fused_expert_names(CFG)) >= {f"{X}.gate_up_proj.weight", f"{X}.gate_up_proj.bias"}
    gu, dn = fused[f"{X}.gate_up_proj"], fused[f"{X}.down_proj"]
    assert isinstance(gu["weight"], QArray) and gu["weight"].shape == (H, 2 * I) and gu["weight"].codes.shape[0] == E
    assert isinstance(gu["weight"].codes, jax.Array)
    for e in (0, E - 1):
        one = jax.tree.map(lambda leaf: leaf[e], gu["weight"])
        g, u = (np.asarray(dequantize(mods[f"{X}.{e}.{p}"]["weight"], jnp.float32)) for p in ("gate_proj", "up_proj"))
        np.testing.assert_array_equal(np.asarray(dequantize(one, jnp.float32)), _interleave(g, u))
        np.testing.assert_array_equal(np.asarray(dequantize(jax.tree.map(lambda leaf: leaf[e], dn["weight"]),
                                                            jnp.float32)),
                                      np.asarray(dequantize(mods[f"{X}.{e}.down_proj"]["weight"], jnp.float32)))
        np.testing.assert_array_equal(gu["bias"][e], _interleave(mods[f"{X}.{e}.gate_proj"]["bias"][None],
                                                                 mods[f"{X}.{e}.up_proj"]["bias"][None])[0])


def test_dense_experts_fuse_to_the_transformers_layout():
    mods = _modules(None)
    fused, _ = fuse_linearized_experts(CFG, mods)
    w = fused[f"{X}.gate_up_proj"]["weight"]
    assert w.shape == (E, H, 2 * I)
    np.testing.assert_array_equal(w[3][:, 0::2], mods[f"{X}.3.gate_proj"]["weight"].T)
    np.testing.assert_array_equal(w[3][:, 1::2], mods[f"{X}.3.up_proj"]["weight"].T)
    np.testing.assert_array_equal(fused[f"{X}.down_proj"]["weight"][5], mods[f"{X}.5.down_proj"]["weight"].T)


def test_other_families_and_fused_checkpoints_are_unchanged():
    mods = {"model.layers.0.mlp.experts": {"gate_up_proj": np.zeros(1)}}
    assert fuse_linearized_experts(CFG, mods) == (mods, {})
    qwen = DecoderConfig.from_hf(hf_config("qwen3_moe").to_dict())
    assert fuse_linearized_experts(qwen, _modules(None))[1] == {} and fused_expert_names(qwen) == {}


def test_refusals_name_the_module():
    block = dataclasses.replace(presets["FP8_BLOCK"].weights, block=(8, 8))
    with pytest.raises(ModelError, match=rf"{X}\.0: strategy 'block'"):
        fuse_linearized_experts(CFG, _modules(block))
    # NVFP4: each projection's own global scale (here one per projection): gate's and up's differ
    with pytest.raises(ModelError, match=rf"{X}\.0: gate_proj and up_proj have different global scales"):
        fuse_linearized_experts(CFG, _modules(presets["NVFP4A16"].weights))
    with pytest.raises(ModelError, match=rf"{X}\.0: gate_proj and up_proj have different per-tensor scales"):
        fuse_linearized_experts(CFG, _modules(presets["FP8"].weights))
    mods = _modules(None)
    del mods[f"{X}.6.up_proj"]
    with pytest.raises(ModelError, match=rf"{X}: 1 of its {3 * E} per-expert modules missing: \['{X}.6.up_proj'\]"):
        fuse_linearized_experts(CFG, mods)
    mods = _modules(None)
    mods[f"{X}.2.down_proj"]["weight"] = quantize(jnp.asarray(mods[f"{X}.2.down_proj"]["weight"].T),
                                                  presets["W8A8"].weights, axis=0)
    with pytest.raises(ModelError, match=rf"{X}: some experts are packed, others dense"):
        fuse_linearized_experts(CFG, mods)
    mods = _modules(None)
    mods[f"{X}.1.gate_proj"]["smooth_scale"] = np.ones(1, np.float32)
    with pytest.raises(ModelError, match=rf"{X}\.1\.gate_proj: expected tensors weight and bias"):
        fuse_linearized_experts(CFG, mods)
    mods = _modules(None)  # static input scales: on every projection or none, gate's equal to up's
    mods[f"{X}.1.gate_proj"]["input_scale"] = np.ones(1, np.float32)
    with pytest.raises(ModelError, match=rf"{X}: input_scale on some experts' projections only"):
        fuse_linearized_experts(CFG, mods)
    mods = _modules(None)
    for e in range(E):
        for p in ("gate_proj", "up_proj", "down_proj"):
            mods[f"{X}.{e}.{p}"]["input_scale"] = np.full(1, 1.0 + e + (p == "up_proj" and e == 3), np.float32)
    with pytest.raises(ModelError, match=rf"{X}\.3: gate_proj and up_proj have different input_scales"):
        fuse_linearized_experts(CFG, mods)
    mods = _modules(None)
    mods[f"{X}.8.gate_proj"] = mods[f"{X}.0.gate_proj"]
    with pytest.raises(ModelError, match=r"are not gpt_oss experts"):
        fuse_linearized_experts(CFG, mods)


@pytest.mark.parametrize("preset", ["W4A16:g16", "W8A8", "NVFP4", "FP8"])
def test_split_gate_up_inverts_interleave(preset):
    """params.split_gate_up (the calibrated gpt-oss checkpoint's per-expert gate_proj / up_proj) gives back exactly the
    two QArrays interleave_gate_up fused: every leaf equal, bytes copied."""
    from qformats.models.decoder.params import interleave_gate_up, split_gate_up
    from qformats.nn import resolve_scheme

    ws = resolve_scheme(preset).weights
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((H, I)).astype(np.float32))
    gate = jax.tree.map(np.asarray, quantize(k, ws, axis=0))
    up = jax.tree.map(np.asarray, quantize(2 * k, ws, axis=0, **({} if gate.global_scale is None else
                                                                  {"global_scale": gate.global_scale})))
    if ws.strategy == "tensor":  # per-tensor scales must be equal to fuse
        up = jax.tree.map(np.asarray, quantize(k[:, ::-1], ws, axis=0))
    fused = interleave_gate_up(gate, up, "x")
    g, u = split_gate_up(fused, "x")
    for mine, ref in ((g, gate), (u, up)):
        assert (mine.shape, mine.scheme) == (ref.shape, ref.scheme)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_static_input_scales_stacked_per_fused_module():
    """Per-expert static input scales (an FP8 / NVFP4 checkpoint in llm-compressor's linearized layout) become [E, 1]
    stacks on the fused gate_up_proj (gate's, equal to up's) and down_proj."""
    mods = _modules(None)
    for e in range(E):
        for p in ("gate_proj", "up_proj", "down_proj"):
            mods[f"{X}.{e}.{p}"]["input_global_scale"] = np.full(1, 10.0 * e + (p == "down_proj"), np.float32)
    out, _ = fuse_linearized_experts(CFG, mods)
    np.testing.assert_array_equal(out[f"{X}.gate_up_proj"]["input_global_scale"],
                                  10.0 * np.arange(E, dtype=np.float32)[:, None])
    np.testing.assert_array_equal(out[f"{X}.down_proj"]["input_global_scale"],
                                  10.0 * np.arange(E, dtype=np.float32)[:, None] + 1)
