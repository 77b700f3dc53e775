"""The checkpoint writer: safetensors shards, their index, config.json and other files, moved into place at once.

Everything is written into a hidden temp directory next to the destination
(`.<name>.tmp-<host>-<pid>-<random>`); `finish` renames that directory to the destination in one step, so
a reader, or a crash at any point, sees either no checkpoint (or the old one, when overwriting) or the
complete new one, never a part. Overwriting swaps the two directories atomically (Linux `renameat2`
with RENAME_EXCHANGE; elsewhere the old directory is renamed aside first and put back if the second
rename fails) and only then deletes the old one. The temp directories that a killed writer leaves behind
are removed by the next writer to the same destination on the same host once their process is gone.

Shard naming as transformers writes it: one `model.safetensors`, or `model-0000i-of-0000N.safetensors`
plus `model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, Sequence

from converters.formats.safe_files import copy_extra_files
from converters.formats.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    EncodedTensor,
    TensorInfo,
    encode_tensor,
    header_bytes,
    parse_size,
    serialize,
    tensor_info,
)
from qformats.errors import CheckpointError

__all__ = ["ShardedWriter", "TensorSpec"]

_HOST = hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


class TensorSpec(NamedTuple):
    """A planned tensor: its name, numpy dtype (ml_dtypes included) and shape."""

    name: str
    dtype: Any
    shape: tuple[int, ...]


class ShardedWriter:
    """Writes a checkpoint directory at `dst`: tensors in safetensors shards of at most `max_shard_size`
    bytes of data each (a larger tensor gets a shard of its own), the index when there is more than one
    shard, and any JSON or other files; `finish` moves it all into place at once.

    Two modes:
      - default: `add` keeps the current shard's arrays (by reference: do not mutate them until written)
        and writes the shard when the next tensor would overflow it; inside a shard, tensors lie in
        safetensors' order (as `save_file` writes them).
      - `plan=[TensorSpec(name, dtype, shape), ...]`: the tensor list is known up front, so every shard's
        header is written before its data and each `add` goes straight to disk (peak memory: one tensor,
        whatever the shard size). `add` must follow the plan's order, names, dtypes and shapes; tensors
        lie in planned order.

    Args:
      dst: the checkpoint directory to create. It must not exist (an empty directory is fine) unless
        `overwrite`; with `overwrite`, whatever is there stays intact until the new checkpoint is complete.
      max_shard_size: bytes, or a string such as "5GB" or "500MiB" (see `parse_size`).
      metadata: the safetensors `__metadata__` of every shard (e.g. {"format": "pt"}).

    Every error is a CheckpointError naming the file; after an error, `abort` (or leaving the `with`
    block by the exception) removes the temp directory. Use as a context manager: it finishes on success
    and aborts on an exception.
    """

    def __init__(self, dst: str | os.PathLike, max_shard_size: int | str = "5GB", *, overwrite: bool = False,
                 plan: Sequence[TensorSpec] | None = None, metadata: dict[str, str] | None = None):
        self.dst = Path(dst)
        self.max_shard_size = parse_size(max_shard_size)
        self.overwrite = bool(overwrite)
        header_bytes([], metadata, where=str(self.dst))  # checks metadata (str -> str) before any work
        self.metadata = dict(metadata) if metadata is not None else None
        self._names: set[str] = set()
        self._files: set[str] = set()  # non-tensor files added
        self._total_size = 0
        self._shards: list[tuple[Path, list[str]]] = []  # written (or open) shard file, names in it
        self._current: list[EncodedTensor] = []  # default mode: the shard being filled
        self._current_size = 0
        self._plan: list[list[tuple[str, TensorInfo]]] | None = None  # planned mode: shards of entries
        self._pos = 0  # planned mode: tensors written
        self._file: BinaryIO | None = None  # planned mode: the shard being written
        self._state = "open"
        if plan is not None:
            self._plan = self._layout(plan)
        _remove_stale(self.dst)
        if _occupied(self.dst) and not self.overwrite:
            raise CheckpointError(f"{self.dst}: expected a new path for the checkpoint, found it exists "
                                  f"(pass overwrite=True to replace it)")
        tag = f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        tmp = self.dst.with_name(f".{self.dst.name}.tmp-{tag}")
        self._aside = self.dst.with_name(f".{self.dst.name}.old-{tag}")  # the old dst, where no atomic swap
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(0o777)  # the umask applies, as for a plain mkdir
        except OSError as e:
            raise CheckpointError(f"{self.dst}: cannot create a temp directory next to it ({e.strerror or e})"
                                  ) from None
        self._tmp = tmp

    # -- tensors ----------------------------------------------------------------------------------------

    def _layout(self, plan: Sequence[TensorSpec]) -> list[list[tuple[str, TensorInfo]]]:
        shards: list[list[tuple[str, TensorInfo]]] = [[]]
        size = 0
        for spec in plan:
            try:
                name, dtype, shape = spec
            except (TypeError, ValueError):
                raise CheckpointError(f"{self.dst}: plan: expected (name, dtype, shape) entries, found "
                                      f"{spec!r:.80}") from None
            if not isinstance(name, str) or name == "__metadata__":
                raise CheckpointError(f"{self.dst}: plan: expected tensor names to be str other than "
                                      f"'__metadata__', found {name!r}")
            info = tensor_info(dtype, shape, where=str(self.dst), name=name)
            if name in self._names:
                raise CheckpointError(f"{self.dst}: plan: expected unique tensor names, found {name!r} twice")
            self._names.add(name)
            if shards[-1] and size + info.nbytes > self.max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append((name, info))
            size += info.nbytes
            self._total_size += info.nbytes
        return shards

    @property
    def next_name(self) -> str | None:
        """Planned mode: the name `add` expects next (None once all are written, or without a plan)."""
        if self._plan is None:
            return None
        flat = [name for shard in self._plan for name, _ in shard]
        return flat[self._pos] if self._pos < len(flat) else None

    def add(self, name: str, array: Any) -> None:
        """Adds tensor `name` (any array np.asarray takes, ml_dtypes included; see `encode_tensor`)."""
        self._check_open(f"tensor {name!r}")
        t = encode_tensor(name, array, where=str(self.dst))
        if self._plan is not None:
            self._add_planned(t)
            return
        if name in self._names:
            raise CheckpointError(f"{self.dst}: tensor {name!r}: expected unique names, found it added twice")
        if self._current and self._current_size + t.data.size > self.max_shard_size:
            self._flush()
        self._names.add(name)
        self._current.append(t)
        self._current_size += t.data.size
        self._total_size += t.data.size

    def _flush(self) -> None:
        part = self._tmp / f"shard-{len(self._shards) + 1:05d}.partial"
        self._shards.append((part, [t.name for t in self._current]))
        _write(part, serialize(self._current, self.metadata, where=str(part)))
        self._current, self._current_size = [], 0

    def _add_planned(self, t: EncodedTensor) -> None:
        assert self._plan is not None
        at = 0
        for i, shard in enumerate(self._plan):
            if self._pos < at + len(shard):
                name, info = shard[self._pos - at]
                first, last = self._pos == at, self._pos == at + len(shard) - 1
                break
            at += len(shard)
        else:
            raise CheckpointError(f"{self.dst}: tensor {t.name!r}: expected no more tensors, found all "
                                  f"{self._pos} planned ones already written")
        if (t.name, t.info) != (name, info):
            raise CheckpointError(f"{self.dst}: expected tensor {name!r} {info.dtype} {list(info.shape)} next, "
                                  f"found {t.name!r} {t.info.dtype} {list(t.info.shape)}")
        if first:
            self._open_planned(i)
        path = self._shards[-1][0]
        try:
            if t.data.size:
                self._file.write(t.data.data)
            self._file.flush()  # to the OS now: the caller may drop the array
        except OSError as e:
            raise CheckpointError(f"{path}: cannot write tensor {name!r} ({e.strerror or e})") from None
        self._pos += 1
        if last:
            self._close_planned()

    def _open_planned(self, i: int) -> None:
        assert self._plan is not None
        path = self._tmp / _shard_name(i, len(self._plan))
        self._shards.append((path, [name for name, _ in self._plan[i]]))
        header = header_bytes(self._plan[i], self.metadata, where=str(path))
        try:
            self._file = open(path, "xb")
            self._file.write(header)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot write the shard ({e.strerror or e})") from None

    def _close_planned(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                with f:
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise CheckpointError(f"{self._shards[-1][0]}: cannot write the shard ({e.strerror or e})") from None

    # -- other files ------------------------------------------------------------------------------------

    def add_file(self, filename: str, data: bytes | str) -> Path:
        """Writes `data` (str as UTF-8) as `filename` in the checkpoint directory; returns its final path.

        `filename` is a plain name (no directories, not hidden), neither a `.safetensors` file nor the
        index, and added once."""
        self._check_open(f"file {filename!r}")
        self._check_filename(filename)
        if not isinstance(data, (str, bytes, bytearray, memoryview)):
            raise CheckpointError(f"{self.dst / filename}: expected str or bytes to write, found "
                                  f"{type(data).__name__}")
        try:
            raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        except UnicodeEncodeError as e:
            raise CheckpointError(f"{self.dst / filename}: expected text encodable as UTF-8, found {e}") from None
        self._files.add(filename)
        _write(self._tmp / filename, [raw])
        return self.dst / filename

    def add_json(self, filename: str, obj: Any) -> Path:
        """Writes `obj` as `filename`: `json.dump(obj, f, indent=2, sort_keys=True)`, as compressed-tensors
        writes config.json (no trailing newline); returns its final path."""
        try:
            text = json.dumps(obj, indent=2, sort_keys=True)
        except (TypeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{self.dst / str(filename)}: expected a JSON-serializable object, found "
                                  f"{type(e).__name__}: {e}") from None
        return self.add_file(filename, text)

    def copy_extra_files(self, src_dir: str | os.PathLike | None) -> list[str]:
        """Copies the other files of checkpoint directory `src_dir` (tokenizer, generation config, ...):
        every entry except weights (*.safetensors, *.bin, *.pt, *.pth, *.index.json), config.json, hidden
        names and names already added, under `converters.safe_files.copy_extra_files`' rules (regular files,
        real directories and links inside the source only). Returns the names copied, sorted; none when
        `src_dir` is None or not a directory."""
        self._check_open("copying extra files")
        copied = copy_extra_files(src_dir, self._tmp, skip=_not_extra)
        self._files.update(copied)
        return copied

    def _check_filename(self, filename: Any) -> None:
        if not (isinstance(filename, str) and filename and filename not in (".", "..") and "/" not in filename
                and os.sep not in filename and "\0" not in filename and not filename.startswith(".")):
            raise CheckpointError(f"{self.dst}: expected a plain file name (no directories, not hidden), found "
                                  f"{filename!r}")
        if filename.endswith(".safetensors") or filename == INDEX_FILE:
            raise CheckpointError(f"{self.dst / filename}: expected a file other than the weights and their "
                                  f"index (add tensors with add), found a weights file name")
        if filename in self._files:
            raise CheckpointError(f"{self.dst / filename}: expected each file added once, found it added twice")

    # -- finish / abort ---------------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise CheckpointError(f"{self.dst}: {what}: expected an open writer, found it {self._state}")

    def finish(self) -> list[Path]:
        """Writes the last shard and the index, then moves the whole directory to `dst` at once (replacing
        the old one when overwriting); returns the final paths of the shards and index. On any error the
        temp directory is removed and `dst` is as it was."""
        self._check_open("finish")
        try:
            paths = self._finish_files()
            _fsync_dir(self._tmp)
            _commit(self._tmp, self.dst, self.overwrite, self._aside)
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        return [self.dst / p.name for p in paths]

    def _finish_files(self) -> list[Path]:
        if self._plan is not None:
            flat = sum(len(s) for s in self._plan)
            if self._pos != flat:
                raise CheckpointError(f"{self.dst}: expected {flat} planned tensors, found {self._pos} written "
                                      f"(next: {self.next_name!r})")
            if not self._shards:  # an empty plan: one file without tensors
                self._open_planned(0)
                self._close_planned()
        elif self._current or not self._shards:
            self._flush()
        count = len(self._shards)
        finals = []
        for i, (path, _) in enumerate(self._shards):
            final = self._tmp / _shard_name(i, count)
            if path != final:
                try:
                    os.replace(path, final)
                except OSError as e:
                    raise CheckpointError(f"{final}: cannot name the shard ({e.strerror or e})") from None
            finals.append(final)
        if count == 1:
            return finals
        weight_map = {name: final.name for final, (_, names) in zip(finals, self._shards) for name in names}
        index = {"metadata": {"total_size": self._total_size}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _write(self._tmp / INDEX_FILE, [text.encode("utf-8")])
        return [*finals, self._tmp / INDEX_FILE]

    def abort(self) -> None:
        """Removes everything written so far; `dst` is as it was. The writer cannot be used afterwards
        (a second call does nothing)."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._current = []
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            if self._state == "open":
                self.finish()
        else:
            self.abort()


# --------------------------------------------------------------------------------------------------
# files and directories


def _not_extra(name: str) -> bool:
    """Weights, their index and config.json: what `copy_extra_files` leaves to the writer."""
    return (name == "config.json" or name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json")))


def _shard_name(i: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def _write(path: Path, chunks: Sequence[Any]) -> None:
    """Writes a new file from `chunks` and fsyncs it."""
    try:
        with open(path, "xb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the file ({e.strerror or e})") from None


def _fsync_dir(path: Path) -> None:
    # Makes the directory's entries durable before it is renamed; some file systems cannot fsync a
    # directory (EINVAL / EBADF), and then there is nothing more to do.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _occupied(path: Path) -> bool:
    """True when `path` holds something: a file, a link, or a non-empty directory."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return True
    try:
        return path.is_dir() and any(os.scandir(path))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list the directory ({e.strerror or e})") from None


def _exchange(a: Path, b: Path) -> bool:
    """Swaps paths `a` and `b` atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _commit(tmp: Path, dst: Path, overwrite: bool, aside: Path) -> None:
    """Moves the finished directory `tmp` to `dst` in one rename; an existing `dst` (with `overwrite`) is
    swapped out atomically where the OS allows (else renamed to `aside` first), then deleted."""
    try:
        if not _occupied(dst):
            os.rename(tmp, dst)  # replaces an empty directory atomically; refuses a non-empty one
        elif not overwrite:
            raise CheckpointError(f"{dst}: expected a new path for the checkpoint, found it created while writing")
        elif _exchange(tmp, dst):
            _remove(tmp)  # the old checkpoint, now at the temp path
        else:
            os.rename(dst, aside)
            try:
                os.rename(tmp, dst)
            except OSError:
                os.rename(aside, dst)  # put the original back
                raise
            _remove(aside)
        _fsync_dir(dst.parent)
    except OSError as e:
        raise CheckpointError(f"{dst}: cannot move the finished checkpoint into place ({e.strerror or e})"
                              ) from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _remove_stale(dst: Path) -> None:
    """Removes the temp directories of writers to `dst` on this host whose process is gone; an old
    checkpoint that such a writer had renamed aside (`.old-`, only where no atomic swap exists) is put
    back at `dst` when nothing is there."""
    pattern = re.compile(re.escape(f".{dst.name}.") + r"(tmp|old)-([0-9a-f]{8})-(\d+)-[0-9a-f]{12}")
    try:
        entries = sorted(os.scandir(dst.parent), key=lambda e: e.name) if dst.parent.is_dir() else []
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if not m or m.group(2) != _HOST or int(m.group(3)) == os.getpid() or _alive(int(m.group(3))):
            continue
        path = Path(entry.path)
        if m.group(1) == "old" and not (dst.exists() or dst.is_symlink()):
            try:
                os.rename(path, dst)
            except OSError as e:
                raise CheckpointError(f"{dst}: cannot restore the checkpoint a stopped writer left at {path} "
                                      f"({e.strerror or e})") from None
        else:
            _remove(path)
