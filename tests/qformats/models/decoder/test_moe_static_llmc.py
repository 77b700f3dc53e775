"""Static activation scales on every expert of a tiny Qwen3-MoE against llm-compressor's, same model and samples.

The expected scales are llm-compressor 0.14's (`oneshot` + QuantizationModifier, presets FP8 (per-tensor input_scale)
and NVFP4 (input_global_scale), observer static_minmax, `moe_calibrate_all_experts` True ("all") and False
("routed"), one sample per batch), pinned in data/static_llmc_moe_tiny.npz by bench/static_llmc_moe_fixture.py on
bench/gptq_llmc_moe_fixture.py's model (2 sparse layers, 8 experts of 32, top-2; its weights' digest is checked
here) and its 96 one-token samples (attention returns v whatever the mask, so both sides see the same inputs).
Ours: the same dense checkpoint through `load_causal_lm` + `calibrate_decoder` (round-to-nearest weights, float
propagation: llm-compressor's QuantizationModifier leaves the weights float until saving).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

# their bit-exact claims rest on XLA's fully optimized arithmetic (rsqrt, fused multiply-adds: tests/conftest.py)
pytestmark = pytest.mark.full_optimization

sys.path.insert(0, str(Path(__file__).parent))
from llmc_pinned import pinned_llmc_source  # noqa: E402

DATA = Path(__file__).parent / "data" / "static_llmc_moe_tiny.npz"
LOCAL = {"FP8": "input_scale", "NVFP4": "input_global_scale"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return pinned_llmc_source(DATA, tmp_path_factory.mktemp("tinymoe") / "src")


def ours_scales(src, samples, scheme: str, statistics: str) -> dict:
    """{HF module name: its static input scale (FP8) or input global scale (NVFP4), float32 scalar} of our
    calibration, experts one by one."""
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.decoder.calibration import calibrate_decoder
    from qformats.nn import quantized_layers
    from qformats.nn.experts import QExperts

    model, _, _ = load_causal_lm(src, tokenizer=False)
    calibrate_decoder(model, samples, scheme, weight_search="rtn", propagate="float", moe_statistics=statistics)
    out = {}
    for path, m in quantized_layers(model).items():
        v = np.asarray((m.input_scale if scheme == "FP8" else m.input_global_scale).get_value(), np.float32)
        name = path.replace("/", ".")
        if isinstance(m, QExperts):
            head, proj = name.rsplit(".", 1)
            assert v.shape == (m.num_experts, 1), (name, v.shape)
            out.update({f"{head}.{e}.{proj}": v[e, 0] for e in range(m.num_experts)})
        else:
            out[name] = v.reshape(())
    return out


def compare(gen, fx, ours, scheme, statistics):
    """(names whose scale equals llm-compressor's bit for bit, max relative difference over all)."""
    equal, worst = [], 0.0
    for name in gen.modules():
        theirs = fx[f"{scheme}/{statistics}/{name}.{LOCAL[scheme]}"].reshape(())
        if ours[name] == theirs:
            equal.append(name)
        worst = max(worst, float(abs(ours[name] - theirs) / abs(theirs)))
    return equal, worst


@pytest.mark.parametrize("scheme,statistics", [("FP8", "all"), pytest.param("FP8", "routed", marks=pytest.mark.slow),
                                               pytest.param("NVFP4", "all", marks=pytest.mark.slow),
                                               pytest.param("NVFP4", "routed", marks=pytest.mark.slow)])
def test_static_expert_scales_match_llm_compressor(source, scheme, statistics):
    """Every projection's static scale (the attention's, and each expert's gate / up / down: 8 experts x 3 x 2
    layers) against llm-compressor's. Both sides take the max |x| of float32 activations, so a scale differs only
    where an activation's rounding does: layer 0's attention scales are bit-exact (its input is the embedding
    through the RMSNorm), and under "all" so is every expert's gate / up scale (the max over all tokens); the
    experts' down_proj inputs silu(x Wg) * (x Wu) and everything in layer 1 (fed by them) differ by float32 matmul
    summation order (torch against XLA): measured within 6.5e-7 relative (a few ulps; BENCHMARKS.md, MoE
    calibration), bounded at 1e-6."""
    gen, fx, src, samples = source
    ours = ours_scales(src, samples, scheme, statistics)
    equal, worst = compare(gen, fx, ours, scheme, statistics)
    print(scheme, statistics, f"{len(equal)}/{len(gen.modules())} bit-exact, max rel diff {worst:.3g}")
    exact = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if statistics == "all":
        exact += [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj")]
    assert not set(exact) - set(equal), sorted(set(exact) - set(equal))
    assert worst <= 1e-6, worst
    # "all": every expert of a layer observes the same tokens through gate / up, so one scale; "routed": their own
    for i in range(2):
        gates = {float(ours[f"model.layers.{i}.mlp.experts.{e}.gate_proj"]) for e in range(8)}
        assert len(gates) == 1 if statistics == "all" else len(gates) > 1
