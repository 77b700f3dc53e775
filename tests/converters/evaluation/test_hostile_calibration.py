"""Hostile calibration files and eval text: the token budget applied while reading (huge .npy arrays never
windowed whole), .npy headers parsed as plain literals and checked against the file size, JSON depth, line and
sample caps, strict UTF-8 without lone surrogates, and `--seq-len` refused beyond the model's context or
memory -- each a typed error naming the file and the limit."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from converters import cli
from converters.evaluation import calibration_data
from converters.evaluation.calibration_data import (
    MAX_JSON_DEPTH,
    MAX_LINE_BYTES,
    MAX_SAMPLES,
    load_calibration,
    read_text_file,
    select_samples,
)
from converters.evaluation.perplexity import check_window, encode_text, evaluate_text
from qformats.errors import CheckpointError, ModelError


def tok(s):
    return [ord(c) for c in s]


def _npy(path, descr: str, shape, data_bytes: int | None = None, header: str | None = None):
    """A .npy file with a hand-written v1 header; the data is a sparse hole of `data_bytes` (default: the
    shape's size)."""
    if header is None:
        header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    raw = header.encode("latin1")
    raw += b" " * (-(10 + len(raw) + 1) % 64) + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(raw).to_bytes(2, "little") + raw)
        if data_bytes is None:
            data_bytes = int(np.prod(shape)) * np.dtype(descr).itemsize
        f.truncate(f.tell() + data_bytes)
    return path


def _reference(path, tokenize, seq_len, max_tokens, seed):
    """The selection with every sample materialised (what load_calibration must equal)."""
    if str(path).endswith(".npy"):
        a = np.load(path)
        rows = [a[i:i + seq_len] for i in range(0, len(a), seq_len)] if a.ndim == 1 else [r[:seq_len] for r in a]
    else:
        text = path.read_text(encoding="utf-8")
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if str(path).endswith(".jsonl"):
            lines = [json.loads(ln)["text"] for ln in lines]
            lines = [t for t in lines if t.strip()]
        rows = [np.asarray(tokenize(t), np.int64)[:seq_len] for t in lines]
    rows = [r.astype(np.int32) for r in rows if len(r)]
    return select_samples(rows, max_tokens, seed)


@pytest.mark.parametrize("keep", [None, 10])  # 10: only lengths kept, the selected samples read again
@pytest.mark.parametrize("seed", [None, 0, 5])
def test_streamed_selection_equals_the_materialised_one(tmp_path, seed, keep, monkeypatch):
    if keep is not None:
        monkeypatch.setattr(calibration_data, "_KEEP_TOKENS", keep)
    rng = np.random.default_rng(1)
    txt = tmp_path / "c.txt"
    txt.write_text("\n".join("".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(n)))
                             for n in rng.integers(0, 40, 200)) + "\r\nlast\rone\n")
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"text": "x" * int(n), "nested": [[1, {"a": [2]}]]})
                            for n in rng.integers(0, 30, 100)))
    npy1, npy2 = tmp_path / "s.npy", tmp_path / "r.npy"
    np.save(npy1, rng.integers(0, 1000, 5001).astype(np.int32))
    np.save(npy2, np.asfortranarray(rng.integers(0, 1000, (300, 17)).astype(np.int16)))
    for path in (txt, jl, npy1, npy2):
        for seq_len, budget in ((8, 100), (16, None), (3, 1)):
            got = load_calibration(path, tok, seq_len=seq_len, max_tokens=budget, seed=seed)
            want = _reference(path, tok, seq_len, budget, seed)
            assert [g.tolist() for g in got] == [w.tolist() for w in want], (path.name, seq_len, budget)
            assert all(g.dtype == np.int32 for g in got)


def test_huge_npy_rows_refused_before_windowing(tmp_path):
    path = _npy(tmp_path / "rows.npy", "|i1", (2**30, 1))  # a 1 GiB sparse file
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"rows.npy: expected at most {MAX_SAMPLES} calibration samples "
                                              r"\(MAX_SAMPLES\), found 1073741824"):
        load_calibration(path)
    assert time.monotonic() - t0 < 5


def test_huge_npy_stream_reads_only_the_budget(tmp_path):
    path = _npy(tmp_path / "stream.npy", "|i1", (2**31 - 4096,))  # ~2 GiB sparse: 4 M windows of 512
    t0 = time.monotonic()
    got = load_calibration(path, seq_len=512, max_tokens=4096, seed=0)
    assert sum(len(g) for g in got) == 4096 and all(not g.any() for g in got)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("header, needle", [
    ("{'descr': '<i4', 'fortran_order': False, 'shape': (__import__('os').getpid(),), }", "plain dict literal"),
    ("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), 'x': 1}", "expected a .npy header"),
    ("{'descr': '<i4', 'fortran_order': False, 'shape': (-3,), }", "non-negative ints"),
    ("{'descr': 'O', 'fortran_order': False, 'shape': (3,), }", "unpickling"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", "integer token ids"),
    ("{'descr': '<i4', 'fortran_order': False, 'shape': (1000000000000,), }", "bytes for a int32 array of shape"),
    ("[" * 60000, "plain dict literal"),
])
def test_npy_header_is_a_plain_literal_checked_against_the_file(tmp_path, header, needle):
    path = _npy(tmp_path / "h.npy", "<i4", (3,), data_bytes=12, header=header)
    with pytest.raises(CheckpointError, match="h.npy: ") as e:
        load_calibration(path)
    assert needle in str(e.value)


def test_npy_magic_and_size(tmp_path):
    (tmp_path / "m.npy").write_bytes(b"not numpy at all")
    with pytest.raises(CheckpointError, match=r"m.npy: expected a .npy array"):
        load_calibration(tmp_path / "m.npy")
    path = _npy(tmp_path / "s.npy", "<i4", (3,), data_bytes=8)
    with pytest.raises(CheckpointError, match=r"expected \d+ bytes for a int32 array of shape \(3,\)"):
        load_calibration(path)


def test_json_depth_is_capped(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n' + "[" * 200000 + "\n")
    with pytest.raises(CheckpointError, match=rf"d.jsonl: line 2: expected JSON nested at most {MAX_JSON_DEPTH}"):
        load_calibration(p, tok)
    p.write_text(json.dumps({"text": "[" * 1000 + "{" * 1000}) + "\n")  # brackets inside a string: fine
    assert len(load_calibration(p, tok, seq_len=4)[0]) == 4


def test_lone_surrogate_and_non_utf8(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(CheckpointError, match=r"s.jsonl: line 2: .*lone surrogate U\+D800"):
        load_calibration(p, tok)
    p = tmp_path / "b.txt"
    p.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(CheckpointError, match=r"b.txt: line 2: expected UTF-8 text"):
        load_calibration(p, tok)
    with pytest.raises(CheckpointError, match=r"b.txt: expected UTF-8 text"):
        read_text_file(p)
    with pytest.raises(ModelError, match="lone surrogate U\\+DC00"):
        encode_text(None, "x\udc00")


def test_long_line_is_refused_naming_the_limit(tmp_path):
    p = tmp_path / "long.txt"
    p.write_bytes(b"short\n" + b"a" * (MAX_LINE_BYTES + 10))
    with pytest.raises(CheckpointError, match=rf"long.txt: line 2: expected at most {MAX_LINE_BYTES} bytes a line "
                                              r"\(MAX_LINE_BYTES\)"):
        load_calibration(p, lambda s: [1])
    p.write_bytes(b"a" * MAX_LINE_BYTES + b"\n")  # exactly the limit: fine
    assert load_calibration(p, lambda s: [len(s) % 7, 1], seq_len=2)[0].tolist() == [MAX_LINE_BYTES % 7, 1]


def test_text_file_cap(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("x" * 100)
    with pytest.raises(CheckpointError, match=r"t.txt: expected a text file of at most 10 bytes, found 100"):
        read_text_file(p, max_bytes=10)
    assert read_text_file(p) == "x" * 100


def test_cli_reads_text_files_with_typed_errors(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9\n")
    assert cli.main(["quantize", str(tmp_path / "out"), "--scheme", "W8A8", "--calibrate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"qformats: error: {bad}: expected UTF-8 text" in err and "Traceback" not in err
    src = tmp_path / "lm"  # a causal LM's SRC (the CLI checks it names one first); nothing of it is loaded
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    assert cli.main(["eval", str(src), "--text", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"qformats: error: {bad}: expected UTF-8 text" in err


def test_seq_len_beyond_context_or_memory_refused_before_loading(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "vocab_size": 49152,
                                                 "num_attention_heads": 9}))
    with pytest.raises(ModelError, match=r"seq_len=512: expected at most the model's context, "
                                         r"max_position_embeddings = 64"):
        evaluate_text(src, "some text", seq_len=512)  # no weights there: refused before any load
    check_window(src, 64, 4)
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 200000, "vocab_size": 49152,
                                                 "num_attention_heads": 9}))
    with pytest.raises(ModelError, match=r"seq_len=100000 with batch_size=4: expected windows whose activations "
                                         r"fit in memory"):
        check_window(src, 100000, 4, memory_bytes=64 * 2**30)


def test_calibration_seq_len_beyond_context_refused_by_the_cli(tmp_path, capsys):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (tmp_path / "c.txt").write_text("calibration text\n")
    argv = ["quantize", str(src), str(tmp_path / "out"), "--scheme", "W4A16", "--calibrate", str(tmp_path / "c.txt"),
            "--seq-len", "512"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"qformats: error: {src}: --seq-len 512: expected at most the model's context, " \
           "max_position_embeddings = 64" in err
    assert not (tmp_path / "out").exists()
