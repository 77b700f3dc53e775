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
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np

from qformats.errors import CheckpointError, ModelError

__all__ = ["load_calibration", "select_samples", "DEFAULT_SEQ_LEN", "DEFAULT_TOKENS"]

DEFAULT_SEQ_LEN = 512
DEFAULT_TOKENS = 65536
MAX_FILE_BYTES = 1 << 31


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
      vocab_size: when given, every id must lie in [0, vocab_size).

    Raises:
      CheckpointError: the file is missing, unreadable, malformed (bad JSON, no "text" string, a pickled or
        non-integer array, ...), or gives no tokens. ModelError: bad seq_len / max_tokens, ids out of range.
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
        samples = _npy_samples(p, seq_len)
    else:
        if tokenize is None:
            raise ModelError(f"{p}: a text calibration file needs a tokenizer (the model has none); give token "
                             "ids as a .npy file instead")
        texts = _jsonl_texts(p) if p.suffix == ".jsonl" else _text_lines(p)
        samples = []
        for i, t in enumerate(texts):
            ids = np.asarray(list(tokenize(t)), np.int64)[:seq_len]
            if ids.size:
                samples.append(ids)
    if not samples:
        raise CheckpointError(f"{p}: no calibration tokens (empty file, or only blank lines)")
    if vocab_size is not None:
        for i, s in enumerate(samples):
            if s.min() < 0 or s.max() >= vocab_size:
                raise ModelError(f"{p}: sample {i} has token ids outside [0, {vocab_size}) "
                                 f"(min {int(s.min())}, max {int(s.max())})")
    return select_samples([s.astype(np.int32) for s in samples], max_tokens, seed)


def select_samples(samples: Sequence[np.ndarray], max_tokens: Optional[int], seed: Optional[int]) -> List[np.ndarray]:
    """The samples in the order `np.random.default_rng(seed).permutation(len(samples))` (seed None: as given),
    taken while the running total stays below `max_tokens`; the last one cut so the total equals max_tokens."""
    order = np.arange(len(samples)) if seed is None else np.random.default_rng(seed).permutation(len(samples))
    out, total = [], 0
    for i in order:
        s = samples[int(i)]
        if max_tokens is not None:
            if total >= max_tokens:
                break
            s = s[:max_tokens - total]
        out.append(s)
        total += len(s)
    return out


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{p}: expected UTF-8 text, found an undecodable byte at offset {e.start}") from None
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read the calibration file: {e}") from None


def _text_lines(p: Path) -> List[str]:
    return [line.strip("\r\n") for line in _read_text(p).split("\n") if line.strip()]


def _jsonl_texts(p: Path) -> List[str]:
    texts = []
    for n, line in enumerate(_read_text(p).split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: line {n}: expected a JSON object, found invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CheckpointError(f"{p}: line {n}: expected a JSON object with a string field \"text\", found "
                                  f"{type(obj).__name__}" + (f" with keys {sorted(obj)[:5]}" if isinstance(obj, dict)
                                                              else ""))
        if obj["text"].strip():
            texts.append(obj["text"])
    return texts


def _npy_samples(p: Path, seq_len: int) -> List[np.ndarray]:
    try:
        a = np.load(p, allow_pickle=False, mmap_mode="r")
    except ValueError as e:  # object arrays need pickle: refused
        raise CheckpointError(f"{p}: expected a .npy array of integer token ids, found one that needs unpickling "
                              f"or is malformed ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read a .npy array: {e}") from None
    if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.integer):
        raise CheckpointError(f"{p}: expected integer token ids, found dtype {getattr(a, 'dtype', type(a))}")
    if a.ndim == 1:
        return [np.array(a[i:i + seq_len], np.int64) for i in range(0, a.shape[0], seq_len)]
    if a.ndim == 2:
        return [np.array(row[:seq_len], np.int64) for row in a if row.shape[0]]
    raise CheckpointError(f"{p}: expected a 1-D token stream or a 2-D [samples, tokens] array, found shape {a.shape}")
