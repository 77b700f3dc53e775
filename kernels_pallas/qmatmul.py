"""Packed-weight matmul y = x @ dequantize(q) as a Pallas (Triton) kernel that dequantizes in registers.

The kernel reads the bit-plane layout of `kernels_pallas.layout` (see its docstring), never a dense weight.
Grid `(M_pad / block_m, N_pad / block_n, split_k)`; program (i, j, s) loops over its share of the K tiles
(`lax.fori_loop`, the Pallas-Triton idiom: grid axes run in parallel on GPU, so a reduction lives inside the
kernel). Per K tile it walks `block_k / chunk` chunks; per chunk it loads the chunk's byte rows of every
plane (`(byte >> i*w) & mask`, OR-ed at the plane's shift), decodes the codes to f32 with integer bit ops,
applies zero point and scale exactly as `qformats.dequantize` rounds them, casts to the activation dtype
and accumulates `dot(x_chunk, w_chunk)` in f32. With split_k > 1 each split writes an f32 partial sum and
the partials are added outside the kernel (decode: more programs than 16-row M blocks alone would give).

Shapes: M is covered by ceil(M / block_m) blocks (block_m >= 16, Triton's smallest dot), the last one
loading and storing under a row mask, so decode pays no pad; x is zero-padded along K only when K is not
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

from kernels_pallas.layout import (LayoutMeta, PreparedWeight, dequant_chunk, prepare, unsupported_reason)

try:  # the Triton CompilerParams select the Triton backend (jax >= 0.7 defaults GPU Pallas to Mosaic GPU)
    from jax.experimental.pallas import triton as pltriton
    _TritonParams = pltriton.CompilerParams
except Exception:  # pragma: no cover - very old/new jax
    _TritonParams = None

_SQUEEZED = getattr(pl, "squeezed", None)  # None is the older spelling of a squeezed block dimension

X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

__all__ = ["BlockSizes", "qmatmul", "default_block_sizes", "X_DTYPES"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one qmatmul call (block_k is fixed by `prepare`).

    block_m: rows of x per program (power of two >= 16); block_n: output columns per program (power of
    two >= 16 dividing N_pad); split_k: K-splits (divides the number of K tiles); num_warps/num_stages:
    Triton launch parameters.
    """

    block_m: int = 16
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_block_sizes(m: int, meta: LayoutMeta, num_sms: int = 132) -> BlockSizes:
    """Heuristic tiling: decode (M <= 16) one 16-row block, N blocks of 64..128 and split-K to fill
    ~2 programs per SM; prefill 64-row blocks (128 for M >= 256), 128 columns, no split."""
    bn = math.gcd(meta.N_pad, 128)
    if m <= 16:
        bm, bn = 16, math.gcd(meta.N_pad, 64)
    elif m <= 32:
        bm = 32
    else:
        bm = 64
    programs = (-(-m // bm)) * (meta.N_pad // bn)
    tiles = meta.K_pad // meta.block_k
    split = 1
    while programs * split < 2 * num_sms and tiles % (split * 2) == 0 and tiles // (split * 2) >= 4:
        split *= 2
    warps = 4 if bm * bn <= 64 * 128 else 8
    return BlockSizes(block_m=bm, block_n=bn, split_k=split, num_warps=warps, num_stages=3)


def _kernel(x_ref, *refs, meta: LayoutMeta, tiles_per_split: int, out_f32: bool, interpret: bool, m: int):
    n_planes = len(meta.planes)
    plane_refs = refs[:n_planes]
    rest = list(refs[n_planes:])
    s_ref = rest.pop(0)
    z_ref = rest.pop(0) if meta.has_zero else None
    g_ref = rest.pop(0) if meta.has_global else None
    (o_ref,) = rest
    bm = x_ref.shape[0]
    bn = o_ref.shape[-1]
    bk, cs = meta.block_k, meta.chunk
    split = pl.program_id(2)
    gscale = g_ref[...] if g_ref is not None else None
    xdt = x_ref.dtype
    # x is not padded along M (a pad would be one more launch at decode): the last M block masks its rows.
    row_mask = None
    if m % bm:
        row_mask = ((pl.program_id(0) * bm + jnp.arange(bm)) < m)[:, None]

    def body(t, acc):
        kt = split * tiles_per_split + t
        for c in range(bk // cs):  # static: chunks of one K tile
            r0 = c * cs
            code = None
            for ref, (w, sh) in zip(plane_refs, meta.planes):
                R = bk * w // 8
                slot, off = divmod(r0, R)
                b = ref[pl.ds(kt * R + off, cs), :].astype(jnp.int32)
                part = b >> (slot * w) if slot else b
                if (slot + 1) * w < 8:  # the top slot of a byte needs no mask
                    part = part & ((1 << w) - 1)
                if sh:
                    part = part << sh
                code = part if code is None else code | part
            row = (kt * bk + r0) // meta.group
            s = s_ref[pl.ds(row, 1), :]
            z = z_ref[pl.ds(row, 1), :] if z_ref is not None else None
            wts = dequant_chunk(code, s, z, gscale, meta, xdt, barrier=interpret)
            if row_mask is None:
                xc = x_ref[:, pl.ds(kt * bk + r0, cs)]
            else:
                xc = pltriton.load(x_ref.at[:, pl.ds(kt * bk + r0, cs)], mask=row_mask, other=0)
            acc = acc + jnp.dot(xc, wts, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, tiles_per_split, body, jnp.zeros((bm, bn), jnp.float32))
    out = acc if out_f32 else acc.astype(o_ref.dtype)
    if row_mask is None:
        o_ref[...] = out
    else:
        pltriton.store(o_ref.at[:, :], out, mask=row_mask)


@functools.partial(jax.jit, static_argnames=("bs", "interpret"))
def _qmatmul_2d(x, pw: PreparedWeight, bs: BlockSizes, interpret: bool):
    """x [M, K_pad] (padded along K only) -> y [M, N_pad] in x.dtype."""
    meta = pw.meta
    m_pad = x.shape[0]  # the true M: the grid covers it with ceil(M / block_m) blocks, the last one masked
    bm, bn, split = bs.block_m, bs.block_n, bs.split_k
    tiles = meta.K_pad // meta.block_k
    grid = (-(-m_pad // bm), meta.N_pad // bn, split)
    in_specs = [pl.BlockSpec((bm, meta.K_pad), lambda i, j, s: (i, 0))]
    args = [x]
    for p in pw.planes:
        in_specs.append(pl.BlockSpec((p.shape[0], bn), lambda i, j, s: (0, j)))
        args.append(p)
    in_specs.append(pl.BlockSpec((pw.scale.shape[0], bn), lambda i, j, s: (0, j)))
    args.append(pw.scale)
    if meta.has_zero:
        in_specs.append(pl.BlockSpec((pw.zero.shape[0], bn), lambda i, j, s: (0, j)))
        args.append(pw.zero)
    if meta.has_global:
        in_specs.append(pl.BlockSpec((1, 1), lambda i, j, s: (0, 0)))
        args.append(pw.gscale)
    if split == 1:
        out_shape = jax.ShapeDtypeStruct((m_pad, meta.N_pad), x.dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split, m_pad, meta.N_pad), jnp.float32)
        out_spec = pl.BlockSpec((_SQUEEZED, bm, bn), lambda i, j, s: (s, i, j))
    kernel = functools.partial(_kernel, meta=meta, tiles_per_split=tiles // split, out_f32=split > 1,
                               interpret=interpret, m=m_pad)
    extra = {}
    if _TritonParams is not None:
        extra["compiler_params"] = _TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    y = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
                       interpret=interpret, name=f"qmatmul_{meta.fmt.name}", **extra)(*args)
    if split > 1:
        y = y.sum(axis=0).astype(x.dtype)
    return y


def _check_block_sizes(bs: BlockSizes, meta: LayoutMeta, m_pad: int) -> None:
    def pow2(v):
        return v >= 16 and v & (v - 1) == 0
    tiles = meta.K_pad // meta.block_k
    bad = []
    if not pow2(bs.block_m):
        bad.append(f"block_m={bs.block_m} (power of two >= 16)")
    if not pow2(bs.block_n) or meta.N_pad % bs.block_n:
        bad.append(f"block_n={bs.block_n} (power of two >= 16 dividing N_pad={meta.N_pad})")
    if bs.split_k < 1 or tiles % bs.split_k:
        bad.append(f"split_k={bs.split_k} (must divide the {tiles} K tiles of {meta.block_k})")
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
    pw = prepare(q) if isinstance(q, QArray) else q
    meta = pw.meta
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lead = x.shape[:-1]
    m = math.prod(lead)
    if isinstance(block_sizes, dict):
        block_sizes = dataclasses.replace(default_block_sizes(m, meta), **block_sizes)
    bs = block_sizes or default_block_sizes(m, meta)
    _check_block_sizes(bs, meta, m)
    if m == 0:
        return jnp.zeros((*lead, meta.N), x.dtype)
    x2 = x.reshape(m, K)
    if meta.K_pad != K:
        x2 = jnp.pad(x2, ((0, 0), (0, meta.K_pad - K)))
    y = _qmatmul_2d(x2, pw, bs, bool(interpret))
    if meta.N_pad != meta.N:
        y = y[:, : meta.N]
    return y.reshape(*lead, meta.N)
