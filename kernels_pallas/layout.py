"""Kernel weight layouts: `prepare(q)` repacks a QArray once into K-major bit planes with row-tiled scales.

The storage layout of `qformats.QArray` (codes `[N, ceil(K*b/8)]`, packed little-endian along K) is the
interchange format. The kernels read a different layout, produced once at load by `prepare(q)` and held in
a `PreparedWeight` pytree. For a weight of logical shape `[K, N]` (quantized along K, axis 0), with the
block size `block_k` (bk) along K, K padded to `K_pad` (a multiple of bk) and N to `N_pad` (a multiple of
`n_align`):

**Codes -> bit planes.** A b-bit code is split into planes of widths 8, 4, 2, 1 (the binary digits of b,
widest first; the plane of width w holds code bits `shift .. shift+w-1`, shifts ascending from 0):

    b = 8: [8]      b = 6: [4 | 2]   (FP6-LLM's 4+2 split)     b = 5: [4 | 1]     b = 4: [4]
    b = 7: [4|2|1]  b = 3: [2 | 1]   b = 2: [2]

Plane p (width w, `n = 8 / w` codes per byte) is a uint8 array `[K_pad * w / 8, N_pad]`, K-major (N
contiguous, so a tile row is one coalesced load). Inside each K tile of bk rows the plane has
`R = bk * w / 8` byte rows; the byte at tile-row r, column c holds the codes of tile rows `r + i*R`,
i = 0..n-1, in bits `i*w .. i*w+w-1`:

    plane[t*R + r, c] = sum_i ((code[t*bk + i*R + r, c] >> shift) & (2^w - 1)) << (i*w)

So one load of `R'` consecutive byte rows followed by `(byte >> i*w) & mask` gives `R'` consecutive K rows
of the tile: no interleave, reshape or gather is needed in the kernel, only shifts and masks (which lower
to Triton on every integer type). The rows of the different planes of a chunk are OR-ed together.
Padding codes are 0 (the activations are zero-padded along K, so padded rows contribute 0).

Integer codes are the offset codes `u = q - qmin` (int8's stored two's complement is re-offset to uint8).

**Scales.** One row per group along K, N contiguous: `[ceil(K_pad / g), N_pad]`.
  - channel (and tensor: broadcast along N): g = K_pad, one row; dtype as stored (bf16/f16/f32).
  - group: g = the group size; dtype as stored.
  - block (FP8_BLOCK): the `[ceil(N/bh), ceil(K/bw)]` scale repeated over its bh output channels: g = bw.
  - MX: uint8 E8M0 codes, g = 32; NVFP4 (tensor_group): uint8 e4m3fn codes (the bit pattern of the stored
    float8 scale), g = 16, plus the f32 global scale as `[1, 1]`.
  Padded rows/columns hold 1.0 (E8M0 code 127, e4m3 code 0x38).
  - zero point (asymmetric int): int8, same shape as the scale.

**Dequantization** (in the kernel, per chunk of rows, and in `dequantize_prepared`, with the same code):
value(code) exactly in f32 by bit operations (float: sign, exponent, mantissa into f32 fields; int:
code + qmin), then `w = (value - zero) * scale` rounded to the scale's dtype (as `qformats.dequantize`
computes in the scale dtype), NVFP4 `w = value * (scale / global)` in f32, then cast to the activation
dtype. This is bit-identical to `qformats.dequantize(q, x.dtype)`.

A chunk of `chunk` K rows (a power of two >= 16, dividing every plane's R and every group) is the unit
the kernel decodes and feeds to one `dot`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import KernelError
from qformats.formats import FloatFormat, IntFormat
from qformats.qarray import QArray

__all__ = ["LayoutMeta", "PreparedWeight", "prepare", "dequantize_prepared", "unsupported_reason",
           "plane_split", "decode_values", "scale_values", "dequant_chunk"]

_FLOAT_SCALES = ("float32", "bfloat16", "float16")
MIN_CHUNK = 16  # Triton's tl.dot needs every dimension >= 16


def plane_split(bits: int) -> Tuple[Tuple[int, int], ...]:
    """((width, shift), ...) of the bit planes of a `bits`-wide code, widest first, shifts from 0."""
    out, shift = [], 0
    for w in (8, 4, 2, 1):
        if bits - shift >= w:
            out.append((w, shift))
            shift += w
    return tuple(out)


def _pow2_part(n: int) -> int:
    return n & -n


@dataclasses.dataclass(frozen=True)
class LayoutMeta:
    """Static facts of a prepared weight (hashable: pytree aux data and jit static argument)."""

    fmt: object            # FloatFormat | IntFormat
    K: int
    N: int
    K_pad: int
    N_pad: int
    block_k: int
    chunk: int             # K rows decoded per dot
    group: int             # K rows per scale row (K_pad for one row)
    planes: Tuple[Tuple[int, int], ...]
    scale_kind: str        # "float" | "e8m0" | "e4m3"
    scale_dtype: str       # dtype the reference dequantizes in: the float scale's dtype, else float32
    has_zero: bool
    has_global: bool
    dtype: str             # the QArray's original dtype
    scheme_desc: str

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def is_int(self) -> bool:
        return isinstance(self.fmt, IntFormat)

    @property
    def scale_rows(self) -> int:
        return -(-self.K_pad // self.group)

    def describe(self) -> str:
        return f"{self.scheme_desc} [K={self.K}, N={self.N}]"


@jax.tree_util.register_pytree_node_class
class PreparedWeight:
    """A weight in the kernel layout (see the module docstring): bit planes, scale rows, zero, global."""

    def __init__(self, planes, scale, zero, gscale, meta: LayoutMeta):
        self.planes = tuple(planes)
        self.scale = scale
        self.zero = zero
        self.gscale = gscale
        self.meta = meta

    def tree_flatten(self):
        return (self.planes, self.scale, self.zero, self.gscale), self.meta

    @classmethod
    def tree_unflatten(cls, meta, children):
        planes, scale, zero, gscale = children
        return cls(planes, scale, zero, gscale, meta)

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.meta.K, self.meta.N)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (*self.planes, self.scale, self.zero, self.gscale) if a is not None)

    def __repr__(self) -> str:
        return f"PreparedWeight({self.meta.describe()}, block_k={self.meta.block_k}, nbytes={self.nbytes})"


# ---- what the kernels take ---------------------------------------------------------------------------------
def _group_of(q: QArray) -> Optional[int]:
    s = q.scheme
    if s.strategy in ("channel", "tensor"):
        return None
    if s.strategy in ("group", "tensor_group"):
        return s.group_size
    if s.strategy == "block":
        return s.block[1]
    return -1


def unsupported_reason(q, block_k: int = 128) -> Optional[str]:
    """Why `prepare(q, block_k)` cannot build a kernel layout for q (None when it can)."""
    if not isinstance(q, QArray):
        return f"expected a QArray, got {type(q).__name__}"
    s = q.scheme
    if q.ndim != 2 or q.axis != 0:
        return f"needs a 2-D weight [K, N] quantized along axis 0, got shape {q.shape} axis {q.axis}"
    if not isinstance(s.format, (FloatFormat, IntFormat)):
        return f"element format {s.format.name} is not a float or int format"
    if s.strategy not in ("channel", "tensor", "group", "tensor_group", "block"):
        return f"strategy {s.strategy!r} is not a weight strategy the kernel takes"
    if block_k < MIN_CHUNK or block_k & (block_k - 1):
        return f"block_k must be a power of two >= {MIN_CHUNK}, got {block_k}"
    max_slots = 8 // min(w for w, _ in plane_split(s.bits))
    chunk = block_k // max_slots
    g = _group_of(q)
    if g is not None:
        chunk = min(chunk, _pow2_part(g))
    if chunk < MIN_CHUNK:
        return (f"no chunk of >= {MIN_CHUNK} rows fits {s.describe()} with block_k={block_k} "
                f"(planes {plane_split(s.bits)}, group {g})")
    if s.scale_format not in _FLOAT_SCALES + ("input", "e8m0", "fp8_e4m3fn"):
        return f"scale format {s.scale_format!r}"
    if s.scale_format == "fp8_e4m3fn" and s.strategy != "tensor_group":
        return "fp8 scales are only taken for NVFP4 (tensor_group)"
    return None


# ---- prepare -----------------------------------------------------------------------------------------------
def prepare(q: QArray, block_k: int = 128, n_align: int = 128) -> PreparedWeight:
    """Repack a QArray `[K, N]` (quantized along axis 0) into the kernel layout of the module docstring.

    Args:
      q: the quantized weight, logical shape [K, N], axis 0.
      block_k: K rows per kernel tile (power of two >= 16); fixes the plane layout.
      n_align: N is padded to a multiple of this (the largest block_n the kernel can then use).

    Returns:
      PreparedWeight. Runs under jit (all layout facts are static).

    Raises:
      KernelError: if the scheme or shape has no kernel layout (`unsupported_reason`).
    """
    why = unsupported_reason(q, block_k)
    if why is not None:
        raise KernelError(f"prepare: {why} ({q.scheme.describe() if isinstance(q, QArray) else ''})")
    return _prepare_jit(q, block_k, n_align)


@functools.partial(jax.jit, static_argnames=("block_k", "n_align"))
def _prepare_jit(q: QArray, block_k: int, n_align: int) -> PreparedWeight:
    s, fmt = q.scheme, q.scheme.format
    K, N = q.shape
    K_pad = -(-K // block_k) * block_k
    N_pad = -(-N // n_align) * n_align
    planes = plane_split(s.bits)
    chunk = block_k // (8 // min(w for w, _ in planes))
    g = _group_of(q)
    if g is not None:
        chunk = min(chunk, _pow2_part(g))
    group = K_pad if g is None else g

    # codes [N, K] -> offset uint32 [K_pad, N_pad]
    c = q.element_codes()
    if isinstance(fmt, IntFormat) and c.dtype == jnp.int8:
        c = c.astype(jnp.int32) - fmt.qmin
    c = c.astype(jnp.uint32)
    c = jnp.pad(c, ((0, N_pad - N), (0, K_pad - K))).T
    tiles = K_pad // block_k
    out = []
    for w, sh in planes:
        n = 8 // w
        R = block_k // n
        part = ((c >> sh) & ((1 << w) - 1)).reshape(tiles, n, R, N_pad)
        byte = jnp.zeros((tiles, R, N_pad), jnp.uint32)
        for i in range(n):
            byte = byte | (part[:, i] << (i * w))
        out.append(byte.reshape(tiles * R, N_pad).astype(jnp.uint8))

    # scales -> [rows, N_pad]
    rows = -(-K_pad // group)
    sc = q.scale
    if s.scale_format == "e8m0":
        kind, one, sdt = "e8m0", 127, jnp.float32
        sc = sc.astype(jnp.uint8)
    elif s.scale_format == "fp8_e4m3fn":
        kind, one, sdt = "e4m3", 0x38, jnp.float32
        sc = jax.lax.bitcast_convert_type(sc.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        kind, one, sdt = "float", 1.0, sc.dtype
    if s.strategy == "tensor":
        sc = jnp.broadcast_to(sc.reshape(1, 1), (N, 1))
    if s.strategy == "block":
        bh = s.block[0]
        sc = jnp.repeat(sc, bh, axis=0)[:N]
    sc = sc.T  # [G, N]
    sc = jnp.pad(sc, ((0, rows - sc.shape[0]), (0, N_pad - N)), constant_values=one)
    zero = None
    if q.zero_point is not None:
        z = q.zero_point.astype(jnp.int8).T
        zero = jnp.pad(z, ((0, rows - z.shape[0]), (0, N_pad - N)))
    gscale = None
    if q.global_scale is not None:
        gscale = q.global_scale.astype(jnp.float32).reshape(1, 1)
    meta = LayoutMeta(fmt=fmt, K=K, N=N, K_pad=K_pad, N_pad=N_pad, block_k=block_k, chunk=chunk,
                      group=group, planes=planes, scale_kind=kind, scale_dtype=jnp.dtype(sdt).name,
                      has_zero=zero is not None, has_global=gscale is not None, dtype=q.dtype.name,
                      scheme_desc=s.describe())
    return PreparedWeight(out, sc, zero, gscale, meta)


# ---- dequantization arithmetic shared by the kernel and dequantize_prepared ------------------------------------
def decode_values(code: jax.Array, meta: LayoutMeta) -> jax.Array:
    """int32 codes (offset for ints) -> exact f32 element values, by integer bit operations only."""
    fmt = meta.fmt
    if isinstance(fmt, IntFormat):
        return (code + fmt.qmin).astype(jnp.float32)
    return _decode_float(code, fmt)


def _decode_float(code: jax.Array, fmt: FloatFormat) -> jax.Array:
    """Exact f32 value of int32 codes: the magnitude bits are placed under the f32 exponent/mantissa fields
    and the exponent rebased by 127 - bias with one integer add (normal codes); subnormal codes (exponent
    field 0) are mag * 2^(emin - m), computed in f32 (exact); the sign bit is OR-ed into bit 31. ~10 integer
    or f32 ops per element and no f32 subnormal intermediates (so a flush-to-zero build cannot change it)."""
    b, m = fmt.bits, fmt.mbits
    mag = code & ((1 << (b - 1)) - 1)
    normal = jax.lax.bitcast_convert_type((mag << (23 - m)) + ((127 - fmt.bias) << 23), jnp.float32)
    sub = mag.astype(jnp.float32) * np.float32(2.0 ** (fmt.emin - m))
    val = jnp.where(mag < (1 << m), sub, normal)
    sign = (code >> (b - 1)) << 31
    val = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(val, jnp.int32) | sign, jnp.float32)
    if fmt.specials == "ieee":
        top = (mag >> m) == (1 << fmt.ebits) - 1
        inf = jnp.where(sign != 0, -np.float32(np.inf), np.float32(np.inf))
        val = jnp.where(top, jnp.where((mag & ((1 << m) - 1)) == 0, inf, np.float32(np.nan)), val)
    elif fmt.specials == "fn":
        val = jnp.where(mag == fmt.nan_code, np.float32(np.nan), val)
    elif fmt.specials == "fnuz":
        val = jnp.where(code == fmt.nan_code, np.float32(np.nan), val)
    return val


_E4M3 = FloatFormat(4, 3)


def _div(a: jax.Array, b: jax.Array, barrier: bool) -> jax.Array:
    """a / b in f32. XLA:CPU rewrites `a / broadcast(b)` into `a * (1 / b)` (an ulp off for half the inputs);
    with `barrier` the divisor is broadcast behind an optimization barrier, as qformats.rounding.div does,
    so the division stays IEEE (XLA paths and the interpreter only: Triton has no barrier)."""
    if barrier:
        b = jax.lax.optimization_barrier(jnp.broadcast_to(b, jnp.broadcast_shapes(a.shape, b.shape)))
    return a / b


def scale_values(s: jax.Array, meta: LayoutMeta, gscale: Optional[jax.Array], barrier: bool = True) -> jax.Array:
    """Stored scale rows -> f32 effective scales (E8M0 / e4m3 codes decoded, NVFP4 divided by the global)."""
    if meta.scale_kind == "e8m0":
        c = s.astype(jnp.int32)
        v = jax.lax.bitcast_convert_type(c << 23, jnp.float32)
        v = jnp.where(c == 0, np.float32(2.0 ** -127), v)
        return jnp.where(c == 255, np.float32(np.nan), v)
    if meta.scale_kind == "e4m3":
        v = _decode_float(s.astype(jnp.int32), _E4M3)
    else:
        v = s.astype(jnp.float32)
    return _div(v, gscale, barrier) if gscale is not None else v


def dequant_chunk(code: jax.Array, s: jax.Array, z: Optional[jax.Array], gscale: Optional[jax.Array],
                  meta: LayoutMeta, out_dtype, barrier: bool = True) -> jax.Array:
    """Codes [rows, n] with their scale row(s) [1 or rows, n] -> weights in `out_dtype`, rounded as
    `qformats.dequantize` rounds: (value - zero) * scale in the scale's dtype, then cast. `barrier`: see
    `_div` (False inside a compiled Triton kernel)."""
    v = decode_values(code, meta)
    if z is not None:
        v = v - z.astype(jnp.float32)
    w = v * scale_values(s, meta, gscale, barrier)
    sdt = jnp.dtype(meta.scale_dtype)
    if sdt != jnp.float32:
        w = w.astype(sdt)
    return w.astype(out_dtype)


def plane_codes(planes, meta: LayoutMeta) -> jax.Array:
    """All codes [K_pad, N_pad] int32 from the planes (the jnp mirror of the kernel's chunk loads)."""
    bk = meta.block_k
    tiles = meta.K_pad // bk
    code = jnp.zeros((tiles, bk, meta.N_pad), jnp.int32)
    for p, (w, sh) in zip(planes, meta.planes):
        n, R = 8 // w, bk * w // 8
        b = p.astype(jnp.int32).reshape(tiles, R, meta.N_pad)
        parts = jnp.concatenate([(b >> (i * w)) & ((1 << w) - 1) for i in range(n)], axis=1)
        code = code | (parts << sh)
    return code.reshape(meta.K_pad, meta.N_pad)


def dequantize_prepared(pw: PreparedWeight, dtype=None) -> jax.Array:
    """The dense weight [K, N] from a PreparedWeight, with the kernel's arithmetic (for tests and fallback)."""
    return _dequantize_prepared_jit(pw, jnp.dtype(pw.meta.dtype if dtype is None else dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_prepared_jit(pw: PreparedWeight, dtype) -> jax.Array:
    meta = pw.meta
    code = plane_codes(pw.planes, meta)
    srow = jnp.repeat(pw.scale, meta.group, axis=0)[: meta.K_pad]
    z = None if pw.zero is None else jnp.repeat(pw.zero, meta.group, axis=0)[: meta.K_pad]
    w = dequant_chunk(code, srow, z, pw.gscale, meta, dtype)
    return w[: meta.K, : meta.N]

