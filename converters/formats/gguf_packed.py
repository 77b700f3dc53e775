"""GGUF block-quantized tensors as packed QArrays, read from the file's bytes without a detour through float.

Each GGML block type below is, value for value, a grouped integer format of `qformats` (plus the QArray's
additive `offset` where the type stores a per-group minimum). For a GGUF matrix of `N` rows of `K` values (HF
`[out, in]`; the Flax kernel `[K, N]` quantized along K, axis 0), the QArray holds the element codes packed along
K (`qformats.packing.pack`), group scales `s [N, K / g]` and, for the types with a minimum, offsets `o [N, K / g]`
(float16 as stored where they are the block's d and m, else float32: "Storage" below), computed in float32, so that
`dequantize` computes

    w = q s            (symmetric types)           w = q s + o     (types with a minimum)

with q the element value (`element_values`: code u minus qmin for the integer formats; for IQ4_NL / IQ4_XS the
entry `kvalues[c]` of the 16-entry table format `qformats.formats.IQ4_NL`, c the file's 4-bit index). Stored type by type (d, dmin: the block's
float16 super-scales, read exactly into float32; sc, m: the sub-block scale and minimum integers):

  type    block  element        group  s                 o              gguf's `dequantize_blocks`
  Q4_0    32     int4  q-8      32     d                 -              d * (q - 8)
  Q5_0    32     int5  q-16     32     d                 -              d * (q - 16)
  Q8_0    32     int8           32     d                 -              q * d
  Q4_1    32     uint4          32     d                 m              d * q + m
  Q5_1    32     uint5          32     d                 m              d * q + m
  Q2_K    256    uint2          16     d * sc (4 bits)   -(dmin * m)    dl * q - ml
  Q3_K    256    int3           16     d * (sc - 32)     -              dl * q
  Q4_K    256    uint4          32     d * sc (6 bits)   -(dmin * m)    d * q - dm
  Q5_K    256    uint5          32     d * sc (6 bits)   -(dmin * m)    d * q - dm
  Q6_K    256    int6           16     d * sc (int8)     -              d * q
  IQ4_NL  32     iq4_nl table   32     d                 -              d * kvalues[q]
  IQ4_XS  256    iq4_nl table   32     d * (sc - 32)     -              dl * kvalues[q]
  MXFP4   32     fp4_e2m1       32     E8M0 code e       -              2^(e - 128) * (2 v)   (OCP MXFP4)

Exactness: d and dmin are float16 (11 significant bits) and every sc, m is an integer of at most 8 bits, so
each product `d * sc`, `dmin * m` has at most 19 significant bits and is exact in float32; the element product
`q * s` then has at most 11 + 6 + 7 = 24 significant bits (IQ4_XS: 11 + 5 + 7; Q5_K: 11 + 6 + 5; Q6_K:
11 + 7 + 5) and is exact too. So the only rounding is gguf's own final one (`+ m` / `- dm`), which the QArray
does identically (`a + (-b)` is `a - b` in IEEE arithmetic, signed zeros included, and a fused multiply-add
gives the same result when the product is exact): `dequantize(q)` equals `gguf.quants.dequantize` bit for bit
(tests/converters/formats/test_gguf_packed.py). No float32 subnormal arises (the smallest non-zero product
is 2^-24), so XLA:CPU's flushing changes nothing.

Storage: where the group scale is the block's own float16 d (and the offset its float16 m) -- Q4_0, Q5_0, Q8_0,
Q4_1, Q5_1, IQ4_NL -- scale and offset are kept float16, the file's bytes, and the QArray computes in float32
(`compute_dtype`: d and m widen exactly, then the products and sums above round as gguf's do), so a Q4_1 block of 32
weights takes 16 + 2 + 2 bytes (5 bits per weight, as in the file) and a Q8_0 block 32 + 2 (8.5, as in the file).
The super-block types store the float32 products d * sc, -(dmin * m): a float16 d times a 6-bit sc has up to 17
significant bits (19 for Q6_K's int8 sc), which neither float16 nor bfloat16 holds, so one float per group has to be a
float32. The alternative, a two-level scale (the float16 d, dmin per super-block and the small integer sc, m per group as
QArray leaves of their own, multiplied out exactly in float32 when decoding), would hold the file's 4.5 bits per Q4_K
weight in 4.625 (sc, m as uint8), Q2_K's 2.625 in 3.125, Q6_K's 6.5625 in 6.5625; it is not done: it is a new kind of
QArray leaf that every code building or slicing QArrays part by part (mesh placement and sharding specs, the decoder's
gate / up fusion and packed-embedding row gather, both kernel layouts, the compressed-tensors writer) would have to carry.
So a b-bit super-block type holds b + 32 / g bits per weight (+ 32 / g more with an offset; per type against the
file's: `bench/gguf_bits.py`, BENCHMARKS.md). IQ4_NL / IQ4_XS keep the file's 4-bit table indices, two per byte, under the
16-entry table format `qformats.formats.IQ4_NL`.

GGUF MXFP4 is OCP MXFP4 (E2M1 codes, E8M0 scales stored as is) for block exponents 2 .. 254; a tensor with an
exponent code 255 (2^127 to ggml, NaN to OCP) or 0 / 1 (subnormal float32 results, which XLA:CPU flushes) is
refused. Other GGML types (the IQ1/IQ2/IQ3 grids, TQ1_0/TQ2_0, GGUF NVFP4) are refused with a CheckpointError
naming the tensor, its type and the types packed here; F32/F16/BF16 tensors are not quantized and stay dense.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np

from qformats.errors import CheckpointError

__all__ = ["PACKED_TYPES", "DENSE_TYPES", "F16_SCALE_TYPES", "gguf_qarray", "decode_blocks", "GGUF_EMBEDDING",
           "swap_packed_embedding"]

#: GGML types that are plain floats (not quantized): loaded dense.
DENSE_TYPES = ("F32", "F16", "BF16", "F64")

_QK_K = 256

#: GGML types whose group scale (and offset) is the block's float16 d (and m) itself: kept float16, as stored.
F16_SCALE_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "IQ4_NL")


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields [n, 2] (uint8) -> float32 [n, 1], exactly."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1, 1)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 nibbles per row: element j < 16 the low nibble of byte j, element 16 + j its high nibble
    (the layout of Q4_0 / Q4_1 / Q5_x / IQ4_NL blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) -> 32 bits per row, bit j for element j (Q5_0 / Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-block scales and minima of a Q4_K / Q5_K super-block (12 bytes), as gguf's
    `Q4_K.get_scale_min` unpacks them."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# Each decoder: blocks uint8 [n, block_bytes] -> (u uint8 [n, block] element codes (u = q - qmin; int8 q for the
# int8 formats; the table index for IQ4_NL / IQ4_XS), scale float32 [n, block / g], offset float32 [n, block / g] or None).
Decoded = Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]


def _q4_0(b):
    return _nibbles32(b[:, 2:]), _f16(b[:, :2]), None


def _q4_1(b):
    return _nibbles32(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b):
    return _nibbles32(b[:, 6:]) | (_high_bits32(b[:, 2:6]) << 4), _f16(b[:, :2]), None


def _q5_1(b):
    return _nibbles32(b[:, 8:]) | (_high_bits32(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None


def _q2_k(b):
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    shift = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    u = ((qs.reshape(n, 2, 1, 32) >> shift) & 3).reshape(n, _QK_K)
    s = d * (scales & 0x0F).astype(np.float32)
    o = -(dmin * (scales >> 4).astype(np.float32))
    return u, s, o


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lo = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, _QK_K) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, _QK_K) & 1
    # gguf: q = ql - 4 (1 - h) in [-4, 3], so the int3 code u = q + 4 = ql + 4 h
    return ql | (qh << 2), d * sc.astype(np.float32), None


def _q4_k(b):
    n = b.shape[0]
    d, dmin, (sc, mn) = _f16(b[:, :2]), _f16(b[:, 2:4]), _k_scale_min(b[:, 4:16])
    qs = b[:, 16:]
    u = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, _QK_K) & 0x0F
    return u, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q5_k(b):
    n = b.shape[0]
    d, dmin, (sc, mn) = _f16(b[:, :2]), _f16(b[:, 2:4]), _k_scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, _QK_K) & 0x0F
    hb = (qh.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, _QK_K) & 1
    return ql | (hb << 4), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, _QK_K) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, _QK_K) & 3
    # gguf: q = (ql | qh << 4) - 32 in [-32, 31]: the int6 code u = q + 32 is the stored 6 bits
    return lo | (hi << 4), d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32), None


def _iq4_nl(b):
    return _nibbles32(b[:, 2:]), _f16(b[:, :2]), None


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1)
    sl = b[:, 4:8]
    lo = (sl.reshape(n, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    hi = ((sh >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)) & 3).astype(np.uint8)
    sc = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    qs = b[:, 8:].reshape(n, 8, 16)
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, _QK_K)
    return u, d * sc.astype(np.float32), None


def _mxfp4(b):
    # ggml's table is the E2M1 values doubled, indexed by the E2M1 code, under d = 2^(e - 128): the nibble is the
    # E2M1 code and e the E8M0 scale code of OCP MX (v * 2^(e - 127)); the "scale" returned is the uint8 code.
    # ggml's table has no -0 (int8 0 for code 8), so code 8 (E2M1 -0) becomes code 0 (+0): the same value, bit for bit
    u = _nibbles32(b[:, 1:])
    return np.where(u == 8, np.uint8(0), u), b[:, :1].copy(), None


#: GGML type name -> (block size, element format name, group size, decoder): the types packed exactly.
PACKED_TYPES: Dict[str, Tuple[int, str, int, Callable[[np.ndarray], Decoded]]] = {
    "Q4_0": (32, "int4", 32, _q4_0),
    "Q5_0": (32, "int5", 32, _q5_0),
    "Q8_0": (32, "int8", 32, _q8_0),
    "Q4_1": (32, "uint4", 32, _q4_1),
    "Q5_1": (32, "uint5", 32, _q5_1),
    "Q2_K": (_QK_K, "uint2", 16, _q2_k),
    "Q3_K": (_QK_K, "int3", 16, _q3_k),
    "Q4_K": (_QK_K, "uint4", 32, _q4_k),
    "Q5_K": (_QK_K, "uint5", 32, _q5_k),
    "Q6_K": (_QK_K, "int6", 16, _q6_k),
    "IQ4_NL": (32, "iq4_nl", 32, _iq4_nl),
    "IQ4_XS": (_QK_K, "iq4_nl", 32, _iq4_xs),
    "MXFP4": (32, "fp4_e2m1", 32, _mxfp4),
}


def decode_blocks(data: np.ndarray, type_name: str, shape: Tuple[int, int], where: str) -> Decoded:
    """The element codes u [N, K] (uint8 u = q - qmin, int8 q for int8; E2M1 codes for MXFP4; the 4-bit table
    index for IQ4_NL / IQ4_XS), scales [N, K / g]
    (float16 for `F16_SCALE_TYPES`, the stored d; float32 otherwise; MXFP4: uint8 E8M0 codes) and offsets [N, K / g]
    (or None; float16 / float32 alike) of a GGUF tensor of `shape` (N rows of
    K values, HF order) stored as GGML `type_name` in `data` (its raw bytes, uint8, any shape of the right size).
    Integer operations only, except the exact float32 products of the super-block scales (module docstring).

    Raises:
      CheckpointError: a type not in `PACKED_TYPES` (naming `where`, the tensor), or a byte count or K that does
        not fit the type's blocks.
    """
    import gguf

    if type_name not in PACKED_TYPES:
        raise CheckpointError(f"{where}: GGML type {type_name} is not packed by qformats (packed exactly: "
                              f"{', '.join(PACKED_TYPES)}; dense: {', '.join(DENSE_TYPES)}); load the file "
                              f"dequantized instead (load_causal_lm(..., packed=False) / qformats convert)")
    block, _, _, decode = PACKED_TYPES[type_name]
    n, k = (int(s) for s in shape)
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    raw = np.asarray(data)
    if raw.dtype != np.uint8 or k % block or raw.size != n * k // block * block_bytes:
        raise CheckpointError(f"{where}: {type_name} [{n}, {k}]: expected {n * (k // block)} blocks of {block_bytes} "
                              f"bytes ({block} values each), found {raw.size} {raw.dtype} bytes")
    u, s, o = decode(np.ascontiguousarray(raw).reshape(-1, block_bytes))
    u = u.reshape(n, k)
    if type_name == "MXFP4":
        bad = (s == 255) | (s < 2)
        if bad.any():
            raise CheckpointError(f"{where}: MXFP4: {int(bad.sum())} block scale(s) with exponent code "
                                  f"{int(s[bad][0])}: ggml reads 255 as 2^127 where OCP MX (E8M0) has NaN, and codes "
                                  f"0 / 1 give float32 subnormals that XLA:CPU flushes; expected codes 2 .. 254")
        return u, np.ascontiguousarray(s.reshape(n, -1)), None
    sdt = np.float16 if type_name in F16_SCALE_TYPES else np.float32  # float16 d, m: exact round trip
    s = np.ascontiguousarray(s.reshape(n, -1), sdt)
    o = None if o is None else np.ascontiguousarray(o.reshape(n, -1), sdt)
    return u, s, o


def gguf_qarray(data: np.ndarray, type_name: str, shape: Tuple[int, int], where: str, *,
                rows: Optional[Callable[[np.ndarray], np.ndarray]] = None):
    """A GGUF matrix of HF `shape` [N, K] (GGML `type_name`, raw bytes `data`) as the packed QArray of its Flax
    kernel: logical shape [K, N] quantized along axis 0, codes [N, packed K], scales (and offsets) [N, K / g] as
    `decode_blocks` gives them (float16 for `F16_SCALE_TYPES`, else float32), scheme `QuantScheme(format, "group",
    g, scale_format="float16" | "float32")`, `compute_dtype` float32 (table: module docstring), so that
    `dequantize(q).T` equals `gguf.quants.dequantize(data, type)` bit for bit.

    `rows`: an optional permutation of rows applied to every part (`unpermute_rope_rows` for llama's Q/K); rows
    move whole, so the result equals permuting the dequantized matrix.

    Raises:
      CheckpointError: a type not packed here (naming `where` and the types that are), or malformed bytes.
    """
    import jax.numpy as jnp

    from qformats.packing import pack_numpy
    from qformats.qarray import QArray
    from qformats.schemes import QuantScheme

    u, s, o = decode_blocks(data, type_name, shape, where)
    _, fmt, g, _ = PACKED_TYPES[type_name]
    if rows is not None:
        u, s = rows(u), rows(s)
        o = None if o is None else rows(o)
    mx = fmt == "fp4_e2m1"
    scheme = QuantScheme(fmt, "group", group_size=g, scale_format="e8m0" if mx else np.dtype(s.dtype).name,
                         scale_rule="floor" if mx else "absmax")
    bits = scheme.bits
    codes = u if bits == 8 else pack_numpy(u, bits)
    n, k = (int(x) for x in shape)
    q = QArray(jnp.asarray(codes), jnp.asarray(s), None, None,
               scheme=scheme, shape=(k, n), dtype=jnp.float32, axis=0, offset=None if o is None else jnp.asarray(o),
               compute_dtype=jnp.float32)
    q.check()
    return q


#: The HF name of the token embedding in a GGUF model's tensors (`GGUFModel.keys`).
GGUF_EMBEDDING = "model.embed_tokens.weight"


def swap_packed_embedding(g, model, cfg, get) -> bool:
    """Swaps `model`'s `nnx.Embed` for a `decoder.PackedEmbed` holding `get(GGUF_EMBEDDING)` (the packed QArray of
    the GGUF token embedding, logical [hidden, vocab]: `g.get_packed` on one device, its slices placed on a mesh by
    `converters.pipelines.mesh_load`) when the file stores the embedding in a packed block type and, for a tied
    lm_head (which reads it every step), only where the fused GEMV takes it (4 / 8 bits: a wider type would be
    dequantized whole per step). Returns whether it swapped; `get` is called only then.

    Raises:
      CheckpointError: the packed embedding is not [hidden_size, vocab_size].
    """
    from flax import nnx

    from qformats.models.decoder import PackedEmbed
    from qformats.packed_dot import packed_dot_supported

    emb = GGUF_EMBEDDING
    if emb not in g.keys() or g.tensor_type(emb) not in PACKED_TYPES \
            or not isinstance(model.model.embed_tokens, nnx.Embed):
        return False
    want = (cfg.hidden_size, cfg.vocab_size)
    n, k = g.shape(emb)
    if (k, n) != want:
        raise CheckpointError(f"{g.path}: tensor {emb}: expected the embedding [{want[1]}, {want[0]}], found "
                              f"[{n}, {k}]")
    if cfg.tie_word_embeddings and not packed_dot_supported((1, cfg.hidden_size), _probe(g, emb)):
        return False
    model.model.embed_tokens = PackedEmbed(get(emb), dtype=model.dtype)
    return True


def _probe(g, name):
    """The packed QArray of the first row of GGUF tensor `name` (its scheme and layout; what `packed_dot_supported`
    reads besides the shape), with the tensor's logical shape."""
    data, type_name = g.raw(name)
    n, k = g.shape(name)
    return gguf_qarray(np.asarray(data[:1]), type_name, (1, k), f"{g.path}: tensor {name!r}").replace(shape=(k, n))
