"""Hostile GGUF files: the header checked within the file's size before gguf's reader sees it, tensor data
aligned, in bounds, non-overlapping and of exactly its type's size, metadata typed and finite, and the tokenizer
built only from string tokens and merges inside the vocabulary -- each a CheckpointError naming the file and
the key or tensor."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_tiny import tensor_info_at, tiny_gguf  # noqa: E402

from converters.formats.gguf_convert import check_gguf_header, convert_gguf, open_gguf  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402

Q = gguf.GGMLQuantizationType


def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _refused(path: Path, *needles: str, tokenizer: bool = False) -> str:
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        m = open_gguf(path)
        if tokenizer:
            m.tokenizer_files()
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_tiny_file_reads_and_header_matches_the_reader(tmp_path):
    path = tiny_gguf(tmp_path / "ok.gguf")
    h = check_gguf_header(path)
    r = gguf.GGUFReader(path)
    assert h.data_offset == r.data_offset and [t.name for t in h.tensors] == [t.name for t in r.tensors]
    assert [t.nbytes for t in h.tensors] == [int(t.n_bytes) for t in r.tensors]
    assert h.fields["tokenizer.ggml.tokens"].element == "STRING"
    convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize("count", [2**40, 2**63, 2**64 - 1])
def test_huge_array_count_in_a_49_byte_file(tmp_path, count):
    body = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string(b"k") + struct.pack("<II", 9, 4)
            + struct.pack("<Q", count))
    path = tmp_path / "a.gguf"
    path.write_bytes(body)
    assert len(body) == 49
    _refused(path, "the element count of 'k'", str(count))


@pytest.mark.parametrize("field, value, needle", [
    ("tensors", 2**40, "the tensor count"), ("kv", 2**40, "the key-value count"),
    ("keylen", 2**62, "the length of a metadata key")])
def test_huge_counts_and_lengths(tmp_path, field, value, needle):
    n_t, n_kv, keylen = (value if field == "tensors" else 0), (value if field == "kv" else 1), \
        (value if field == "keylen" else 1)
    body = b"GGUF" + struct.pack("<IQQ", 3, n_t, n_kv) + struct.pack("<Q", keylen) + b"k" + struct.pack("<II", 4, 7)
    path = tmp_path / "c.gguf"
    path.write_bytes(body)
    _refused(path, needle)


def test_nested_arrays_and_unknown_types(tmp_path):
    nested = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string(b"k")
    nested += (struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + b"\0" * 4)
    (tmp_path / "n.gguf").write_bytes(nested)
    _refused(tmp_path / "n.gguf", "nested deeper")
    unknown = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string(b"k") + struct.pack("<I", 77) + b"\0" * 8
    (tmp_path / "u.gguf").write_bytes(unknown)
    _refused(tmp_path / "u.gguf", "unknown value type 77")


def test_block_count_beyond_the_file(tmp_path):
    path = tiny_gguf(tmp_path / "b.gguf", block_count=0xFFFFFFFF)
    _refused(path, "'llama.block_count'", "4294967295")


@pytest.mark.parametrize("kw, key", [
    ({"freq_base": float("nan")}, "llama.rope.freq_base"), ({"freq_base": -1.0}, "llama.rope.freq_base"),
    ({"freq_base": float("inf")}, "llama.rope.freq_base"),
    ({"rms_eps": float("nan")}, "llama.attention.layer_norm_rms_epsilon"),
    ({"rms_eps": 0.0}, "llama.attention.layer_norm_rms_epsilon")])
def test_non_finite_or_negative_metadata(tmp_path, kw, key):
    path = tiny_gguf(tmp_path / "m.gguf", **kw)
    _refused(path, repr(key), "finite number > 0")


def test_integer_keys_must_be_integers(tmp_path):
    # the writer refuses a key twice: write a string under a look-alike key, then swap the two names in place
    path = tiny_gguf(tmp_path / "v.gguf", metadata=[lambda w: w.add_string("llama.context_lengtx", "long")])
    raw = path.read_bytes()
    raw = raw.replace(b"llama.context_length", b"llama.context_lengtz", 1).replace(b"llama.context_lengtx",
                                                                                  b"llama.context_length", 1)
    path.write_bytes(raw)
    _refused(path, "'llama.context_length'", "expected one integer", "STRING")


@pytest.mark.parametrize("what", ["tokens", "merges"])
def test_tokens_or_merges_stored_as_integers(tmp_path, what):
    if what == "tokens":
        path = tiny_gguf(tmp_path / "t.gguf", tokens=list(range(258)))
    else:
        path = tiny_gguf(tmp_path / "m.gguf", merges=[1, 2, 3])
    _refused(path, f"'tokenizer.ggml.{what}'", "expected an array of strings", tokenizer=True)


def test_merges_outside_the_vocabulary(tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf", merges=["h e", "q z"])
    _refused(path, "tokenizer.ggml.merges", "'q z'", "'qz' missing", tokenizer=True)
    path = tiny_gguf(tmp_path / "x.gguf", merges=["h e", "notatoken x"])
    _refused(path, "'notatoken' missing", tokenizer=True)
    with pytest.raises(CheckpointError):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _patch(path: Path, name: str, *, ttype=None, offset=None) -> Path:
    data = bytearray(path.read_bytes())
    at = tensor_info_at(bytes(data), name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    at += 4 + 8 * n_dims
    if ttype is not None:
        struct.pack_into("<I", data, at, int(ttype))
    if offset is not None:
        struct.pack_into("<Q", data, at + 4, offset(struct.unpack_from("<Q", data, at + 4)[0]))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("offset, needle", [
    (lambda o: (o + 2**64 - 32) % 2**64, "expected its data at offset"),  # wraps past 2^64
    (lambda o: o + 4, "aligned to 32 bytes"),
    (lambda o: 0, "overlapping"),  # the same offset as the first tensor
    (lambda o: o + 2**20 * 32, "expected its data at offset"),  # past the end
])
def test_tensor_offsets(tmp_path, offset, needle):
    path = _patch(tiny_gguf(tmp_path / "o.gguf"), "blk.0.ffn_up.weight", offset=offset)
    _refused(path, needle)


@pytest.mark.parametrize("ttype", [Q.Q4_K, Q.IQ2_XXS, Q.Q8_0, Q.F16])
def test_tensor_type_over_bytes_of_another_size(tmp_path, ttype):
    path = _patch(tiny_gguf(tmp_path / "t.gguf", inter=256), "blk.0.ffn_down.weight", ttype=ttype)
    _refused(path, "'blk.0.ffn_down.weight'")


def test_unknown_tensor_type_and_bad_dims(tmp_path):
    _refused(_patch(tiny_gguf(tmp_path / "u.gguf"), "blk.0.ffn_up.weight", ttype=250), "known GGML type")
    path = tiny_gguf(tmp_path / "d.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, tensor_info_at(bytes(data), "blk.0.ffn_up.weight"), 9)
    path.write_bytes(bytes(data))
    _refused(path, "'blk.0.ffn_up.weight'", "1 to 4 dimensions")


def test_truncated_or_padded_file(tmp_path):
    path = tiny_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    _refused(path, "expected the tensor data to end the file")
    path.write_bytes(data + b"\0" * 64)
    _refused(path, "expected the tensor data to end the file")


def test_every_prefix_is_a_typed_error(tmp_path):
    data = tiny_gguf(tmp_path / "full.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    h = check_gguf_header(tmp_path / "full.gguf")
    for n in sorted({*range(0, 64), *np.linspace(64, h.data_offset + 64, 60).astype(int).tolist()}):
        path.write_bytes(data[:n])
        with pytest.raises(CheckpointError):
            open_gguf(path)
