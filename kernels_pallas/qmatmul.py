"""Packed-weight matmul y = x @ dequantize(q) as a Pallas (Triton) kernel that dequantizes in registers.

The kernel reads the bit-plane layout of `kernels_pallas.layout` (see its docstring), never a dense weight.
Grid `(ceil(M / block_m), N_pad / block_n, split_k)` (block_n is the layout's); program (i, j, s) loops
over its share of the K tiles (`lax.fori_loop`, the Pallas-Triton idiom: grid axes run in parallel on GPU,
so a reduction lives inside the kernel). Per K tile it walks `block_k / chunk` chunks; per chunk it loads
the chunk's word rows of every plane (`(word >> i*w) & mask` on four codes at once, OR-ed at the plane's
shift; a plane block loaded for one chunk is reused by the chunks that share it), decodes the four byte
lanes through f16 bit patterns (exact), applies zero point, scale and the optional additive offset (GGUF
minima) exactly as `qformats.dequantize` rounds them, casts to the activation dtype and accumulates four `dot(x_chunk, w_lane)` into the four
quarter-blocks of output columns, in f32. That is the dot form (block_m >= 16). The GEMV form
(block_m 1..8, the default for M <= 2) uses no tensor-core dot: each row of x multiplies the decoded
lanes into f32 accumulators [32, block_n/4] (one FMA per weight and row), reduced over K once after the
loop. With split_k > 1 each split writes an f32 partial sum and the partials are added outside the
kernel (decode: more programs than one M block alone gives).

Shapes: M is covered by ceil(M / block_m) blocks (the dot form needs block_m >= 16, Triton's smallest
dot), the last one loading and storing under a row mask, so decode pays no pad; x is zero-padded along K only when K is not
a multiple of block_k (padded codes then contribute nothing); N is padded to N_pad by `prepare` and the
result sliced back only when N_pad != N. Every array a kernel loads or stores is
a power-of-two shape (Triton's requirement); the full-K x block is only ever loaded in chunks.

Numerics: the dequantized weights are bit-identical to `qformats.dequantize(q, x.dtype)`; the products
x*w are exact in f32 for bf16/f16 inputs (f32 inputs: IEEE f32 dot), accumulated in f32. The result
differs from `jnp.dot(x, dequantize(q, x.dtype), preferred_element_type=f32).astype(x.dtype)` only by
accumulation order: |y - y_ref| <= eps(x.dtype) * |y_ref| + 2 * K * 2^-24 * (|x| @ |w|).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qformats.errors import KernelError
from qformats.qarray import QArray

from kernels_pallas.layout import (LANES, LayoutMeta, PreparedWeight, decode_words, finish, plane_part, prepare,
                                   scale_values, unsupported_reason)

try:  # the Triton CompilerParams select the Triton backend (jax >= 0.7 defaults GPU Pallas to Mosaic GPU)
    from jax.experimental.pallas import triton as pltriton
    _TritonParams = pltriton.CompilerParams
except Exception:  # pragma: no cover - very old/new jax
    _TritonParams = None

try:
    from jax._src.core import Tracer as _Tracer  # jax.core.Tracer is being retired from the public API
except ImportError:  # pragma: no cover
    _Tracer = jax.core.Tracer

_SQUEEZED = getattr(pl, "squeezed", None)
GEMV_CHUNK = 32  # K rows per step of the GEMV form (any power of two <= the layout's chunk works)  # None is the older spelling of a squeezed block dimension

X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

__all__ = ["BlockSizes", "qmatmul", "default_block_sizes", "X_DTYPES"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one qmatmul call (block_k and block_n are fixed by `prepare`).

    block_m: rows of x per program: 1, 2, 4 or 8 for the GEMV form (FMAs into per-row accumulators, no
    tensor-core dot), a power of two >= 16 for the dot form; block_n: None (the layout's) or equal to it;
    split_k: K-splits, 1 .. the number of K tiles (ceil(tiles / split_k) tiles each, the last fewer);
    num_warps / num_stages: Triton launch parameters.
    """

    block_m: int = 16
    block_n: Optional[int] = None
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_block_sizes(m: int, meta: LayoutMeta, num_sms: int = 132) -> BlockSizes:
    """Heuristic tiling (to be replaced by measured winners: bench/kernels.py --tune): M <= 2 the GEMV form
    with block_m = M, M <= 16 one 16-row dot block, both with split-K until ~2 programs per SM (keeping
    >= 4 K tiles per split); M <= 32 a 32-row block; prefill 64-row blocks (128 when block_n <= 64 and
    M >= 256)."""
    bn = meta.block_n
    if m <= 2:
        bm = max(m, 1)  # GEMV form
    elif m <= 16:
        bm = 16
    elif m <= 32:
        bm = 32
    elif m >= 256 and bn <= 64:
        bm = 128
    else:
        bm = 64
    programs = (-(-m // bm)) * (meta.N_pad // bn)
    tiles = meta.K_pad // meta.block_k
    split = 1
    while programs * split < 2 * num_sms and tiles // (split * 2) >= 4:
        split *= 2
    warps = 4 if bm * bn <= 64 * 64 else 8
    return BlockSizes(block_m=bm, block_n=bn, split_k=split, num_warps=warps, num_stages=3)


def _kernel(x_ref, *refs, meta: LayoutMeta, tiles_per_split: int, tiles: int, out_f32: bool, interpret: bool,
            m: int, probe: Optional[str] = None):
    n_planes = len(meta.planes)
    plane_refs = refs[:n_planes]
    rest = list(refs[n_planes:])
    s_ref = rest.pop(0)
    z_ref = rest.pop(0) if meta.has_zero else None
    g_ref = rest.pop(0) if meta.has_global else None
    off_ref = rest.pop(0) if meta.has_offset else None
    (o_ref,) = rest
    bm = x_ref.shape[0]
    bn4 = meta.block_n // LANES
    bk, cs = meta.block_k, meta.chunk
    split = pl.program_id(2)
    gscale = g_ref[...] if g_ref is not None else None
    xdt = x_ref.dtype
    # x is not padded along M (a pad would be one more launch at decode): the last M block masks its rows.
    row_mask = None
    if m % bm:
        row_mask = ((pl.program_id(0) * bm + jnp.arange(bm)) < m)[:, None]
    # block_m < 16: the GEMV form. No tensor-core dot (whose smallest M is 16, and whose operand layout
    # costs a shared-memory round trip per chunk): per row r and lane q an f32 [chunk, bn/4] accumulator
    # takes x[r, k] * w[k, n] (one FMA per weight and row); it is reduced over k once, after the K loop.
    gemv = bm < 16
    if gemv:  # smaller chunks keep the accumulators at [<= 32, bn/4] per row and lane (registers)
        cs = min(cs, GEMV_CHUNK)
    row_ok = [None] * bm
    if gemv and m % bm:
        row_ok = [pl.program_id(0) * bm + r < m for r in range(bm)]
        last_row = m - 1 - pl.program_id(0) * bm

    def scales_at(row):
        """Per-lane effective scale [1, bn/4], zero point and offset of scale row `row`."""
        out = []
        for q in range(LANES):
            cols = pl.ds(q * bn4, bn4)
            s = scale_values(s_ref[pl.ds(row, 1), cols], meta, gscale, barrier=interpret)
            out.append((s, z_ref[pl.ds(row, 1), cols] if z_ref is not None else None,
                        off_ref[pl.ds(row, 1), cols].astype(jnp.float32) if off_ref is not None else None))
        return out

    # A scale row is decoded once per row, not per chunk: once per call for per-channel scales, once per
    # tile when a group spans whole tiles, once per group inside a tile otherwise.
    g = meta.group
    hoisted = scales_at(0) if g >= meta.K_pad else None
    aligned = g % bk == 0 or bk % g == 0

    def body(t, accs):
        kt = split * tiles_per_split + t
        accs = list(accs)
        loaded = {}
        srows = {}
        for c in range(bk // cs):  # static: chunks of one K tile
            r0 = c * cs
            code = None
            for p, (ref, (w, sh)) in enumerate(zip(plane_refs, meta.planes)):
                R = bk * w // 8
                slot, off = divmod(r0, R)
                if (p, off) not in loaded:  # chunks in other slots of the same byte rows reuse the load
                    loaded[(p, off)] = ref[pl.ds(kt * R + off, cs), :]
                part = plane_part(loaded[(p, off)], slot, w, sh)
                code = part if code is None else code | part
            if probe == "no_decode":  # timing probe only (wrong values): the loads and dots without the decode
                lanes = [(code >> (8 * q)).astype(jnp.float32) for q in range(LANES)]
            else:
                lanes = decode_words(code, meta)
            if hoisted is not None:
                sz = hoisted
            else:
                key = (r0 // g) if aligned else c
                if key not in srows:
                    srows[key] = scales_at((kt * bk + r0) // g)
                sz = srows[key]
            if gemv:
                wqs = [finish(lanes[q], sz[q][0], sz[q][1], meta, xdt, sz[q][2]).astype(jnp.float32)
                       for q in range(LANES)]
                for r in range(bm):
                    cols = pl.ds(kt * bk + r0, cs)
                    # rows past M (last block) read row M-1 instead; their sums are never stored
                    xr = x_ref[r if row_ok[r] is None else jnp.minimum(r, last_row), cols]
                    xr = xr.astype(jnp.float32)[:, None]
                    for q in range(LANES):
                        accs[r * LANES + q] = accs[r * LANES + q] + xr * wqs[q]
                continue
            if row_mask is None:
                xc = x_ref[:, pl.ds(kt * bk + r0, cs)]
            else:
                xc = pltriton.load(x_ref.at[:, pl.ds(kt * bk + r0, cs)], mask=row_mask, other=0)
            for q in range(LANES):
                wq = finish(lanes[q], sz[q][0], sz[q][1], meta, xdt, sz[q][2])
                accs[q] = accs[q] + jnp.dot(xc, wq, preferred_element_type=jnp.float32)
        return tuple(accs)

    n_tiles = tiles_per_split
    if tiles % tiles_per_split:  # the last split has fewer tiles
        n_tiles = jnp.minimum(tiles_per_split, tiles - split * tiles_per_split)
    if gemv:
        zero = jnp.zeros((cs, bn4), jnp.float32)
        accs = jax.lax.fori_loop(0, n_tiles, body, (zero,) * (LANES * bm))
        for r in range(bm):
            for q in range(LANES):
                out = jnp.sum(accs[r * LANES + q], axis=0)
                out = out if out_f32 else out.astype(o_ref.dtype)
                if row_ok[r] is None:
                    o_ref[r, pl.ds(q * bn4, bn4)] = out
                else:
                    pltriton.store(o_ref.at[pl.ds(r, 1), pl.ds(q * bn4, bn4)], out[None, :],
                                   mask=jnp.broadcast_to(row_ok[r], (1, bn4)))
        return
    zero = jnp.zeros((bm, bn4), jnp.float32)
    accs = jax.lax.fori_loop(0, n_tiles, body, (zero,) * LANES)
    for q in range(LANES):
        out = accs[q] if out_f32 else accs[q].astype(o_ref.dtype)
        if row_mask is None:
            o_ref[:, pl.ds(q * bn4, bn4)] = out
        else:
            pltriton.store(o_ref.at[:, pl.ds(q * bn4, bn4)], out, mask=row_mask)


def _qmatmul_2d(x, pw: PreparedWeight, bs: BlockSizes, interpret: bool):
    """Jitted `_qmatmul_2d_impl`. Called eagerly in interpret mode, the interpreter's XLA:CPU program is
    compiled without LLVM's expensive passes (it runs once per test; compiling it is most of its cost);
    jax takes compiler options on top-level jits only, so under an outer jit the plain one is used."""
    top_level = not isinstance(x, _Tracer)
    fn = _qmatmul_2d_interp if (interpret and top_level) else _qmatmul_2d_gpu
    return fn(x, pw, bs=bs, interpret=interpret)


def _qmatmul_2d_impl(x, pw: PreparedWeight, bs: BlockSizes, interpret: bool, probe: Optional[str] = None):
    """x [M, K_pad] (padded along K only) -> y [M, N_pad] in x.dtype."""
    meta = pw.meta
    m = x.shape[0]  # the true M: the grid covers it with ceil(M / block_m) blocks, the last one masked
    bm, bn, split = bs.block_m, meta.block_n, bs.split_k
    tiles = meta.K_pad // meta.block_k
    grid = (-(-m // bm), meta.N_pad // bn, split)
    in_specs = [pl.BlockSpec((bm, meta.K_pad), lambda i, j, s: (i, 0))]
    args = [x]
    for p in pw.planes:
        in_specs.append(pl.BlockSpec((p.shape[0], bn // LANES), lambda i, j, s: (0, j)))
        args.append(p)
    in_specs.append(pl.BlockSpec((pw.scale.shape[0], bn), lambda i, j, s: (0, j)))
    args.append(pw.scale)
    if meta.has_zero:
        in_specs.append(pl.BlockSpec((pw.zero.shape[0], bn), lambda i, j, s: (0, j)))
        args.append(pw.zero)
    if meta.has_global:
        in_specs.append(pl.BlockSpec((1, 1), lambda i, j, s: (0, 0)))
        args.append(pw.gscale)
    if meta.has_offset:
        in_specs.append(pl.BlockSpec((pw.offset.shape[0], bn), lambda i, j, s: (0, j)))
        args.append(pw.offset)
    if split == 1:
        out_shape = jax.ShapeDtypeStruct((m, meta.N_pad), x.dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split, m, meta.N_pad), jnp.float32)
        out_spec = pl.BlockSpec((_SQUEEZED, bm, bn), lambda i, j, s: (s, i, j))
    kernel = functools.partial(_kernel, meta=meta, tiles_per_split=-(-tiles // split), tiles=tiles,
                               out_f32=split > 1, interpret=interpret, m=m, probe=probe)
    extra = {}
    if _TritonParams is not None:
        extra["compiler_params"] = _TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    y = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
                       interpret=interpret, name=f"qmatmul_{meta.fmt.name}", **extra)(*args)
    if split > 1:
        y = y.sum(axis=0).astype(x.dtype)
    return y


_qmatmul_2d_gpu = jax.jit(_qmatmul_2d_impl, static_argnames=("bs", "interpret", "probe"))
_qmatmul_2d_interp = jax.jit(_qmatmul_2d_impl, static_argnames=("bs", "interpret", "probe"),
                             compiler_options={"xla_backend_optimization_level": 0,
                                               "xla_llvm_disable_expensive_passes": True})


def _check_block_sizes(bs: BlockSizes, meta: LayoutMeta) -> None:
    def pow2(v):
        return v >= 16 and v & (v - 1) == 0
    tiles = meta.K_pad // meta.block_k
    bad = []
    if not (pow2(bs.block_m) or bs.block_m in (1, 2, 4, 8)):
        bad.append(f"block_m={bs.block_m} (1, 2, 4, 8: GEMV form; or a power of two >= 16: dot form)")
    if bs.block_n is not None and bs.block_n != meta.block_n:
        bad.append(f"block_n={bs.block_n} (fixed by prepare at {meta.block_n}: prepare(q, block_n=...))")
    if not 1 <= bs.split_k <= tiles:
        bad.append(f"split_k={bs.split_k} (1 .. the {tiles} K tiles of {meta.block_k})")
    if bad:
        raise KernelError(f"qmatmul: bad block sizes for {meta.describe()}: {', '.join(bad)}")


def qmatmul(x: jax.Array, q: Union[QArray, PreparedWeight], *, interpret: Optional[bool] = None,
            block_sizes: Union[BlockSizes, dict, None] = None) -> jax.Array:
    """y[..., n] = sum_k x[..., k] * W[k, n], W = dequantize(q) of logical shape [K, N], quantized along K.

    The weight is read packed and dequantized in registers (see the module docstring); pass a
    `PreparedWeight` (`kernels_pallas.prepare(q)`, done once at load) to skip the per-call repack that a
    plain QArray costs.

    Args:
      x: activations [..., K], bfloat16, float16 or float32.
      q: QArray [K, N] (axis 0) of a supported scheme, or its PreparedWeight.
      interpret: run the Pallas interpreter (default: True unless the default backend is GPU).
      block_sizes: BlockSizes or a dict of its fields (default: `default_block_sizes`).

    Returns:
      [..., N] in x.dtype (accumulated in f32).

    Raises:
      KernelError: x's K differs from the weight's, x's dtype is not supported, or the scheme has no
        kernel layout.
    """
    if isinstance(q, QArray):
        why = unsupported_reason(q)
        if why is not None:
            raise KernelError(f"qmatmul: no kernel for {q.scheme.describe()} shape {q.shape}: {why}")
        kdesc = f"{q.scheme.describe()} shape {q.shape}"
        K = q.shape[0]
    elif isinstance(q, PreparedWeight):
        kdesc, K = q.meta.describe(), q.meta.K
    else:
        raise KernelError(f"qmatmul: expected a QArray or PreparedWeight, got {type(q).__name__}")
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != K:
        raise KernelError(f"qmatmul: x has shape {tuple(x.shape)} (K = {x.shape[-1] if x.ndim else None}) "
                          f"but the weight {kdesc} has K = {K}")
    if x.dtype not in X_DTYPES:
        raise KernelError(f"qmatmul: x dtype {x.dtype} is not supported (expected bfloat16, float16 or "
                          f"float32); weight {kdesc}")
    if isinstance(q, QArray):
        bn = block_sizes.get("block_n") if isinstance(block_sizes, dict) else getattr(block_sizes, "block_n", None)
        pw = prepare(q, block_n=bn or 64)
    else:
        pw = q
    meta = pw.meta
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lead = x.shape[:-1]
    m = math.prod(lead)
    if isinstance(block_sizes, dict):
        block_sizes = dataclasses.replace(default_block_sizes(m, meta), **block_sizes)
    bs = block_sizes or default_block_sizes(m, meta)
    _check_block_sizes(bs, meta)
    if m == 0:
        return jnp.zeros((*lead, meta.N), x.dtype)
    x2 = x.reshape(m, K)
    if meta.K_pad != K:
        x2 = jnp.pad(x2, ((0, 0), (0, meta.K_pad - K)))
    y = _qmatmul_2d(x2, pw, bs, bool(interpret))
    if meta.N_pad != meta.N:
        y = y[:, : meta.N]
    return y.reshape(*lead, meta.N)
