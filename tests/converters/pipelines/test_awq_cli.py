"""AWQ through converters.pipelines.calibrate.quantize_calibrated_lm(awq=True) and `qformats quantize SRC DST --awq`: a tiny
random llama checkpoint gets exactly the codes of qformats.models.decoder.calibration (AWQ) in memory, the CLI
writes the same tensors as the API, and AWQ with SmoothQuant is refused."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from converters.pipelines.calibrate import quantize_calibrated_lm  # noqa: E402
from converters.evaluation.calibration_data import load_calibration  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from converters.cli import main  # noqa: E402
from converters.formats.safetensors_io import open_checkpoint  # noqa: E402
from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder.calibration import awq_transform, calibrate_decoder  # noqa: E402
from qformats.nn import quantized_layers  # noqa: E402

# num_key_value_heads == num_attention_heads: the v_proj -> o_proj mapping applies too
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
SCHEME = "W4A16:g32"
KW = dict(seq_len=32, calibration_tokens=128, awq_n_grid=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", **TINY)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():  # outlier channels in the norms, as in real LMs
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
                p[torch.randperm(p.numel())[:3]] *= 15.0
    model.save_pretrained(root / "src")
    np.save(root / "calib.npy", np.random.default_rng(0).integers(0, 96, 200).astype(np.int32))
    return root


def test_checkpoint_holds_the_awq_codes(tiny, tmp_path):
    dst = tmp_path / "q"
    info = quantize_calibrated_lm(tiny / "src", dst, SCHEME, tiny / "calib.npy", awq=True, **KW)
    assert info["searched"] == 0  # AWQ's default weight search: round-to-nearest
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["format"] == "pack-quantized"
    samples = load_calibration(tiny / "calib.npy", seq_len=32, max_tokens=128, seed=0)
    ref, _, _ = load_causal_lm(tiny / "src", tokenizer=False)
    plain, _, _ = load_causal_lm(tiny / "src", tokenizer=False)
    rec = []
    calibrate_decoder(ref, samples, SCHEME, weight_search="rtn", propagate="float",
                      transform=awq_transform(SCHEME, n_grid=6, record=rec))
    calibrate_decoder(plain, samples, SCHEME, weight_search="rtn")
    assert [r["smooth"] for r in rec[:4]] == ["input_layernorm", "self_attn/v_proj", "post_attention_layernorm",
                                              "mlp/up_proj"] and len(rec) == 8
    loaded, _, _ = load_causal_lm(dst, tokenizer=False)
    a, b, c = quantized_layers(loaded), quantized_layers(ref), quantized_layers(plain)
    assert set(a) == set(b) and len(a) == 14
    differ = 0
    for p in a:
        for x, y, z in zip(*(jax.tree.leaves(m[p].kernel.get_value()) for m in (a, b, c))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)
            differ += not np.array_equal(np.asarray(x), np.asarray(z))
    assert differ > 0  # the scales changed the codes
    la, lb = loaded.model.layers[0], ref.model.layers[0]  # the folded norms are in the checkpoint
    np.testing.assert_array_equal(np.asarray(la.input_layernorm.weight.get_value()),
                                  np.asarray(lb.input_layernorm.weight.get_value()))


def test_cli_awq_writes_the_api_checkpoint(tiny, tmp_path):
    api = tmp_path / "api"
    quantize_calibrated_lm(tiny / "src", api, SCHEME, tiny / "calib.npy", awq=True, seq_len=32,
                           calibration_tokens=128)
    cli = tmp_path / "cli"
    assert main(["quantize", str(tiny / "src"), str(cli), "--scheme", SCHEME, "--calibrate", str(tiny / "calib.npy"),
                 "--awq", "--calibration-tokens", "128", "--seq-len", "32", "--quiet"]) == 0
    with open_checkpoint(cli) as x, open_checkpoint(api) as y:
        assert sorted(x.keys()) == sorted(y.keys())
        for k in x.keys():
            np.testing.assert_array_equal(np.asarray(x.get(k)), np.asarray(y.get(k)), err_msg=k)


def test_awq_with_smoothquant_refused(tiny, tmp_path, capsys):
    with pytest.raises(ModelError, match="AWQ and SmoothQuant"):
        quantize_calibrated_lm(tiny / "src", tmp_path / "a", SCHEME, tiny / "calib.npy", awq=True, smooth=0.5)
    assert main(["quantize", str(tiny / "src"), str(tmp_path / "b"), "--scheme", SCHEME, "--calibrate",
                 str(tiny / "calib.npy"), "--awq", "--smooth", "0.5"]) == 2
    assert "--awq and --smooth" in capsys.readouterr().err
    assert main(["quantize", str(tiny / "src"), str(tmp_path / "d"), "--scheme", SCHEME, "--awq"]) == 2
    assert "--awq needs --calibrate" in capsys.readouterr().err
    with pytest.raises(ModelError, match="duo_scaling"):
        quantize_calibrated_lm(tiny / "src", tmp_path / "c", SCHEME, tiny / "calib.npy", awq=True,
                               awq_duo_scaling="sometimes")
    assert not any((tmp_path / n).exists() for n in "abcd")
