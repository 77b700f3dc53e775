"""Kernel weight layouts: `prepare(q)` repacks a QArray once into K-major bit planes of 32-bit words.

The storage layout of `qformats.QArray` (codes `[N, ceil(K*b/8)]`, packed little-endian along K) is the
interchange format. The kernels read a different layout, produced once at load by `prepare(q)` and held in
a `PreparedWeight` pytree. For a weight of logical shape `[K, N]` (quantized along K, axis 0), with block
sizes `block_k` (bk) along K and `block_n` (bn) along N, K padded to `K_pad` (a multiple of bk) and N to
`N_pad` (a multiple of bn):

**Codes -> bit planes.** A b-bit code is split into planes of widths 8, 4, 2, 1 (the binary digits of b,
widest first; the plane of width w holds code bits `shift .. shift+w-1`, shifts ascending from 0):

    b = 8: [8]      b = 6: [4 | 2]   (FP6-LLM's 4+2 split)     b = 5: [4 | 1]     b = 4: [4]
    b = 7: [4|2|1]  b = 3: [2 | 1]   b = 2: [2]

*Plane bytes along K.* Plane p (width w, `n = 8 / w` codes per byte) has, inside each K tile of bk rows,
`R = bk * w / 8` byte rows; the byte at tile-row r of column c holds the codes of tile rows `r + i*R`,
i = 0..n-1, in bits `i*w .. i*w+w-1`:

    byte[t*R + r, c] = sum_i ((code[t*bk + i*R + r, c] >> shift) & (2^w - 1)) << (i*w)

so `(byte >> i*w) & mask` of R' consecutive byte rows gives R' consecutive K rows of the tile: no
interleave, reshape or gather in the kernel.

*Bytes into words along N.* Four bytes of a row form one little-endian uint32 word; within each block of
bn columns, byte q of word j is column `q * bn/4 + j`:

    plane[row, blk * bn/4 + j] = sum_q byte[row, blk*bn + q*bn/4 + j] << (8 q)       uint32 [K_pad*w/8, N_pad/4]

One 32-bit operation then works on four codes (SIMD within a register), and the four byte lanes decode to
four contiguous quarter-blocks of output columns (four `dot`s, no column interleave).

**Decode (SWAR, exact).** The OR of a chunk's planes holds four codes in its byte lanes; two shifted,
masked copies of it put the codes of lanes q = 0, 2 (and 1, 3) into the two 16-bit halves of a word. For
a float format with e <= 5 exponent bits each half becomes the IEEE half `sign << 15 | magnitude << (10 - m)`
(five integer ops for two codes, straight from the word), whose value is
value(code) * 2^(bias - 15) exactly, subnormals included (f16 has room for every e<=5 code, and
f16 -> f32 conversion keeps subnormals, so no flush-to-zero setting can change it); the factor 2^(15 - bias)
is folded into the scale row. Integer codes u (offset, u = q - qmin) become the half `0x6400 | u` = 1024 + u,
and q = half - (1024 - qmin). Specials (NaN of e4m3fn / fnuz, inf of ieee e<5) are selected explicitly.

**Scales.** One row per group along K, columns in natural order: `[ceil(K_pad / g), N_pad]`.
  - channel (and tensor: broadcast along N): g = K_pad, one row; dtype as stored (bf16/f16/f32).
  - group: g = the group size; dtype as stored.
  - block (FP8_BLOCK): the `[ceil(N/bh), ceil(K/bw)]` scale repeated over its bh output channels: g = bw.
  - MX: uint8 E8M0 codes, g = 32; NVFP4 (tensor_group): uint8 e4m3fn codes (the bit pattern of the stored
    float8 scale), g = 16, plus the f32 global scale as `[1, 1]`.
  Padded rows/columns hold 1.0 (E8M0 code 127, e4m3 code 0x38).
  - zero point (asymmetric int): int8, same shape as the scale.
  - offset (GGUF minima, `QArray.offset`): as stored (f16 / bf16 / f32), same shape as the scale, padded with 0.

**Rounding.** `w = (value - zero) * scale [+ offset]`, each op rounded to the dtype `qformats.dequantize`
computes in (`QArray.work_dtype`: the scale's dtype, or the QArray's compute_dtype), NVFP4 `w = value * (scale / global)` in f32, then cast to the activation
dtype: bit-identical to `qformats.dequantize(q, x.dtype)` (the product is the same real number, rounded
once; on GPU the NVFP4 division may differ by an ulp, see qmatmul).

A chunk of `chunk` K rows (a power of two >= 16, dividing every plane's R and every group) is the unit
the kernel decodes and feeds to its four dots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import KernelError
from qformats.formats import FloatFormat, IntFormat
from qformats.qarray import QArray

__all__ = ["LayoutMeta", "PreparedWeight", "prepare", "dequantize_prepared", "unsupported_reason",
           "plane_split", "decode_words", "decode_elements", "scale_values", "finish"]

_FLOAT_SCALES = ("float32", "bfloat16", "float16")
MIN_CHUNK = 16  # Triton's tl.dot needs every dimension >= 16
LANES = 4       # codes per 32-bit word


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
    block_n: int
    chunk: int             # K rows decoded per dot
    group: int             # K rows per scale row (K_pad for one row)
    planes: Tuple[Tuple[int, int], ...]
    scale_kind: str        # "float" | "e8m0" | "e4m3"
    scale_dtype: str       # dtype the reference dequantizes in: the float scale's dtype, else float32
    has_zero: bool
    has_global: bool
    dtype: str             # the QArray's original dtype
    scheme_desc: str
    has_offset: bool = False  # an additive per-group offset (GGUF minima: w = d q + m), rows like the scale

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
    """A weight in the kernel layout (see the module docstring): bit planes, scale rows, zero, global, offset
    rows (None without one)."""

    def __init__(self, planes, scale, zero, gscale, meta: LayoutMeta, offset=None):
        self.planes = tuple(planes)
        self.scale = scale
        self.zero = zero
        self.gscale = gscale
        self.offset = offset
        self.meta = meta

    def tree_flatten(self):
        return (self.planes, self.scale, self.zero, self.gscale, self.offset), self.meta

    @classmethod
    def tree_unflatten(cls, meta, children):
        planes, scale, zero, gscale, offset = children
        return cls(planes, scale, zero, gscale, meta, offset)

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.meta.K, self.meta.N)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (*self.planes, self.scale, self.zero, self.gscale, self.offset) if a is not None)

    def __repr__(self) -> str:
        m = self.meta
        return f"PreparedWeight({m.describe()}, block_k={m.block_k}, block_n={m.block_n}, nbytes={self.nbytes})"


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


def unsupported_reason(q, block_k: int = 128, block_n: int = 64) -> Optional[str]:
    """Why `prepare(q, block_k, block_n)` cannot build a kernel layout for q (None when it can)."""
    if not isinstance(q, QArray):
        return f"expected a QArray, got {type(q).__name__}"
    s = q.scheme
    if q.ndim != 2 or q.axis != 0:
        return f"needs a 2-D weight [K, N] quantized along axis 0, got shape {q.shape} axis {q.axis}"
    fmt = s.format
    if fmt.kind == "table":  # the in-kernel decode is bit arithmetic on the codes (SWAR into f16), not a gather
        return (f"element format {fmt.name} is a {2 ** fmt.bits}-entry table; the kernel decodes float / int codes by "
                f"bit arithmetic only (the XLA path and its fused GEMV take tables)")
    if not isinstance(fmt, (FloatFormat, IntFormat)):
        return f"element format {fmt.name} is not a float or int format"
    if isinstance(fmt, FloatFormat) and (fmt.ebits > 5 or (fmt.ebits == 5 and fmt.specials != "ieee")):
        return f"element format {fmt.name}: the in-kernel decode goes through f16 (needs <= 5 exponent bits)"
    if s.strategy not in ("channel", "tensor", "group", "tensor_group", "block"):
        return f"strategy {s.strategy!r} is not a weight strategy the kernel takes"
    if block_k < MIN_CHUNK or block_k & (block_k - 1):
        return f"block_k must be a power of two >= {MIN_CHUNK}, got {block_k}"
    if block_n < LANES * MIN_CHUNK or block_n & (block_n - 1):
        return f"block_n must be a power of two >= {LANES * MIN_CHUNK}, got {block_n}"
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
    if q.offset is not None and (q.global_scale is not None or s.scale_format not in _FLOAT_SCALES):
        return "an additive offset is taken with float32 / bf16 / f16 scales only (no global scale)"
    return None


# ---- prepare -----------------------------------------------------------------------------------------------
def prepare(q: QArray, block_k: int = 128, block_n: int = 64) -> PreparedWeight:
    """Repack a QArray `[K, N]` (quantized along axis 0) into the kernel layout of the module docstring.

    Args:
      q: the quantized weight, logical shape [K, N], axis 0.
      block_k: K rows per kernel tile (power of two >= 16); fixes the plane layout along K.
      block_n: output columns per kernel program (power of two >= 64); fixes the column permutation.

    Returns:
      PreparedWeight. Runs under jit (all layout facts are static).

    Raises:
      KernelError: if the scheme or shape has no kernel layout (`unsupported_reason`).
    """
    why = unsupported_reason(q, block_k, block_n)
    if why is not None:
        raise KernelError(f"prepare: {why} ({q.scheme.describe() if isinstance(q, QArray) else ''})")
    return _prepare_jit(q, block_k, block_n)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n"))
def _prepare_jit(q: QArray, block_k: int, block_n: int) -> PreparedWeight:
    s, fmt = q.scheme, q.scheme.format
    K, N = q.shape
    K_pad = -(-K // block_k) * block_k
    N_pad = -(-N // block_n) * block_n
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
    tiles, nb, bn4 = K_pad // block_k, N_pad // block_n, block_n // LANES
    out = []
    for w, sh in planes:
        n = 8 // w
        R = block_k // n
        part = ((c >> sh) & ((1 << w) - 1)).reshape(tiles, n, R, N_pad)
        byte = jnp.zeros((tiles, R, N_pad), jnp.uint32)
        for i in range(n):
            byte = byte | (part[:, i] << (i * w))
        byte = byte.reshape(tiles * R, nb, LANES, bn4)
        word = byte[:, :, 0] | (byte[:, :, 1] << 8) | (byte[:, :, 2] << 16) | (byte[:, :, 3] << 24)
        out.append(word.reshape(tiles * R, N_pad // LANES))

    # scales -> [rows, N_pad]
    rows = -(-K_pad // group)
    sc = q.scale
    if s.scale_format == "e8m0":
        kind, one = "e8m0", 127
        sc = sc.astype(jnp.uint8)
    elif s.scale_format == "fp8_e4m3fn":
        kind, one = "e4m3", 0x38
        sc = jax.lax.bitcast_convert_type(sc.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        kind, one = "float", 1.0
    sdt = q.work_dtype  # the scale's float dtype, or the QArray's compute_dtype (float16 GGUF d: float32)

    def scale_rows(a, pad):
        """A scale-shaped part [N, G] (tensor: [1]; block: [N / bh, G]) -> [rows, N_pad] rows along K."""
        if s.strategy == "tensor":
            a = jnp.broadcast_to(a.reshape(1, 1), (N, 1))
        if s.strategy == "block":
            a = jnp.repeat(a, s.block[0], axis=0)[:N]
        a = a.T  # [G, N]
        return jnp.pad(a, ((0, rows - a.shape[0]), (0, N_pad - N)), constant_values=pad)

    sc = scale_rows(sc, one)
    offset = None if q.offset is None else scale_rows(q.offset, 0)
    zero = None
    if q.zero_point is not None:
        z = q.zero_point.astype(jnp.int8).T
        zero = jnp.pad(z, ((0, rows - z.shape[0]), (0, N_pad - N)))
    gscale = None
    if q.global_scale is not None:
        gscale = q.global_scale.astype(jnp.float32).reshape(1, 1)
    meta = LayoutMeta(fmt=fmt, K=K, N=N, K_pad=K_pad, N_pad=N_pad, block_k=block_k, block_n=block_n,
                      chunk=chunk, group=group, planes=planes, scale_kind=kind,
                      scale_dtype=jnp.dtype(sdt).name, has_zero=zero is not None,
                      has_global=gscale is not None, dtype=q.dtype.name, scheme_desc=s.describe(),
                      has_offset=offset is not None)
    return PreparedWeight(out, sc, zero, gscale, meta, offset)


# ---- dequantization arithmetic shared by the kernel and dequantize_prepared ------------------------------------
def _shift(v: jax.Array, n: int) -> jax.Array:
    """v << n for n >= 0, v >> -n (logical) otherwise."""
    return v << n if n > 0 else (v >> -n if n < 0 else v)


def plane_part(word: jax.Array, slot: int, w: int, shift: int) -> jax.Array:
    """Codes bits `shift..shift+w-1` of four columns (byte lanes) from a plane word, slot `slot`: one shift
    moves the slot's bits to the code position inside each byte, one mask drops what crossed in from the
    neighbouring byte (shift + w <= 8 and slot * w + w <= 8, so the kept bits never leave their byte)."""
    if w == 8:
        return word
    return _shift(word, shift - slot * w) & np.uint32((((1 << w) - 1) << shift) * 0x01010101)


def _u16_to_f32(lane: jax.Array) -> jax.Array:
    """uint32 holding a half's bit pattern in its low 16 bits -> that half's value as f32 (exact)."""
    return jax.lax.bitcast_convert_type(lane.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def decode_words(code: jax.Array, meta: LayoutMeta) -> List[jax.Array]:
    """uint32 words with four codes in their byte lanes (each code < 2^bits) -> four f32 arrays, lane q's
    values, scaled by 2^(bias - 15) for float formats (`scale_values` multiplies 2^(15 - bias) back) and
    exact for ints.

    Half words (lanes 0, 2) and (1, 3) get the f16 pattern `sign << 15 | mag << (10 - m)` straight from the
    word by two shifted, masked copies (sign bits and magnitude fields land in their 16-bit lane; the
    other byte's bits are masked away): five integer ops per two codes."""
    fmt = meta.fmt
    out = [None] * LANES
    for src, lanes in ((0, (0, 2)), (8, (1, 3))):  # bit offset of the lanes' bytes in the word
        if isinstance(fmt, IntFormat):
            pat = (_shift(code, -src) & np.uint32(0x00FF00FF)) | np.uint32(0x64006400)  # half 1024 + u
        else:
            b, m = fmt.bits, fmt.mbits
            sign = _shift(code, 15 - (src + b - 1)) & np.uint32(0x80008000)
            mag = _shift(code, (10 - m) - src) & np.uint32((((1 << (b - 1)) - 1) << (10 - m)) * 0x00010001)
            pat = sign | mag
        for lane, p in zip(lanes, (pat, pat >> 16)):
            v = _u16_to_f32(p)
            if isinstance(fmt, IntFormat):
                v = v - np.float32(1024 - fmt.qmin)
            else:
                v = _specials(v, p, fmt)
            out[lane] = v
    return out


def decode_elements(code: jax.Array, fmt) -> jax.Array:
    """uint32 codes, one per element (each < 2^bits) -> f32, by the same f16 placement as `decode_words`:
    floats give value(code) * 2^(bias - 15) (the half `sign << 15 | magnitude << (10 - m)`; the scale carries
    2^(15 - bias)), ints u = q - qmin give q exactly (the half 1024 + u, minus 1024 - qmin)."""
    if isinstance(fmt, IntFormat):
        return _u16_to_f32(code | np.uint32(0x6400)) - np.float32(1024 - fmt.qmin)
    b, m = fmt.bits, fmt.mbits
    pat = ((code >> (b - 1)) << 15) | ((code & np.uint32((1 << (b - 1)) - 1)) << (10 - m))
    return _specials(_u16_to_f32(pat), pat, fmt)


def _specials(v: jax.Array, pat: jax.Array, fmt: FloatFormat) -> jax.Array:
    """NaN / inf codes that the f16 placement turns into finite values (formats with ebits < 5)."""
    if fmt.specials == "finite" or (fmt.ebits == 5 and fmt.specials == "ieee"):
        return v
    m = fmt.mbits
    mag = (pat & np.uint32(0x7FFF)) >> (10 - m)  # the code's magnitude field
    if fmt.specials == "fn":
        return jnp.where(mag == fmt.nan_code, np.float32(np.nan), v)
    if fmt.specials == "fnuz":
        return jnp.where((pat & np.uint32(0xFFFF)) == np.uint32(0x8000), np.float32(np.nan), v)
    top = (mag >> m) == (1 << fmt.ebits) - 1  # ieee with ebits < 5
    inf = jnp.where(v < 0, -np.float32(np.inf), np.float32(np.inf))
    return jnp.where(top, jnp.where((mag & ((1 << m) - 1)) == 0, inf, np.float32(np.nan)), v)


def _div(a: jax.Array, b: jax.Array, barrier: bool) -> jax.Array:
    """a / b in f32. XLA:CPU rewrites `a / broadcast(b)` into `a * (1 / b)` (an ulp off for half the inputs);
    with `barrier` the divisor is broadcast behind an optimization barrier, as qformats.rounding.div does,
    so the division stays IEEE (XLA paths and the interpreter only: Triton has no barrier)."""
    if barrier:
        b = jax.lax.optimization_barrier(jnp.broadcast_to(b, jnp.broadcast_shapes(a.shape, b.shape)))
    return a / b


def _decode_e4m3(c: jax.Array) -> jax.Array:
    """int32 e4m3fn codes -> f32 (scales: few elements, so the plain select form)."""
    mag = c & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    val = jnp.where(mag < 8, mag.astype(jnp.float32) * np.float32(2.0 ** -9), normal)
    val = jnp.where(mag == 0x7F, np.float32(np.nan), val)
    return jnp.where((c & 0x80) != 0, -val, val)


def scale_values(s: jax.Array, meta: LayoutMeta, gscale: Optional[jax.Array], barrier: bool = True) -> jax.Array:
    """Stored scale rows -> f32 effective scales: E8M0 / e4m3 codes decoded, NVFP4 divided by the global,
    times 2^(15 - bias) for float element formats (the factor that `decode_words` leaves out)."""
    if meta.scale_kind == "e8m0":
        c = s.astype(jnp.int32)
        v = jax.lax.bitcast_convert_type(c << 23, jnp.float32)
        v = jnp.where(c == 0, np.float32(2.0 ** -127), v)
        v = jnp.where(c == 255, np.float32(np.nan), v)
    else:
        v = _decode_e4m3(s.astype(jnp.int32)) if meta.scale_kind == "e4m3" else s.astype(jnp.float32)
        if gscale is not None:
            v = _div(v, gscale, barrier)
    if not meta.is_int and meta.fmt.bias != 15:
        v = v * np.float32(2.0 ** (15 - meta.fmt.bias))  # exact: a power of two
    return v


def finish(v: jax.Array, s_eff: jax.Array, z: Optional[jax.Array], meta, out_dtype,
           o: Optional[jax.Array] = None) -> jax.Array:
    """w = (value - zero) * scale [+ offset], each op rounded to `meta.scale_dtype` (the dtype `qformats.dequantize`
    computes in: the float scale's, or the QArray's compute_dtype), then cast to `out_dtype`: dequantize's
    rounding (`qformats.rounding`: each op correctly rounded in f32, then once to that dtype; the offset is widened
    to f32 exactly first)."""
    if z is not None:
        v = v - z.astype(jnp.float32)
    w = v * s_eff
    sdt = jnp.dtype(meta.scale_dtype)
    if sdt != jnp.float32:
        w = w.astype(sdt)
    if o is not None:
        w = w.astype(jnp.float32) + o.astype(jnp.float32)
        if sdt != jnp.float32:
            w = w.astype(sdt)
    return w.astype(out_dtype)


def plane_codes(planes, meta: LayoutMeta) -> jax.Array:
    """All code words [K_pad, N_pad/4] uint32 from the planes (the jnp mirror of the kernel's chunk loads)."""
    bk = meta.block_k
    tiles = meta.K_pad // bk
    nw = meta.N_pad // LANES
    code = jnp.zeros((tiles, bk, nw), jnp.uint32)
    for p, (w, sh) in zip(planes, meta.planes):
        n, R = 8 // w, bk * w // 8
        b = p.reshape(tiles, R, nw)
        code = code | jnp.concatenate([plane_part(b, i, w, sh) for i in range(n)], axis=1)
    return code.reshape(meta.K_pad, nw)


def dequantize_prepared(pw: PreparedWeight, dtype=None) -> jax.Array:
    """The dense weight [K, N] from a PreparedWeight, with the kernel's arithmetic (for tests and fallback)."""
    return _dequantize_prepared_jit(pw, jnp.dtype(pw.meta.dtype if dtype is None else dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_prepared_jit(pw: PreparedWeight, dtype) -> jax.Array:
    meta = pw.meta
    nb, bn4 = meta.N_pad // meta.block_n, meta.block_n // LANES
    lanes = decode_words(plane_codes(pw.planes, meta), meta)  # 4 x [K_pad, N_pad/4], lane q of each block
    v = jnp.stack([lane.reshape(meta.K_pad, nb, bn4) for lane in lanes], axis=2).reshape(meta.K_pad, meta.N_pad)
    srow = jnp.repeat(scale_values(pw.scale, meta, pw.gscale), meta.group, axis=0)[: meta.K_pad]
    z = None if pw.zero is None else jnp.repeat(pw.zero, meta.group, axis=0)[: meta.K_pad]
    o = None if pw.offset is None else jnp.repeat(pw.offset, meta.group, axis=0)[: meta.K_pad]
    return finish(v, srow, z, meta, dtype, o)[: meta.K, : meta.N]
