"""safetensors files and HF checkpoints without torch: validating memory-mapped reader, tensor encoder, file writer.

The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(`{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}`,
padded with spaces to a multiple of 8), then the data section; offsets are relative to its start and
every element is stored little-endian, row-major.

The reader validates the whole header before it maps any data (sizes, offsets inside the data
section tiled exactly as safetensors requires: no gap, no overlap, no trailing byte; known dtypes; regular
files only; at most MAX_METADATA_ENTRIES `__metadata__` entries, each checked in time linear in the header), then hands out read-only numpy views of the memory map, so a
tensor, or a range of its rows, costs nothing until it is touched. Dtypes go through ml_dtypes
(`F8_E4M3` -> `float8_e4m3fn`, `BF16` -> `bfloat16`, ...) because safetensors' own numpy loader
rejects them. The sub-byte dtypes `F4`, `F6_E2M3`, `F6_E3M2` are packed densely little-endian (element
0 in the lowest bits: `F4` is torch's `float4_e2m1fn_x2` layout); the header shape counts elements,
and `get` returns them unpacked, one ml_dtypes code per byte.

The writer produces the bytes `safetensors.numpy.save_file` produces (tensors sorted by descending
dtype rank, then by name; `__metadata__` first; header padded with spaces) -- except that metadata keys
are sorted, where the reference writes them in hash order. Whole checkpoint directories (shards, index,
config) are written by `converters.formats.shard_writer.ShardedWriter`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import ml_dtypes
import numpy as np

from converters.formats.safe_files import loads_strict as _loads_strict
from converters.formats.safe_files import open_regular, read_json
from qformats.errors import CheckpointError

__all__ = [
    "DTYPES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "Checkpoint",
    "EncodedTensor",
    "SafetensorsFile",
    "TensorInfo",
    "TensorSlice",
    "encode_tensor",
    "header_bytes",
    "open_checkpoint",
    "parse_size",
    "read_json",
    "save_file",
    "serialize",
    "tensor_info",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors refuses headers above 100 MB; so do we, so that a corrupt length never makes us read GBs.
MAX_HEADER_SIZE = 100_000_000
#: `__metadata__` entries accepted (transformers writes one, {"format": "pt"}); more is a CheckpointError.
MAX_METADATA_ENTRIES = 100_000
_MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
_LITTLE_HOST = sys.byteorder == "little"


class _Dtype(NamedTuple):
    code: str  # the safetensors name
    bits: int  # storage bits per element
    numpy: np.dtype  # dtype of the arrays `get` returns (little-endian for the numpy builtins)


# In the order of safetensors' `Dtype` enum: the writer sorts tensors by descending rank in this list.
_DTYPE_LIST = [
    _Dtype("BOOL", 8, np.dtype("?")),
    _Dtype("F4", 4, np.dtype(ml_dtypes.float4_e2m1fn)),
    _Dtype("F6_E2M3", 6, np.dtype(ml_dtypes.float6_e2m3fn)),
    _Dtype("F6_E3M2", 6, np.dtype(ml_dtypes.float6_e3m2fn)),
    _Dtype("U8", 8, np.dtype("u1")),
    _Dtype("I8", 8, np.dtype("i1")),
    _Dtype("F8_E5M2", 8, np.dtype(ml_dtypes.float8_e5m2)),
    _Dtype("F8_E4M3", 8, np.dtype(ml_dtypes.float8_e4m3fn)),
    _Dtype("F8_E8M0", 8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    _Dtype("F8_E4M3FNUZ", 8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    _Dtype("F8_E5M2FNUZ", 8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    _Dtype("I16", 16, np.dtype("<i2")),
    _Dtype("U16", 16, np.dtype("<u2")),
    _Dtype("F16", 16, np.dtype("<f2")),
    _Dtype("BF16", 16, np.dtype(ml_dtypes.bfloat16)),
    _Dtype("I32", 32, np.dtype("<i4")),
    _Dtype("U32", 32, np.dtype("<u4")),
    _Dtype("F32", 32, np.dtype("<f4")),
    _Dtype("C64", 64, np.dtype("<c8")),
    _Dtype("F64", 64, np.dtype("<f8")),
    _Dtype("I64", 64, np.dtype("<i8")),
    _Dtype("U64", 64, np.dtype("<u8")),
]
#: safetensors dtype name -> (bits per element, numpy dtype of the arrays the reader returns).
DTYPES: dict[str, _Dtype] = {d.code: d for d in _DTYPE_LIST}
_RANK = {d.code: i for i, d in enumerate(_DTYPE_LIST)}
_CODE_OF_NUMPY = {d.numpy.name: d.code for d in _DTYPE_LIST}  # "float32" -> "F32", "bfloat16" -> "BF16"


class TensorInfo(NamedTuple):
    """What the header says about one tensor: safetensors dtype name and logical shape (elements)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of the array `get` returns (ml_dtypes for BF16 / F8_* / F4 / F6_*)."""
        return DTYPES[self.dtype].numpy

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies in the file (sub-byte dtypes packed)."""
        return math.prod(self.shape) * DTYPES[self.dtype].bits // 8


# --------------------------------------------------------------------------------------------------
# helpers


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as "5GB" (10**9), "500MiB" (2**20), "1.5 GB", "4096".

    Units: B, KB/MB/GB/TB (powers of 1000, as transformers reads them), KiB/MiB/GiB/TiB (powers of
    1024); case-insensitive. The result must be positive.
    """
    if _is_int(size):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*", size, re.IGNORECASE)
        if not m:
            raise CheckpointError(f"size: expected an int or a string like '5GB' or '500MiB', found {size!r}")
        unit = (m.group(2) or "b").lower()
        scale = 1 if unit == "b" else (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
        value = int(float(m.group(1)) * scale)
    else:
        raise CheckpointError(f"size: expected an int or a string like '5GB', found {type(size).__name__}")
    if value <= 0:
        raise CheckpointError(f"size: expected a positive number of bytes, found {size!r}")
    return value


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Dense little-endian sub-byte codes -> one uint8 code per element (count elements)."""
    if bits == 4:
        out = np.empty(2 * packed.size, np.uint8)
        out[0::2] = packed & 0x0F
        out[1::2] = packed >> 4
    else:  # 6 bits: four codes in three bytes, as one little-endian 24-bit word
        word = packed.reshape(-1, 3).astype(np.uint32)
        word = word[:, 0] | (word[:, 1] << 8) | (word[:, 2] << 16)
        out = ((word[:, None] >> np.array([0, 6, 12, 18], np.uint32)) & 0x3F).astype(np.uint8).reshape(-1)
    return out[:count]


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `_unpack`; codes.size * bits must be a multiple of 8."""
    codes = codes.astype(np.uint8) & ((1 << bits) - 1)
    if bits == 4:
        return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    c = codes.reshape(-1, 4).astype(np.uint32)
    word = c[:, 0] | (c[:, 1] << 6) | (c[:, 2] << 12) | (c[:, 3] << 18)
    return np.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], axis=1).astype(np.uint8).reshape(-1)


# --------------------------------------------------------------------------------------------------
# reader


class _Entry(NamedTuple):
    info: TensorInfo
    begin: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One .safetensors file: header validated at open, tensors served lazily from a memory map.

    `get` returns read-only arrays that view the map (copy them to modify); they stay valid after
    `close`, which only drops this object's reference to the map. Sub-byte dtypes are unpacked into
    a new array. Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike, root: str | os.PathLike | None = None):
        # root: the checkpoint directory a link to this file must stay inside (None: no restriction).
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        # Regular files only (a FIFO would block the open, /dev/zero would read forever): see safe_files.
        fd, _ = open_regular(self.path, root, "a safetensors file")
        try:
            with open(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._entries, self._metadata = self._parse_header(f, size)
                # An empty data section still leaves 8+N > 0 bytes, so the map is never empty.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: expected a safetensors file, found no such file") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: expected a safetensors file, found a directory") from None
        except (OSError, ValueError, OverflowError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{self.path}: cannot read or map the file ({type(e).__name__}: {e})") from None

    def _parse_header(self, f, size: int) -> tuple[dict[str, _Entry], dict[str, str]]:
        where = str(self.path)
        if size < 8:
            raise CheckpointError(f"{where}: expected at least 8 bytes (the header length), found a "
                                  f"{size}-byte file")
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise CheckpointError(f"{where}: header length {n} does not fit in the file: expected at most "
                                  f"{size - 8} bytes after the length field (file is {size} bytes)")
        if n > MAX_HEADER_SIZE:
            raise CheckpointError(f"{where}: header length {n} exceeds safetensors' limit of "
                                  f"{MAX_HEADER_SIZE} bytes")
        if n == 0:
            raise CheckpointError(f"{where}: header length 0: expected a JSON object (at least '{{}}')")
        raw = f.read(n)
        if len(raw) != n:
            raise CheckpointError(f"{where}: expected a {n}-byte header, read {len(raw)} bytes")
        try:
            header = _loads_strict(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{where}: header: expected UTF-8 JSON, found invalid UTF-8 at byte "
                                  f"{8 + e.start}") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{where}: header: expected a JSON object, found invalid JSON ({e.msg} at "
                                  f"header char {e.pos})") from None
        except (ValueError, RecursionError) as e:  # duplicate keys, NaN, 5000-digit ints, deep nesting
            raise CheckpointError(f"{where}: header: expected a JSON object, found {type(e).__name__}: "
                                  f"{str(e)[:200]}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{where}: header: expected a JSON object, found {type(header).__name__}")
        data_start, data_size = 8 + n, size - 8 - n

        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not set(map(type, metadata.values())) <= {str}:
            raise CheckpointError(f"{where}: __metadata__: expected an object of string values, found "
                                  f"{_brief(metadata)}")
        if len(metadata) > MAX_METADATA_ENTRIES:
            raise CheckpointError(f"{where}: __metadata__: expected at most {MAX_METADATA_ENTRIES} entries, found "
                                  f"{len(metadata)}")
        _check_texts(where, "__metadata__ key", metadata.keys())
        _check_texts(where, "__metadata__ value", metadata.values())
        _check_texts(where, "tensor name", header.keys())

        entries: dict[str, _Entry] = {}
        for name, spec in header.items():
            info, begin, end = self._check_entry(where, name, spec, data_size)
            entries[name] = _Entry(info, data_start + begin, end - begin)

        # As safetensors: the byte ranges, sorted, tile the data section exactly -- each begins where the
        # previous ended, the first at 0, the last at the end of the file (no gap, no overlap, no trailing
        # bytes). A header length a byte short (the padding absorbing it) fails here, not as a shifted read.
        at, prev = 0, None
        for begin, end, name in sorted((e.begin - data_start, e.begin - data_start + e.nbytes, name)
                                       for name, e in entries.items()):
            if begin != at:
                how = (f"tensors {prev!r} and {name!r} overlap" if begin < at else
                       f"tensor {name!r} leaves a gap of {begin - at} bytes before it")
                raise CheckpointError(
                    f"{where}: {how}: expected data_offsets [{at}, ...] (the end of "
                    f"{repr(prev) if prev is not None else 'nothing: the first tensor begins at 0'}), found "
                    f"[{begin}, {end}]")
            at, prev = end, name
        if at != data_size:
            raise CheckpointError(f"{where}: expected the tensors to cover the data section exactly: they end at "
                                  f"byte {at}, the data section holds {data_size} bytes (header length {n}, file "
                                  f"{size} bytes)")
        return entries, dict(metadata)

    @staticmethod
    def _check_entry(where: str, name: str, spec: Any, data_size: int) -> tuple[TensorInfo, int, int]:
        at = f"{where}: tensor {name!r}"
        if not isinstance(spec, dict):
            raise CheckpointError(f"{at}: expected an object with dtype, shape, data_offsets, found "
                                  f"{_brief(spec)}")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in spec:
                raise CheckpointError(f"{at}: expected a {key!r} field, found keys {sorted(spec)[:8]}")
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise CheckpointError(f"{at}: expected a dtype among {', '.join(DTYPES)}, found {_brief(code)}")
        dtype = DTYPES[code]
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise CheckpointError(f"{at}: expected shape to be a list of non-negative ints, found "
                                  f"{_brief(shape)}")
        if len(shape) > _MAX_DIMS:
            raise CheckpointError(f"{at}: expected at most {_MAX_DIMS} dimensions, found {len(shape)}")
        # numpy must be able to allocate the shape even when a zero dim makes it empty.
        if math.prod(d for d in shape if d) * max(dtype.numpy.itemsize, 1) >= 2**62:
            raise CheckpointError(f"{at}: shape {shape} is too large to address")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise CheckpointError(f"{at}: expected data_offsets to be [begin, end] ints, found "
                                  f"{_brief(offsets)}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(f"{at}: data_offsets out of range: expected 0 <= begin <= end <= "
                                  f"{data_size} (the data section size), found [{begin}, {end}]")
        count = math.prod(shape)
        if count * dtype.bits % 8:
            raise CheckpointError(f"{at}: {count} {code} elements do not fill whole bytes")
        expected = count * dtype.bits // 8
        if end - begin != expected:
            raise CheckpointError(f"{at}: size mismatch: shape {shape} of {code} needs {expected} bytes, "
                                  f"data_offsets [{begin}, {end}] hold {end - begin}")
        return TensorInfo(code, tuple(shape)), begin, end

    # -- access -------------------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, str]:
        """The header's `__metadata__` (empty when absent)."""
        return dict(self._metadata)

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise CheckpointError(f"{self.path}: expected a tensor named {name!r}, found none "
                                  f"({len(self._entries)} tensors in the file)") from None

    def info(self, name: str) -> TensorInfo:
        """dtype (safetensors name) and shape of `name`, from the header alone."""
        return self._entry(name).info

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `name` as a numpy array, or only rows[rows] of its first dimension.

        With `rows`, only those rows' bytes are mapped (for a step of 1), so reading a slice of a huge
        tensor touches nothing else. Returns a read-only view of the map, except for sub-byte dtypes
        (unpacked copy).
        """
        entry = self._entry(name)
        if self._mmap is None:
            raise CheckpointError(f"{self.path}: tensor {name!r}: expected an open file, found it closed")
        shape, dtype = entry.info.shape, DTYPES[entry.info.dtype]
        begin, nbytes = entry.begin, entry.nbytes
        step = 1
        if rows is not None:
            if not isinstance(rows, slice):
                raise TypeError(f"rows must be a slice, got {type(rows).__name__}")
            if not shape:
                raise CheckpointError(f"{self.path}: tensor {name!r}: expected at least one dimension to "
                                      f"slice rows of, found a scalar")
            start, stop, step = rows.indices(shape[0])
            row_elems = math.prod(shape[1:])
            if step != 1 or row_elems * dtype.bits % 8:
                # Strided rows, or packed rows that straddle bytes: view (or unpack) all, then slice.
                return self.get(name)[rows]
            nrows = max(stop - start, 0)
            row_bytes = row_elems * dtype.bits // 8
            begin, nbytes, shape = begin + start * row_bytes, nrows * row_bytes, (nrows, *shape[1:])
        count = math.prod(shape)
        if count == 0:
            return np.empty(shape, dtype.numpy)
        if dtype.bits < 8:
            packed = np.frombuffer(self._mmap, np.uint8, nbytes, begin)
            return _unpack(packed, dtype.bits, count).view(dtype.numpy).reshape(shape)
        if dtype.numpy.byteorder == "=" and dtype.bits > 8 and not _LITTLE_HOST:
            # ml_dtypes types have no non-native byte order: swap into a native copy.
            raw = np.frombuffer(self._mmap, f"<u{dtype.bits // 8}", count, begin)
            return raw.astype(raw.dtype.newbyteorder("=")).view(dtype.numpy).reshape(shape)
        return np.frombuffer(self._mmap, dtype.numpy, count, begin).reshape(shape)

    def get_slice(self, name: str) -> TensorSlice:
        """A lazy handle on `name`: `.shape`, `.dtype`, and `[a:b, ...]` indexing that reads only rows a:b."""
        return TensorSlice(self, name)

    def drop_pages(self) -> None:
        """Lets the kernel drop this process's mapped pages (MADV_DONTNEED): resident memory falls back while
        streaming through a large file. Arrays already returned stay valid (pages fault back in)."""
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            with contextlib.suppress(OSError, ValueError):
                self._mmap.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Drops the map; arrays already returned keep their part alive until they are freed."""
        mm, self._mmap = self._mmap, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # views exported: the map closes when they go
                mm.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"


class TensorSlice:
    """Lazy tensor handle (like safetensors' `get_slice`): the first index picks rows before any read."""

    def __init__(self, source: SafetensorsFile | Checkpoint, name: str):
        self._source, self._name = source, name
        self._info = source.info(name)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._info.shape

    @property
    def dtype(self) -> str:
        return self._info.dtype

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
        if not self.shape:
            return self._source.get(self._name)[key]
        if isinstance(first, slice):
            return self._source.get(self._name, rows=first)[(slice(None), *rest)]
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            i = int(first)
            if not -self.shape[0] <= i < self.shape[0]:
                raise IndexError(f"index {i} is out of bounds for axis 0 with size {self.shape[0]}")
            i %= self.shape[0]
            return self._source.get(self._name, rows=slice(i, i + 1))[(0, *rest)]
        return self._source.get(self._name)[key]


def _check_texts(where: str, what: str, texts: Iterable[str]) -> None:
    """_check_text of every string of `texts`, in one encode of their concatenation (linear, at C speed); the
    per-string pass only runs to name the offender."""
    texts = list(texts)
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for text in texts:
            _check_text(where, what, text)


def _check_text(where: str, what: str, text: str) -> None:
    """Names and metadata must be valid Unicode (a JSON escape of a lone surrogate is not; safetensors
    rejects it, and no file system or writer could use such a name)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(f"{where}: {what} {ascii(text)[:120]}: expected valid Unicode, found a lone "
                              f"surrogate escape") from None


def _brief(value: Any) -> str:
    """A short rendering of a (JSON) value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not JSON, a 5000-digit int, very deep nesting
        text = f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------------------
# checkpoints (a file, a directory with model.safetensors, or a sharded index)


class Checkpoint:
    """The tensors of an HF-style checkpoint, over one or several SafetensorsFile shards."""

    def __init__(self, path: Path, files: list[SafetensorsFile], file_of: dict[str, SafetensorsFile],
                 index: dict[str, Any] | None = None):
        self.path = path
        self._files = files
        self._file_of = file_of
        #: The parsed index JSON for a sharded checkpoint, else None.
        self.index = index

    @property
    def files(self) -> list[Path]:
        """The safetensors files, in the order they were opened."""
        return [f.path for f in self._files]

    @property
    def metadata(self) -> dict[str, str]:
        """`__metadata__` of the first file (transformers writes the same into every shard)."""
        return self._files[0].metadata if self._files else {}

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._file_of)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._file_of[name]
        except (KeyError, TypeError):
            raise CheckpointError(f"{self.path}: expected a tensor named {name!r}, found none "
                                  f"({len(self._file_of)} tensors in the checkpoint)") from None

    def file_of(self, name: str) -> Path:
        """The file that holds `name`."""
        return self._file(name).path

    def info(self, name: str) -> TensorInfo:
        return self._file(name).info(name)

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """See `SafetensorsFile.get`."""
        return self._file(name).get(name, rows=rows)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, name)

    def drop_pages(self) -> None:
        """See `SafetensorsFile.drop_pages`."""
        for f in self._files:
            f.drop_pages()

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._files)} files, {len(self._file_of)} tensors)"


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Opens a .safetensors file, or a directory holding `model.safetensors` (preferred, as in
    transformers), `model.safetensors.index.json` with its shards, or exactly one other *.safetensors.

    A sharded index is validated up front: every shard exists and every name in `weight_map` is in
    the shard it names, and every tensor of a shard is listed in `weight_map` for that shard.
    Every file read must be a regular file (in a directory: one inside it, see `safe_files`).
    """
    path = Path(path)
    if not path.is_dir():
        if not os.path.lexists(path):
            raise CheckpointError(f"{path}: expected a safetensors file or a checkpoint directory, found no "
                                  f"such path")
        return _open_single(path, None)
    if os.path.lexists(path / SINGLE_FILE):
        return _open_single(path / SINGLE_FILE, path)
    if os.path.lexists(path / INDEX_FILE):
        return _open_sharded(path / INDEX_FILE)
    candidates = sorted(p.name for p in path.glob("*.safetensors"))
    if len(candidates) == 1:
        return _open_single(path / candidates[0], path)
    found = f"{len(candidates)} other .safetensors files ({', '.join(candidates[:4])})" if candidates else "none"
    raise CheckpointError(f"{path}: expected {SINGLE_FILE} or {INDEX_FILE} in the directory, found {found}")


def _open_single(path: Path, root: Path | None) -> Checkpoint:
    f = SafetensorsFile(path, root)
    return Checkpoint(path, [f], {name: f for name in f.keys()})


_SHARD_NAME = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


def _check_all_shards_listed(index_path: Path, listed: set) -> None:
    """A shard of the series the index names (`P-0000i-of-0000N.safetensors`) that the index does not list
    would be silently dropped: an error. (Other .safetensors files, e.g. `consolidated.safetensors`, are
    another copy of the model and stay ignored, as transformers ignores them.)"""
    series = {(m.group(1), m.group(3)) for m in map(_SHARD_NAME.fullmatch, map(str, listed)) if m}
    for p in sorted(index_path.parent.glob("*.safetensors")):
        m = _SHARD_NAME.fullmatch(p.name)
        if m and (m.group(1), m.group(3)) in series and p.name not in listed:
            raise CheckpointError(f"{index_path}: expected every shard of the series in the weight_map, found "
                                  f"{p.name} next to it but not listed")


def _open_sharded(index_path: Path) -> Checkpoint:
    index = read_json(index_path, index_path.parent)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: expected an object with a 'weight_map' object, found "
                              f"{_brief(index)}")
    if not weight_map:
        raise CheckpointError(f"{index_path}: expected a weight_map naming the checkpoint's tensors, found it empty")
    root = index_path.parent
    _check_all_shards_listed(index_path, {v for v in weight_map.values() if isinstance(v, str)})
    shards: dict[str, SafetensorsFile] = {}
    file_of: dict[str, SafetensorsFile] = {}
    try:
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(f"{index_path}: tensor {name!r}: expected a shard file name inside "
                                      f"the directory, found {_brief(shard)}")
            if shard not in shards:
                if not os.path.lexists(root / shard):
                    raise CheckpointError(f"{index_path}: tensor {name!r}: expected shard file {shard!r} "
                                          f"next to the index, found no such file")
                shards[shard] = SafetensorsFile(root / shard, root)
            if name not in shards[shard]:
                raise CheckpointError(f"{index_path}: tensor {name!r}: expected in shard {shard!r} as the "
                                      f"weight_map says, found it missing from {root / shard}")
            file_of[name] = shards[shard]
        for shard, f in shards.items():  # a tensor the index does not list would be silently dropped
            unlisted = [k for k in f.keys() if weight_map.get(k) != shard]
            if unlisted:
                raise CheckpointError(f"{root / shard}: tensor {unlisted[0]!r}: expected every tensor of the shard "
                                      f"in the index's weight_map, found {len(unlisted)} missing from "
                                      f"{index_path.name} or mapped to another shard")
    except BaseException:
        for f in shards.values():
            f.close()
        raise
    return Checkpoint(index_path.parent, list(shards.values()), file_of, index)


# --------------------------------------------------------------------------------------------------
# writer: tensors -> safetensors bytes (the shard writer, converters.formats.shard_writer, builds on these)


class EncodedTensor(NamedTuple):
    """One tensor as a safetensors file stores it: its name, header entry, and bytes (1-D uint8, packed
    little-endian; `data.size == info.nbytes`)."""

    name: str
    info: TensorInfo
    data: np.ndarray


def tensor_info(dtype: Any, shape: Any, *, where: str, name: str) -> TensorInfo:
    """The header entry of a tensor of numpy `dtype` (ml_dtypes included) and `shape`.

    float32 -> F32, bfloat16 -> BF16, float8_e4m3fn -> F8_E4M3, float4_e2m1fn -> F4, ...; a sub-byte
    dtype needs `prod(shape) * bits` to be a multiple of 8. CheckpointError (naming `where` and `name`)
    for a dtype safetensors cannot store.
    """
    try:
        dt = np.dtype(dtype)
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: tensor {name!r}: expected a numpy dtype and a shape, found "
                              f"{type(e).__name__}: {e}") from None
    code = _CODE_OF_NUMPY.get(dt.name)
    if code is None:
        raise CheckpointError(f"{where}: tensor {name!r}: expected a dtype safetensors stores "
                              f"({', '.join(sorted(_CODE_OF_NUMPY))}), found {dt}")
    if any(d < 0 for d in dims):
        raise CheckpointError(f"{where}: tensor {name!r}: expected a shape of non-negative ints, found {list(dims)}")
    bits = DTYPES[code].bits
    if math.prod(dims) * bits % 8:
        raise CheckpointError(f"{where}: tensor {name!r}: {math.prod(dims)} {code} elements do not fill whole "
                              f"bytes; expected a multiple of {8 // math.gcd(8, bits)}")
    return TensorInfo(code, dims)


def encode_tensor(name: Any, array: Any, *, where: str) -> EncodedTensor:
    """`array` (anything np.asarray takes) as safetensors stores it: dtype via `tensor_info`, bytes
    little-endian row-major, sub-byte codes packed densely (element 2i in the low nibble for F4, four
    6-bit codes per 3 bytes for F6_*). The bytes view `array` where no conversion is needed."""
    if not isinstance(name, str):
        raise CheckpointError(f"{where}: expected tensor names to be str, found {name!r}")
    if name == "__metadata__":
        raise CheckpointError(f"{where}: '__metadata__' is reserved for the header, not a tensor name")
    try:
        name.encode("utf-8")
        arr = np.asarray(array)
    except (UnicodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: tensor {name!r}: expected an array, found {type(e).__name__}: {e}") from None
    info = tensor_info(arr.dtype, arr.shape, where=where, name=name)
    bits = DTYPES[info.dtype].bits
    if bits < 8:
        data = _pack(np.ascontiguousarray(arr).reshape(-1).view(np.uint8), bits)
    else:
        order = arr.dtype.byteorder
        if bits > 8 and (order == ">" or (order == "=" and not _LITTLE_HOST)):
            if arr.dtype.isbuiltin != 2:  # numpy type (2 = user-defined, i.e. ml_dtypes)
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            else:  # ml_dtypes (native order only) on a big-endian host: swap the raw words
                arr = np.ascontiguousarray(arr).view(f"=u{arr.dtype.itemsize}").astype(f"<u{arr.dtype.itemsize}")
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return EncodedTensor(name, info, data)


def header_bytes(entries: Sequence[tuple[str, TensorInfo]], metadata: Mapping[str, str] | None, *,
                 where: str) -> bytes:
    """The first bytes of a safetensors file whose data section holds `entries` back to back, in order:
    the 8-byte little-endian length N, then N bytes of JSON (`__metadata__` first, its keys sorted;
    offsets [sum of previous nbytes, + nbytes]) padded with spaces to a multiple of 8."""
    header: dict[str, Any] = {}
    if metadata is not None:
        if not (isinstance(metadata, Mapping)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise CheckpointError(f"{where}: expected metadata to map str to str, found {metadata!r:.80}")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name, info in entries:
        if name in header:
            raise CheckpointError(f"{where}: expected unique tensor names, found {name!r} twice")
        header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    try:
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeError as e:
        raise CheckpointError(f"{where}: expected names and metadata encodable as UTF-8, found {e}") from None
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def serialize(tensors: Sequence[EncodedTensor], metadata: Mapping[str, str] | None, *, where: str) -> list[Any]:
    """A whole safetensors file as a list of buffers to write in turn: `header_bytes`, then each tensor's
    data, tensors in safetensors' order (descending dtype rank, then name), as `safetensors.numpy.save_file`
    lays them out."""
    # Python str order == Rust's UTF-8 byte order.
    tensors = sorted(tensors, key=lambda t: (-_RANK[t.info.dtype], t.name))
    chunks: list[Any] = [header_bytes([(t.name, t.info) for t in tensors], metadata, where=where)]
    chunks.extend(t.data.data for t in tensors if t.data.size)
    return chunks


def save_file(tensors: Mapping[str, Any], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (numpy / ml_dtypes arrays, or anything np.asarray takes) as a safetensors file.

    Byte-identical to `safetensors.numpy.save_file` (for metadata with at most one key; the reference
    orders several keys by hash, we sort them). ml_dtypes float8 / bfloat16 map to F8_E4M3, F8_E5M2,
    F8_E8M0, BF16, ...; float4_e2m1fn / float6_* arrays are packed into F4 / F6_*. Atomic: a temp file
    in the same directory, fsynced, renamed over `path`.
    """
    path = Path(path)
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"{path}: expected a mapping of name -> array, found {type(tensors).__name__}")
    chunks = serialize([encode_tensor(k, v, where=str(path)) for k, v in tensors.items()], metadata, where=str(path))
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        # os.open with 0o666 lets the umask decide the final mode, as for a plain open().
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CheckpointError(f"{path}: cannot write the file ({e.strerror or e})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
