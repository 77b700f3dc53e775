"""The checkpoint writer: safetensors shards, their index, config.json and other files, moved into place at once.

Everything is written into a hidden temp directory next to the destination
(`.<name>.tmp-<host>-<pid>-<random>`); `finish` renames that directory to the destination in one step, so
a reader, or a crash at any point, sees either no checkpoint (or the old one, when overwriting) or the
complete new one, never a part. Overwriting swaps the two directories atomically (Linux `renameat2`
with RENAME_EXCHANGE; elsewhere the old directory is renamed aside first and put back if the second
rename fails) and only then deletes the old one.

Hostile destinations and interruptions:
  - the source(s) being read are given to the writer (`sources=`), and a destination that is a source, lies
    inside one or holds one (resolved, links followed) is refused before anything is written
    (`converters.formats.safe_files.check_destination`), with or without `overwrite`;
  - one writer at a time per destination: a lock file `.<name>.lock` beside it, held with `flock` from the
    start to the final rename; a second writer gets a CheckpointError at once;
  - SIGTERM and SIGHUP are handled like SIGINT while a writer is open (a KeyboardInterrupt, so the temp
    directory is removed and the old checkpoint stays), unless the program installed its own handler
    (or ignores SIGHUP); a signal that arrives during the final renames takes effect after them;
  - the temp directories a killed writer leaves behind (its host and PID are in the name) are removed by
    the next writer into the same parent folder on the same host once that process is gone.

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
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, Sequence

try:
    import fcntl
except ImportError:  # not POSIX: the lock file is created with O_EXCL instead
    fcntl = None  # type: ignore[assignment]

from converters.formats.safe_files import check_destination, copy_extra_files
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
      sources: the paths the checkpoint is made from (directories or files); `dst` may be none of them,
        nor lie inside or hold one of them.
      max_shard_size: bytes, or a string such as "5GB" or "500MiB" (see `parse_size`).
      metadata: the safetensors `__metadata__` of every shard (e.g. {"format": "pt"}).

    Every error is a CheckpointError naming the file; after an error, `abort` (or leaving the `with`
    block by the exception) removes the temp directory. Use as a context manager: it finishes on success
    and aborts on an exception.
    """

    def __init__(self, dst: str | os.PathLike, max_shard_size: int | str = "5GB", *, overwrite: bool = False,
                 plan: Sequence[TensorSpec] | None = None, metadata: dict[str, str] | None = None,
                 sources: Sequence[str | os.PathLike] = ()):
        self.dst = Path(dst)
        if isinstance(sources, (str, os.PathLike)):
            sources = (sources,)
        check_destination(self.dst, sources)
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
        self._lock: _Lock | None = None
        self._signals: _Signals | None = None
        if plan is not None:
            self._plan = self._layout(plan)
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.dst}: cannot create a temp directory next to it ({e.strerror or e})"
                                  ) from None
        self._lock = _Lock(self.dst)
        try:
            _remove_stale(self.dst)
            if _occupied(self.dst) and not self.overwrite:
                raise CheckpointError(f"{self.dst}: expected a new path for the checkpoint, found it exists "
                                      f"(pass overwrite=True to replace it)")
            tag = f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            tmp = self.dst.with_name(f".{self.dst.name}.tmp-{tag}")
            self._aside = self.dst.with_name(f".{self.dst.name}.old-{tag}")  # the old dst, where no atomic swap
            try:
                tmp.mkdir(0o777)  # the umask applies, as for a plain mkdir
            except OSError as e:
                raise CheckpointError(f"{self.dst}: cannot create a temp directory next to it "
                                      f"({e.strerror or e})") from None
        except BaseException:
            self._lock.release()
            raise
        self._tmp = tmp
        self._signals = _Signals()

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
        names and names already added, under `converters.formats.safe_files.copy_extra_files`' rules (regular files,
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
            with self._signals.deferred():
                _commit(self._tmp, self.dst, self.overwrite, self._aside, self._lock.release)
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        self._close()
        return [self.dst / p.name for p in paths]

    def _close(self) -> None:
        """Releases the lock and the signal handlers; a signal deferred during the renames is raised now."""
        if self._lock is not None:
            self._lock.release()
        if self._signals is not None:
            self._signals.restore()

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
        if self._signals is not None:
            self._signals.pending = None  # interrupted already: this abort is the interruption's effect
        self._close()

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


def _commit(tmp: Path, dst: Path, overwrite: bool, aside: Path, release=lambda: None) -> None:
    """Moves the finished directory `tmp` to `dst` in one rename; an existing `dst` (with `overwrite`) is
    swapped out atomically where the OS allows (else renamed to `aside` first), then deleted; `release`
    (the lock) is called before the parent directory is made durable."""
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
        release()
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


_STALE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{12}")
_LOCK = re.compile(r"\.(?P<name>.+)\.lock")


def _dead(host: str, pid: str) -> bool:
    """True for a writer of this host whose process is gone."""
    return host == _HOST and int(pid) != os.getpid() and not _alive(int(pid))


def _remove_stale(dst: Path) -> None:
    """Removes what writers into `dst`'s parent folder left when killed, where their process (on this host)
    is gone: temp directories, lock files no one holds, and -- put back at its name when nothing is there --
    an old checkpoint such a writer had renamed aside (`.old-`, only where no atomic swap exists)."""
    try:
        entries = sorted(os.scandir(dst.parent), key=lambda e: e.name) if dst.parent.is_dir() else []
    except OSError:
        return
    for entry in entries:
        m = _STALE.fullmatch(entry.name)
        if m is None:
            lock = _LOCK.fullmatch(entry.name)
            if lock is not None and lock.group("name") != dst.name:
                _Lock.remove_stale(Path(entry.path))
            continue
        if not _dead(m.group("host"), m.group("pid")):
            continue
        path = Path(entry.path)
        target = dst.with_name(m.group("name"))
        if m.group("kind") == "old" and not (target.exists() or target.is_symlink()):
            try:
                os.rename(path, target)
            except OSError as e:
                if target == dst:  # another destination's: its own next writer retries
                    raise CheckpointError(f"{dst}: cannot restore the checkpoint a stopped writer left at {path} "
                                          f"({e.strerror or e})") from None
        else:
            _remove(path)


class _Lock:
    """One writer per destination: `.<name>.lock` beside `dst`, held with flock (released by the kernel when
    the process dies, so a killed writer never blocks the next one) and unlinked on release. The file holds
    `<host> <pid>` of its writer, so that a writer into the same folder can remove a dead writer's lock."""

    def __init__(self, dst: Path):
        self.path = dst.with_name(f".{dst.name}.lock")
        self.fd: int | None = None
        for _ in range(16):  # the file can be unlinked between our open and our flock: then try again
            fd = self._open()
            if fd is None:
                continue
            if not self._try_lock(fd):
                os.close(fd)
                raise CheckpointError(f"{dst}: expected no other writer to this destination, found one writing it "
                                      f"(it holds the lock {self.path}); wait for it to finish or choose another "
                                      f"destination")
            if self._current(fd):
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{_HOST} {os.getpid()}\n".encode())
                self.fd = fd
                return
            os.close(fd)
        raise CheckpointError(f"{dst}: cannot take the lock {self.path}: it keeps being replaced")

    def _open(self) -> int | None:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        if fcntl is None:
            flags |= os.O_EXCL
        try:
            return os.open(self.path, flags, 0o666)
        except FileExistsError:  # no flock: the file is the lock
            if _Lock.remove_stale(self.path):
                return None
            raise CheckpointError(f"{self.path.with_name(self.path.name[1:-5])}: expected no other writer to this "
                                  f"destination, found its lock {self.path}") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot create the writer's lock file ({e.strerror or e})") from None

    @staticmethod
    def _try_lock(fd: int) -> bool:
        if fcntl is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise CheckpointError(f"cannot lock a writer's lock file ({e.strerror or e})") from None
        return True

    def _current(self, fd: int) -> bool:
        """True when `fd` is still the file at `self.path` (not one unlinked after we opened it)."""
        try:
            a, b = os.fstat(fd), os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    @staticmethod
    def remove_stale(path: Path) -> bool:
        """Unlinks lock file `path` when its writer (this host) is dead and no one holds it; True if removed."""
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            if fcntl is not None and not _Lock._try_lock(fd):
                return False
            owner = os.read(fd, 64).decode("ascii", "replace").split()
            if len(owner) != 2 or not owner[1].isdigit() or not _dead(owner[0], owner[1]):
                return False
            os.unlink(path)
            return True
        except (OSError, CheckpointError):
            return False
        finally:
            os.close(fd)

    def release(self) -> None:
        """Unlinks the lock file, then lets it go (in that order, so that no one locks an unlinked file in
        the meantime and believes it holds the lock); a second call does nothing."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(fd)


class _Signals:
    """While a writer is open: SIGTERM and SIGHUP raise KeyboardInterrupt, as SIGINT does, where the program
    left them at their defaults (so the writer's `with` block removes the temp directory and `dst` keeps the
    old checkpoint); inside `deferred()` (the final renames) any of the three is held back until `restore`.
    Only the main thread can install signal handlers; elsewhere nothing changes."""

    def __init__(self):
        self.prev: dict[int, Any] = {}
        self.pending: int | None = None
        self._defer = False
        if threading.current_thread() is not threading.main_thread():
            return
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            cur = signal.getsignal(sig)
            if cur is (signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL):
                self.prev[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._defer:
            self.pending = signum
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def deferred(self):
        self._defer = True
        try:
            yield
        finally:
            self._defer = False

    def restore(self) -> None:
        prev, self.prev = self.prev, {}
        for sig, handler in prev.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)
        pending, self.pending = self.pending, None
        if pending is not None:
            raise KeyboardInterrupt(signal.Signals(pending).name)
