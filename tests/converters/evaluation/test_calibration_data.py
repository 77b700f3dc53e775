"""converters.evaluation.calibration_data: text / jsonl / .npy samples, truncation, the token budget, the seed, typed
errors."""

import json

import numpy as np
import pytest

from converters.evaluation.calibration_data import load_calibration, select_samples
from qformats.errors import CheckpointError, ModelError


def tok(s):
    return [ord(c) for c in s]


def test_text_lines_one_sample_each_truncated(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("abc\n\n   \nhello world\r\nxy\n")
    got = load_calibration(p, tok, seq_len=5, max_tokens=None, seed=None)
    assert [s.tolist() for s in got] == [tok("abc"), tok("hello"), tok("xy")]
    assert all(s.dtype == np.int32 for s in got)


def test_jsonl(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "cde", "id": 3}) + "\n")
    got = load_calibration(p, tok, seq_len=8, max_tokens=None, seed=None)
    assert [s.tolist() for s in got] == [tok("ab"), tok("cde")]


@pytest.mark.parametrize("line, what", [("{bad", "invalid JSON"), ('{"txt": "a"}', '"text"'), ("[1]", '"text"')])
def test_jsonl_errors_name_the_line(tmp_path, line, what):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(CheckpointError, match=f"line 2: .*{what}"):
        load_calibration(p, tok)


def test_npy_stream_and_rows(tmp_path):
    p = tmp_path / "s.npy"
    np.save(p, np.arange(10, dtype=np.int16))
    got = load_calibration(p, seq_len=4, max_tokens=None, seed=None)
    assert [s.tolist() for s in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    np.save(p, np.arange(12, dtype=np.int64).reshape(2, 6))
    got = load_calibration(p, seq_len=4, max_tokens=None, seed=None)
    assert [s.tolist() for s in got] == [[0, 1, 2, 3], [6, 7, 8, 9]]


def test_npy_refuses_pickles_floats_and_3d(tmp_path):
    p = tmp_path / "o.npy"
    np.save(p, np.array([[1], "a"], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match="unpickling"):
        load_calibration(p)
    np.save(p, np.ones(4, np.float32))
    with pytest.raises(CheckpointError, match="integer token ids"):
        load_calibration(p)
    np.save(p, np.ones((2, 2, 2), np.int32))
    with pytest.raises(CheckpointError, match="shape"):
        load_calibration(p)


def test_budget_and_seed(tmp_path):
    samples = [np.full(n, i, np.int32) for i, n in enumerate([3, 5, 2, 4])]
    order = np.random.default_rng(7).permutation(4)
    got = select_samples(samples, 9, 7)
    assert sum(len(s) for s in got) == 9
    expect, total = [], 0
    for i in order:
        take = min(len(samples[i]), 9 - total)
        if take <= 0:
            break
        expect.append([int(i)] * take)
        total += take
    assert [s.tolist() for s in got] == expect
    assert [s.tolist() for s in select_samples(samples, None, None)] == [s.tolist() for s in samples]
    assert sum(len(s) for s in select_samples(samples, 100, 0)) == 14  # fewer tokens than the budget: all


def test_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_calibration(tmp_path / "nope.txt", tok)
    p = tmp_path / "e.txt"
    p.write_text("\n \n")
    with pytest.raises(CheckpointError, match="no calibration tokens"):
        load_calibration(p, tok)
    p.write_text("abc\n")
    with pytest.raises(ModelError, match="needs a tokenizer"):
        load_calibration(p)
    with pytest.raises(ModelError, match="seq_len"):
        load_calibration(p, tok, seq_len=0)
    with pytest.raises(ModelError, match="max_tokens"):
        load_calibration(p, tok, max_tokens=0)
    with pytest.raises(ModelError, match=r"outside \[0, 50\)"):
        load_calibration(p, tok, vocab_size=50)
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="UTF-8"):
        load_calibration(p, tok)
