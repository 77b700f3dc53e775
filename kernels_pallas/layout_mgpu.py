"""Weight layout of the Mosaic GPU qmatmul: `prepare_mgpu(q)` repacks a QArray once into N-major byte planes.

The Mosaic GPU kernel (`qmatmul_mgpu`) computes y^T = W^T x^T with the weight as the *register* operand of
`wgmma` (rows = output channels, 64 per warpgroup) and the activations as the shared-memory operand, so the
codes are decoded element by element in the WGMMA register layout. Every array it reads is therefore a
stack of `[N, 64]` byte tiles (64 K positions per row, one TMA box, 64-byte swizzle), and a decoded tile
row holds 64 consecutive K positions of one output channel.

For a weight of logical shape `[K, N]` quantized along K, with K tile `tk` (`tile_k`) and N padded to a
multiple of 64 (`N_pad`), K to a multiple of `tk` (`K_pad`):

**Codes -> byte planes.** A b-bit code is split into planes of widths 8, 4, 2, 1 (`layout.plane_split`:
the binary digits of b, widest first, shifts ascending). Plane p of width w holds, per K tile, `R = tk*w/8`
byte columns in `S = R / 64` chunks of 64; byte column `r = s*64 + c` of tile t packs the codes of tile
rows `r + i*R`, i = 0 .. 8/w - 1, in bits `i*w .. i*w + w - 1`:

    plane[t*S + s, n, c] = sum_i ((code[t*tk + i*R + s*64 + c, n] >> shift) & (2^w - 1)) << (i*w)

(uint8 [K_pad/tk*S, N_pad, 64])

so K chunk j (rows j*64 .. j*64+63 of a tile) is `(plane[s] >> i*w) & mask` with `i*R + s*64 = j*64`, OR-ed
over the planes at their shifts: a code is read once, with no interleave, and an 8-bit code is its byte.
`tk = max(128, 64 * 8 / w_min)` (8 and 4 bits: 128; 6 and 2: 256; 5, 7, 3: 512), so every plane has whole
64-byte chunks. Integer codes are stored as the offset `u = q - qmin` (unsigned).

**Scales.** One row per group along K, `[K_pad / g, N_pad]` (g = the group along K; K_pad for channel and
tensor scales; the block width for FP8_BLOCK, its rows repeated over the block's output channels). MX (E8M0):
the uint8 codes, decoded in the kernel (`MgpuMeta.scale_f32`: a shift and two selects, exact). NVFP4: the uint8
e4m3 codes and an 8-entry f32 table `t[f] = fl((1 + f/8) / G) * 2^(15 - bias)` (zero-padded to 32 and repeated
per K tile: [K_pad / tk, 32]), from which the kernel forms fl(S / G) * 2^(15 - bias) without dividing
(`e4m3_table_scale`), when that is bit-identical to IEEE division for all 256 codes with this global scale G
(checked when the global scale is concrete; otherwise, or if not, f32 scales). Everything else: f32 effective
scales computed once here with `layout.scale_values` (NVFP4's e4m3 block scale divided by the global scale in
IEEE f32, times 2^(15 - bias) for float elements): the kernel multiplies, it never divides. The zero point of
asymmetric ints as f32 of the same shape, and so the additive offset (GGUF minima, `QArray.offset`). Padding:
scale 1 (E8M0 code 127), zero 0, offset 0, codes 0.

**Rounding.** The kernel computes `w = (v - zero) * scale` in f32 (exact for bf16/f16 scales and values:
the product has <= 22 significant bits), rounds it to the dtype dequantize computes in (`QArray.work_dtype`: the
scale's, or the QArray's compute_dtype), adds the offset there (f32 sum, rounded once), then casts to the
activation dtype:
bit-identical to `qformats.dequantize(q, x.dtype)` (`dequantize_mgpu` checks it without a GPU).
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

from kernels_pallas.layout import LayoutMeta, decode_elements, finish, plane_split, scale_values

__all__ = ["MgpuMeta", "MgpuWeight", "prepare_mgpu", "dequantize_mgpu", "mgpu_unsupported_reason",
           "chunk_codes", "e4m3_table_scale", "CHUNK", "TILE_N"]

CHUNK = 64   # K positions per decoded tile (one 64-byte row of a plane chunk)
TILE_N = 64  # output channels per warpgroup (wgmma's M)
TABLE_LEN = 32  # NVFP4's 8 table entries, padded to 128 bytes (Mosaic copies whole warpgroup widths)
_FLOAT_SCALES = ("float32", "bfloat16", "float16")


def _tile_k(bits: int) -> int:
    return max(128, CHUNK * 8 // min(w for w, _ in plane_split(bits)))


@dataclasses.dataclass(frozen=True)
class MgpuMeta:
    """Static facts of a prepared weight (hashable: pytree aux data and jit static argument)."""

    fmt: object            # FloatFormat | IntFormat
    K: int
    N: int
    K_pad: int
    N_pad: int
    tile_k: int
    group: int             # K rows per scale row (K_pad: one row)
    planes: Tuple[Tuple[int, int], ...]
    scale_kind: str        # "e8m0" / "e4m3_table": uint8 codes decoded in the kernel; "float": f32 scales
    scale_dtype: str       # the dtype dequantize rounds w in (the float scale's dtype, else float32)
    has_zero: bool
    dtype: str             # the QArray's dtype
    scheme_desc: str
    has_offset: bool = False  # f32 offset rows like the zero rows (GGUF minima: w = d q + m)

    @property
    def sub(self) -> int:
        """K positions per scale-constant slice of a chunk: min(group, 64)."""
        return min(self.group, CHUNK)

    @property
    def is_int(self) -> bool:
        return isinstance(self.fmt, IntFormat)

    def describe(self) -> str:
        return f"{self.scheme_desc} [K={self.K}, N={self.N}] (Mosaic GPU layout)"

    def scale_f32(self, s: jax.Array, table=None) -> jax.Array:
        """Stored scale rows -> f32 effective scales (the kernel runs this on each row it reads): E8M0 codes
        decoded (`layout.scale_values`: 2^(c - 127), times 2^(15 - bias) for float elements); NVFP4's e4m3
        codes through the 8-entry table (`e4m3_table_scale`); f32 rows as they are."""
        if self.scale_kind == "e8m0":
            return scale_values(s, self, None)
        if self.scale_kind == "e4m3_table":
            return e4m3_table_scale(s, table)
        return s

    def plane_chunks(self) -> Tuple[int, ...]:
        """S per plane: 64-byte chunks per K tile."""
        return tuple(self.tile_k * w // 8 // CHUNK for w, _ in self.planes)


@jax.tree_util.register_pytree_node_class
class MgpuWeight:
    """A weight in the Mosaic GPU layout (module docstring): byte planes, scale rows (f32, or E8M0 / e4m3
    codes), f32 zero rows, NVFP4's 8-entry scale table, f32 offset rows (None without one)."""

    def __init__(self, planes, scale, zero, table, meta: MgpuMeta, offset=None):
        self.planes = tuple(planes)
        self.scale = scale
        self.zero = zero
        self.table = table
        self.offset = offset
        self.meta = meta

    def tree_flatten(self):
        return (self.planes, self.scale, self.zero, self.table, self.offset), self.meta

    @classmethod
    def tree_unflatten(cls, meta, children):
        planes, scale, zero, table, offset = children
        return cls(planes, scale, zero, table, meta, offset)

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.meta.K, self.meta.N)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (*self.planes, self.scale, self.zero, self.table, self.offset) if a is not None)

    def __repr__(self) -> str:
        return f"MgpuWeight({self.meta.describe()}, tile_k={self.meta.tile_k}, nbytes={self.nbytes})"


def e4m3_table_scale(c: jax.Array, t) -> jax.Array:
    """e4m3fn scale codes -> fl(S / G) * 2^(15 - bias) without a division, from t[f] = fl(M_f / G) *
    2^(15 - bias), f = 0..7, M_f = 1 + f/8: every nonzero e4m3 value S is M_f * 2^E (normals: f = the
    mantissa bits, E = exponent - 7; subnormals f * 2^-9 renormalised), and fl(M_f 2^E / G) = 2^E fl(M_f / G)
    while the result is a normal f32 (`prepare_mgpu` checks all 256 codes against IEEE division before it
    chooses this form). Zero codes give +-0, 0x7F / 0xFF NaN, the sign bit the sign."""
    c = c.astype(jnp.int32)
    mag = c & 0x7F
    e, f = mag >> 3, c & 7
    sub = e == 0
    # subnormal f * 2^-9: f = 1 -> M_0 2^-9, 2 -> M_0 2^-8, 3 -> M_4 2^-8, 4 -> M_0 2^-7, 5 -> M_2 2^-7,
    # 6 -> M_4 2^-7, 7 -> M_6 2^-7
    fi = jnp.where(sub, jnp.where((f == 3) | (f == 6), 4, jnp.where(f == 5, 2, jnp.where(f == 7, 6, 0))), f)
    ex = jnp.where(sub, jnp.where(f == 1, -9, jnp.where(f <= 3, -8, -7)), e - 7)
    sel = jnp.where(fi == 1, t[1], t[0])
    for i in range(2, 8):
        sel = jnp.where(fi == i, t[i], sel)
    v = sel * jax.lax.bitcast_convert_type((ex + 127) << 23, jnp.float32)
    v = jnp.where(mag == 0, np.float32(0.0), v)
    v = jnp.where(mag == 0x7F, np.float32(np.nan), v)
    return jnp.where((c & 0x80) != 0, -v, v)


def _group_of(q: QArray) -> Optional[int]:
    s = q.scheme
    if s.strategy in ("channel", "tensor"):
        return None
    if s.strategy in ("group", "tensor_group"):
        return s.group_size
    if s.strategy == "block":
        return s.block[1]
    return -1


def mgpu_unsupported_reason(q) -> Optional[str]:
    """Why `prepare_mgpu(q)` cannot build a Mosaic GPU layout for q (None when it can)."""
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
    if s.scale_format not in _FLOAT_SCALES + ("input", "e8m0", "fp8_e4m3fn"):
        return f"scale format {s.scale_format!r}"
    if q.offset is not None and (q.global_scale is not None or s.scale_format not in _FLOAT_SCALES):
        return "an additive offset is taken with float32 / bf16 / f16 scales only (no global scale)"
    g = _group_of(q)
    tk = _tile_k(s.bits)
    if g is not None:
        if g not in (16, 32) and g % CHUNK:
            return f"group {g} along K: the Mosaic GPU kernel takes groups of 16, 32 or a multiple of {CHUNK}"
        if g % tk and tk % g:
            return f"group {g} along K and K tile {tk} ({s.bits}-bit codes): neither divides the other"
    return None


def prepare_mgpu(q: QArray) -> MgpuWeight:
    """Repack a QArray `[K, N]` (quantized along axis 0) into the Mosaic GPU layout of the module docstring.

    Args:
      q: the quantized weight, logical shape [K, N], axis 0.

    Returns:
      MgpuWeight (runs under jit: every layout fact is static).

    Raises:
      KernelError: if the scheme or shape has no Mosaic GPU layout (`mgpu_unsupported_reason`).
    """
    why = mgpu_unsupported_reason(q)
    if why is not None:
        desc = q.scheme.describe() if isinstance(q, QArray) else type(q).__name__
        raise KernelError(f"prepare_mgpu: {why} ({desc})")
    return _prepare_jit(q, table=_table_is_exact(q))


def _table_is_exact(q: QArray) -> bool:
    """NVFP4 (e4m3 scales / a global scale): whether `e4m3_table_scale` equals the IEEE scale / global of
    `layout.scale_values` bit for bit on all 256 codes for this global scale. Needs the global scale's value:
    under a trace the f32 scale layout is used (always exact)."""
    if q.scheme.scale_format != "fp8_e4m3fn" or q.global_scale is None:
        return False
    try:
        g = np.asarray(q.global_scale, np.float32).reshape(1, 1)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
    ref, got = _table_check(jnp.asarray(g), q.scheme.format)
    ref, got = np.asarray(ref), np.asarray(got)
    return bool(np.array_equal(np.isnan(ref), np.isnan(got))
                and np.array_equal(ref.view(np.uint32)[~np.isnan(ref)], got.view(np.uint32)[~np.isnan(ref)]))


@functools.partial(jax.jit, static_argnames=("fmt",))
def _table_check(g, fmt):
    lm = _e4m3_meta(fmt)
    codes = jnp.arange(256, dtype=jnp.uint8).reshape(1, 256)
    table = scale_values(jnp.arange(0x38, 0x40, dtype=jnp.uint8).reshape(1, 8), lm, g)[0]
    return scale_values(codes, lm, g)[0], e4m3_table_scale(codes[0], table)


def _e4m3_meta(fmt) -> LayoutMeta:
    return LayoutMeta(fmt=fmt, K=0, N=0, K_pad=0, N_pad=0, block_k=0, block_n=0, chunk=0, group=0, planes=(),
                      scale_kind="e4m3", scale_dtype="float32", has_zero=False, has_global=True, dtype="float32",
                      scheme_desc="")


@functools.partial(jax.jit, static_argnames=("table",))
def _prepare_jit(q: QArray, table: bool) -> MgpuWeight:
    s, fmt = q.scheme, q.scheme.format
    K, N = q.shape
    tk = _tile_k(s.bits)
    K_pad = -(-K // tk) * tk
    N_pad = -(-N // TILE_N) * TILE_N
    planes = plane_split(s.bits)
    g = _group_of(q)
    group = K_pad if g is None else g

    c = q.element_codes()  # [N, K]
    if isinstance(fmt, IntFormat) and c.dtype == jnp.int8:
        c = c.astype(jnp.int32) - fmt.qmin
    c = jnp.pad(c.astype(jnp.uint32), ((0, N_pad - N), (0, K_pad - K)))  # [N_pad, K_pad]
    tiles = K_pad // tk
    out = []
    for w, sh in planes:
        n = 8 // w
        R = tk * w // 8
        part = ((c >> sh) & ((1 << w) - 1)).reshape(N_pad, tiles, n, R)
        byte = sum(part[:, :, i] << (i * w) for i in range(n))  # [N_pad, tiles, R]
        byte = byte.reshape(N_pad, tiles * (R // CHUNK), CHUNK).transpose(1, 0, 2)
        out.append(byte.astype(jnp.uint8))

    lm = LayoutMeta(fmt=fmt, K=K, N=N, K_pad=K_pad, N_pad=N_pad, block_k=tk, block_n=TILE_N, chunk=CHUNK,
                    group=group, planes=planes, scale_kind={"e8m0": "e8m0", "fp8_e4m3fn": "e4m3"}.get(
                        s.scale_format, "float"), scale_dtype="float32", has_zero=False,
                    has_global=q.global_scale is not None, dtype=q.dtype.name, scheme_desc=s.describe())
    rows = -(-K_pad // group)
    sc = q.scale
    if s.scale_format == "e8m0":
        sc, one, sdt = sc.astype(jnp.uint8), 127, jnp.float32
    elif s.scale_format == "fp8_e4m3fn":
        sc = jax.lax.bitcast_convert_type(sc.astype(jnp.float8_e4m3fn), jnp.uint8)
        one, sdt = 0x38, jnp.float32
    else:
        one = 1.0
    sdt = q.work_dtype  # the dtype dequantize rounds in (a float16 GGUF d computes in float32)

    def scale_rows(a, pad):
        """A scale-shaped part [N, G] (tensor: [1]; block: [N / bh, G]) -> [rows, N_pad] rows along K."""
        if s.strategy == "tensor":
            a = jnp.broadcast_to(a.reshape(1, 1), (N, 1))
        if s.strategy == "block":
            a = jnp.repeat(a, s.block[0], axis=0)[:N]
        return jnp.pad(a.T, ((0, rows - a.shape[1]), (0, N_pad - N)), constant_values=pad)

    sc = scale_rows(sc, one)  # [rows, N_pad]
    offset = None if q.offset is None else scale_rows(q.offset.astype(jnp.float32), 0.0)
    gscale = None if q.global_scale is None else q.global_scale.astype(jnp.float32).reshape(1, 1)
    kind = "e8m0" if s.scale_format == "e8m0" else ("e4m3_table" if table else "float")
    seff = sc if kind != "float" else scale_values(sc, lm, gscale, barrier=True)
    tab = None
    if kind == "e4m3_table":  # t[f] = fl((1 + f/8) / G) * 2^(15 - bias): the e4m3 codes 0x38 + f are 1 + f/8
        tab = scale_values(jnp.arange(0x38, 0x40, dtype=jnp.uint8).reshape(1, 8), lm, gscale)
        # [tiles, 32]: one 128-byte copy per K tile (a warpgroup's width; every pipelined input follows the K
        # tile index, which the warp-specialized pipeline requires)
        tab = jnp.tile(jnp.pad(tab, ((0, 0), (0, TABLE_LEN - 8))), (tiles, 1))
    zero = None
    if q.zero_point is not None:
        z = q.zero_point.astype(jnp.float32).T
        zero = jnp.pad(z, ((0, rows - z.shape[0]), (0, N_pad - N)))
    meta = MgpuMeta(fmt=fmt, K=K, N=N, K_pad=K_pad, N_pad=N_pad, tile_k=tk, group=group, planes=planes,
                    scale_kind=kind, scale_dtype=jnp.dtype(sdt).name, has_zero=zero is not None, dtype=q.dtype.name,
                    scheme_desc=s.describe(), has_offset=offset is not None)
    return MgpuWeight(out, seff, zero, tab, meta, offset)


# ---- the arithmetic the kernel runs on each decoded tile ---------------------------------------------------------
def chunk_codes(plane_tiles, meta: MgpuMeta, j: int) -> jax.Array:
    """uint32 codes of K chunk j of a tile from the tile's planes (`plane_tiles[p][s]`: chunk s of plane p,
    [rows, 64] uint8): `(byte >> i*w) & mask` of the chunk that holds it in each plane, shifted to the plane's
    bits and OR-ed."""
    code = None
    for tiles_p, (w, sh), S in zip(plane_tiles, meta.planes, meta.plane_chunks()):
        i, s = divmod(j, S)
        b = tiles_p[s].astype(jnp.uint32)
        if w != 8:
            b = (b >> np.uint32(i * w)) & np.uint32((1 << w) - 1)
        if sh:
            b = b << np.uint32(sh)
        code = b if code is None else code | b
    return code


def dequantize_mgpu(mw: MgpuWeight, dtype=None) -> jax.Array:
    """The dense weight [K, N] from an MgpuWeight with the kernel's arithmetic (tests, no GPU needed)."""
    return _dequantize_jit(mw, jnp.dtype(mw.meta.dtype if dtype is None else dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_jit(mw: MgpuWeight, dtype) -> jax.Array:
    meta = mw.meta
    tk, tiles = meta.tile_k, meta.K_pad // meta.tile_k
    # chunk s of every tile at once: [tiles, N_pad, 64] per (plane, s); the kernel indexes one tile's chunks
    tile_planes = [[p.reshape(tiles, S, meta.N_pad, CHUNK)[:, s] for s in range(S)]
                   for p, S in zip(mw.planes, meta.plane_chunks())]
    v = jnp.stack([decode_elements(chunk_codes(tile_planes, meta, j), meta.fmt) for j in range(tk // CHUNK)],
                  axis=1)  # [tiles, chunks, N_pad, 64]
    v = v.transpose(2, 0, 1, 3).reshape(meta.N_pad, meta.K_pad)
    rep = lambda a: jnp.repeat(a, meta.group, axis=0)[: meta.K_pad].T  # noqa: E731
    z = None if mw.zero is None else rep(mw.zero)
    o = None if mw.offset is None else rep(mw.offset)
    table = None if mw.table is None else [mw.table[0, i] for i in range(8)]
    w = finish(v, rep(meta.scale_f32(mw.scale, table)), z, meta, dtype, o)  # finish reads meta.scale_dtype only
    return w.T[: meta.K, : meta.N]
