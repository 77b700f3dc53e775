"""`qformats quantize SRC DST --calibrate FILE` on DeepSeek-V3 and gpt-oss checkpoints (the tiny models of
bench/gptq_llmc_families_fixture.py): the streamed calibration writes every Linear of the latent attention, the dense
first layer, the shared expert and every expert quantized, routers dense and ignored; gpt-oss's fused experts in
llm-compressor's per-expert layout (`experts.{e}.{gate,up,down}_proj` with their biases). `load_causal_lm` reads the
checkpoint back with exactly the packed weights (and static input scales) of the same calibration run in memory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from converters.cli import main
from converters.evaluation.calibration_data import load_calibration
from converters.formats.safetensors_io import open_checkpoint
from converters.pipelines.causal_lm import load_causal_lm
from qformats.errors import ModelError
from qformats.models.decoder.calibration import calibrate_decoder, quantized_paths
from qformats.nn.experts import QExperts


def _gen():
    spec = importlib.util.spec_from_file_location(
        "gptq_llmc_families_fixture", Path(__file__).resolve().parents[3] / "bench" / "gptq_llmc_families_fixture.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def _leaves(module):
    v = module.kernel.get_value()
    out = list(jax.tree.leaves(v))
    for extra in ("input_scale", "input_global_scale", "bias"):
        var = getattr(module, extra, None)
        if var is not None:
            out.append(var.get_value())
    return out


# ~55 CPU s each in isolation (deepseek_v3-NVFP4 measured: 57 s user, 384 s wall at load 40): ~30 CPU s is the CLI's
# calibration, nearly all XLA compilation (two layer passes, one GPTQ sweep per Linear shape, one quantize per
# shape and scheme, ~60 small eager ops); the in-process reference calibration reuses those compiled functions
# (3 CPU s), so it is not a second cost. Params after the first in one process share the model's GPTQ shapes.
# One case per family: gpt-oss's per-expert layout (the fused gate_up split, the per-expert biases) is written the same
# way whatever the scheme, and NVFP4 adds its input global scales; an integer-group scheme on streamed MoE experts
# (W4A16:g16) is test_calibrate_moe.py's test_cli_calibrated_moe_checkpoint_reads_back.
@pytest.mark.slow
@pytest.mark.parametrize("family,scheme", [("gpt_oss", "NVFP4"), ("deepseek_v3", "NVFP4")])
def test_cli_calibrated_checkpoint_reads_back(family, scheme, tmp_path):
    gen = _gen()
    src = gen.write_checkpoint(family, tmp_path / "src", gen.tensors(family))
    ids = tmp_path / "calib.npy"
    np.save(ids, np.random.default_rng(3).integers(0, 128, 400).astype(np.int32))
    dst = tmp_path / "dst"
    assert main(["quantize", str(src), str(dst), "--scheme", scheme, "--calibrate", str(ids),
                 "--seq-len", "40", "--calibration-tokens", "120"]) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    model, _, _ = load_causal_lm(src, tokenizer=False)
    m = model.config.moe
    sparse = [i for i, f in enumerate(model.config.moe_layers) if f]
    assert set(qc["ignore"]) == {"lm_head"} | {f"model.layers.{i}.mlp.{m.router_name}" for i in sparse}
    with open_checkpoint(dst) as ck:
        names = set(ck.keys())
    for i in sparse:
        for e in range(m.num_experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{i}.mlp.experts.{e}.{p}.weight_packed" in names
                if family == "gpt_oss":
                    assert f"model.layers.{i}.mlp.experts.{e}.{p}.bias" in names
                if scheme == "NVFP4":
                    assert f"model.layers.{i}.mlp.experts.{e}.{p}.input_global_scale" in names
    assert not any(n.endswith(("gate_up_proj", "gate_up_proj_bias")) for n in names)

    back, _, _ = load_causal_lm(dst, tokenizer=False)
    samples = load_calibration(ids, None, seq_len=40, max_tokens=120, seed=0, vocab_size=128)
    calibrate_decoder(model, samples, scheme)
    for i, (lb, lm) in enumerate(zip(back.model.layers, model.model.layers)):
        for rel in quantized_paths(lm):
            qb, qm = lb, lm
            for part in rel.split("/"):
                qb, qm = getattr(qb, part), getattr(qm, part)
            assert type(qb) is type(qm), rel
            if isinstance(qm, QExperts) or rel.startswith("self_attn/kv_b"):
                for a, b in zip(_leaves(qb), _leaves(qm)):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"layer {i} {rel}")
    out = back(np.asarray(np.arange(3, 13)[None]))
    assert np.all(np.isfinite(np.asarray(out[0] if isinstance(out, tuple) else out)))


def test_refusals(tmp_path):
    """Typed errors before any work: a gpt-oss weight scheme whose scales span the fused gate / up rows (per tensor,
    2-D blocks) or an MSE search of its NVFP4 global scales, AWQ and SmoothQuant on gpt-oss (llm-compressor has no
    mapping for it; DeepSeek-V3's: tests/qformats/models/decoder/test_moe_awq_families.py), a KV-cache scheme on
    latent attention."""
    from converters.pipelines.calibrate import quantize_calibrated_lm
    from qformats.models.decoder.calibration import awq_transform, smoothquant_transform

    gen = _gen()
    samples = [np.arange(3, 9, dtype=np.int32)]
    go = gen.write_checkpoint("gpt_oss", tmp_path / "go", gen.tensors("gpt_oss"))
    ds = gen.write_checkpoint("deepseek_v3", tmp_path / "ds", gen.tensors("deepseek_v3"))
    model, _, _ = load_causal_lm(go, tokenizer=False)
    for scheme in ("FP8", "FP8_BLOCK"):
        with pytest.raises(ModelError, match=r"fused gate_up_proj .* strategy '(tensor|block)'"):
            calibrate_decoder(model, samples, scheme)
    with pytest.raises(ModelError, match=r"one NVFP4 global scale per expert .* weight_search 'mse'"):
        calibrate_decoder(model, samples, "NVFP4", weight_search="mse")
    for what, tf in (("AWQ", awq_transform("W4A16:g16")), ("SmoothQuant", smoothquant_transform(0.5))):
        with pytest.raises(ModelError, match=f"model/layers/0/mlp/experts: {what} on gpt-oss.*no {what} mapping"):
            calibrate_decoder(model, samples, "W4A16:g16", weight_search="rtn", transform=tf)
    model, _, _ = load_causal_lm(ds, tokenizer=False)
    with pytest.raises(ModelError, match="KV-cache quantization .* latent cache"):
        calibrate_decoder(model, samples, "W4A16:g16", kv_cache="fp8")
    with pytest.raises(ModelError, match="AWQ on gpt_oss models is not supported"):
        quantize_calibrated_lm(go, tmp_path / "d", "W4A16:g16", tmp_path / "none.npy", awq=True)
    with pytest.raises(ModelError, match="SmoothQuant on gpt_oss models is not supported"):
        quantize_calibrated_lm(go, tmp_path / "d", "W8A8", tmp_path / "none.npy", smooth=0.5)
