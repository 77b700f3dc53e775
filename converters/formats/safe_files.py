"""Files of an untrusted checkpoint directory: regular files only, size-capped JSON, copies that stay inside.

A checkpoint directory comes from elsewhere, so none of its entries may make a reader block, read without
end or write outside its destination:
  - a file is checked with stat before it is opened, opened with O_NONBLOCK (a FIFO swapped in meanwhile
    then opens at once instead of waiting for a writer) and checked again with fstat on the descriptor:
    anything but a regular file (FIFO, device such as /dev/zero, socket, directory) is a CheckpointError;
  - a symbolic link may point only inside the checkpoint directory, or into the `blobs/` folder of a
    Hugging Face cache repository when the directory is one of its `snapshots/<revision>/` (the layout
    `huggingface_hub` downloads into: every file there is such a link);
  - JSON is read up to MAX_JSON_BYTES and parsed strictly (no NaN/Infinity, no duplicate keys);
  - `copy_extra_files` copies exactly the bytes a regular file had when it was opened, recurses into real
    sub-directories only, never writes through a link in the destination, and refuses to copy the
    destination (or a directory holding it) into itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Tuple

from qformats.errors import CheckpointError

__all__ = ["MAX_JSON_BYTES", "allowed_roots", "check_destination", "copy_extra_files", "loads_strict", "open_regular",
           "read_quantization_config",
           "read_json"]

#: Largest JSON file (config.json, an index, a tokenizer config) read from a checkpoint: 64 MiB. The
#: weight_map of a 1T-parameter model's index is a few MB.
MAX_JSON_BYTES = 64 * 2**20
_CHUNK = 1 << 20
_KIND = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def _kind(mode: int) -> str:
    for test, name in _KIND:
        if test(mode):
            return name
    return "not a regular file"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def allowed_roots(root: "str | os.PathLike") -> Tuple[str, ...]:
    """The real directories a link in checkpoint directory `root` may point into: `root` itself, and, when
    `root` is `<repo>/snapshots/<revision>` of a Hugging Face cache, `<repo>/blobs`."""
    real = os.path.realpath(root)
    roots = [real]
    parent = os.path.dirname(os.path.abspath(root))
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")))
    return tuple(roots)


def _check_target(path: Path, roots: Optional[Iterable[str]], what: str) -> str:
    """The real path behind `path`, which must lie under one of `roots` (when given)."""
    real = os.path.realpath(path)
    if roots is not None:
        roots = tuple(roots)
        if not any(_inside(real, r) for r in roots):
            raise CheckpointError(f"{path}: expected {what} inside the checkpoint directory {roots[0]}, found a "
                                  f"symbolic link to {real}")
    return real


def open_regular(path: "str | os.PathLike", root: "str | os.PathLike | None" = None, what: str = "a regular file"
                 ) -> Tuple[int, os.stat_result]:
    """Opens `path` read-only without blocking and returns (fd, fstat); the caller closes fd.

    CheckpointError (naming `path`) when it is missing, not a regular file (FIFO, device, socket,
    directory), or -- with `root` -- a link that resolves outside `allowed_roots(root)`.
    """
    path = Path(path)
    real = _check_target(path, allowed_roots(root) if root is not None else None, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        # stat first, so that no device is ever opened (opening one can have effects); fstat after the open
        # closes the window in which the path could be swapped.
        mode = os.stat(real).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: expected {what}, found {_kind(mode)}")
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: expected {what}, found no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: expected {what}, found a directory") from None
    except OSError as e:
        raise CheckpointError(f"{path}: expected {what}, cannot open it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: expected {what}, found {_kind(st.st_mode)}")
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _reject_duplicates(pairs: List[Tuple[str, Any]]) -> dict:
    out = dict(pairs)  # one C-level pass; the Python loop below only runs to name a duplicate
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity and without duplicate keys (a duplicate name would be ambiguous).

    Raises json.JSONDecodeError / ValueError / RecursionError as json does.
    """
    return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)


def read_json(path: "str | os.PathLike", root: "str | os.PathLike | None" = None,
              max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parses a JSON file of a checkpoint (config.json, an index, ...) strictly, reading at most `max_bytes`.

    Any failure -- missing, not a regular file, a link leaving `root`, larger than `max_bytes`, invalid
    UTF-8, invalid or non-strict JSON -- is a CheckpointError naming the file.
    """
    path = Path(path)
    fd, st = open_regular(path, root, "a JSON file")
    try:
        if st.st_size > max_bytes:
            raise CheckpointError(f"{path}: expected a JSON file of at most {max_bytes} bytes, found "
                                  f"{st.st_size} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:  # read(n) allocates n bytes up front: ask for the size + 1
            raw = f.read(st.st_size + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: expected a readable JSON file, found {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # grew after the fstat
        raise CheckpointError(f"{path}: expected a JSON file of at most {max_bytes} bytes, found more")
    try:
        return loads_strict(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: expected UTF-8 JSON, found invalid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: expected JSON, found a syntax error ({e.msg}, line {e.lineno} "
                              f"column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: expected JSON, found {type(e).__name__}: {str(e)[:200]}") from None


def read_quantization_config(path: "str | os.PathLike"):
    """(config, quantization_config, where) of the checkpoint at `path` (a directory, or a file inside one): its
    config.json read strictly (`read_json`), `where` its path for messages. CheckpointError unless config.json is an
    object holding a `quantization_config` object."""
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    where = str(root / "config.json")
    cfg = read_json(root / "config.json")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("quantization_config"), dict):
        raise CheckpointError(f"{where}: expected a JSON object with a quantization_config object")
    return cfg, cfg["quantization_config"], where


def check_destination(dst: "str | os.PathLike", sources: Iterable["str | os.PathLike"]) -> None:
    """Refuses a destination that would overwrite or hold what is being read: CheckpointError when `dst`,
    resolved (links followed, `..` removed), equals one of `sources`, lies inside one, or contains one, or
    names the same file (hard link). Call it before anything is written; `overwrite` makes no difference."""
    dst_real = os.path.realpath(dst)
    for src in sources:
        if src is None:
            continue
        src_real = os.path.realpath(src)
        same = dst_real == src_real
        if not same:
            with contextlib.suppress(OSError):
                same = os.path.samefile(dst_real, src_real)
        if same:
            found = "it is the source"
        elif _inside(dst_real, src_real):
            found = f"it inside the source ({src_real})"
        elif _inside(src_real, dst_real):
            found = f"it holds the source ({src_real})"
        else:
            continue
        raise CheckpointError(f"{dst}: expected a destination apart from the source {src}, found {found}; "
                              f"choose another destination (nothing was written)")


# ---- copying --------------------------------------------------------------------------------------------------
def _copy_file(src: Path, dst: Path, roots: Tuple[str, ...]) -> None:
    fd, st = open_regular(src, None, "a regular file to copy")
    try:
        _check_target(src, roots, "a file to copy")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            out = os.open(dst, flags, 0o666)
        except OSError as e:
            raise CheckpointError(f"{src}: cannot create the copy {dst} ({e.strerror or e})") from None
        try:
            left = st.st_size  # exactly the size it had when opened: a growing file cannot fill the disk
            while left > 0:
                chunk = os.read(fd, min(_CHUNK, left))
                if not chunk:
                    raise CheckpointError(f"{src}: expected {st.st_size} bytes to copy, found the file shrank "
                                          f"while copying")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
                left -= len(chunk)
        except OSError as e:
            raise CheckpointError(f"{src}: cannot copy it to {dst} ({e.strerror or e})") from None
        finally:
            os.close(out)
        with contextlib.suppress(OSError):
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(fd)


def _entries(d: Path) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            yield from sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise CheckpointError(f"{d}: cannot list the directory ({e.strerror or e})") from None


def _copy_tree(src: Path, dst: Path, roots: Tuple[str, ...], dst_real: str, top: bool, skip) -> List[str]:
    copied = []
    for e in _entries(src):
        p = src / e.name
        if e.name.startswith(".") or (top and skip(e.name)) or (dst / e.name).exists() or \
                os.path.islink(dst / e.name):
            continue
        try:
            lst = os.lstat(p)
        except OSError as err:
            raise CheckpointError(f"{p}: cannot stat it ({err.strerror or err})") from None
        if stat.S_ISDIR(lst.st_mode):
            real = os.path.realpath(p)
            if _inside(dst_real, real) or _inside(real, dst_real):
                raise CheckpointError(f"{p}: expected an extra directory to copy, found it holds (or is) the "
                                      f"destination {dst_real}")
            try:
                os.mkdir(dst / e.name)
            except OSError as err:
                raise CheckpointError(f"{dst / e.name}: cannot create it ({err.strerror or err})") from None
            _copy_tree(p, dst / e.name, roots, dst_real, False, skip)
        elif stat.S_ISLNK(lst.st_mode):
            real = _check_target(p, roots, "a file to copy")
            if os.path.isdir(real):
                raise CheckpointError(f"{p}: expected a regular file to copy, found a symbolic link to the "
                                      f"directory {real}")
            _copy_file(p, dst / e.name, roots)
        else:
            _copy_file(p, dst / e.name, roots)
        copied.append(e.name)
    return copied


def copy_extra_files(src_dir: "str | os.PathLike | None", dst_dir: "str | os.PathLike", skip=lambda name: False
                     ) -> List[str]:
    """Copies the entries of checkpoint directory `src_dir` into `dst_dir`; returns the top-level names copied.

    Skipped: names for which `skip(name)` is true (top level only), hidden entries (a leading dot: VCS
    folders, our own temp directories), and names already in `dst_dir`. Everything else must be a regular
    file, a real directory (copied recursively under the same rules) or a link to a regular file inside
    `allowed_roots(src_dir)`; anything else -- FIFO, device, socket, a link leaving the directory or to a
    directory, a directory that holds the destination -- is a CheckpointError naming the entry.
    """
    if src_dir is None or not Path(src_dir).is_dir():
        return []
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_real = os.path.realpath(dst_dir)
    if _inside(dst_real, os.path.realpath(src_dir)) and not any(
            part.startswith(".") for part in Path(os.path.relpath(dst_real, os.path.realpath(src_dir))).parts):
        raise CheckpointError(f"{dst_dir}: expected a destination outside the source checkpoint {src_dir}, found "
                              f"it inside")
    return _copy_tree(src_dir, dst_dir, allowed_roots(src_dir), dst_real, True, skip)
