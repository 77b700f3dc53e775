"""converters.pipelines.calibrate.quantize_calibrated_lm: a tiny llama checkpoint calibrated layer by layer on a .npy token
file gives a compressed-tensors checkpoint holding exactly the codes of qformats.models.decoder.calibration, loadable by
the library (and its logits those of the in-memory model)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from converters.pipelines.calibrate import quantize_calibrated_lm  # noqa: E402
from converters.evaluation.calibration_data import load_calibration  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.errors import CheckpointError, ModelError  # noqa: E402
from qformats.models.decoder.calibration import calibrate_decoder  # noqa: E402
from qformats.nn import QLinear, quantized_layers  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", **TINY)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval().save_pretrained(root / "src")
    np.save(root / "calib.npy", np.random.default_rng(0).integers(0, 96, 200).astype(np.int32))
    return root


@pytest.fixture(scope="module")
def w4a16(tiny, tmp_path_factory):
    """(checkpoint, info) of the API's W4A16:g32 calibration of the tiny checkpoint, without between_phases (read
    only; run once for the tests that check it)."""
    dst = tmp_path_factory.mktemp("api") / "q"
    info = quantize_calibrated_lm(tiny / "src", dst, "W4A16:g32", tiny / "calib.npy", seq_len=32,
                                  calibration_tokens=160)
    return dst, info


@pytest.mark.slow
def test_checkpoint_holds_the_sequential_codes(tiny, w4a16):
    dst, info = w4a16
    samples = load_calibration(tiny / "calib.npy", seq_len=32, max_tokens=160, seed=0)
    assert info["tokens"] == 160 and info["samples"] == len(samples) and info["projections"] == 14
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["format"] == "pack-quantized"
    loaded, _, _ = load_causal_lm(dst, tokenizer=False)
    ref, _, _ = load_causal_lm(tiny / "src", tokenizer=False)
    calibrate_decoder(ref, samples, "W4A16:g32", guard=False)  # the pipeline keeps every GPTQ result
    a, b = quantized_layers(loaded), quantized_layers(ref)
    assert set(a) == set(b) and len(a) == 14 and all(isinstance(m, QLinear) for m in a.values())
    for p in a:
        for x, y in zip(jax.tree.leaves(a[p].kernel.get_value()), jax.tree.leaves(b[p].kernel.get_value())):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, (1, 12)))
    np.testing.assert_array_equal(np.asarray(loaded(ids)[0]), np.asarray(ref(ids)[0]))


def test_errors(tiny, tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        quantize_calibrated_lm(tiny / "src", tmp_path / "exists", "W4A16", tiny / "calib.npy")
    with pytest.raises(CheckpointError, match="not found"):
        quantize_calibrated_lm(tiny / "src", tmp_path / "a", "W4A16", tiny / "nope.npy")
    with pytest.raises(ModelError, match="needs a tokenizer"):  # the tiny checkpoint has no tokenizer.json
        (tmp_path / "t.txt").write_text("hello\n")
        quantize_calibrated_lm(tiny / "src", tmp_path / "b", "W4A16", tmp_path / "t.txt")
    with pytest.raises(ModelError, match="AWQ and SmoothQuant"):
        quantize_calibrated_lm(tiny / "src", tmp_path / "c", "W4A16", tiny / "calib.npy", awq=True, smooth=0.5)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_calibrates_a_causal_lm(tiny, w4a16, tmp_path):
    """The `qformats` command (main with argv None, in its own process) restarts itself with huge-page malloc where
    the machine has it (`converters.process.reexec_with_hugepage_malloc`: the command line runs twice, the second
    time under GLIBC_TUNABLES), and writes the API's checkpoint byte for byte."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from converters.cli import main
    from converters.process import hugepage_malloc_env

    dst = tmp_path / "cli"
    argv = ["qformats", "quantize", str(tiny / "src"), str(dst), "--scheme", "W4A16:g32", "--calibrate",
            str(tiny / "calib.npy"), "--calibration-tokens", "160", "--seq-len", "32", "--quiet"]
    code = ("import os, sys\nprint('GLIBC_TUNABLES', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
            f"sys.argv = {argv!r}\nfrom converters.cli import main\nsys.exit(main())\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(Path(__file__).resolve().parents[3]))
    assert r.returncode == 0, r.stderr[-3000:]
    starts = r.stdout.splitlines()
    assert starts == (["GLIBC_TUNABLES None"] if hugepage_malloc_env(env) is None
                      else ["GLIBC_TUNABLES None", "GLIBC_TUNABLES glibc.malloc.hugetlb=1"]), starts
    ref = w4a16[0]  # the API's checkpoint of the same arguments
    from converters.formats.safetensors_io import open_checkpoint
    with open_checkpoint(dst) as a, open_checkpoint(ref) as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(np.asarray(a.get(k)), np.asarray(b.get(k)), err_msg=k)
    assert main(["quantize", str(tmp_path / "x"), "--scheme", "W4A16", "--calibrate", "--smooth", "0.5"]) == 2


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W8A8", "FP8"])
def test_streamed_checkpoint_holds_the_sequential_codes(tiny, tmp_path, scheme):
    """A dense directory is calibrated streamed (one layer resident); the checkpoint holds the codes of the in-memory
    `calibrate_decoder`, for schemes with and without static input scales."""
    dst = tmp_path / "q"
    quantize_calibrated_lm(tiny / "src", dst, scheme, tiny / "calib.npy", seq_len=32, calibration_tokens=160)
    samples = load_calibration(tiny / "calib.npy", seq_len=32, max_tokens=160, seed=0)
    loaded, _, _ = load_causal_lm(dst, tokenizer=False)
    ref, _, _ = load_causal_lm(tiny / "src", tokenizer=False)
    calibrate_decoder(ref, samples, scheme)
    a, b = quantized_layers(loaded), quantized_layers(ref)
    assert set(a) == set(b) and len(a) == 14
    for p in a:
        for x, y in zip(jax.tree.leaves(a[p].kernel.get_value()), jax.tree.leaves(b[p].kernel.get_value())):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)


def test_between_phases_runs_during_calibration(tiny, tmp_path):
    """The between_phases callback (the CLI hands it `converters.process.trim_malloc`) is called while the layers are
    calibrated; that the checkpoint does not depend on it is test_cli_calibrates_a_causal_lm (CLI with the process
    tuning against the API without)."""
    calls = []
    quantize_calibrated_lm(tiny / "src", tmp_path / "q", "W4A16:g32", tiny / "calib.npy", seq_len=32,
                           calibration_tokens=160, between_phases=lambda: calls.append(1))
    assert calls and (tmp_path / "q" / "config.json").is_file()
