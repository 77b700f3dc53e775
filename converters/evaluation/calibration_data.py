"""Calibration samples for causal LMs: token-id arrays read from a text, jsonl or .npy file under a token budget.

Sources (by file suffix):

- ``.txt`` (any suffix other than the two below): one sample per non-empty line (lines stripped of their line
  break; blank / whitespace-only lines skipped), tokenized with the model's tokenizer;
- ``.jsonl``: one JSON object per non-empty line with a string field ``"text"``, tokenized likewise;
- ``.npy``: integer token ids, read with ``np.load(..., allow_pickle=False)`` (never unpickled): a 1-D array is
  one token stream cut into consecutive ``seq_len`` windows (a shorter tail is a sample of its own), a 2-D
  array ``[n, T]`` is n samples.

Each sample is truncated to ``seq_len`` tokens. Then, with ``seed``, the samples are shuffled
(``np.random.default_rng(seed).permutation``) and taken in that order until ``max_tokens`` is reached; the last
one taken is cut so that the total is exactly ``max_tokens`` (unless the file holds fewer tokens: then all
are used). ``seed=None`` keeps the file's order.

Bounds (the file is untrusted): the budget is applied while reading -- a text file is read line by line and
only each sample's length kept until the selection is known, a .npy array is memory-mapped and only the
selected windows copied -- so memory follows the samples (at most MAX_SAMPLES) and the budget, not the
file. A file is at most MAX_FILE_BYTES, a line MAX_LINE_BYTES, a JSON line nested at most MAX_JSON_DEPTH, a run
without whitespace in a whole text file (`read_text_file`, the eval / MiniLM calibration text) MAX_WORD_CHARS;
text is strict UTF-8 without lone surrogates; a .npy header is parsed as a plain literal (never evaluated)
and its shape checked against the file size before mapping. Each limit is a CheckpointError naming it.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np

from converters.formats.safe_files import open_regular
from qformats.errors import CheckpointError, ModelError

__all__ = ["load_calibration", "read_text_file", "select_samples", "DEFAULT_SEQ_LEN", "DEFAULT_TOKENS",
           "MAX_FILE_BYTES", "MAX_LINE_BYTES", "MAX_SAMPLES", "MAX_JSON_DEPTH", "MAX_WORD_CHARS", "json_lines",
           "longest_word_at"]

DEFAULT_SEQ_LEN = 512
DEFAULT_TOKENS = 65536
#: Largest calibration or evaluation text / .npy file read: 2 GiB.
MAX_FILE_BYTES = 1 << 31
#: Longest line of a text or .jsonl calibration file: 4 MiB (a 512-token sample is a few KB).
MAX_LINE_BYTES = 4 << 20
#: Most samples (non-empty lines, .npy windows or rows) a calibration file may give: 2^24.
MAX_SAMPLES = 1 << 24
#: Deepest nesting of arrays / objects in a .jsonl line.
MAX_JSON_DEPTH = 64
#: Longest run of characters without whitespace in a text handed to a tokenizer whole (one "word": BPE over a
#: multi-megabyte word takes minutes and gigabytes, and aborts the process once allocation fails).
MAX_WORD_CHARS = 100_000
_NPY_HEADER_BYTES = 1 << 16


def load_calibration(path: "str | os.PathLike", tokenize: Optional[Callable[[str], Sequence[int]]] = None, *,
                     seq_len: int = DEFAULT_SEQ_LEN, max_tokens: Optional[int] = DEFAULT_TOKENS,
                     seed: Optional[int] = 0, vocab_size: Optional[int] = None) -> List[np.ndarray]:
    """Calibration samples from `path` as a list of 1-D int32 token arrays, each of length 1 .. `seq_len`,
    whose lengths sum to min(max_tokens, tokens in the file) (see the module docstring for the formats).

    Args:
      path: a text file, a ``.jsonl`` file or a ``.npy`` array of token ids.
      tokenize: text -> token ids (e.g. ``lambda s: tok.encode(s).ids`` for a `tokenizers.Tokenizer`); required
        for text and jsonl files.
      seq_len: the longest sample, in tokens (>= 1).
      max_tokens: the token budget (>= 1), or None for every sample.
      seed: the shuffling seed (None: the file's order).
      vocab_size: when given, every id of the samples taken must lie in [0, vocab_size).

    Raises:
      CheckpointError: the file is missing, unreadable, malformed (bad JSON, no "text" string, a pickled or
        non-integer array, ...), beyond a limit (file, line, sample count, JSON depth), or gives no tokens.
        ModelError: bad seq_len / max_tokens, ids out of range.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ModelError(f"calibration: seq_len must be a positive int, got {seq_len!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise ModelError(f"calibration: max_tokens must be a positive int or None, got {max_tokens!r}")
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: calibration file not found (expected a text, .jsonl or .npy file)")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise CheckpointError(f"{p}: calibration file of {p.stat().st_size} bytes exceeds {MAX_FILE_BYTES}")
    if p.suffix == ".npy":
        lengths, get = _npy_samples(p, seq_len)
    else:
        if tokenize is None:
            raise ModelError(f"{p}: a text calibration file needs a tokenizer (the model has none); give token "
                             "ids as a .npy file instead")
        lengths, get = _text_samples(p, tokenize, seq_len)
    if not lengths:
        raise CheckpointError(f"{p}: no calibration tokens (empty file, or only blank lines)")
    picked = _select(lengths, max_tokens, seed)
    fetched = get(sorted({i for i, _ in picked}))
    out = []
    for i, n in picked:
        s = fetched[i]
        if vocab_size is not None and s.size and (s.min() < 0 or s.max() >= vocab_size):
            raise ModelError(f"{p}: sample {i} has token ids outside [0, {vocab_size}) "
                             f"(min {int(s.min())}, max {int(s.max())})")
        out.append(s.astype(np.int32)[:n])
    return out


def _select(lengths: Sequence[int], max_tokens: Optional[int], seed: Optional[int]) -> List[tuple]:
    """(sample index, tokens taken) in `select_samples`' order and cuts, from the lengths alone."""
    order = np.arange(len(lengths)) if seed is None else np.random.default_rng(seed).permutation(len(lengths))
    out, total = [], 0
    for i in order:
        n = lengths[int(i)]
        if max_tokens is not None:
            if total >= max_tokens:
                break
            n = min(n, max_tokens - total)
        out.append((int(i), n))
        total += n
    return out


def select_samples(samples: Sequence[np.ndarray], max_tokens: Optional[int], seed: Optional[int]) -> List[np.ndarray]:
    """The samples in the order `np.random.default_rng(seed).permutation(len(samples))` (seed None: as given),
    taken while the running total stays below `max_tokens`; the last one cut so the total equals max_tokens."""
    return [samples[i][:n] for i, n in _select([len(s) for s in samples], max_tokens, seed)]


def read_text_file(path: "str | os.PathLike", what: str = "a text file", max_bytes: int = MAX_FILE_BYTES,
                   max_word: int = MAX_WORD_CHARS) -> str:
    """The whole of UTF-8 text file `path` (universal newlines, as `Path.read_text`), at most `max_bytes`.

    Raises CheckpointError naming the file: missing, not a regular file, larger than `max_bytes`, not UTF-8
    (the byte offset given), or with a run of more than `max_word` characters without whitespace (the
    character index given)."""
    p = Path(path)
    fd, st = open_regular(p, None, what)
    if st.st_size > max_bytes:
        os.close(fd)
        raise CheckpointError(f"{p}: expected {what} of at most {max_bytes} bytes, found {st.st_size} bytes")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(max_bytes + 1)
        except OSError as e:
            raise CheckpointError(f"{p}: cannot read {what} ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise CheckpointError(f"{p}: expected {what} of at most {max_bytes} bytes, found more")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{p}: expected UTF-8 text, found an undecodable byte at offset {e.start}") from None
    at = longest_word_at(text, max_word)
    if at is not None:
        raise CheckpointError(f"{p}: expected {what} with runs of at most {max_word} characters without whitespace "
                              f"(MAX_WORD_CHARS), found a longer one at character {at}")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def longest_word_at(text: str, max_word: int = MAX_WORD_CHARS) -> Optional[int]:
    """The character index where `text` first has a run of more than `max_word` characters without whitespace
    (`re`'s \\s), or None. Linear: a run is tried only from its first character."""
    m = re.search(r"(?<!\S)\S{%d}" % (int(max_word) + 1), text)
    return None if m is None else m.start()


def _lines(p: Path, what: str = "a calibration file") -> Iterator[tuple]:
    """(line number, text) of each line of `p` (universal newlines, the line break removed), streamed;
    CheckpointError for a line over MAX_LINE_BYTES or invalid UTF-8."""
    fd, _ = open_regular(p, None, what)
    with os.fdopen(fd, "rb") as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 2)
            if not raw:
                break
            n += 1
            if len(raw) > MAX_LINE_BYTES + 1 or (len(raw) == MAX_LINE_BYTES + 1 and not raw.endswith(b"\n")):
                raise CheckpointError(f"{p}: line {n}: expected at most {MAX_LINE_BYTES} bytes a line "
                                      f"(MAX_LINE_BYTES), found a longer one")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{p}: line {n}: expected UTF-8 text, found an undecodable byte at offset "
                                      f"{e.start} of the line") from None
            if text.endswith("\n"):
                text = text[:-1]
            if text.endswith("\r"):
                text = text[:-1]
            # a lone \r is a line break too (universal newlines, as Path.read_text reads)
            parts = text.split("\r")
            for part in parts:
                yield n, part


def json_lines(path: "str | os.PathLike", what: str = "a JSON lines file") -> Iterator[tuple]:
    """(line number, parsed value) of each non-blank line of a JSON-lines file, streamed under this module's bounds:
    a file of at most MAX_FILE_BYTES, lines of at most MAX_LINE_BYTES, JSON nested at most MAX_JSON_DEPTH deep,
    strict UTF-8. CheckpointError naming the file (and line) otherwise."""
    p = Path(path)
    if p.is_file() and p.stat().st_size > MAX_FILE_BYTES:
        raise CheckpointError(f"{p}: {what} of {p.stat().st_size} bytes exceeds {MAX_FILE_BYTES} (MAX_FILE_BYTES)")
    for n, line in _lines(p, what):
        if not line.strip():
            continue
        _check_depth(p, n, line)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: line {n}: expected a JSON object, found invalid JSON ({e.msg})") from None
        except RecursionError:
            raise CheckpointError(f"{p}: line {n}: expected JSON nested at most {MAX_JSON_DEPTH} deep "
                                  f"(MAX_JSON_DEPTH), found deeper") from None
        yield n, obj


def _texts(p: Path) -> Iterator[tuple]:
    """(line number, sample text) of each non-blank line (.txt) or JSON line's "text" (.jsonl)."""
    if p.suffix != ".jsonl":
        for n, line in _lines(p):
            if line.strip():
                yield n, line
        return
    for n, obj in json_lines(p, "a calibration file"):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CheckpointError(f"{p}: line {n}: expected a JSON object with a string field \"text\", found "
                                  f"{type(obj).__name__}" + (f" with keys {sorted(obj)[:5]}" if isinstance(obj, dict)
                                                              else ""))
        text = obj["text"]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CheckpointError(f"{p}: line {n}: expected text of Unicode characters, found a lone surrogate "
                                  f"U+{ord(text[e.start]):04X} at character {e.start} (a \\u escape of half a "
                                  f"UTF-16 pair)") from None
        if text.strip():
            yield n, text


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _check_depth(p: Path, n: int, line: str) -> None:
    """CheckpointError when JSON `line` nests arrays / objects deeper than MAX_JSON_DEPTH (strings skipped)."""
    if line.count("[") + line.count("{") <= MAX_JSON_DEPTH:
        return
    bare = np.frombuffer(_JSON_STRING.sub("", line).encode("utf-8", "replace"), np.uint8)
    step = (bare == ord("[")).astype(np.int32) + (bare == ord("{")) - (bare == ord("]")) - (bare == ord("}"))
    if step.size and int(np.cumsum(step).max()) > MAX_JSON_DEPTH:
        raise CheckpointError(f"{p}: line {n}: expected JSON nested at most {MAX_JSON_DEPTH} deep (MAX_JSON_DEPTH), "
                              f"found deeper")


def _tokens(p: Path, n: int, tokenize: Callable, text: str, seq_len: int) -> np.ndarray:
    try:
        ids = list(tokenize(text))
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{p}: line {n}: the tokenizer refused the text ({type(e).__name__}: {e})") from None
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{p}: line {n}: expected the tokenizer to give integer ids")
    return np.asarray(ids, np.int64)[:seq_len]


#: Tokens a text file's first pass keeps (int32, 64 MiB); beyond, only lengths are kept and the selected
#: samples are tokenized again in a second pass.
_KEEP_TOKENS = 1 << 24


def _text_samples(p: Path, tokenize: Callable, seq_len: int):
    """Pass 1: each sample's length (tokenized, truncated), the arrays too while they total at most
    _KEEP_TOKENS; beyond that `get` tokenizes the selected samples again."""
    lengths: List[int] = []
    where: List[int] = []  # the sample's ordinal among the file's non-blank texts
    kept: Optional[List[np.ndarray]] = []
    total = 0
    for k, (n, text) in enumerate(_texts(p)):
        ids = _tokens(p, n, tokenize, text, seq_len)
        if ids.size:
            if len(lengths) >= MAX_SAMPLES:
                raise CheckpointError(f"{p}: expected at most {MAX_SAMPLES} calibration samples (MAX_SAMPLES), "
                                      f"found more")
            lengths.append(ids.size)
            where.append(k)
            total += ids.size
            if kept is not None:
                kept.append(ids)
                if total > _KEEP_TOKENS:
                    kept = None

    def get(indices: List[int]) -> dict:
        if kept is not None:
            return {i: kept[i] for i in indices}
        want = {where[i]: i for i in indices}
        out = {}
        for k, (n, text) in enumerate(_texts(p)):
            if k in want:
                out[want[k]] = ids = _tokens(p, n, tokenize, text, seq_len)
                if ids.size != lengths[want[k]]:
                    break
        if len(out) != len(indices) or any(out[i].size != lengths[i] for i in out):
            raise CheckpointError(f"{p}: expected the same samples on a second read, found the file changed")
        return out

    return lengths, get


def _npy_header(p: Path, f) -> tuple:
    """(dtype, shape, fortran_order, data offset) of .npy file `f`, the header parsed as a plain literal."""
    magic = f.read(8)
    if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
        raise CheckpointError(f"{p}: expected a .npy array (magic \\x93NUMPY), found {magic[:6]!r}")
    major = magic[6]
    if major == 1:
        size_bytes = f.read(2)
        hlen, off = (int.from_bytes(size_bytes, "little") if len(size_bytes) == 2 else -1), 10
    elif major in (2, 3):
        size_bytes = f.read(4)
        hlen, off = (int.from_bytes(size_bytes, "little") if len(size_bytes) == 4 else -1), 12
    else:
        raise CheckpointError(f"{p}: expected .npy format version 1, 2 or 3, found {major}")
    if not 0 < hlen <= _NPY_HEADER_BYTES:
        raise CheckpointError(f"{p}: expected a .npy header of 1 to {_NPY_HEADER_BYTES} bytes, found {hlen}")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise CheckpointError(f"{p}: expected a .npy header of {hlen} bytes, found the file cut short")
    try:
        header = ast.literal_eval(raw.decode("latin1" if major < 3 else "utf-8"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
        raise CheckpointError(f"{p}: expected a .npy header that is a plain dict literal, found "
                              f"{raw[:60]!r}...") from None
    if not (isinstance(header, dict) and set(header) == {"descr", "fortran_order", "shape"}
            and isinstance(header["shape"], tuple) and isinstance(header["fortran_order"], bool)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in header["shape"])):
        raise CheckpointError(f"{p}: expected a .npy header {{'descr', 'fortran_order', 'shape'}} with a shape of "
                              f"non-negative ints, found {str(header)[:120]}")
    try:
        dtype = np.dtype(header["descr"]) if isinstance(header["descr"], str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.hasobject:
        raise CheckpointError(f"{p}: expected a .npy array of integer token ids, found one that needs unpickling "
                              f"or is malformed (descr {str(header['descr'])[:60]})")
    return dtype, header["shape"], header["fortran_order"], off + hlen


def _npy_samples(p: Path, seq_len: int):
    """The windows (1-D) or rows (2-D) of a .npy array as lengths, then `get` copies only the ones selected
    out of the memory map."""
    fd, st = open_regular(p, None, "a .npy file")
    with os.fdopen(fd, "rb") as f:
        dtype, shape, fortran, offset = _npy_header(p, f)
    if not np.issubdtype(dtype, np.integer):
        raise CheckpointError(f"{p}: expected integer token ids, found dtype {dtype}")
    if len(shape) not in (1, 2):
        raise CheckpointError(f"{p}: expected a 1-D token stream or a 2-D [samples, tokens] array, found shape "
                              f"{shape}")
    count = int(np.prod(shape, dtype=object))
    if offset + count * dtype.itemsize != st.st_size:
        raise CheckpointError(f"{p}: expected {offset + count * dtype.itemsize} bytes for a {dtype} array of shape "
                              f"{shape}, found a {st.st_size}-byte file")
    if len(shape) == 1:
        n = shape[0]
        samples = -(-n // seq_len)
        lengths_of = (lambda i: min(seq_len, n - i * seq_len))
    else:
        rows, cols = shape
        samples = rows if cols else 0
        lengths_of = (lambda i: min(seq_len, cols))
    if samples > MAX_SAMPLES:
        raise CheckpointError(f"{p}: expected at most {MAX_SAMPLES} calibration samples (MAX_SAMPLES), found "
                              f"{samples} (shape {shape}, seq_len {seq_len})")
    lengths = [lengths_of(i) for i in range(samples)]

    def get(indices: List[int]) -> dict:
        if not indices:
            return {}
        try:
            a = np.memmap(p, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{p}: cannot map the .npy array ({e})") from None
        if len(shape) == 1:
            return {i: np.array(a[i * seq_len:(i + 1) * seq_len], np.int64) for i in indices}
        return {i: np.array(a[i, :seq_len], np.int64) for i in indices}

    return lengths, get
