"""A shard writer that streams: the tensor list (names, dtypes, shapes) is planned up front, so every shard's
header is written before its data and each tensor goes to disk the moment it is produced (no shard buffer).

Same file naming as `ShardedWriter` (`model.safetensors`, or `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`); inside a file, tensors lie in the planned order (readers go by the header's
offsets). Peak memory is one tensor, whatever `max_shard_size` is.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, List, NamedTuple, Sequence, Tuple

import numpy as np

from converters.safetensors_io import DTYPES, INDEX_FILE, SINGLE_FILE, _CODE_OF_NUMPY, _header, _prepare, _Prepared, \
    parse_size
from qformats.errors import CheckpointError

__all__ = ["PlannedShardWriter", "TensorSpec"]


class TensorSpec(NamedTuple):
    name: str
    dtype: np.dtype
    shape: Tuple[int, ...]


class _Size(NamedTuple):
    size: int


class PlannedShardWriter:
    """Write exactly the planned tensors, in the planned order; shards of at most `max_shard_size` bytes of
    data (a larger tensor gets a shard of its own). `finish` renames the partial files into place and writes
    the index; `abort` (or an exception inside `with`) removes them."""

    def __init__(self, dst_dir: "str | os.PathLike", plan: Sequence[TensorSpec], max_shard_size: "int | str" = "5GB",
                 metadata=None):
        self.dst_dir = Path(dst_dir)
        limit = parse_size(max_shard_size)
        self.metadata = metadata
        names = [s.name for s in plan]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"{self.dst_dir}: expected unique tensor names, found duplicates {dup[:5]}")
        shards: List[List[_Prepared]] = [[]]
        size = 0
        for s in plan:
            code = _CODE_OF_NUMPY.get(np.dtype(s.dtype).name)
            if code is None:
                raise CheckpointError(f"{self.dst_dir}: tensor {s.name!r}: dtype {s.dtype} cannot be stored")
            nbytes = int(np.prod(s.shape, dtype=np.int64)) * DTYPES[code].bits // 8
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append(_Prepared(s.name, code, tuple(int(d) for d in s.shape), _Size(nbytes)))
            size += nbytes
        self._shards = shards
        self._flat = [(i, t) for i, sh in enumerate(shards) for t in sh]
        self._pos = 0
        self._file = None
        self._file_index = -1
        self._partials: List[Path] = []
        self._done = False
        self.total_size = sum(t.data.size for _, t in self._flat)

    def _open(self, i: int) -> None:
        self._close()
        part = self.dst_dir / f".shard-{i + 1:05d}.{uuid.uuid4().hex[:8]}.partial"
        try:
            self._file = open(part, "wb")
        except OSError as e:
            raise CheckpointError(f"{part}: cannot create it ({e.strerror or e})") from None
        self._partials.append(part)
        self._file_index = i
        header = _header(str(part), self._shards[i], self.metadata)
        self._file.write(len(header).to_bytes(8, "little"))
        self._file.write(header)

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    @property
    def next_name(self) -> str | None:
        return self._flat[self._pos][1].name if self._pos < len(self._flat) else None

    def write(self, name: str, array: Any) -> None:
        """Write the next planned tensor; its name, dtype and shape must be the planned ones."""
        if self._pos >= len(self._flat):
            raise CheckpointError(f"{self.dst_dir}: tensor {name!r}: all planned tensors are already written")
        i, spec = self._flat[self._pos]
        t = _prepare(str(self.dst_dir), name, array)
        if (t.name, t.code, t.shape) != (spec.name, spec.code, spec.shape):
            raise CheckpointError(f"{self.dst_dir}: expected tensor {spec.name!r} {spec.code} {list(spec.shape)} next, "
                                  f"found {t.name!r} {t.code} {list(t.shape)}")
        if i != self._file_index:
            self._open(i)
        try:
            if t.data.size:
                self._file.write(t.data.data)
        except OSError as e:
            raise CheckpointError(f"{self._partials[-1]}: cannot write tensor {name!r} ({e.strerror or e})") from None
        self._pos += 1

    add = write  # the ShardedWriter spelling

    def finish(self) -> List[Path]:
        if self._pos != len(self._flat):
            raise CheckpointError(f"{self.dst_dir}: expected {len(self._flat)} tensors, {self._pos} written "
                                  f"(next: {self.next_name!r})")
        if not self._flat:  # an empty checkpoint: one empty file, as ShardedWriter writes
            self._open(0)
        self._close()
        self._done = True
        if len(self._partials) == 1:
            final = self.dst_dir / SINGLE_FILE
            os.replace(self._partials[0], final)
            return [final]
        count = len(self._partials)
        weight_map = {}
        written = []
        for i, part in enumerate(self._partials):
            final = self.dst_dir / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(part, final)
            written.append(final)
            weight_map.update((t.name, final.name) for t in self._shards[i])
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.dst_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [*written, self.dst_dir / INDEX_FILE]

    def abort(self) -> None:
        self._done = True
        with contextlib.suppress(OSError):
            if self._file is not None:
                self._file.close()
        self._file = None
        for p in self._partials:
            with contextlib.suppress(OSError):
                os.unlink(p)

    def __enter__(self) -> "PlannedShardWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            if not self._done:
                self.finish()
        elif not self._done:
            self.abort()
