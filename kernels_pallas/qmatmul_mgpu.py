"""Packed-weight matmul y = x @ dequantize(q) as a Mosaic GPU (Hopper) kernel: TMA, in-register decode, wgmma.

Computes y^T = W^T x^T ("swap AB"): the decoded weight tile is the *register* operand of `wgmma` (64 output
channels per warpgroup, wgmma's M), the activations the shared-memory operand (their token count is wgmma's
N: 16 .. 256 tokens, so M = 1 pays for 16 rows of tensor-core work, not 64, and the weight never goes back
to shared memory). The layout is `layout_mgpu`'s (byte planes [N, 64] per 64 K positions, scale rows).

Grid `(N_pad / (64 compute_wgs), M_pad / tile_m, split_k)`. A program owns 64 (one compute warpgroup) or 128
(two, warp-specialized) output channels x tile_m tokens and `K_pad / tile_k / split_k` K tiles, streamed by TMA
into shared memory, `stages` tiles in flight: the x^T tile, every plane chunk and the tile's scale (f32, or
E8M0 / e4m3 codes), zero rows, offset rows and NVFP4's scale table. One warpgroup: `plgpu.emit_pipeline` (the same warpgroup
issues the copies and computes). Two: `plgpu.emit_pipeline_warp_specialized` (a memory warpgroup with 40
registers issues the copies; each compute warpgroup decodes and multiplies its 64 channels of the shared tiles
and writes its own epilogue), the default from 64 tokens on.

Per K tile and per 64-position chunk: the plane bytes are loaded into registers (WGMMA layout, 64-byte
swizzle), shifted, masked and OR-ed into codes (`layout_mgpu.chunk_codes`), placed into IEEE halves and widened
to f32 (`layout.decode_elements`), zero point subtracted, scale multiplied and the optional offset added as
`qformats.dequantize` rounds them (`layout.finish`), cast to x's dtype and fed to `wgmma` against the matching rows of the x^T tile (one
wgmma per scale group when the group is 16 or 32; the x^T tile is swizzled at min(2 tile_m, 2 group, 128)
bytes). The f32 accumulator goes through shared memory to y^T (f32 partial sums per split when split_k > 1,
added outside), transposed back outside the kernel.

`lhs="smem"` stores each decoded slice into a swizzled shared-memory tile and runs wgmma from there: that is
what GPU interpret mode (which only takes reference operands) runs on the CPU, and a variant to measure on
the device; `lhs="regs"` (default on GPU) keeps the weight in registers. Both are lowered for cuda in the
tests.

Not done (see NOTES.md): an FMA GEMV path for M <= 8 (wgmma with a 16-token tile does the work here), f32
activations (wgmma would be tf32: not exact; they take the Triton or XLA path), a persistent grid.

Numerics: weights bit-identical to `qformats.dequantize(q, x.dtype)`; products exact in f32, accumulated in
f32 (wgmma's order): |y - y_ref| <= eps(x.dtype) |y_ref| + 2 K 2^-24 (|x| @ |w|).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from qformats.errors import KernelError
from qformats.qarray import QArray

from kernels_pallas.layout import decode_elements, finish
from kernels_pallas.layout_mgpu import (CHUNK, TABLE_LEN, TILE_N, MgpuMeta, MgpuWeight, chunk_codes,
                                        mgpu_unsupported_reason, prepare_mgpu)

try:  # GPU interpret mode lives under a private path in jax 0.10-0.11; this is its only import in the package
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as _InterpretGPUParams
except ImportError:  # pragma: no cover - a jax without GPU interpret mode
    _InterpretGPUParams = None

__all__ = ["MgpuBlockSizes", "qmatmul_mgpu", "default_mgpu_block_sizes", "MGPU_X_DTYPES", "interpret_params"]

MGPU_X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_LIMIT = 232448  # bytes of shared memory per block on H100/H200 (227 KB)
MAX_STAGES = 4


def interpret_params():
    """The GPU interpret mode parameters (runs a Mosaic GPU kernel on the CPU, simulating SMEM, TMA, barriers)."""
    if _InterpretGPUParams is None:
        raise KernelError("qmatmul_mgpu: this jax has no Mosaic GPU interpret mode (InterpretGPUParams)")
    return _InterpretGPUParams()


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """Tiling of one Mosaic GPU qmatmul call.

    tile_m: tokens per program (wgmma's N; the x^T tile's swizzled minor dimension): 16, 32, 64, 128, 192
    or 256; split_k: K splits (divides the K tile count); stages: K tiles in flight in the TMA pipeline;
    lhs: "regs" (decoded weight as wgmma's register operand) or "smem" (through a shared-memory tile; forced
    in interpret mode); compute_wgs: 1 (one warpgroup loads and computes 64 channels: `emit_pipeline`) or 2
    (warp specialization: a memory warpgroup issues the TMA copies while two compute warpgroups decode and
    multiply 64 channels each, 128 per program: `emit_pipeline_warp_specialized`; needs N_pad % 128 == 0).
    """

    tile_m: int = 16
    split_k: int = 1
    stages: int = 2
    lhs: str = "regs"
    compute_wgs: int = 1


def _stage_bytes(tm: int, meta: MgpuMeta, wgs: int = 1, xbytes: int = 2) -> int:
    tk, n = meta.tile_k, TILE_N * wgs
    rows = max(1, tk // meta.group)
    sbytes = 4 if meta.scale_kind == "float" else 1
    return tm * tk * xbytes + n * tk * meta.fmt.bits // 8 + rows * n * (sbytes + 4 * meta.has_zero
                                                                        + 4 * meta.has_offset)


def _smem_bytes(bs: MgpuBlockSizes, meta: MgpuMeta) -> int:
    """Shared memory of one program: the pipeline stages, the f32 epilogue tiles, the weight tiles of
    lhs="smem" and 1 KB for barriers."""
    wgs = bs.compute_wgs
    return (bs.stages * _stage_bytes(bs.tile_m, meta, wgs) + wgs * TILE_N * bs.tile_m * 4
            + (wgs * TILE_N * meta.sub * 2 if bs.lhs == "smem" else 0) + 1024)


def default_mgpu_block_sizes(m: int, meta: MgpuMeta, num_sms: int = 132) -> MgpuBlockSizes:
    """Heuristic (to be replaced by measured winners): tile_m = the first of 16, 32, 64, 128 that holds M, at
    most 128 (64 for the 512-row K tiles of 3/5/7-bit codes); warp specialization (2 compute warpgroups) from
    64 tokens on when N_pad is a multiple of 128; split-K (dividing the K tiles, >= 2 tiles per split) until
    about two programs per SM; as many pipeline stages (<= 4, <= the K tiles per split) as fit in shared
    memory."""
    tm = next(t for t in (16, 32, 64, 128) if t >= m or t == 128)
    tm = min(tm, 128 if meta.tile_k <= 256 else 64)
    wgs = 2 if tm >= 64 and meta.N_pad % (2 * TILE_N) == 0 else 1
    programs = (meta.N_pad // (TILE_N * wgs)) * -(-m // tm)
    tiles = meta.K_pad // meta.tile_k
    split = 1
    while programs * split * 2 <= 2 * num_sms and tiles % (split * 2) == 0 and tiles // (split * 2) >= 2:
        split *= 2
    bs = MgpuBlockSizes(tile_m=tm, split_k=split, stages=1, lhs="regs", compute_wgs=wgs)
    for stages in range(min(MAX_STAGES, tiles // split), 1, -1):
        if _smem_bytes(dataclasses.replace(bs, stages=stages), meta) <= SMEM_LIMIT:
            return dataclasses.replace(bs, stages=stages)
    return bs


class _Chunks:
    """Plane chunk s of a plane's SMEM tile [S, channels, 64] on `[s]`, for one warpgroup's 64 channels."""

    def __init__(self, ref, channels):
        self.ref, self.channels = ref, channels

    def __getitem__(self, s):
        return self.ref[s] if self.channels is None else self.ref[s, self.channels]


def _swizzle_transforms(minor_bytes: int, itemsize: int):
    sw = min(128, minor_bytes)
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def _qmatmul_mgpu_2d(x, mw: MgpuWeight, bs: MgpuBlockSizes, interpret: bool):
    """x^T [K_pad, M_pad] (M_pad a multiple of tile_m) -> y^T: [N_pad, M_pad] in x.dtype, or f32
    [split, N_pad, M_pad] partial sums when split_k > 1."""
    meta = mw.meta
    k_pad, m_pad = x.shape
    xdt = x.dtype
    tm, split, tk, g, sub = bs.tile_m, bs.split_k, meta.tile_k, meta.group, meta.sub
    tiles = k_pad // tk
    tps = tiles // split
    n_planes = len(meta.planes)
    lhs_smem = bs.lhs == "smem" or interpret
    # x^T's swizzle: at most one scale group of K rows per swizzle atom (wgmma takes K in whole atoms), and
    # the same swizzle for both operands when the weight goes through shared memory (wgmma's rule)
    sw = 2 * min(tm, 64, sub)
    x_tr = _swizzle_transforms(sw, 2)
    w_tr = _swizzle_transforms(CHUNK, 1)
    srows = max(1, tk // g)
    out_dt = xdt if split == 1 else jnp.dtype(jnp.float32)

    wgs = bs.compute_wgs
    cta_n = TILE_N * wgs
    has_table = mw.table is not None
    n_rows_in = 1 + meta.has_zero + meta.has_offset  # scale, zero and offset rows
    n_in = n_planes + n_rows_in + has_table

    def as_row(v):
        """A [64] scale row in the layout of a WGMMA tile's rows (a no-op for the interpreter)."""
        return v if interpret else plgpu.layout_cast(v, plgpu.Layout.WGMMA.reduce(1))

    def tile_math(acc, x_smem, tile_refs, wg, lhs_ref):
        """One K tile into acc: decode each 64-row chunk of this warpgroup's 64 channels, scale, wgmma."""
        ch = None if wg is None else pl.ds(wg * TILE_N, TILE_N)
        plane_refs = [_Chunks(r, ch) for r in tile_refs[:n_planes]]
        s_smem = tile_refs[n_planes]
        z_smem = tile_refs[n_planes + 1] if meta.has_zero else None
        o_smem = tile_refs[n_planes + 1 + meta.has_zero] if meta.has_offset else None
        t_smem = tile_refs[-1] if has_table else None
        table = None if t_smem is None else [t_smem[0, i] for i in range(8)]

        def row(ref, r):
            return as_row(ref[r] if ch is None else ref[r, ch])

        for j in range(tk // CHUNK):
            v = decode_elements(chunk_codes(plane_refs, meta, j), meta.fmt)  # f32 [64, 64]
            for i in range(CHUNK // sub):
                k0 = j * CHUNK + i * sub
                r = k0 // g if g < tk else 0
                vs = v if sub == CHUNK else v[:, i * sub:(i + 1) * sub]
                sc = lax.broadcast_in_dim(meta.scale_f32(row(s_smem, r), table), (TILE_N, sub), (0,))
                z = None if z_smem is None else lax.broadcast_in_dim(row(z_smem, r), (TILE_N, sub), (0,))
                o = None if o_smem is None else lax.broadcast_in_dim(row(o_smem, r), (TILE_N, sub), (0,))
                wq = finish(vs, sc, z, meta, xdt, o)  # finish reads meta.scale_dtype only
                rhs = x_smem.at[pl.ds(k0, sub), :]
                if lhs_smem:
                    lhs_ref[...] = wq
                    plgpu.commit_smem()
                    plgpu.wgmma(acc, lhs_ref, rhs)
                    plgpu.wgmma_wait(0)  # lhs_ref is rewritten by the next slice
                else:
                    plgpu.wgmma(acc, wq, rhs)
        plgpu.wgmma_wait(0)  # the pipeline reuses this step's SMEM slots once the body returns

    def kernel(x_gmem, *refs):
        in_refs = refs[:n_in]
        o_gmem = refs[len(in_refs)]
        scratch = refs[len(in_refs) + 1:]
        o_smem = scratch[0]
        lhs_all = scratch[1] if lhs_smem else None
        ni, mi, si = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
        base = si * tps

        n_sl = pl.ds(ni * cta_n, cta_n)
        in_specs = [plgpu.BlockSpec((tk, tm), lambda k: (base + k, 0), transforms=x_tr)]
        args = [x_gmem.at[:, pl.ds(mi * tm, tm)]]
        for (w, _), S, p_gmem in zip(meta.planes, meta.plane_chunks(), in_refs[:n_planes]):
            in_specs.append(plgpu.BlockSpec((S, cta_n, CHUNK), lambda k: (base + k, 0, 0), transforms=w_tr))
            args.append(p_gmem.at[:, n_sl])
        row_map = (lambda k: ((base + k) * tk // g, 0)) if g >= tk else (lambda k: (base + k, 0))
        for r_gmem in in_refs[n_planes:n_planes + n_rows_in]:
            in_specs.append(plgpu.BlockSpec((srows, cta_n), row_map))
            args.append(r_gmem.at[:, n_sl])
        if has_table:  # NVFP4's 8 f32 entries (padded to 32), the K tile's copy (128 bytes)
            in_specs.append(plgpu.BlockSpec((1, TABLE_LEN), lambda k: (base + k, 0)))
            args.append(in_refs[-1])

        def epilogue(acc, wg):
            """acc -> this warpgroup's epilogue tile -> its 64 rows of y^T (or of the split's partial sum)."""
            o_ref = o_smem.at[wg]
            o_ref[...] = acc[...].astype(out_dt)
            plgpu.commit_smem()
            rows = pl.ds(ni * cta_n + wg * TILE_N, TILE_N)
            cols = pl.ds(mi * tm, tm)
            plgpu.copy_smem_to_gmem(o_ref, o_gmem.at[rows, cols] if split == 1 else o_gmem.at[si, rows, cols])
            plgpu.wait_smem_to_gmem(0)

        stages = max(1, min(bs.stages, tps))
        if wgs == 1:
            def scope(acc):
                def step(_, x_smem, *tile_refs):
                    tile_math(acc, x_smem, tile_refs, None, None if lhs_all is None else lhs_all.at[0])
                plgpu.emit_pipeline(step, grid=(tps,), in_specs=in_specs, max_concurrent_steps=stages)(*args)
                epilogue(acc, 0)

            pl.run_scoped(scope, plgpu.ACC((TILE_N, tm), jnp.float32))
            return

        def compute_context(eval_pipeline):
            wg = lax.axis_index("wg")

            def scope(acc):
                eval_pipeline(acc)
                epilogue(acc, wg)

            pl.run_scoped(scope, plgpu.ACC((TILE_N, tm), jnp.float32))

        def ws_step(_, x_smem, *tile_refs_and_acc):
            *tile_refs, acc = tile_refs_and_acc
            wg = lax.axis_index("wg")
            tile_math(acc, x_smem, tile_refs, wg, None if lhs_all is None else lhs_all.at[wg])
            return acc

        plgpu.emit_pipeline_warp_specialized(
            ws_step, grid=(tps,), memory_registers=40, in_specs=in_specs, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=stages, compute_context=compute_context)(*args)

    scratch = [plgpu.SMEM((wgs, TILE_N, tm), out_dt)]
    if lhs_smem:
        scratch.append(plgpu.SMEM((wgs, TILE_N, sub), xdt, transforms=_swizzle_transforms(sw, 2)))
    out_shape = (meta.N_pad, m_pad) if split == 1 else (split, meta.N_pad, m_pad)
    args = ([x, *mw.planes, mw.scale] + ([mw.zero] if meta.has_zero else []) + ([mw.offset] if meta.has_offset else [])
            + ([mw.table] if has_table else []))
    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dt),
                     grid=(meta.N_pad // cta_n, m_pad // tm, split), grid_names=("n", "m", "s"),
                     scratch_types=scratch, interpret=interpret_params() if interpret else None,
                     **({} if wgs == 1 else {"num_threads": wgs + 1, "thread_name": "wg"}))
    return f(*args)


_kernel_jit = jax.jit(_qmatmul_mgpu_2d, static_argnames=("bs", "interpret"))
# Interpreted on the CPU, the program is compiled without LLVM's expensive passes: compiling it is most of
# its cost. jax takes compiler options on top-level jits only (an outer jit uses `_kernel_jit`).
_kernel_interp = jax.jit(_qmatmul_mgpu_2d, static_argnames=("bs", "interpret"),
                         compiler_options={"xla_backend_optimization_level": 0,
                                           "xla_llvm_disable_expensive_passes": True})


def _qmatmul_mgpu_impl(x2, mw: MgpuWeight, bs: MgpuBlockSizes, interpret: bool):
    """x2 [M, K] -> [M, N]: pads M to tile_m and K to K_pad, runs the kernel on x^T, sums the splits, transposes
    back. The kernel is its own jit, so every M that pads to the same tile_m shares one compile."""
    meta = mw.meta
    m, k = x2.shape
    m_pad = -(-m // bs.tile_m) * bs.tile_m
    xt = jnp.pad(x2, ((0, m_pad - m), (0, meta.K_pad - k))).T
    top_level = interpret and not isinstance(xt, jax.core.Tracer)  # (only asked when interpreting)
    yt = (_kernel_interp if top_level else _kernel_jit)(xt, mw, bs=bs, interpret=interpret)
    if bs.split_k > 1:
        yt = yt.sum(axis=0)
    return yt[: meta.N, :m].T.astype(x2.dtype)


def _check_block_sizes(bs: MgpuBlockSizes, meta: MgpuMeta) -> None:
    tiles = meta.K_pad // meta.tile_k
    bad = []
    if bs.tile_m not in (16, 32) and (bs.tile_m % 64 or not 64 <= bs.tile_m <= 256):
        bad.append(f"tile_m={bs.tile_m} (16, 32 or a multiple of 64 up to 256)")
    if bs.split_k < 1 or tiles % bs.split_k:
        bad.append(f"split_k={bs.split_k} (must divide the {tiles} K tiles of {meta.tile_k})")
    if bs.stages < 1:
        bad.append(f"stages={bs.stages} (>= 1)")
    if bs.compute_wgs not in (1, 2) or meta.N_pad % (TILE_N * bs.compute_wgs):
        bad.append(f"compute_wgs={bs.compute_wgs} (1, or 2 when N_pad = {meta.N_pad} is a multiple of 128)")
    if bs.lhs not in ("regs", "smem"):
        bad.append(f"lhs={bs.lhs!r} ('regs' or 'smem')")
    if bs.tile_m % 8 == 0 and _smem_bytes(bs, meta) > SMEM_LIMIT:
        bad.append(f"tile_m={bs.tile_m} x stages={bs.stages}: {_smem_bytes(bs, meta)} bytes of shared memory "
                   f"(> {SMEM_LIMIT}, 227 KB)")
    if bad:
        raise KernelError(f"qmatmul_mgpu: bad block sizes for {meta.describe()}: {', '.join(bad)}")


def qmatmul_mgpu(x: jax.Array, q: Union[QArray, MgpuWeight], *, interpret: Optional[bool] = None,
                 block_sizes: Union[MgpuBlockSizes, dict, None] = None) -> jax.Array:
    """y[..., n] = sum_k x[..., k] * W[k, n], W = dequantize(q) of logical shape [K, N], quantized along K, on
    Mosaic GPU (Hopper: TMA, wgmma). The weight is read packed and decoded in registers (module docstring);
    pass an `MgpuWeight` (`prepare_mgpu(q)`, once at load) to skip the per-call repack of a QArray.

    Args:
      x: activations [..., K], bfloat16 or float16.
      q: QArray [K, N] (axis 0) of a supported scheme (`mgpu_unsupported_reason`), or its MgpuWeight.
      interpret: run in GPU interpret mode on the CPU (default: True unless the default backend is GPU).
      block_sizes: MgpuBlockSizes or a dict of its fields (default: `default_mgpu_block_sizes`).

    Returns:
      [..., N] in x.dtype (accumulated in f32).

    Raises:
      KernelError: x's K differs from the weight's, x's dtype is not bf16/f16, the scheme has no Mosaic GPU
        layout, or the block sizes are invalid.
    """
    if isinstance(q, QArray):
        why = mgpu_unsupported_reason(q)
        if why is not None:
            raise KernelError(f"qmatmul_mgpu: no kernel for {q.scheme.describe()} shape {q.shape}: {why}")
        kdesc, K = f"{q.scheme.describe()} shape {q.shape}", q.shape[0]
    elif isinstance(q, MgpuWeight):
        kdesc, K = q.meta.describe(), q.meta.K
    else:
        raise KernelError(f"qmatmul_mgpu: expected a QArray or MgpuWeight, got {type(q).__name__}")
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != K:
        raise KernelError(f"qmatmul_mgpu: x has shape {tuple(x.shape)} (K = {x.shape[-1] if x.ndim else None}) "
                          f"but the weight {kdesc} has K = {K}")
    if x.dtype not in MGPU_X_DTYPES:
        raise KernelError(f"qmatmul_mgpu: x dtype {x.dtype} is not supported (expected bfloat16 or float16: "
                          f"wgmma on f32 would round to tf32); weight {kdesc}")
    mw = prepare_mgpu(q) if isinstance(q, QArray) else q
    meta = mw.meta
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lead = x.shape[:-1]
    m = math.prod(lead)
    if isinstance(block_sizes, dict):
        block_sizes = dataclasses.replace(default_mgpu_block_sizes(m, meta), **block_sizes)
    bs = block_sizes or default_mgpu_block_sizes(m, meta)
    _check_block_sizes(bs, meta)
    if m == 0:
        return jnp.zeros((*lead, meta.N), x.dtype)
    y = _qmatmul_mgpu_impl(x.reshape(m, K), mw, bs, bool(interpret))
    return y.reshape(*lead, meta.N)
