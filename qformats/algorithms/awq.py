"""AWQ (Lin et al., 2023): activation-aware per-channel weight scales chosen by a grid search, as pure functions.

For one mapping (smooth module, balance projections reading its output, parent module whose output is compared;
the decoder family's mappings and the model glue are `qformats.models.decoder.calibration`), with llm-compressor
0.14's arithmetic (`AWQModifier`, modifiers/transform/awq):

    x_mean_j = mean over calibration tokens of |X_tj|      (X: the balance projections' input, float32)
    w_mean_j = sum_p sum_o |W_p[o, j]| / (amax of W_p[o, j]'s quantization chunk + 1e-6) / sum_p N_p   (float64;
               torch layout W_p [N_p, K]; chunk: the row (channel), group_size elements (group, tensor_group),
               the whole tensor (tensor), a block)
    grid (duo_scaling=True, n_grid=20): (0, plain) then ratios r = i / (n_grid - 2), i = 0 .. n_grid - 2, duo;
               duo_scaling=False: r = i / (n_grid - 1), plain; "both": n = n_grid // 2, r = i / (n - 1), plain and duo
    s(r)     = max(x_mean^r / (w_mean^(1-r) + 1e-4), 1e-4)     (duo; x_mean^r in float32, the rest float64)
             = max(x_mean^r, 1e-4)                              (plain; float32)
    s       <- s / sqrt(max(s) min(s));   s_j <- 1 where s_j is inf or nan
    loss(r)  = sum over tokens and outputs of (parent(X; W_p <- Q(W_p diag(s)) diag(s)^-1) - parent(X))^2 / count
    best     = the first r of the grid with the smallest finite loss (strict <)

(`race_scales` finds the same best without summing every term: the loss summed over chunks of tokens, a grid point
dropped once its partial sum cannot win.)

where Q is the weight scheme's round-to-nearest fake quantization (min-max scales of W diag(s), as llm-compressor's
memoryless_minmax observer), W diag(s) and Q(.) diag(s)^-1 are formed in the scales' dtype and rounded to the
weight's. The chosen s is folded so the float model's function is unchanged:

    W_p[:, j] <- W_p[:, j] * s_j        (every balance projection; a Flax kernel's row j)
    norm.weight <- norm.weight / s      (a norm smooth module)   or   W_smooth[j, :] <- W_smooth[j, :] / s_j,
                                                                      b_smooth <- b_smooth / s (a linear one)

so the result is an ordinary float checkpoint whose projections then go through the weight search (RTN by
default, GPTQ, ...). arXiv:2306.00978. Tensor-group (NVFP4) weights take a global scale per projection here,
where llm-compressor shares it among q/k/v and gate/up.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import ModelError
from qformats.quantize import dequantize, quantize
from qformats.schemes import QuantScheme
from qformats.threads import each

__all__ = ["grid", "weight_means", "activation_means", "candidate_scales", "fake_quantize_scaled", "ScaleSearch",
           "race_scales", "search_scales", "scale_rows", "unscale_cols", "unscale"]


SCALE_FLOOR = 1e-4
WEIGHT_EPS = 1e-6
DuoScaling = Union[bool, str]


def grid(n_grid: int = 20, duo_scaling: DuoScaling = True) -> List[Tuple[float, bool]]:
    """The (ratio, duo) points of the search, in llm-compressor's order:

      duo_scaling=True:   [(0, False)] + [(i / (n_grid - 2), True) for i in 0 .. n_grid - 2]
      duo_scaling=False:  [(i / (n_grid - 1), False) for i in 0 .. n_grid - 1]
      "both":             n = n_grid // 2; [(i / (n - 1), d) for i in 0 .. n - 1 for d in (False, True)]

    Raises ModelError for a duo_scaling other than True / False / "both" or an n_grid too small for its grid.
    """
    if duo_scaling not in (True, False, "both") or (isinstance(duo_scaling, str) and duo_scaling != "both"):
        raise ModelError(f"AWQ: duo_scaling must be True, False or 'both', got {duo_scaling!r}")
    least = {True: 3, False: 2, "both": 4}[duo_scaling]
    if not isinstance(n_grid, int) or isinstance(n_grid, bool) or n_grid < least:
        raise ModelError(f"AWQ: n_grid must be an int >= {least} with duo_scaling={duo_scaling!r}, got {n_grid!r}")
    if duo_scaling == "both":
        n = n_grid // 2
        return [(i / (n - 1), d) for i in range(n) for d in (False, True)]
    if duo_scaling is False:
        return [(i / (n_grid - 1), False) for i in range(n_grid)]
    return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]


def _chunks(w: np.ndarray, scheme: QuantScheme, where: str) -> np.ndarray:
    """|w| / (amax of its quantization chunk + 1e-6) for a torch-layout weight w [N, K], float32."""
    n, k = w.shape
    a = np.abs(w.astype(np.float32))
    st = scheme.strategy
    if st == "tensor":
        v = a.reshape(1, -1)
    elif st == "channel":
        v = a.reshape(-1, k)
    elif st in ("group", "tensor_group"):
        if k % scheme.group_size:
            raise ModelError(f"{where}: AWQ needs in_features {k} divisible by the group size {scheme.group_size}")
        v = a.reshape(-1, scheme.group_size)
    elif st == "block":
        bh, bw = scheme.block
        if n % bh or k % bw:
            raise ModelError(f"{where}: AWQ needs the weight [{n}, {k}] divisible into blocks {bh}x{bw}")
        v = a.reshape(n // bh, bh, k // bw, bw).transpose(0, 2, 1, 3).reshape(-1, bh * bw)
    else:
        raise ModelError(f"{where}: AWQ cannot weigh a weight quantized per {st!r}")
    v = v / (v.max(axis=1, keepdims=True) + np.float32(WEIGHT_EPS))
    if st == "block":
        bh, bw = scheme.block
        return v.reshape(n // bh, k // bw, bh, bw).transpose(0, 2, 1, 3).reshape(n, k)
    return v.reshape(n, k)


def weight_means(kernels: Sequence, scheme: QuantScheme, where: str = "AWQ") -> np.ndarray:
    """w_mean [K] float64: the mean over every output row of the balance projections of |W[o, j]| normalised by
    its quantization chunk's amax + 1e-6 (module docstring). `kernels`: Flax kernels [K, N_p]."""
    total, count = 0.0, 0
    for k in kernels:
        w = np.asarray(k).T
        total = total + _chunks(w, scheme, where).sum(axis=0, dtype=np.float64)
        count += w.shape[0]
    return total / count


@jax.jit
def _abs_sum(x, valid):
    v = valid[..., None]
    return jnp.sum(jnp.where(v, jnp.abs(x.astype(jnp.float32)), 0.0), axis=(0, 1)), jnp.sum(valid)


def activation_means(xs: Sequence, valid: Sequence) -> np.ndarray:
    """x_mean [K] float32 = sum over real tokens of |x_t| / their count, for batches xs [B, T, K] and masks
    valid [B, T] (True = a real token)."""
    total, count = None, 0
    for x, v in zip(xs, valid):
        s, c = _abs_sum(x, v)
        total = s if total is None else total + s
        count += int(c)
    if count == 0:
        raise ModelError("AWQ: no real calibration tokens")
    return np.asarray(total, np.float32) / np.float32(count)


def candidate_scales(x_mean, w_mean, ratio: float, duo: bool) -> np.ndarray:
    """s [K] of one grid point (module docstring): duo: max(x^r / (w^(1-r) + 1e-4), 1e-4) in float64 (x^r in float32);
    plain: max(x^r, 1e-4) in float32; then s / sqrt(max(s) min(s)), with inf / nan entries set to 1."""
    x = np.asarray(x_mean, np.float32)
    with np.errstate(all="ignore"):
        xr = np.power(x, np.float32(ratio)).astype(np.float32)
        if duo:
            s = np.maximum(xr.astype(np.float64) / (np.power(np.asarray(w_mean, np.float64), 1.0 - ratio) + 1e-4),
                           SCALE_FLOOR)
        else:
            s = np.maximum(xr, np.float32(SCALE_FLOOR))
        s = s / np.sqrt(s.max() * s.min())
    s[~np.isfinite(s)] = 1
    return s


@jax.jit
def _scale_rows(k, s):
    return (k.astype(s.dtype) * s[:, None]).astype(k.dtype)


@jax.jit
def _unscale_rows(k, s):
    return (k.astype(s.dtype) / s[:, None]).astype(k.dtype)


@jax.jit
def _unscale_cols(k, s):
    return (k.astype(s.dtype) / s[None, :]).astype(k.dtype)


@jax.jit
def _unscale(v, s):
    return (v.astype(s.dtype) / s).astype(v.dtype)


def _in_dtype(fn, *args):
    """fn(*args) with 64-bit types enabled for this call, so float64 scales act in float64 (as torch promotes)."""
    with jax.enable_x64(True):
        return fn(*args)


@functools.partial(jax.jit, static_argnames=("scheme",))
def _fake_quantize(w, scheme):
    """Q(w) along the kernel's input axis (-2) of a [..., K, N] kernel: leading axes (stacked experts) one by one."""
    fn = lambda k: dequantize(quantize(k, scheme, 0))  # noqa: E731
    for _ in range(w.ndim - 2):
        fn = jax.vmap(fn)
    return fn(w)


def fake_quantize_scaled(kernel, s, scheme: QuantScheme):
    """Q(W diag(s)) diag(s)^-1 for a Flax kernel [K, N] or a stack [E, K, N] (every expert's rows scaled, each
    quantized on its own): fl(fl(k_j s_j) quantized-dequantized / s_j),
    each product and quotient in s's dtype (float64 scales: as torch promotes a float32 weight times float64
    scales) and rounded to the kernel's dtype; Q is round-to-nearest along K with min-max scales."""
    s = np.asarray(s)
    ws = _in_dtype(_scale_rows, kernel, s)
    return _in_dtype(_unscale_rows, _fake_quantize(ws, scheme), s)


def scale_rows(kernel, s):
    """W diag(s) for a Flax kernel [K, N]: row j times s_j, in s's dtype, rounded to the kernel's (the fold into
    the balance projections)."""
    return _in_dtype(_scale_rows, kernel, np.asarray(s))


def unscale_cols(kernel, s):
    """W diag(s)^-1 for a Flax kernel [K, N]: column j divided by s_j, in s's dtype, rounded to the kernel's (the
    fold into a linear smooth module)."""
    return _in_dtype(_unscale_cols, kernel, np.asarray(s))


def unscale(v, s):
    """v / s elementwise (a norm's weight or a linear smooth module's bias), in s's dtype, rounded to v's."""
    return _in_dtype(_unscale, v, np.asarray(s))


class ScaleSearch(NamedTuple):
    """The result of `search_scales` / `race_scales`: the chosen scales, their grid point (ratio, duo), the loss at
    every grid point in order (None for a point the race pruned: its loss is known to lose), the loss at the first
    point (None if pruned), the best loss, and the fraction of (point, chunk) terms evaluated."""

    scales: np.ndarray
    ratio: float
    duo: bool
    errors: List[Optional[float]]
    initial_error: Optional[float]
    best_error: float
    evaluated: float = 1.0


RACE_KEEP_BYTES = 64 << 20
"""How many bytes of quantized kernels `race_scales` keeps from the first chunk's pass for the points it races first
(the others are quantized again when raced)."""
RACE_WORKERS = 2
"""How many (grid point, chunk) terms `race_scales` evaluates at once, from as many threads: while one XLA computation
waits on its threads at the end of an op, the other's ops keep the cores busy (on a 2-core CPU, 8-15% more terms a
second than one at a time). 1: one term after the other, in the calling thread."""


def race_scales(x_mean, w_mean, kernels: Sequence, scheme: QuantScheme, points: Sequence[Tuple[float, bool]],
                chunk_sse: Callable[[tuple, int], float], chunks: int, count: float, where: str = "AWQ",
                parent: str = "the parent", prune: bool = True, workers: Optional[int] = None) -> ScaleSearch:
    """AWQ's grid search (module docstring) with the loss summed over `chunks` parts of the calibration tokens:

        s_i = candidate_scales(x_mean, w_mean, ratio_i, duo_i),   K_i = Q(W_p diag(s_i)) diag(s_i)^-1 per kernel
        loss_i = (sse_i(0) + sse_i(1) + ... + sse_i(chunks - 1)) / count      (summed left to right, float64)

    with sse_i(c) = chunk_sse(K_i, c) >= 0 (the parent's squared output error over chunk c). The result is the first
    grid point with the smallest finite loss (strict <, as `search_scales`), found without summing every term: every
    point's chunk 0 first, then the point of smallest chunk-0 sum to its end, then the others in increasing order of
    that sum, each summed chunk by chunk while its partial loss can still win against the best total so far
    (partial < best, or == best at an earlier grid index). Chunk sums are non-negative and rounded addition and
    division are monotone, so a partial loss that already cannot win bounds a total that cannot either, and the best
    total only decreases: the choice equals that of evaluating every term (`prune=False` evaluates every term),
    whatever the order the terms finish in.

    `workers` (RACE_WORKERS by default) terms at a time, from threads: every point's chunk 0 and the first point's
    chunks side by side, then one point per thread (`chunk_sse` must be thread-safe). The choice does not depend on
    it; which losing points were cut off where (`errors`, `evaluated`) may, with the threads' timing.

    Put the chunks that carry most of the error first (e.g. tokens of the largest |x|): a losing point's partial sum
    then passes the best total early.

    Raises ModelError naming `where` and `parent` when no point gives a finite loss."""
    n = len(points)
    workers = RACE_WORKERS if workers is None else max(1, int(workers))
    scales = [candidate_scales(x_mean, w_mean, r, d) for r, d in points]
    lock = threading.Lock()
    kept: dict = {}  # point -> its quantized kernels from the first chunk's pass, within RACE_KEEP_BYTES
    sse: List[float] = [math.nan] * n
    done = [0] * n

    def quantized(i):
        with lock:
            ks = kept.pop(i, None)
        return ks or tuple(fake_quantize_scaled(k, scales[i], scheme) for k in kernels)

    def first(i):
        ks = quantized(i)
        s = float(chunk_sse(ks, 0))
        with lock:
            sse[i], done[i] = s, 1
            if chunks > 1 and math.isfinite(s) and sum(k.nbytes for k in ks) * (len(kept) + 1) <= RACE_KEEP_BYTES:
                kept[i] = ks
            elif kept and math.isfinite(s) and s < max(sse[j] for j in kept):
                del kept[max(kept, key=lambda j: sse[j])]  # keep those raced first: the smallest first-chunk sums
                kept[i] = ks

    each(first, range(n), workers)
    best = [None, math.inf]  # the grid index of the best total so far, its loss

    def can_win(loss, i):
        return loss < best[1] or (loss == best[1] and best[0] is not None and i < best[0])

    def finish(i):
        with lock:
            if done[i] == chunks and math.isfinite(sse[i] / count) and can_win(sse[i] / count, i):
                best[:] = [i, sse[i] / count]

    def race(i):
        ks = None
        while True:
            with lock:
                if done[i] == chunks or not math.isfinite(sse[i]) or (
                        prune and best[0] is not None and not can_win(sse[i] / count, i)):
                    break
            ks = quantized(i) if ks is None else ks
            sse[i] += float(chunk_sse(ks, done[i]))  # point i is this thread's alone
            done[i] += 1
        finish(i)

    order = sorted(range(n), key=lambda i: (not math.isfinite(sse[i]), sse[i] if math.isfinite(sse[i]) else 0.0, i))
    # the likely winner first: nothing to race against yet, so its chunks run side by side
    if chunks > 1 and math.isfinite(sse[order[0]]):
        i = order.pop(0)
        ks = quantized(i)
        while done[i] < chunks and math.isfinite(sse[i]):
            batch = range(done[i], min(chunks, done[i] + workers))
            for s in each(lambda c: float(chunk_sse(ks, c)), batch, workers):
                if math.isfinite(sse[i]):
                    sse[i] += s
                    done[i] += 1
        finish(i)
    each(race, order, workers)
    if best[0] is None:
        raise ModelError(f"{where}: AWQ found no finite loss on the grid (NaN or inf in the outputs of {parent} "
                         "under the scaled weights)")
    errors = [sse[i] / count if done[i] == chunks else None for i in range(n)]
    return ScaleSearch(scales[best[0]], points[best[0]][0], points[best[0]][1], errors, errors[0], best[1],
                       sum(done) / (n * chunks))


def search_scales(x_mean, w_mean, kernels: Sequence, scheme: QuantScheme, points: Sequence[Tuple[float, bool]],
                  loss: Callable[[tuple], float], where: str = "AWQ", parent: str = "the parent") -> ScaleSearch:
    """AWQ's grid search (module docstring): for each grid point (ratio, duo) of `points` (`grid`),

        s = candidate_scales(x_mean, w_mean, ratio, duo),   err = loss(Q(W_p diag(s)) diag(s)^-1 for each kernel)

    (`fake_quantize_scaled` of each Flax kernel [K, N_p] in `kernels` under the weight `scheme`); `loss` maps those
    kernels to the parent's mean squared output error. The first point with the smallest finite error wins
    (strict <). `race_scales` with one chunk (every point evaluated). Raises ModelError naming `where` and `parent`
    when no point gives a finite error."""
    return race_scales(x_mean, w_mean, kernels, scheme, points, lambda ks, c: loss(ks), 1, 1.0, where, parent)
