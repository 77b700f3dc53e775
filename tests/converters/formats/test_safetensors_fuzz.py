"""Fuzzing the safetensors reader: a mutated file either reads or raises CheckpointError, fast."""

import json
import struct
import uuid
from datetime import timedelta

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converters.formats.safetensors_io import INDEX_FILE, SafetensorsFile, open_checkpoint, save_file
from qformats.errors import CheckpointError
from time_limit import time_limit

FUZZ = settings(max_examples=200, deadline=timedelta(seconds=3),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PER_EXAMPLE_SECONDS = 10  # a hang fails the example instead of stalling the suite

TENSORS = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "bf": np.linspace(-2, 2, 4).astype(ml_dtypes.bfloat16),
    "q": np.arange(6, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(3, 2),
    "f4": np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).reshape(2, 4),
    "f6": np.arange(4, dtype=np.uint8).view(ml_dtypes.float6_e3m2fn),
    "step": np.array(7, np.int64),
    "empty": np.zeros((0, 3), np.uint8),
    "mask": np.array([True, False]),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(directory for mutants, bytes of a valid file, its header as a dict, the header length)."""
    work = tmp_path_factory.mktemp("fuzz")
    save_file(TENSORS, work / "base.safetensors", metadata={"format": "pt"})
    raw = (work / "base.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return work, raw, json.loads(raw[8:8 + n]), n


def _read_everything(path):
    """Opens `path` and reads every tensor whole and by rows; only CheckpointError may escape."""
    with time_limit(PER_EXAMPLE_SECONDS, "reading a mutated file"):
        try:
            with SafetensorsFile(path) as f:
                f.metadata
                for name in f.keys():
                    info = f.info(name)
                    a = f.get(name)
                    assert a.shape == info.shape and a.dtype == info.numpy_dtype
                    a.tobytes()  # touch every byte of the map
                    if info.shape:
                        assert f.get(name, rows=slice(0, 1)).shape[0] == min(1, info.shape[0])
                        f.get(name, rows=slice(None, None, 2)).tobytes()
                        f.get_slice(name)[-1:].tobytes()
        except CheckpointError:
            pass


def _write(work, data, suffix=".safetensors"):
    path = work / f"{uuid.uuid4().hex}{suffix}"  # a fresh file: never rewrite one that is still mapped
    path.write_bytes(data)
    return path


def _with_header(header_bytes, data):
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


def test_base_file_reads(base):
    work, raw, _, _ = base
    with SafetensorsFile(_write(work, raw)) as f:
        assert f.keys() == sorted(TENSORS)


# -- byte-level mutations -----------------------------------------------------------------------------

_positions = st.integers(min_value=0, max_value=10_000)
_mutations = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(_positions, st.integers(1, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("set"), st.lists(st.tuples(_positions, st.integers(0, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("digits"), st.lists(st.tuples(_positions, st.integers(0, 9)), min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), _positions),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("length"), st.one_of(st.integers(0, 2**64 - 1), st.integers(-64, 64))),
    st.tuples(st.just("header_text"), st.text(max_size=200)),
)


def _mutate(raw, n, mutation):
    kind, arg = mutation
    data = bytearray(raw)
    if kind in ("flip", "set"):
        for pos, value in arg:
            pos %= len(data)
            data[pos] = data[pos] ^ value if kind == "flip" else value
    elif kind == "digits":  # rewrite digits of the header: shapes and offsets that still parse
        digits = [i for i in range(8, 8 + n) if 0x30 <= data[i] <= 0x39]
        for k, value in arg:
            data[digits[k % len(digits)]] = 0x30 + value
    elif kind == "truncate":
        del data[arg % len(data):]
    elif kind == "append":
        data += arg
    elif kind == "length":  # a random length, or one near the true length
        data[:8] = struct.pack("<Q", arg if arg >= 64 else max(n + arg, 0))
    elif kind == "header_text":  # arbitrary text as the header, data section kept
        return _with_header(arg.encode("utf-8", "surrogatepass"), bytes(raw[8 + n:]))
    return bytes(data)


@FUZZ
@given(mutation=_mutations)
def test_byte_mutations_read_or_raise_checkpoint_error(base, mutation):
    work, raw, _, n = base
    _read_everything(_write(work, _mutate(raw, n, mutation)))


# -- header-field mutations -----------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# values that are nearly right, to get past the first checks and reach the later ones
_plausible = st.one_of(
    st.sampled_from(["F32", "BF16", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "U8", "BOOL", "I64", "C64", "f32", ""]),
    st.lists(st.integers(-2, 40), max_size=4),
    st.lists(st.integers(0, 2**64), min_size=2, max_size=2),
    st.lists(st.integers(0, 64), min_size=2, max_size=2),  # offsets inside the data: overlaps, gaps
    st.lists(st.sampled_from([0, 1, 2, 3, 8, 10**30, 2**63]), max_size=66),
)
_targets = st.sampled_from(["__metadata__", "new", *TENSORS])
_fields = st.sampled_from([None, "dtype", "shape", "data_offsets", "format", "extra"])


@FUZZ
@given(edits=st.lists(st.tuples(_targets, _fields, _json_values | _plausible), max_size=4),
       moves=st.lists(st.tuples(st.sampled_from(sorted(TENSORS)), st.integers(0, 64)), max_size=3),
       keep_data=st.booleans())
def test_header_field_mutations_read_or_raise_checkpoint_error(base, edits, moves, keep_data):
    work, raw, header, n = base
    header = json.loads(json.dumps(header))
    for name, begin in moves:  # same size elsewhere: overlaps, gaps, past the end
        old_begin, old_end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin, begin + old_end - old_begin]
    for target, field, value in edits:
        if field is None or not isinstance(header.get(target), dict):
            header[target] = value  # replace the whole entry
        else:
            header[target][field] = value
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    _read_everything(_write(work, _with_header(text, raw[8 + n:] if keep_data else raw[8 + n:][:17])))


NASTY_HEADERS = [
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the recursion limit
    b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',  # int too long
    b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "U8", "shape": [1], '
    b'"data_offsets": [0, 1]}}',  # duplicate name
    b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}',
    b'{"a": {"dtype": "F32", "shape": [0, 1000000000000000000000000000000], "data_offsets": [0, 0]}}',
    b'{"a": {"dtype": "U8", "shape": [' + b"1," * 99 + b'1], "data_offsets": [0, 1]}}',  # 100 dims
    b'{"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}',  # 12 bits
    b'{"a": {"dtype": "F6_E2M3", "shape": [2], "data_offsets": [0, 2]}}',
    b'{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": {"x": 1}, "shape": [1], "data_offsets": [0, 4]}}',
    b'{"__metadata__": {"k": 1}}',
    b'{"__metadata__": [["k", "v"]]}',
    b'{"__metadata__": null, "a": null}',
    b"\xef\xbb\xbf{}",  # UTF-8 BOM
    b"{\xff}",
    b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',  # lone surrogate name
    b"",
    b"null",
    b'"text"',
]


@pytest.mark.parametrize("header", NASTY_HEADERS, ids=range(len(NASTY_HEADERS)))
def test_nasty_headers_read_or_raise_checkpoint_error(base, header):
    work, _, _, _ = base
    _read_everything(_write(work, _with_header(header, bytes(64))))


# -- sharded index mutations ----------------------------------------------------------------------------


@settings(FUZZ, max_examples=60)
@given(index=st.one_of(
    _json_values,
    st.dictionaries(st.sampled_from(["weight_map", "metadata"]), _json_values | _plausible, max_size=2),
    st.fixed_dictionaries({"weight_map": st.dictionaries(
        st.sampled_from([*TENSORS, "ghost"]),
        st.sampled_from(["s.safetensors", "missing.safetensors", "../s.safetensors", "/etc/passwd", "", ".",
                         "sub/s.safetensors", "a\x00b", "\ud800"]) | _json_values, max_size=6)}),
))
def test_index_mutations_open_or_raise_checkpoint_error(base, index):
    work, raw, _, _ = base
    ckpt_dir = work / uuid.uuid4().hex
    ckpt_dir.mkdir()
    (ckpt_dir / "s.safetensors").write_bytes(raw)
    (ckpt_dir / INDEX_FILE).write_text(json.dumps(index), encoding="utf-8", errors="surrogatepass")
    with time_limit(PER_EXAMPLE_SECONDS, "reading a mutated file"):
        try:
            with open_checkpoint(ckpt_dir) as ckpt:
                for name in ckpt.keys():
                    ckpt.get(name).tobytes()
                    assert ckpt.file_of(name) == ckpt_dir / "s.safetensors"
        except CheckpointError:
            pass
