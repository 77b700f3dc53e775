"""GPTQ weight quantization (Frantar et al., 2022) as a pure, jit-able JAX function, following llm-compressor.

GPTQ quantizes a weight one input column at a time and, after each column, spreads that column's rounding
error over the columns not yet quantized, weighted by the inverse Hessian of the layer's reconstruction loss
||X W - X Q||^2 (X: calibration inputs). Reference: arXiv:2210.17323; the lazy-batch ("block") update and the
Cholesky form of the inverse are its sections 3.3-3.4. The arithmetic here follows llm-compressor 0.14
(`modifiers/gptq/gptq_quantize.py::quantize_weight`, `helpers.py::factorize_hessian` and
`helpers.py::apply_activation_ordering`), with or without its "static" / "weight" activation ordering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qformats import rounding as R
from qformats.codec import decode
from qformats.errors import SchemeError
from qformats.grouping import expand, normalize_axis
from qformats.qarray import QArray, element_values, round_elements
from qformats.quantize import check_input, quantize
from qformats.scales import compute_scales
from qformats.schemes import QuantScheme

__all__ = ["DAMPENING_FRAC", "GPTQOptions", "gptq_quantize", "gptq_quantize_shared", "gptq_hinv", "gptq_hinv_host"]

DAMPENING_FRAC = 0.01
"""GPTQ's default relative dampening, H += 0.01 * mean(diag H) * I: llm-compressor 0.14's GPTQModifier default."""


@dataclasses.dataclass(frozen=True)
class GPTQOptions:
    """llm-compressor 0.14 GPTQModifier's options: `block_size` (columns per lazy batch), `dampening_frac`
    (H += dampening_frac * mean(diag H) * I), `actorder` ("static", its alias "weight", or None: column order;
    "group" was removed from llm-compressor and is refused by `gptq_quantize`)."""

    block_size: int = 128
    dampening_frac: float = DAMPENING_FRAC
    actorder: Optional[str] = "static"


_ACTORDERS = (None, "static", "weight")

FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False}
"""XLA compile options of the weight search's programs (`jax.jit(..., compiler_options=FAST_COMPILE)`): XLA:CPU's
classic loop emitters instead of its MLIR fusion emitters, which take about twice as long to compile these programs
(GPTQ's column sweep, quantize with given scales) for the same arithmetic and run time (the codes are identical:
tests/qformats/algorithms/test_gptq.py). Used only on the CPU backend and only where this XLA still knows the option
(`_device_jit`); otherwise the default compiler."""


def gptq_quantize(w, scheme: QuantScheme, h, *, block_size: int = 128, dampening_frac: float = DAMPENING_FRAC,
                  axis: int = 0, qparams: Optional[QArray] = None, actorder: Optional[str] = None) -> QArray:
    """Quantize `w` with GPTQ for the input second moment `h`, optionally in activation order.

    Layout: `w` is a kernel whose contracted (input) axis is `axis` (0 for a Flax kernel `[K, N]`); every
    other axis is an independent output row. `h` is the `[K, K]` Hessian H = E[x x^T] over calibration
    tokens (llm-compressor accumulates 2/n sum x x^T; a positive factor on H leaves the result unchanged,
    the dampening being relative to mean(diag H)).

    Algorithm, with W viewed as `[K, N]` (row k = input column k), exactly as llm-compressor 0.14 does it:
      1. Scales, zero points and the NVFP4 global scale come first, from the *original* weight, by the
         scheme's own rule (llm-compressor's `memoryless_minmax` weight observer; i.e. the scales of
         `quantize(w, scheme, axis)`), for every strategy (channel, group, tensor_group, block, tensor).
         They stay fixed while GPTQ runs. Pass `qparams` (a QArray of w, e.g. from
         `observers.mse_quantize(w, scheme, importance=diag(h))`) to use other scales (llm-compressor's
         `memoryless_mse` observer plays that role).
      1b. Activation order (`actorder="static"` or its alias `"weight"`; llm-compressor's
         `apply_activation_ordering`, GPTQModifier's default "static"): the rows are processed in the order
           perm = argsort(-diag(H))       (stable: equal entries keep index order; on H as given, before 2-3)
         i.e. W <- W[perm], H <- H[perm][:, perm], and every row keeps the scales / zero point of its
         *original* column (llm-compressor permutes g_idx along: g_idx[perm]), so the scales of step 1 are
         unchanged and the result needs no g_idx. Steps 2-5 run on the permuted W and H, and the result is
         un-permuted, Q <- Q[argsort(perm)]. Dead inputs (diag 0) thus come last.
      2. Dead inputs, H[k, k] == 0: H[k, k] = 1 and W[k, :] = 0.
      3. Dampening: H += dampening_frac * mean(diag H) * I.
      4. Hinv = U, the upper Cholesky factor of H^-1 (H = L L^T, H^-1 = cholesky_inverse(L), H^-1 = U^T U).
         If H is not positive definite, U = I: plain round-to-nearest (llm-compressor's "RTN fallback";
         a warning says so when called eagerly).
      5. For blocks of `block_size` rows [i1, i2), for k = i1 .. i2 - 1 (W1 = the block's rows, updated):
           q_k   = dequantize(quantize(W1[k], scales of row k))             (the row's fixed scales)
           e_k   = (W1[k] - q_k) / U[k, k]
           W1[j] -= e_k * U[k, j]            for j in k's sub-block of 8 rows     (eagerly)
         after each sub-block s, W1[later rows] -= U[s, later]^T E_s (llm-compressor updates every later row of
         the block eagerly: the same products, summed in groups of 8 before the subtraction, so rare rounding
         ties may differ), then W[i2:] -= U[i1:i2, i2:]^T E (E = the block's e rows; the lazy batch update) and
         the block's rows become the q_k. The quantize-dequantize is the scheme's own (qformats' rounding, in float32
         as llm-compressor's float32 working copy; the product value * scale is rounded to the stored
         scale's dtype, as compressed-tensors' `_dequantize` does).
    The result is re-quantized through `quantize(Q, scheme, axis, scale=..., zero_point=..., global_scale=...)`
    with the scales of step 1, Q cast to w's dtype first — what compressed-tensors does when it compresses
    llm-compressor's GPTQ output — so codes, packing and serialization are those of any other QArray.

    Consequences worth knowing (all shared with llm-compressor): with H = c I the result is RTN, except that
    a float format's -0 code comes back as +0 (an exact -0.0 re-quantizes to +0) and that bf16/f16 weights
    are divided by their scale in float32, not in their own dtype as RTN does (a few ties move). Dead inputs
    make the result depend on H's scale (their H[k, k] = 1 enters mean(diag H)): llm-compressor's H is
    2 * (tokens per calibration sample) * E[x x^T]. Any strategy and element format of qformats works
    (llm-compressor 0.14 rounds only int, fp8 and fp4 elements). Activation order: torch's
    `argsort(descending=True)` is not stable, so when two live inputs have exactly equal diag(H) entries the
    processing order (hence a few codes) may differ from llm-compressor's; tied dead inputs do not matter
    (their rows and columns of H are zero: they are decoupled from the rest and quantize to 0).
    "group" act order (alias "dynamic"; older llm-compressor, rejected by the compressed-tensors that 0.14 pins:
    scales computed on the permuted weight, groups of permuted columns) needs a per-column g_idx at inference,
    which QArray and the checkpoint writer do not carry; it is refused.

    Args:
      w: float32/bfloat16/float16 weight, ndim >= 2 (block strategy: exactly 2), contracted axis `axis`.
      scheme: the weight QuantScheme (e.g. `presets["W4A16"].weights`).
      h: `[K, K]` input second moment, K = w.shape[axis]; must be finite.
      block_size: rows per lazy batch (llm-compressor's `block_size`, default 128).
      dampening_frac: relative dampening (llm-compressor's `dampening_frac`, default 0.01).
      axis: the contracted axis of w.
      qparams: optional QArray of w (same scheme, shape, axis) whose scale / zero_point / global_scale to use.
      actorder: None (column order; the default of this function) or "static" / "weight" (activation
        order, step 1b; "weight" is compressed-tensors' alias of "static", same result). The Flax layers
        (`qformats.nn`) pass "static", GPTQModifier's default. "group"/"dynamic" raise a SchemeError.

    Returns:
      A QArray like `quantize(w, scheme, axis)` returns (same scales unless `qparams` is given).
    """
    return _gptq([w], scheme, h, block_size, dampening_frac, axis, [qparams], actorder, "gptq_quantize")[0]


def gptq_quantize_shared(ws: Sequence, scheme: QuantScheme, h, *, block_size: int = 128,
                         dampening_frac: float = DAMPENING_FRAC, axis: int = 0,
                         qparams: Optional[Sequence[Optional[QArray]]] = None,
                         actorder: Optional[str] = None) -> List[QArray]:
    """GPTQ of several weights that read the same input (one Hessian `h`), e.g. a decoder layer's q/k/v or
    gate/up projections: `[gptq_quantize(w_i, scheme, h, qparams=qparams_i, ...) for each i]`, computed as one
    problem.

    Why one problem gives the same result: in `gptq_quantize`'s step 5 every output row n of the [K, N] view
    only ever meets its own elements, H (through U) and its own scales; rows never mix. So the [K, N_i] views
    are concatenated along N into [K, sum N_i], run through one column loop (one compilation per concatenated
    shape, one sequential pass over the K columns instead of one per weight) and split again; each piece is
    re-quantized with its own scales as `gptq_quantize` does. The element operations are the same ones, so the
    codes equal the separate calls' (the sub-block and lazy block updates' matmuls sum the same 8- and 128-term
    products per element; tests/qformats/algorithms/test_gptq.py checks equality).

    Weights whose qparams carry different NVFP4 global scales cannot share the loop (the scale is one scalar
    there): they are quantized one by one.

    Args:
      ws: the weights (same contracted size K along `axis`), each as `gptq_quantize`'s `w`.
      scheme, h, block_size, dampening_frac, axis, actorder: as `gptq_quantize`, shared by all.
      qparams: None, or one entry (a QArray or None) per weight.

    Returns:
      One QArray per weight, in order.
    """
    ws = list(ws)
    if not ws:
        raise SchemeError("gptq_quantize_shared: expected at least one weight, got none")
    qps = list(qparams) if qparams is not None else [None] * len(ws)
    if len(qps) != len(ws):
        raise SchemeError(f"gptq_quantize_shared: {len(ws)} weights but {len(qps)} qparams")
    return _gptq(ws, scheme, h, block_size, dampening_frac, axis, qps, actorder, "gptq_quantize_shared")


def _gptq(ws, scheme, h, block_size, dampening_frac, axis, qps, actorder, fn: str) -> List[QArray]:
    """`gptq_quantize_shared` after its own checks: validation (`_prepare`), H ordered and factorized once
    (`_factor`), then one compiled program per group of weights that can share the column loop (`_gptq_device`:
    the scales, the loop and the re-quantization in one program; one weight at a time where their NVFP4 global
    scales differ)."""
    prep = [_prepare(w, scheme, h, block_size, dampening_frac, axis, qp, actorder, fn) for w, qp in zip(ws, qps)]
    ws = [p[0] for p in prep]
    axis = prep[0][1]
    qps = [p[2] for p in prep]
    concrete = prep[0][3]
    gs = [None if qp is None else qp.global_scale for qp in qps]
    same_g = all(g is None for g in gs) or (
        all(g is not None and not isinstance(g, jax.core.Tracer) for g in gs)
        and all(bool(jnp.all(jnp.asarray(g) == jnp.asarray(gs[0]))) for g in gs[1:]))
    u, dead, perm, fallback = _factor(h, dampening_frac, actorder, concrete)
    run = _device_jit() if concrete and not any(isinstance(w, jax.core.Tracer) for w in ws) else _gptq_device
    if len(ws) == 1 or same_g:
        out = list(run(ws, qps, u, dead, perm, scheme, axis, block_size))
    else:
        out = [run([w], [qp], u, dead, perm, scheme, axis, block_size)[0] for w, qp in zip(ws, qps)]
    if concrete and not isinstance(fallback, jax.core.Tracer) and bool(fallback):
        k = u.shape[0]
        shapes = ", ".join(str(tuple(w.shape)) for w in ws)
        warnings.warn(f"{fn}: the dampened Hessian ({k}x{k}) is not positive definite; weight of "
                      f"shape {shapes} quantized with round-to-nearest (as llm-compressor falls "
                      "back). Consider a larger dampening_frac or more calibration data.", stacklevel=3)
    return out


def _prepare(w, scheme, h, block_size, dampening_frac, axis, qparams, actorder, fn: str):
    """Validates gptq_quantize's arguments; returns (w, axis, qparams or None, concrete: H is not a tracer).
    qparams None stands for round-to-nearest's own (`quantize(w, scheme, axis)`), computed where it is used: by the
    caller here for NVFP4 (tensor_group) schemes, whose global scale decides whether weights share a loop; inside
    `_gptq_device` otherwise."""
    w = check_input(w, scheme, fn)
    if isinstance(actorder, str) and actorder.lower() in ("group", "dynamic"):
        raise SchemeError(f"{fn}: actorder={actorder!r} computes group scales on the activation-ordered "
                          "(permuted) weight, so each input column needs a g_idx (its group index) at inference; "
                          "qformats' QArray and checkpoint writer carry no g_idx. Use actorder='static' (scales "
                          "of the original column groups, no g_idx needed) or None")
    if not (actorder is None or (isinstance(actorder, str) and actorder in _ACTORDERS)):
        raise SchemeError(f"{fn}: actorder must be None, 'static' or 'weight', got {actorder!r}")
    if w.ndim < 2:
        raise SchemeError(f"{fn}: expected a kernel with ndim >= 2, got shape {tuple(w.shape)}")
    axis = normalize_axis(axis, w.ndim, fn)
    if scheme.strategy == "block" and w.ndim != 2:
        raise SchemeError(f"{fn}: block strategy needs a 2-D kernel, got shape {tuple(w.shape)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise SchemeError(f"{fn}: block_size must be a positive int, got {block_size!r}")
    if not (isinstance(dampening_frac, (int, float)) and math.isfinite(dampening_frac) and dampening_frac >= 0):
        raise SchemeError(f"{fn}: dampening_frac must be a finite float >= 0, got {dampening_frac!r}")
    k = w.shape[axis]
    concrete = not isinstance(h, jax.core.Tracer)
    if concrete:
        h = np.asarray(h)  # checked on the host: no device program per shape
    if tuple(h.shape) != (k, k):
        raise SchemeError(f"{fn}: Hessian h must have shape ({k}, {k}) for a weight of shape "
                          f"{tuple(w.shape)} contracted along axis {axis}, got shape {tuple(h.shape)}")
    if not jnp.issubdtype(h.dtype, jnp.floating):
        raise SchemeError(f"{fn}: Hessian h must be a float array, got {h.dtype}")
    if concrete and not np.isfinite(h).all():
        raise SchemeError(f"{fn}: Hessian h of shape {tuple(h.shape)} has "
                          f"{int(np.sum(~np.isfinite(h)))} non-finite entries")

    if qparams is None:
        if scheme.strategy == "tensor_group":
            qparams = _quantize_jit(w, scheme, axis)
    elif not isinstance(qparams, QArray) or qparams.scheme != scheme or qparams.shape != tuple(w.shape) \
            or qparams.axis != axis:
        raise SchemeError(f"{fn}: qparams must be a QArray of scheme {scheme.describe()!r}, shape "
                          f"{tuple(w.shape)}, axis {axis}; got {qparams!r}")
    return w, axis, qparams, concrete


def _factor(h, dampening_frac, actorder, concrete):
    """(U, dead, perm, fallback) of GPTQ's H: the activation order perm (None in column order) and `gptq_hinv`'s
    factor of the permuted H.

    A concrete H is ordered and factorized on the host by LAPACK (`gptq_hinv_host`: the routines torch's
    `cholesky_ex` / `cholesky_inverse` / `cholesky` call, blocked, where XLA:CPU's Cholesky and triangular
    solves run unblocked and cost more than the whole sweep); under a trace (jit, vmap) by `gptq_hinv`."""
    act_order = actorder is not None
    if concrete:
        hn = np.asarray(h, np.float32)
        perm = np.argsort(-np.diagonal(hn), kind="stable") if act_order else None
        if perm is not None:
            hn = hn[perm][:, perm]
        u, dead, fallback = gptq_hinv_host(hn, dampening_frac)
        return u, dead, None if perm is None else jnp.asarray(perm, jnp.int32), fallback
    h = jnp.asarray(h).astype(jnp.float32)
    perm = None
    if act_order:
        perm = jnp.argsort(jnp.diagonal(h), descending=True, stable=True)
        h = jnp.take(jnp.take(h, perm, axis=0), perm, axis=1)
    u, dead, fallback = gptq_hinv(h, dampening_frac)
    return u, dead, perm, fallback


def _gptq_device(ws, qps, u, dead, perm, scheme, axis, block_size):
    """GPTQ of weights `ws` that share one loop, given H's factor: each weight's scales (qparams, or
    round-to-nearest's), its [K, N] float32 view and per-element scales, the views concatenated along N and swept
    once (`_gptq_sweep`), each piece re-quantized with its own fixed scales (`_requantize`). One program per
    group of shapes: no per-step programs compiled and dispatched apart."""
    qps = [quantize(w, scheme, axis) if qp is None else qp for w, qp in zip(ws, qps)]
    # [K, N] working views (input rows; N = every other axis flattened, in QArray.tshape order)
    views = [jnp.moveaxis(w, axis, 0).reshape(w.shape[axis], -1).astype(jnp.float32) for w in ws]
    rows = [_row_qparams(qp, v.shape[0], v.shape[1]) for qp, v in zip(qps, views)]
    cat = (lambda xs: xs[0]) if len(ws) == 1 else (lambda xs: jnp.concatenate(xs, axis=1))
    w2, s_rows = cat(views), cat([r[0] for r in rows])
    z_rows = None if rows[0][1] is None else cat([r[1] for r in rows])
    sc = qps[0].scale.dtype
    sdt = sc if sc in R.FLOAT_DTYPES else jnp.dtype(jnp.float32)
    q2 = _gptq_sweep(w2, u, dead, perm, s_rows, z_rows, qps[0].global_scale, scheme, block_size, jnp.dtype(sdt).name)
    out, start = [], 0
    for w, v, qp in zip(ws, views, qps):
        n = v.shape[1]
        out.append(_requantize(q2[:, start:start + n], w, scheme, qp))
        start += n
    return out


@functools.lru_cache(maxsize=None)
def _device_jit():
    """`_gptq_device` compiled on its own (a concrete H: called eagerly; under a caller's trace `_gptq_device` is
    traced into the caller's program), with FAST_COMPILE on XLA:CPU when this XLA accepts it (a trivial program
    compiled with it once: an XLA without the option refuses it), else with the default compiler."""
    opts = None
    if jax.default_backend() == "cpu":
        try:
            jax.jit(lambda x: x + 1, compiler_options=FAST_COMPILE).lower(np.float32(0)).compile()
            opts = FAST_COMPILE
        except Exception:  # noqa: BLE001 -- an unknown option: compile as everything else does
            opts = None
    return jax.jit(_gptq_device, static_argnames=("scheme", "axis", "block_size"), compiler_options=opts)


def _requantize(q2, w, scheme, qparams: QArray) -> QArray:
    """Q [K, N] float32 back to w's layout and dtype, re-quantized with the fixed scales of `qparams`."""
    axis = qparams.axis
    k = w.shape[axis]
    rest = tuple(s for i, s in enumerate(w.shape) if i != axis)
    q = jnp.moveaxis(q2.reshape((k,) + rest), 0, axis).astype(w.dtype)
    return quantize(q, scheme, axis, scale=qparams.scale, zero_point=qparams.zero_point,
                    global_scale=qparams.global_scale)


def gptq_hinv(h, dampening_frac: float = DAMPENING_FRAC):
    """(U, dead, fallback): the upper Cholesky factor U of (H')^-1 GPTQ works with.

    H' = H with dead diagonal entries (H[k, k] == 0, flagged in `dead`) set to 1, plus
    dampening_frac * mean(diag H') on the diagonal. U satisfies (H')^-1 = U^T U. When H' is not positive
    definite (its Cholesky factor has NaNs), U = I and `fallback` is True: GPTQ then reduces to RTN.
    All in float32, as llm-compressor's `factorize_hessian`.
    """
    h = jnp.asarray(h, jnp.float32)
    n = h.shape[0]
    eye = jnp.eye(n, dtype=jnp.float32)
    d = jnp.diagonal(h)
    dead = d == 0
    h = jnp.where(eye.astype(bool) & dead[None, :], 1.0, h)
    damp = dampening_frac * jnp.mean(jnp.diagonal(h))
    h = h + damp * eye
    lower = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((lower, True), eye)  # cholesky_inverse(L)
    hinv = (hinv + hinv.T) * 0.5  # exactly symmetric, as LAPACK's potri leaves it
    u = jnp.triu(jnp.linalg.cholesky(hinv).T)
    fallback = ~(jnp.all(jnp.isfinite(lower)) & jnp.all(jnp.isfinite(u)))
    return jnp.where(fallback, eye, u), dead, fallback


def gptq_hinv_host(h, dampening_frac: float = DAMPENING_FRAC):
    """`gptq_hinv` for a concrete H, on the host with LAPACK in float32, step for step as llm-compressor's
    `factorize_hessian` calls torch: L = potrf(H', lower) (`torch.linalg.cholesky_ex`), H'^-1 = potri(L)
    (`torch.cholesky_inverse`, its lower triangle mirrored), U = potrf(H'^-1, upper) (`torch.linalg.cholesky(...,
    upper=True)`). H' as in `gptq_hinv` (dead diagonal entries set to 1; + dampening_frac * mean(diag H') * I).
    Returns (U, dead, fallback) as jax arrays; U = I and fallback True where a factorization fails."""
    h = np.array(h, np.float32)  # a copy: modified in place
    with _one_blas_thread():
        return _hinv_host(h, dampening_frac)


def _one_blas_thread():
    """A context limiting the host BLAS/LAPACK (scipy's OpenBLAS) to one thread, where threadpoolctl is installed.

    Why: factorizations of a few hundred to a few thousand rows are far too small to share between threads, and
    OpenBLAS's threads spin while they wait; on a machine whose cores are busy a 576-row potrf then costs ~250x
    its single-threaded CPU time. One thread also makes the factors independent of the core count."""
    if not _BLAS:
        import scipy.linalg.lapack  # noqa: F401  loaded first: the controller sees only the libraries loaded

        try:
            from threadpoolctl import ThreadpoolController
            _BLAS.append(ThreadpoolController())  # scans the loaded libraries once
        except ImportError:  # optional: without it, OpenBLAS keeps its own thread count (OPENBLAS_NUM_THREADS)
            _BLAS.append(None)
    return contextlib.nullcontext() if _BLAS[0] is None else _BLAS[0].limit(limits=1, user_api="blas")


_BLAS: list = []


def _hinv_host(h: np.ndarray, dampening_frac: float):
    """`gptq_hinv_host`'s factorizations on its float32 copy `h` (modified in place)."""
    from scipy.linalg import lapack

    n = h.shape[0]
    idx = np.arange(n)
    dead = h[idx, idx] == 0
    h[idx[dead], idx[dead]] = 1.0
    h[idx, idx] += np.float32(dampening_frac) * np.mean(h[idx, idx], dtype=np.float32)
    lower, info = lapack.spotrf(h, lower=1, clean=1)
    u = None
    if info == 0:
        hinv, info = lapack.spotri(lower, lower=1)
        if info == 0:
            # potrf(upper) reads the upper triangle only: that of hinv.T is potri's lower triangle, mirrored
            u, info = lapack.spotrf(hinv.T, lower=0, clean=1)
            if info != 0 or not np.all(np.isfinite(u)):
                u = None
    fallback = u is None
    u = np.eye(n, dtype=np.float32) if fallback else np.asarray(u, np.float32)
    return jnp.asarray(u), jnp.asarray(dead), jnp.asarray(fallback)


# ---- internals ----------------------------------------------------------------------------------------------
def _row_qparams(qa: QArray, k: int, n: int):
    """Scale and zero point of every element of the [K, N] view, as float32 [K, N] (E8M0: the codes).

    The stored scale is contracted over QArray.tshape = rest + (K,); N is `rest` flattened, so the [K, N]
    view is the expanded scale (`grouping.expand`) reshaped to [N, K] and transposed.
    """
    def rows(a):
        return expand(a.astype(jnp.float32), qa.scheme, qa.tshape).reshape(n, k).T

    z = None if qa.zero_point is None else rows(qa.zero_point)
    return rows(qa.scale), z


# jitted: op by op, every primitive of these would compile once per weight shape (dozens of small compilations)
_quantize_jit = jax.jit(quantize, static_argnames=("scheme", "axis"))


def _qdq_row(x, s, z, g, scheme: QuantScheme, sdt):
    """dequantize(quantize(x)) of one [N] row with given per-element scales (float32 in and out).

    Quantization: compute_scales' `apply` with the given scales (x / s (+ z) in float32, as x is the float32
    working copy) and the scheme's element rounding; dequantization: (value - z) * (s / g) rounded in the
    stored scale's dtype `sdt`, as `quantize.dequantize` (and compressed-tensors' `_dequantize`) do it.
    """
    sr = compute_scales(x, (0,), scheme, dtype=jnp.float32, global_scale=g, scale=s, zero_point=z)
    vals = element_values(round_elements(sr.apply(x), scheme.format), scheme.format, jnp.float32)
    scale = decode(s.astype(jnp.uint8), "e8m0", jnp.float32) if scheme.scale_format == "e8m0" else s
    if g is not None:
        scale = R.div(scale, g, sdt)
    if z is not None:
        vals = R.sub(vals, z, sdt)
    return R.mul(vals, scale, sdt)


_SUB_BLOCK = 8
"""Rows per sub-block of `_gptq_sweep`: a column's rank-1 update reaches only its sub-block's rows; the block's later
rows get the sub-block's errors in one GEMM (per column the loop then touches sb rows, not the block's b)."""


def _gptq_sweep(w, u, dead, perm, s_rows, z_rows, g, scheme: QuantScheme, block_size: int, sdt: str):
    """GPTQ's column sweep (`gptq_quantize` step 5) on W [K, N], given U [K, K] and the dead inputs of the
    (permuted, when `perm` is not None) H; rows processed in `perm` order and returned in the original order.

    Within a block of b rows, the column loop runs over sub-blocks of sb = `_SUB_BLOCK` rows: column k's rank-1
    update W1[j] -= e_k U[k, j] reaches only the rows j of its own sub-block; after the sub-block, its rows' errors
    E_s update the block's later rows at once, W1 -= U[s, :]^T E_s (a GEMM of sb-term sums), then the block's E the
    rows after the block (the lazy batch update, as before). In exact arithmetic this is llm-compressor's sweep;
    in float32 an element's sb updates are summed before being subtracted instead of subtracted one by one, so a
    rounding tie can, rarely, fall the other way (bench/gptq_parity.py measures the agreement)."""
    k, n = w.shape
    if perm is not None:  # llm-compressor's apply_activation_ordering; rows keep their own qparams
        w, s_rows = jnp.take(w, perm, axis=0), jnp.take(s_rows, perm, axis=0)
        if z_rows is not None:
            z_rows = jnp.take(z_rows, perm, axis=0)
    w = jnp.where(dead[:, None], 0.0, w)
    dt = jnp.dtype(sdt)
    sub = _SUB_BLOCK
    b = min(block_size, k)
    sb = math.gcd(b, sub)  # sub-blocks tile the block
    kp = -(-k // b) * b
    pad = kp - k
    if pad:  # zero rows with unit scales quantize to 0 with no error; U gets an identity block
        w = jnp.pad(w, ((0, pad), (0, 0)))
        one = 127.0 if scheme.scale_format == "e8m0" else 1.0
        s_rows = jnp.pad(s_rows, ((0, pad), (0, 0)), constant_values=one)
        if z_rows is not None:
            z_rows = jnp.pad(z_rows, ((0, pad), (0, 0)))
        u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(jnp.concatenate(
            [jnp.zeros((k,), jnp.float32), jnp.ones((pad,), jnp.float32)]))
    hi = jax.lax.Precision.HIGHEST
    row_ids = jnp.arange(kp)

    def column(i, c):
        ws, us, ss, zs, qs, es = c
        x = ws[i]
        q = _qdq_row(x, ss[i], None if zs is None else zs[i], g, scheme, dt)
        e = (x - q) / us[i, i]
        # U is upper triangular: us[i, j] == 0 for j < i, so rows already done are left unchanged
        ws = ws - us[i][:, None] * e[None, :]
        return ws, us, ss, zs, qs.at[i].set(q), es.at[i].set(e)

    def block(bi, wq):
        i1 = bi * b
        w1 = jax.lax.dynamic_slice(wq, (i1, 0), (b, n))
        u1 = jax.lax.dynamic_slice(u, (i1, i1), (b, b))

        def step(j, c):  # one sub-block of sb rows: its column loop, then its update of the block's later rows
            w1, q1, e1 = c
            r = j * sb
            ws = jax.lax.dynamic_slice(w1, (r, 0), (sb, n))
            us = jax.lax.dynamic_slice(u1, (r, r), (sb, sb))
            ss = jax.lax.dynamic_slice(s_rows, (i1 + r, 0), (sb, n))
            zs = None if z_rows is None else jax.lax.dynamic_slice(z_rows, (i1 + r, 0), (sb, n))
            zeros = jnp.zeros((sb, n), jnp.float32)
            *_, qs, es = jax.lax.fori_loop(0, sb, column, (ws, us, ss, zs, zeros, zeros))
            # U[r:r+sb, :] is zero before column r: earlier rows unchanged; the sub-block's own rows are done
            w1 = w1 - jnp.matmul(jax.lax.dynamic_slice(u1, (r, 0), (sb, b)).T, es, precision=hi)
            return w1, jax.lax.dynamic_update_slice(q1, qs, (r, 0)), jax.lax.dynamic_update_slice(e1, es, (r, 0))

        zeros = jnp.zeros((b, n), jnp.float32)
        _, q1, e1 = jax.lax.fori_loop(0, b // sb, step, (w1, zeros, zeros))
        ub = jax.lax.dynamic_slice(u, (i1, 0), (b, kp))  # U[i1:i2, :]: the lazy batch update of the later rows
        upd = jnp.matmul(ub.T, e1, precision=hi)
        wq = wq - jnp.where((row_ids >= i1 + b)[:, None], upd, 0.0)
        return jax.lax.dynamic_update_slice(wq, q1, (i1, 0))

    wq = jax.lax.fori_loop(0, kp // b, block, w)[:k]
    if perm is not None:
        wq = jnp.take(wq, jnp.argsort(perm), axis=0)  # restore the original order (torch.gather by invperm)
    return wq
