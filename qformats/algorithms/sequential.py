"""Layer-by-layer (sequential) calibration, the pure pieces: calibration samples padded or packed into batches, and the
projections of a layer grouped by the input they read (one Hessian per group).

The layer loop itself (calibration pass, weight search per input group, propagation pass) needs the model: for the
decoder family it is `qformats.models.decoder.calibration.calibrate_decoder`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from qformats.algorithms.shared_scales import sibling_groups
from qformats.errors import ModelError

__all__ = ["Batches", "make_batches", "pack_batches", "input_groups"]


@dataclasses.dataclass(frozen=True)
class Batches:
    """Calibration samples padded into batches: `ids[b]` [B, T_b] int32, `valid[b]` [B, T_b] bool (True = a real
    token). `tokens` = the number of real tokens.

    One sample a row (`make_batches`: `positions` and `segments` None; real tokens first in each row, position t at
    column t), or several samples packed into each row (`pack_batches`): then `positions[b]` [B, T_b] int32 is each
    token's position within its own sample and `segments[b]` [B, T_b] int32 the sample it belongs to within its
    row (0, 1, ...; -1 on padding), so a token attends only to the earlier tokens of its own sample
    (`packed_mask`)."""

    ids: Tuple[np.ndarray, ...]
    valid: Tuple[np.ndarray, ...]
    tokens: int
    positions: Optional[Tuple[np.ndarray, ...]] = None
    segments: Optional[Tuple[np.ndarray, ...]] = None


def make_batches(samples: Sequence[np.ndarray], *, tokens_per_batch: int = 8192, bucket: int = 32,
                 max_padding: float = 0.0, shape_cost: int = 0) -> Batches:
    """Samples (1-D int token arrays) -> Batches: each sample right-padded (with id 0) to its bucket length
    T = bucket * ceil(len / bucket); samples of one bucket batched B = max(1, tokens_per_batch // T) rows at a
    time, in order, the last batch of a bucket filled with all-padding rows (so each bucket has one shape).

    `max_padding` > 0 merges buckets, shortest first, into the next longer one while the padding of all the
    batches stays <= max_padding * (real tokens): fewer shapes, so fewer compilations of the layer passes (each
    distinct [B, T] compiles once), for a little padded compute (masked out of every statistic).

    `shape_cost` > 0 (in token positions) chooses the merging instead, by cost: the bucket lengths, sorted, are
    split into runs, each run's samples padded to its longest length, so as to minimise

        sum over runs of (positions computed: batches * B * T, empty rows of the last batch included)
        + shape_cost * (number of runs, i.e. of distinct shapes)

    (exact, by dynamic programming over the bucket lengths). A compilation of the layer passes costs about as
    much as `shape_cost` token positions run through every layer: with few calibration tokens this gives one or
    two shapes, with many it keeps the buckets apart."""
    if not samples:
        raise ModelError("calibration needs at least one sample")
    if bucket < 1 or tokens_per_batch < 1:
        raise ModelError(f"make_batches: bucket and tokens_per_batch must be >= 1, got {bucket}, {tokens_per_batch}")
    groups: Dict[int, List[np.ndarray]] = {}
    for i, s in enumerate(samples):
        s = np.asarray(s)
        if s.ndim != 1 or s.size == 0 or not np.issubdtype(s.dtype, np.integer):
            raise ModelError(f"calibration sample {i}: expected a non-empty 1-D integer token array, got "
                             f"{s.dtype} of shape {s.shape}")
        groups.setdefault(bucket * -(-s.size // bucket), []).append(s)
    if shape_cost > 0:
        groups = _merge_by_cost(groups, tokens_per_batch, shape_cost)
    elif max_padding > 0:
        real = sum(r.size for rows in groups.values() for r in rows)
        pad = sum(t * len(rows) for t, rows in groups.items()) - real
        lengths = sorted(groups)
        for short, long in zip(lengths, lengths[1:]):
            extra = (long - short) * len(groups[short])
            if pad + extra <= max_padding * real:
                pad += extra
                groups[long] = groups.pop(short) + groups[long]
    ids, valid = [], []
    for t in sorted(groups):
        rows = groups[t]
        b = max(1, min(len(rows), tokens_per_batch // t))
        for j in range(0, len(rows), b):
            chunk = rows[j:j + b]
            a = np.zeros((b, t), np.int32)
            v = np.zeros((b, t), bool)
            for r, s in enumerate(chunk):
                a[r, :s.size] = s
                v[r, :s.size] = True
            ids.append(a)
            valid.append(v)
    return Batches(tuple(ids), tuple(valid), int(sum(np.asarray(s).size for s in samples)))


def pack_batches(samples: Sequence[np.ndarray], *, tokens_per_batch: int = 2048, bucket: int = 32,
                 shape_cost: int = 0) -> Batches:
    """Samples (1-D int token arrays) -> Batches with several samples per row: one row length
    T = bucket * ceil(longest sample / bucket), samples placed into rows first-fit in decreasing length (ties in
    sample order), the rows split into n = ceil(rows / B0) batches of B = ceil(rows / n) rows each
    (B0 = max(1, tokens_per_batch // T); empty rows pad the last batch). One [B, T] shape for every batch, so the
    layer passes compile once, and far fewer padded positions than one sample per row when lengths vary.

    `shape_cost` > 0 (in token positions, as in `make_batches`: what one more shape's compilations cost): when the
    last batch's empty rows hold more than shape_cost positions it keeps its own rows only, [B', T] with B' < B (a
    second shape; the empty rows would only add zeros to every statistic).

    Each token keeps its position within its sample (`Batches.positions`) and attends to its own sample only
    (`Batches.segments`, `packed_mask`): the layer's output on a packed row equals its output on each sample alone
    (the masked keys get probability exactly 0)."""
    if not samples:
        raise ModelError("calibration needs at least one sample")
    if bucket < 1 or tokens_per_batch < 1:
        raise ModelError(f"pack_batches: bucket and tokens_per_batch must be >= 1, got {bucket}, {tokens_per_batch}")
    arrays = []
    for i, s in enumerate(samples):
        s = np.asarray(s)
        if s.ndim != 1 or s.size == 0 or not np.issubdtype(s.dtype, np.integer):
            raise ModelError(f"calibration sample {i}: expected a non-empty 1-D integer token array, got "
                             f"{s.dtype} of shape {s.shape}")
        arrays.append(s)
    t = bucket * -(-max(s.size for s in arrays) // bucket)
    rows: List[List[np.ndarray]] = []
    free: List[int] = []
    for i in sorted(range(len(arrays)), key=lambda i: -arrays[i].size):  # stable: ties keep sample order
        s = arrays[i]
        r = next((r for r, f in enumerate(free) if f >= s.size), None)
        if r is None:
            rows.append([])
            free.append(t)
            r = len(rows) - 1
        rows[r].append(s)
        free[r] -= s.size
    n = -(-len(rows) // max(1, tokens_per_batch // t))
    b = -(-len(rows) // n)
    if shape_cost <= 0 or (n * b - len(rows)) * t <= shape_cost:
        rows += [[] for _ in range(n * b - len(rows))]
    ids, valid, pos, seg = [], [], [], []
    for j in range(0, len(rows), b):
        chunk = rows[j:j + b]
        a = np.zeros((len(chunk), t), np.int32)
        v = np.zeros(a.shape, bool)
        p = np.zeros(a.shape, np.int32)
        g = np.full(a.shape, -1, np.int32)
        for r, row in enumerate(chunk):
            c = 0
            for k, s in enumerate(row):
                a[r, c:c + s.size] = s
                v[r, c:c + s.size] = True
                p[r, c:c + s.size] = np.arange(s.size)
                g[r, c:c + s.size] = k
                c += s.size
            p[r, c:] = np.arange(t - c)  # padding: a run of its own (segment -1)
        ids.append(a)
        valid.append(v)
        pos.append(p)
        seg.append(g)
    return Batches(tuple(ids), tuple(valid), int(sum(s.size for s in arrays)), tuple(pos), tuple(seg))


def packed_mask(positions: np.ndarray, segments: np.ndarray, window: Optional[int] = None) -> np.ndarray:
    """[B, T, T] visibility of a packed batch (`pack_batches`): key k is seen by query p iff both are in the same
    segment and positions[k] <= positions[p] (and positions[k] > positions[p] - window with a sliding window), and
    no query sees a later column (for the real tokens that follows; padding's queries see the padding up to their own
    column: the mask is causal by column, as `Attention` without a cache assumes)."""
    same = segments[:, :, None] == segments[:, None, :]
    qp, kp = positions[:, :, None], positions[:, None, :]
    cols = np.arange(segments.shape[1])
    mask = same & (kp <= qp) & (cols[None, :] <= cols[:, None])[None]
    if window is not None:
        mask &= kp > qp - window
    return mask


def _positions(t: int, n: int, tokens_per_batch: int) -> int:
    """Token positions computed for n rows of length t batched as `make_batches` does."""
    b = max(1, min(n, tokens_per_batch // t))
    return -(-n // b) * b * t


def _merge_by_cost(groups: Dict[int, List[np.ndarray]], tokens_per_batch: int, shape_cost: int):
    """`make_batches`' shape_cost partition of the buckets (runs of consecutive lengths, each padded to its last)."""
    lengths = sorted(groups)
    counts = [len(groups[t]) for t in lengths]
    m = len(lengths)
    best = [0] + [None] * m  # best[j]: cost of the first j buckets; cut[j]: where its last run starts
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        n = 0
        for i in range(j, 0, -1):  # last run = buckets i-1 .. j-1
            n += counts[i - 1]
            c = best[i - 1] + _positions(lengths[j - 1], n, tokens_per_batch) + shape_cost
            if best[j] is None or c < best[j]:
                best[j], cut[j] = c, i - 1
    out: Dict[int, List[np.ndarray]] = {}
    j = m
    while j > 0:
        i = cut[j]
        out[lengths[j - 1]] = [r for t in lengths[i:j] for r in groups[t]]
        j = i
    return out


def input_groups(projections: Sequence[str], sep: str = "/") -> List[Tuple[str, ...]]:
    """The projections (module paths) grouped by the input they read, in `projections` order of first member: each
    fused sibling group (`shared_scales.sibling_groups`: q/k/v, gate/up read one norm's output) is one group, every
    other projection its own (o_proj, down_proj)."""
    fused = {g[0]: g for g in sibling_groups(projections, sep=sep)}
    member = {r for g in fused.values() for r in g}
    return [fused.get(r, (r,)) for r in projections if r in fused or r not in member]
