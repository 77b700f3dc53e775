"""safetensors reader/writer: round trips, byte-identity with the reference, sharded reads, bad files."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from converters.formats.safetensors_io import (
    DTYPES,
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsFile,
    TensorInfo,
    encode_tensor,
    header_bytes,
    open_checkpoint,
    parse_size,
    read_json,
    save_file,
    serialize,
    tensor_info,
)
from qformats.errors import CheckpointError

# dtype of the array handed to save_file -> safetensors name in the header
WRITE_DTYPES = {
    np.float64: "F64", np.float32: "F32", np.float16: "F16", ml_dtypes.bfloat16: "BF16",
    ml_dtypes.float8_e4m3fn: "F8_E4M3", ml_dtypes.float8_e5m2: "F8_E5M2", ml_dtypes.float8_e8m0fnu: "F8_E8M0",
    ml_dtypes.float8_e4m3fnuz: "F8_E4M3FNUZ", ml_dtypes.float8_e5m2fnuz: "F8_E5M2FNUZ",
    np.int64: "I64", np.int32: "I32", np.int16: "I16", np.int8: "I8",
    np.uint64: "U64", np.uint32: "U32", np.uint16: "U16", np.uint8: "U8", np.bool_: "BOOL", np.complex64: "C64",
    ml_dtypes.float4_e2m1fn: "F4", ml_dtypes.float6_e2m3fn: "F6_E2M3", ml_dtypes.float6_e3m2fn: "F6_E3M2",
}
SUB_BYTE = {ml_dtypes.float4_e2m1fn: 4, ml_dtypes.float6_e2m3fn: 6, ml_dtypes.float6_e3m2fn: 6}


def _sample(dtype, shape, seed=0):
    """Arbitrary bit patterns (every code of the narrow types, NaNs included) of `dtype`."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype in SUB_BYTE:
        return rng.integers(0, 1 << SUB_BYTE[dtype], n).astype(np.uint8).view(dt).reshape(shape)
    return rng.integers(0, 256, n * dt.itemsize).astype(np.uint8).view(dt).reshape(shape)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")


def _raw_file(path, header, data=b"", header_len=None):
    """Writes a safetensors file from an explicit header (dict or raw bytes) and data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


# -- round trips and the reference writer ----------------------------------------------------------


def test_dtype_table_covers_the_writer():
    assert set(WRITE_DTYPES.values()) == set(DTYPES)


@pytest.mark.parametrize("dtype", list(WRITE_DTYPES), ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype(tmp_path, dtype):
    tensors = {"m": _sample(dtype, (3, 8), 1), "v": _sample(dtype, (4,), 2), "s": _sample(dtype, (), 3)
               if dtype not in SUB_BYTE else _sample(dtype, (8,), 3), "z": np.zeros((0, 5), dtype)}
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "np"})
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        assert f.keys() == sorted(tensors)
        assert f.metadata == {"format": "np"}
        for name, want in tensors.items():
            assert f.info(name) == (WRITE_DTYPES[dtype], want.shape)
            got = f.get(name)
            assert got.dtype == np.dtype(dtype) and got.shape == want.shape
            np.testing.assert_array_equal(_bits(got), _bits(want))


REFERENCE_DTYPES = [d for d in WRITE_DTYPES if d not in SUB_BYTE]


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}])
def test_byte_identical_to_safetensors_numpy(tmp_path, metadata):
    st_numpy = pytest.importorskip("safetensors.numpy")
    # Every dtype at once exercises the reference's ordering (descending dtype rank, then name).
    tensors = {f"{i % 5}.{np.dtype(d).name}": _sample(d, (2, i + 1), i) for i, d in enumerate(REFERENCE_DTYPES)}
    tensors.update({"scalar": np.array(3.5, np.float32), "empty": np.zeros((0,), np.float16),
                    "é/ü\n\"q\"\x01": np.arange(3)})  # names that JSON must escape
    tensors["big_endian"] = np.arange(5, dtype=">i4")
    st_numpy.save_file(tensors, tmp_path / "ref.safetensors", metadata=metadata)
    save_file(tensors, tmp_path / "ours.safetensors", metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_reads_reference_files(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {np.dtype(d).name: _sample(d, (3, 2), 7) for d in REFERENCE_DTYPES}
    st_numpy.save_file(tensors, tmp_path / "ref.safetensors", metadata={"a": "b"})
    with SafetensorsFile(tmp_path / "ref.safetensors") as f:
        assert f.metadata == {"a": "b"}
        for name, want in tensors.items():
            np.testing.assert_array_equal(_bits(f.get(name)), _bits(want))
            assert f.get(name).dtype == want.dtype


def test_reads_torch_written_fp8_bf16_fp4(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    tensors = {
        "w8": codes.clone().view(torch.float8_e4m3fn),
        "w5": codes.clone().view(torch.float8_e5m2),
        "e8": codes.clone().view(torch.float8_e8m0fnu),
        "bf": torch.linspace(-3, 3, 12, dtype=torch.bfloat16).reshape(3, 4),
        "f4": codes[:2].clone().view(torch.float4_e2m1fn_x2),  # [2, 16] bytes = [2, 32] elements
    }
    st_torch.save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        assert f.info("w8") == ("F8_E4M3", (16, 16)) and f.info("f4") == ("F4", (2, 32))
        for name, dt in [("w8", ml_dtypes.float8_e4m3fn), ("w5", ml_dtypes.float8_e5m2),
                         ("e8", ml_dtypes.float8_e8m0fnu)]:
            got = f.get(name)
            assert got.dtype == dt
            np.testing.assert_array_equal(got.view(np.uint8), codes.numpy())
        np.testing.assert_array_equal(f.get("bf").astype(np.float32), tensors["bf"].float().numpy())
        f4 = f.get("f4")  # element 2i is the low nibble of byte i, as torch's float4_e2m1fn_x2
        assert f4.dtype == ml_dtypes.float4_e2m1fn and f4.shape == (2, 32)
        packed = codes[:2].numpy()
        np.testing.assert_array_equal(f4.view(np.uint8)[:, 0::2], packed & 15)
        np.testing.assert_array_equal(f4.view(np.uint8)[:, 1::2], packed >> 4)
        # ...and we write back exactly the bytes torch wrote.
        save_file({k: f.get(k) for k in f.keys()}, tmp_path / "back.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "t.safetensors").read_bytes()


def test_writes_files_safetensors_torch_reads(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    w = _sample(ml_dtypes.float8_e4m3fn, (4, 8))
    save_file({"w": w, "b": np.ones(3, ml_dtypes.bfloat16)}, tmp_path / "t.safetensors")
    loaded = st_torch.load_file(tmp_path / "t.safetensors")
    assert loaded["w"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(loaded["w"].view(torch.uint8).numpy(), w.view(np.uint8))
    assert loaded["b"].dtype == torch.bfloat16 and loaded["b"].float().tolist() == [1.0, 1.0, 1.0]


# -- lazy access ---------------------------------------------------------------------------------------


def test_lazy_row_slices(tmp_path):
    a = np.arange(10 * 3 * 4, dtype=np.float32).reshape(10, 3, 4)
    f4 = _sample(ml_dtypes.float4_e2m1fn, (6, 4))
    odd = _sample(ml_dtypes.float4_e2m1fn, (4, 3))  # 12-bit rows straddle bytes
    save_file({"a": a, "f4": f4, "odd": odd, "s": np.float32(2.0)}, tmp_path / "t.safetensors")
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        rows = f.get("a", rows=slice(2, 5))
        np.testing.assert_array_equal(rows, a[2:5])
        # a view of only those rows' bytes in the map, not a copy of the tensor
        assert not rows.flags.owndata and not rows.flags.writeable and rows.nbytes == 3 * 48
        np.testing.assert_array_equal(f.get("a", rows=slice(None, None, -3)), a[::-3])
        np.testing.assert_array_equal(f.get("a", rows=slice(8, 100)), a[8:])
        assert f.get("a", rows=slice(5, 2)).shape == (0, 3, 4)
        sl = f.get_slice("a")
        assert sl.shape == (10, 3, 4) and sl.dtype == "F32" and sl.get_shape() == [10, 3, 4]
        np.testing.assert_array_equal(sl[1:3], a[1:3])
        np.testing.assert_array_equal(sl[-1], a[-1])
        np.testing.assert_array_equal(sl[4, 1:, ::2], a[4, 1:, ::2])
        np.testing.assert_array_equal(sl[..., 0], a[..., 0])
        with pytest.raises(IndexError):
            sl[10]
        np.testing.assert_array_equal(_bits(f.get("f4", rows=slice(1, 4))), _bits(f4[1:4]))
        np.testing.assert_array_equal(_bits(f.get_slice("odd")[1:3]), _bits(odd[1:3]))
        assert f.get_slice("s")[()] == 2.0
        with pytest.raises(CheckpointError, match="scalar"):
            f.get("s", rows=slice(0, 1))


def test_arrays_outlive_close(tmp_path):
    save_file({"a": np.arange(4.0)}, tmp_path / "t.safetensors")
    f = SafetensorsFile(tmp_path / "t.safetensors")
    a = f.get("a")
    f.close()
    np.testing.assert_array_equal(a, np.arange(4.0))
    with pytest.raises(CheckpointError, match="closed"):
        f.get("a")


def test_missing_tensor_names_file_and_tensor(tmp_path):
    save_file({"a": np.zeros(2)}, tmp_path / "t.safetensors")
    with SafetensorsFile(tmp_path / "t.safetensors") as f, pytest.raises(CheckpointError) as e:
        f.get("nope")
    assert "t.safetensors" in str(e.value) and "'nope'" in str(e.value)


# -- writer ------------------------------------------------------------------------------------------


def test_save_file_is_atomic_and_rejects_bad_input(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.zeros(2)}, path)
    before = path.read_bytes()
    for bad, needle in [({"a": np.zeros(2, np.complex128)}, "complex128"),
                        ({"a": np.array(["x"])}, "<U1"),
                        ({"__metadata__": np.zeros(1)}, "reserved"),
                        ({"f4": np.zeros(3, ml_dtypes.float4_e2m1fn)}, "whole bytes")]:
        with pytest.raises(CheckpointError, match=needle):
            save_file(bad, path)
    with pytest.raises(CheckpointError, match="metadata"):
        save_file({"a": np.zeros(2)}, path, metadata={"k": 1})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["t.safetensors"]  # no temp files left behind


def test_encoder_parts(tmp_path):
    assert tensor_info(ml_dtypes.float4_e2m1fn, (2, 3), where="w", name="t") == TensorInfo("F4", (2, 3))
    assert tensor_info(np.float32, [5], where="w", name="t").nbytes == 20
    with pytest.raises(CheckpointError, match="w: tensor 't'.*found complex128"):
        tensor_info(np.complex128, (1,), where="w", name="t")
    with pytest.raises(CheckpointError, match="w: tensor 't': 3 F6_E2M3 elements do not fill whole bytes"):
        tensor_info(ml_dtypes.float6_e2m3fn, (3,), where="w", name="t")
    t = encode_tensor("f6", np.arange(4, dtype=np.uint8).view(ml_dtypes.float6_e2m3fn), where="w")
    assert t.info == TensorInfo("F6_E2M3", (4,)) and t.data.tolist() == [0x40, 0x20, 0x0C]  # 0|1<<6|2<<12|3<<18
    # header_bytes + data in the given order is a file the reader takes; serialize sorts as save_file does
    a, b = encode_tensor("b", np.ones(2, np.int8), where="w"), encode_tensor("a", np.ones(3, np.float32), where="w")
    (tmp_path / "given.safetensors").write_bytes(header_bytes([(a.name, a.info), (b.name, b.info)], None, where="w")
                                                 + a.data.tobytes() + b.data.tobytes())
    with SafetensorsFile(tmp_path / "given.safetensors") as f:
        assert f.get("b").tolist() == [1, 1] and f.get("a").tolist() == [1.0, 1.0, 1.0]
    save_file({"b": np.ones(2, np.int8), "a": np.ones(3, np.float32)}, tmp_path / "ref.safetensors")
    assert b"".join(bytes(c) for c in serialize([a, b], None, where="w")) == (tmp_path / "ref.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="'b' twice"):
        header_bytes([("b", b.info), ("b", b.info)], None, where="w")


def test_save_file_takes_views_and_array_likes(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"t": base.T, "strided": base[::2, 1::3], "f": np.asfortranarray(base), "list": [[1, 2], [3, 4]]}
    save_file(tensors, tmp_path / "t.safetensors")
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        for name, want in tensors.items():
            np.testing.assert_array_equal(f.get(name), np.asarray(want))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("5gib") == 5 * 2**30
    assert parse_size("500 MB") == 500 * 10**6
    assert parse_size("1.5KiB") == 1536
    assert parse_size("10kb") == 10_000
    assert parse_size("123") == 123 and parse_size("7B") == 7 and parse_size(4096) == 4096
    for bad in ["", "GB", "5XB", "-1GB", "0", 0, 1.5, None, True]:
        with pytest.raises(CheckpointError):
            parse_size(bad)


# -- bad input: each is a CheckpointError naming the file (and the tensor) ---------------------------


def _valid(tmp_path, name="t.safetensors"):
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(4, np.int8)}, tmp_path / name)
    return tmp_path / name


def _assert_error(fn, *needles):
    with pytest.raises(CheckpointError) as e:
        fn()
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    return str(e.value)


def test_truncated_file(tmp_path):
    path = _valid(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "'b'", "out of range")  # 'b' is last
    path.write_bytes(b"\x10\x00\x00")
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "at least 8 bytes")


def test_header_length_larger_than_file(tmp_path):
    path = _raw_file(tmp_path / "t.safetensors", {}, header_len=1 << 40)
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "does not fit")


def test_offsets_out_of_range(tmp_path):
    path = _raw_file(tmp_path / "t.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                     bytes(8))
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "'w'", "out of range", "[4, 12]")


def test_overlapping_offsets(tmp_path):
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "y": {"dtype": "I32", "shape": [2], "data_offsets": [4, 12]}}
    path = _raw_file(tmp_path / "t.safetensors", header, bytes(12))
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "'x'", "'y'", "overlap")


def test_size_not_shape_times_itemsize(tmp_path):
    path = _raw_file(tmp_path / "t.safetensors", {"w": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 10]}},
                     bytes(16))
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "'w'", "needs 12 bytes", "hold 10")


def test_unknown_dtype(tmp_path):
    path = _raw_file(tmp_path / "t.safetensors", {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                     bytes(16))
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "'w'", '"F128"', "F8_E4M3")


def test_non_json_header(tmp_path):
    path = _raw_file(tmp_path / "t.safetensors", b'{"w": {"dtype": "F32",', bytes(8))
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "invalid JSON")
    path = _raw_file(tmp_path / "t.safetensors", b"[1, 2]")
    _assert_error(lambda: SafetensorsFile(path), "t.safetensors", "expected a JSON object", "list")


def test_index_points_at_missing_shard(tmp_path):
    _valid(tmp_path, "model-00001-of-00002.safetensors")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}))
    _assert_error(lambda: open_checkpoint(tmp_path), INDEX_FILE, "'c'", "model-00002-of-00002.safetensors",
                  "no such file")


def test_index_names_tensor_the_shard_lacks(tmp_path):
    _valid(tmp_path, "model-00001-of-00001.safetensors")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00001.safetensors", "ghost": "model-00001-of-00001.safetensors"}}))
    _assert_error(lambda: open_checkpoint(tmp_path), "model-00001-of-00001.safetensors", "'ghost'", "missing")


def test_empty_directory(tmp_path):
    _assert_error(lambda: open_checkpoint(tmp_path), str(tmp_path), SINGLE_FILE, "found none")


def test_read_json_errors(tmp_path):
    _assert_error(lambda: read_json(tmp_path / "config.json"), "config.json", "no such file")
    (tmp_path / "config.json").write_text("{'single': quotes}")
    _assert_error(lambda: read_json(tmp_path / "config.json"), "config.json", "line 1")
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert read_json(tmp_path / "config.json") == {"a": 1}
