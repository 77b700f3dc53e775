"""`qformats convert / generate / eval --text / quantize` on causal LMs, through main([...]): the embedded SmolLM2
(converted once per test process, tests/conftest.py) and a tiny random llama saved by transformers, against transformers' own
generate and loss on the same checkpoints."""

from __future__ import annotations

import importlib.metadata
import json
import math
import shutil

import numpy as np
import pytest

from converters.cli import main
from converters.evaluation.embedded import smollm2_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A real English text: the Apache License 2.0, as the jax wheel ships it (licenses/LICENSE)."""
    text = importlib.metadata.distribution("jax").read_text("licenses/LICENSE")
    assert text and "Apache License" in text
    p = tmp_path_factory.mktemp("text") / "apache-2.0.txt"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def smol(smollm2_dense):
    """SmolLM2-135M-Instruct converted from the embedded GGUF (tests/conftest.py: once per test process)."""
    return smollm2_dense


@pytest.fixture(scope="module")
def hf_smol(smol):
    """transformers' model of the converted SmolLM2, float32, loaded once for the module."""
    return _hf(smol)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol):
    """A random llama (2 layers, hidden 128, untied lm_head) saved with transformers; SmolLM2's tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    dst = tmp_path_factory.mktemp("tiny") / "dense"
    model.save_pretrained(dst, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / f, dst / f)
    return dst


def _json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def _hf_greedy(path, n, model=None):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = (model or _hf(path)).generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist(), tok


def _hf_ppl(path, text_file, seq_len, windows, model=None):
    """transformers' mean loss over the same windows (every window has seq_len - 1 predicted tokens)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    w = torch.tensor(ids[: windows * seq_len]).reshape(windows, seq_len)
    model = model or _hf(path)
    with torch.no_grad():
        losses = [float(model(input_ids=w[i:i + 1], labels=w[i:i + 1]).loss) for i in range(windows)]
    return math.exp(float(np.mean(losses))), sum(p.numel() * p.element_size() for p in model.parameters())


# ---- convert --------------------------------------------------------------------------------------------------
def test_convert_writes_what_convert_gguf_writes(tmp_path, capsys):
    """`qformats convert --dense` of a tiny GGUF file: the same files, byte for byte, as
    converters.formats.gguf_convert.convert_gguf (whose output equals transformers' own GGUF loading: test_gguf_convert,
    on the embedded SmolLM2 too)."""
    from converters.formats.gguf_convert import convert_gguf
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # test_gguf_convert's helper
    from test_gguf_convert import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main(["convert", str(path), str(tmp_path / "cli"), "--dense"]) == 0
    ref = convert_gguf(path, tmp_path / "lib")
    names = sorted(p.name for p in ref.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == names
    for n in names:
        assert (tmp_path / "cli" / n).read_bytes() == (ref / n).read_bytes(), n


# ---- SmolLM2 -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_convert_refuses_existing_dst(smol, capsys):
    assert (smol / "model.safetensors").is_file() and (smol / "tokenizer.json").is_file()
    assert main(["convert", str(smollm2_gguf()), str(smol)]) == 1
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_greedy_equals_transformers(smol, hf_smol, capsys):
    """The real 30-layer model through the CLI, its layers scanned (the CLI's default: one compiled layer body, not
    30; unrolled layers on SmolLM2, packed: test_causal_lm's test_smollm2_gguf_greedy_tokens_equal_transformers;
    the tiny llama through the CLI: test_tiny_generate_equals_transformers; --no-scan: test_cli_generate)."""
    assert main(["generate", str(smol), "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]) == 0
    got = _json(capsys)
    want, tok = _hf_greedy(smol, 8, hf_smol)
    assert got["tokens"] == want
    assert got["text"] == tok.decode(want, skip_special_tokens=True)


@pytest.mark.slow
def test_generate_w4a16_refused_naming_every_layer(smol, capsys):
    assert main(["generate", str(smol), "--prompt", PROMPT, "--scheme", "W4A16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qformats: loading ")  # generate says what it does before the error
    assert err.splitlines()[1].startswith("qformats: error: ") and "180 layer(s) do not fit" in err  # 6 of 7 x 30
    assert "  model/layers/{0..29}/self_attn/v_proj (30 layers): weight group size 128 of W4A16" in err
    assert "mlp/down_proj" not in err  # 1536 columns: 12 groups
    assert "'W4A16:g64'" in err and "--skip-indivisible" in err


@pytest.fixture(scope="module")
def smol_eval(smol, text_file):
    """`qformats eval SMOL --text FILE --schemes stored,dense,W4A16:g64` (2 windows of 48 tokens), run once."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", str(smol), "--text", str(text_file), "--seq-len", "48", "--max-windows", "2",
                     "--schemes", "stored,dense,W4A16:g64", "--json"]) == 0
    r = json.loads(out.getvalue().strip().splitlines()[-1])
    assert list(r) == ["stored", "dense", "W4A16:g64"]
    return r


@pytest.mark.slow
def test_eval_text_dense_equals_transformers(smol, hf_smol, text_file, smol_eval):
    r = smol_eval
    ppl, nbytes = _hf_ppl(smol, text_file, 48, 2, hf_smol)
    for k in ("stored", "dense"):
        assert r[k]["tokens"] == 2 * 47 and r[k]["bytes"] == nbytes
        assert abs(r[k]["ppl"] / ppl - 1) < 1e-4  # float32 logits, summation order differs
    assert r["stored"] == r["dense"]


@pytest.mark.slow
def test_quantize_g64_then_eval_stored_equals_rtn_in_memory(smol, text_file, smol_eval, tmp_path, capsys):
    out = tmp_path / "w4g64"
    assert main(["quantize", str(smol), str(out), "--scheme", "W4A16", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "180 of the 210 targeted weights do not fit scheme 'W4A16'" in err and not out.exists()
    assert main(["quantize", str(smol), str(out), "--scheme", "W4A16:g64", "--quiet"]) == 0
    assert "quantized 210 weights with W4A16:g64" in capsys.readouterr().err
    args = ["--text", str(text_file), "--seq-len", "48", "--max-windows", "2", "--json"]
    assert main(["eval", str(out), *args]) == 0
    stored = _json(capsys)["stored"]
    rtn = smol_eval["W4A16:g64"]  # `eval SMOL --schemes W4A16:g64` with the same text arguments
    assert stored == rtn  # same codes and scales, packed in the checkpoint or in memory: the same logits
    assert stored["bytes"] < 0.35 * 538060032
    for scheme in ("dense", "W8A16"):
        assert main(["eval", str(out), "--schemes", scheme, *args]) == 1
        assert "needs a dense checkpoint, found a quantized one (pack-quantized)" in capsys.readouterr().err


# ---- a tiny random llama saved by transformers ---------------------------------------------------------------
@pytest.mark.slow
def test_tiny_generate_equals_transformers_and_packed_equals_rtn(tiny, tmp_path, capsys):
    assert main(["generate", str(tiny), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]) == 0
    got = _json(capsys)
    want, _ = _hf_greedy(tiny, 12)
    assert got["tokens"] == want
    q = tmp_path / "w4"
    assert main(["quantize", str(tiny), str(q), "--scheme", "W4A16", "--quiet"]) == 0
    assert json.loads((q / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    assert main(["generate", str(q), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]) == 0
    packed = _json(capsys)
    assert main(["generate", str(tiny), "--prompt", PROMPT, "--max-new-tokens", "12", "--scheme", "W4A16",
                 "--json"]) == 0
    assert _json(capsys) == packed
    assert main(["generate", str(q), "--prompt", PROMPT, "--scheme", "W4A16"]) == 1
    assert "needs a dense checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_eval_equals_transformers(tiny, text_file, capsys):
    assert main(["eval", str(tiny), "--text", str(text_file), "--seq-len", "32", "--max-windows", "5",
                 "--batch-size", "2", "--json"]) == 0  # 5 windows in batches of 2: a padded last batch
    r = _json(capsys)["stored"]
    ppl, nbytes = _hf_ppl(tiny, text_file, 32, 5)
    assert r["tokens"] == 5 * 31 and r["bytes"] == nbytes
    assert abs(r["ppl"] / ppl - 1) < 1e-4


@pytest.mark.slow
def test_tiny_sampling_is_seeded(tiny, capsys):
    args = ["generate", str(tiny), "--prompt", PROMPT, "--max-new-tokens", "6", "--temperature", "1.0",
            "--top-k", "50", "--top-p", "0.9", "--json"]
    assert main([*args, "--seed", "3"]) == 0
    a = _json(capsys)
    assert main([*args, "--seed", "3"]) == 0
    assert _json(capsys) == a and len(a["tokens"]) <= 6 and all(0 <= t < 49152 for t in a["tokens"])


# ---- usage errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, code, msg", [
    (["eval", "x.gguf", "--text", "/no/such/file"], 2, "--text /no/such/file: no such file"),
    (["generate", "x", "--prompt", "p", "--scheme", "W4A16:g7x"], 1, "suffix ':g7x'"),
    (["generate", "x", "--prompt", "p", "--skip-indivisible"], 2, "--skip-indivisible needs --scheme"),
    (["generate", "/no/such/dir", "--prompt", "p"], 1, "expected a checkpoint directory or a .gguf file"),
    (["convert", "/no/such.gguf", "/tmp/never"], 1, "expected a GGUF file, found no such file"),
])
def test_usage_and_input_errors(argv, code, msg, capsys):
    assert main(argv) == code
    assert msg in capsys.readouterr().err


def test_eval_help_states_the_protocol(capsys):
    assert main(["eval", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "without special tokens" in out and "non-overlapping windows of --seq-len tokens" in out
    assert "the last partial window is dropped" in out and "exp(mean NLL of every token but the first" in out


# dense only: a stored packed checkpoint through `generate --tensor-parallel 2` (the same CLI code and loader, read
# shard by shard) is test_cli_parallel's test_generate_expert_parallel_equals_one_device (--tensor-parallel 2 alone,
# compressed-tensors W4A16:g16); a packed llama on a tensor-parallel mesh: tests/multidevice/test_sharded_load.py
# (w4, every parameter equal) and test_tensor_parallel.py (W4A16:g16 greedy tokens)
@pytest.mark.parametrize("scheme", [None])
@pytest.mark.slow
def test_tiny_generate_tensor_parallel_equals_one_device(tiny, tmp_path, scheme, capsys):
    """--tensor-parallel 2 (a fresh interpreter: the CPU device count is set before JAX starts) gives the
    single-device greedy tokens, with each device holding about half of the parameter bytes."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    src = tiny
    if scheme is not None:  # a stored packed checkpoint, read shard by shard onto the mesh
        src = tmp_path / "q"
        assert main(["quantize", str(tiny), str(src), "--scheme", scheme, "--quiet"]) == 0
    args = ["generate", str(src), "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]
    assert main(args) == 0
    want = _json(capsys)
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-m", "converters.cli", *args, "--tensor-parallel", "2"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(root)), cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == want["tokens"]
    per = got["param_bytes_per_device"]
    assert len(per) == 2 and max(per) <= 0.52 * sum(per), per
