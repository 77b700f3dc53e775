"""Bit packing of sub-byte codes: little-endian bit streams into uint8 bytes and int32 words (compressed-tensors)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import SchemeError

__all__ = [
    "check_codes",
    "offset_signed",
    "pack",
    "pack_int32",
    "pack_numpy",
    "packed_length",
    "packed_length_int32",
    "unoffset_signed",
    "unpack",
    "unpack_int32",
]


# ----------------------------------------------------------------------------------------------------------------
# validation (static: runs at trace time, so errors surface before anything is compiled)


def _check_bits(bits, where: str) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise SchemeError(f"{where}: bits must be an integer in 1..8, got {bits!r}")
    return int(bits)


def _check_n(n, where: str) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise SchemeError(f"{where}: the logical length n must be a non-negative integer, got {n!r}")
    return int(n)


def _check_axis(axis, ndim: int, where: str) -> int:
    if ndim == 0:
        raise SchemeError(f"{where}: expected an array with at least one dimension, got a scalar")
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise SchemeError(f"{where}: axis must be an integer in [{-ndim}, {ndim}) for a {ndim}-d array, got {axis!r}")
    return int(axis) % ndim


def _as_int_array(x, where: str, what: str, itemsizes=None) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise SchemeError(f"{where}: expected integer {what}, got dtype {x.dtype}")
    if itemsizes is not None and x.dtype.itemsize not in itemsizes:
        allowed = " or ".join(f"{8 * s}-bit" for s in itemsizes)
        raise SchemeError(f"{where}: expected {allowed} integer {what}, got dtype {x.dtype}")
    return x


def packed_length(n: int, bits: int) -> int:
    """Bytes that `pack` writes for a row of n codes of `bits` bits: ceil(n * bits / 8)."""
    return -(-_check_n(n, "packed_length") * _check_bits(bits, "packed_length") // 8)


def packed_length_int32(n: int, bits: int, legacy: bool = False) -> int:
    """Words that `pack_int32` writes for n values: ceil(n * bits / 32), or ceil(n / (32 // bits)) if legacy."""
    n, bits = _check_n(n, "packed_length_int32"), _check_bits(bits, "packed_length_int32")
    return -(-n // (32 // bits)) if legacy else -(-n * bits // 32)


# ----------------------------------------------------------------------------------------------------------------
# the shared kernel: chunks of `elems` codes of `bits` bits laid out little-endian into `words` words of `wbits`
#
# Element e of a chunk occupies bits e*bits .. e*bits+bits-1 of the chunk's stream; word k holds stream bits
# k*wbits .. k*wbits+wbits-1 (bit 0 = LSB of word 0). A chunk is the smallest run of codes that fills whole words
# (dense) or, for the legacy int32 layout, the 32 // bits codes of one word. Every (element, word) overlap is a
# static shift, so the whole pack/unpack is a few dozen fused elementwise ops: no gathers, no scatters.


def _chunking(bits: int, wbits: int, legacy: bool) -> tuple[int, int]:
    if legacy:
        return wbits // bits, 1
    g = math.gcd(bits, wbits)
    return wbits // g, bits // g  # (elems per chunk, words per chunk)


def _pack_stream(u: jax.Array, bits: int, wbits: int, legacy: bool, out_len: int) -> jax.Array:
    """u: uint32 [..., n] with values < 2^bits -> uint32 [..., out_len] words of `wbits` bits (in the low bits)."""
    elems, words = _chunking(bits, wbits, legacy)
    n = u.shape[-1]
    chunks = -(-n // elems)
    u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, chunks * elems - n)])
    u = u.reshape(*u.shape[:-1], chunks, elems)
    wmask = jnp.uint32((1 << wbits) - 1)
    out = []
    for k in range(words):
        acc = jnp.zeros(u.shape[:-1], jnp.uint32)
        for e in range(elems):
            lo = e * bits - k * wbits  # position of element e's LSB relative to word k's LSB
            if lo >= wbits or lo + bits <= 0:
                continue
            v = u[..., e]
            acc = acc | (v << jnp.uint32(lo) if lo >= 0 else v >> jnp.uint32(-lo))
        out.append(acc & wmask)
    packed = jnp.stack(out, axis=-1).reshape(*u.shape[:-2], chunks * words)
    return packed[..., :out_len]


def _unpack_stream(w: jax.Array, bits: int, wbits: int, legacy: bool, n: int) -> jax.Array:
    """w: uint32 [..., L] words of `wbits` bits -> uint32 [..., n] codes of `bits` bits (inverse of _pack_stream)."""
    elems, words = _chunking(bits, wbits, legacy)
    length = w.shape[-1]
    chunks = -(-length // words)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, chunks * words - length)])
    w = w.reshape(*w.shape[:-1], chunks, words)
    emask = jnp.uint32((1 << bits) - 1)
    out = []
    for e in range(elems):
        acc = jnp.zeros(w.shape[:-1], jnp.uint32)
        for k in range(words):
            lo = e * bits - k * wbits
            if lo >= wbits or lo + bits <= 0:
                continue
            v = w[..., k]
            acc = acc | (v >> jnp.uint32(lo) if lo >= 0 else v << jnp.uint32(-lo))
        out.append(acc & emask)
    codes = jnp.stack(out, axis=-1).reshape(*w.shape[:-2], chunks * elems)
    return codes[..., :n]


# ----------------------------------------------------------------------------------------------------------------
# uint8 byte streams (FP4 / FP6 / any-width codes)


@functools.partial(jax.jit, static_argnames=("bits",))
def pack(codes, bits: int) -> jax.Array:
    """Pack `bits`-wide codes into a little-endian bit stream of bytes along the last axis.

    Layout: code j of a row occupies bits j*bits .. j*bits+bits-1 of the row's stream, where stream bit
    8*i + t is bit t (t = 0 is the LSB) of byte i. Equivalently byte i = sum_j ((code_j << (j*bits)) >> 8i) & 0xFF.
      - bits=4: code 2i in the low nibble of byte i, code 2i+1 in the high nibble (compressed-tensors'
        nvfp4/mxfp4 `pack_fp4_to_uint8`, torchao's `pack_uint4`);
      - bits=6: four codes c0..c3 in three bytes holding c0 | c1 << 6 | c2 << 12 | c3 << 18 little-endian
        (compressed-tensors' mxfp6 `pack_fp6_to_uint8`);
      - bits=8: the identity.
    When n*bits is not a multiple of 8 the unused high bits of the last byte are zero. Bits of a code above
    `bits` are masked off silently (jit cannot raise on data; see `check_codes` to validate eagerly).

    Args:
      codes: integer array [..., n] (normally uint8) with the codes in its low `bits` bits; numpy accepted.
      bits: code width, 1..8 (static).

    Returns:
      uint8 [..., ceil(n*bits/8)].
    """
    bits = _check_bits(bits, "pack")
    codes = _as_int_array(codes, "pack", "codes")
    if codes.ndim == 0:
        raise SchemeError("pack: expected codes with at least one dimension, got a scalar")
    u = codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    return _pack_stream(u, bits, 8, False, -(-codes.shape[-1] * bits // 8)).astype(jnp.uint8)


def pack_numpy(codes, bits: int) -> np.ndarray:
    """`pack(codes, bits)` computed in numpy on the host, bit for bit: byte i of a row = sum_j ((code_j & (2^bits -
    1)) << (j * bits) >> 8i) & 0xFF, ceil(n * bits / 8) bytes (the high bits of a partial last byte zero); 8 bits:
    the codes' low bytes as they are. For codes already on the host (a checkpoint's decoded blocks): no device
    transfer and no compilation (XLA:CPU took 10-20 s to compile `pack` alone for [128 x 128] 3- and 5-bit codes);
    [4096 x 4096] codes pack in 0.02-0.1 s.

    Raises:
      SchemeError: bits outside 1..8, a scalar, or codes that are not integers.
    """
    bits = _check_bits(bits, "pack_numpy")
    codes = np.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):
        raise SchemeError(f"pack_numpy: expected integer codes, got dtype {codes.dtype}")
    if codes.ndim == 0:
        raise SchemeError("pack_numpy: expected codes with at least one dimension, got a scalar")
    mask = (1 << bits) - 1
    u = codes.view(np.uint8) if codes.dtype.itemsize == 1 else (codes & mask).astype(np.uint8)
    if bits == 8:
        return u
    u = u & np.uint8(mask)
    n = u.shape[-1]
    if bits == 4 and n % 2 == 0:
        return u[..., 0::2] | (u[..., 1::2] << np.uint8(4))
    pad = -n % 8  # whole octets of codes: `bits` bytes each
    if pad:
        u = np.concatenate([u, np.zeros(u.shape[:-1] + (pad,), np.uint8)], axis=-1)
    # an octet's codes as one little-endian uint64 (code j in byte j), compressed in three steps: the odd code of
    # each pair moves down next to the even one, then the odd pair of each quad, then the odd quad: code j at bit
    # j * bits, the octet's 8 * bits bits in the word's low `bits` bytes
    w = np.ascontiguousarray(u).view("<u8")
    for step, keep in ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0x00000000FFFFFFFF)):
        moved = (w & np.uint64(keep ^ 0xFFFFFFFFFFFFFFFF)) >> np.uint64(step - step // 8 * bits)
        w = (w & np.uint64(keep)) | moved
    out = w.view(np.uint8).reshape(u.shape[:-1] + (-1, 8))[..., :bits]
    return out.reshape(u.shape[:-1] + (-1,))[..., :-(-n * bits // 8)]


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def unpack(packed, bits: int, n: int) -> jax.Array:
    """Inverse of `pack`: code j of a row = bits j*bits .. j*bits+bits-1 of the row's little-endian byte stream.

    Args:
      packed: uint8 (or int8) [..., ceil(n*bits/8)]; numpy accepted.
      bits: code width, 1..8 (static).
      n: logical number of codes per row (static); the packed length must be exactly ceil(n*bits/8).

    Returns:
      uint8 [..., n], each code in the low `bits` bits. Padding bits of the last byte are ignored.

    Raises:
      SchemeError: if the packed length does not match n.
    """
    bits, n = _check_bits(bits, "unpack"), _check_n(n, "unpack")
    packed = _as_int_array(packed, "unpack", "packed bytes", itemsizes=(1,))
    if packed.ndim == 0:
        raise SchemeError("unpack: expected packed bytes with at least one dimension, got a scalar")
    want = -(-n * bits // 8)
    if packed.shape[-1] != want:
        raise SchemeError(
            f"unpack: {n} codes of {bits} bits pack into ceil({n}*{bits}/8) = {want} bytes per row, "
            f"but the packed array has {packed.shape[-1]} (shape {tuple(packed.shape)})"
        )
    w = packed.astype(jnp.uint8).astype(jnp.uint32)
    return _unpack_stream(w, bits, 8, False, n).astype(jnp.uint8)


def check_codes(codes, bits: int) -> None:
    """Raise SchemeError unless every code satisfies 0 <= code < 2^bits (eager numpy check, not jit-able).

    `pack` masks each code with (1 << bits) - 1 so it can run under jit; call this first when input may be
    out of range. The error names the first offending index (row-major order) and its value.
    """
    bits = _check_bits(bits, "check_codes")
    arr = np.asarray(codes)
    if not np.issubdtype(arr.dtype, np.integer):
        raise SchemeError(f"check_codes: expected integer codes, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= (1 << bits))
    if bad.any():
        flat = int(np.argmax(bad.reshape(-1)))
        idx = tuple(int(i) for i in np.unravel_index(flat, arr.shape))
        raise SchemeError(
            f"check_codes: codes of {bits} bits must lie in [0, {(1 << bits) - 1}], but codes{list(idx)} = "
            f"{arr.reshape(-1)[flat]} ({int(bad.sum())} of {arr.size} codes out of range)"
        )


# ----------------------------------------------------------------------------------------------------------------
# int32 words (compressed-tensors `pack-quantized`)


@functools.partial(jax.jit, static_argnames=("bits",))
def offset_signed(q, bits: int) -> jax.Array:
    """Signed integers q in [-2^(bits-1), 2^(bits-1) - 1] -> unsigned u = q + 2^(bits-1) as uint8.

    This is the offset compressed-tensors applies before `pack_to_int32` (int4 -8..7 -> 0..15). The result is
    taken modulo 256; out-of-range q are not detected here (pack masks to `bits` bits).
    """
    bits = _check_bits(bits, "offset_signed")
    q = _as_int_array(q, "offset_signed", "values")
    return (q.astype(jnp.int32) + (1 << (bits - 1))).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits",))
def unoffset_signed(u, bits: int) -> jax.Array:
    """Unsigned u in [0, 2^bits) -> signed q = u - 2^(bits-1) as int8 (inverse of `offset_signed`)."""
    bits = _check_bits(bits, "unoffset_signed")
    u = _as_int_array(u, "unoffset_signed", "values")
    return ((u.astype(jnp.int32) & ((1 << bits) - 1)) - (1 << (bits - 1))).astype(jnp.int8)


@functools.partial(jax.jit, static_argnames=("bits", "legacy", "axis"))
def pack_int32(values, bits: int, legacy: bool = False, axis: int = -1) -> jax.Array:
    """Pack unsigned `bits`-wide values into int32 words along `axis` (compressed-tensors `pack-quantized`).

    Dense layout (legacy=False, compressed-tensors >= 0.18): value j occupies bits j*bits .. j*bits+bits-1 of
    the little-endian stream of 32-bit words, so a value may straddle two words; word k =
    sum_j ((u_j << (j*bits)) >> 32k) mod 2^32, ceil(n*bits/32) words. Legacy layout (legacy=True,
    compressed-tensors <= 0.17): 32 // bits values per word, value j at bit (j mod (32//bits)) * bits of word
    j // (32//bits), the top 32 mod bits bits of each word zero, ceil(n / (32//bits)) words. The two agree for
    bits in {1, 2, 4, 8}. Unused trailing bits are zero. Words are reinterpreted as two's-complement int32
    (bit 31 set -> negative), as torch stores them.

    compressed-tensors packs weights along the last axis (`packed_dim=1`) and asymmetric zero points along
    dim 0 of each 2-d matrix (`packed_dim=0`): axis=0 for a 2-d [N, G] zero point, axis=-2 for a stacked
    [E, N, G] one (it packs each [N, G] slice separately).

    Args:
      values: integer array, unsigned offset values u in [0, 2^bits) (see `offset_signed`); bits above `bits`
        are masked off. numpy accepted.
      bits: value width, 1..8 (static).
      legacy: use the pre-0.18 layout (static).
      axis: the axis to pack along (static).

    Returns:
      int32 with `axis` resized to the word count.
    """
    bits = _check_bits(bits, "pack_int32")
    values = _as_int_array(values, "pack_int32", "values")
    axis = _check_axis(axis, values.ndim, "pack_int32")
    u = jnp.moveaxis(values, axis, -1).astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    words = _pack_stream(u, bits, 32, bool(legacy), packed_length_int32(u.shape[-1], bits, bool(legacy)))
    return jnp.moveaxis(jax.lax.bitcast_convert_type(words, jnp.int32), -1, axis)


@functools.partial(jax.jit, static_argnames=("bits", "n", "legacy", "axis"))
def unpack_int32(packed, bits: int, n: int, legacy: bool = False, axis: int = -1) -> jax.Array:
    """Inverse of `pack_int32`: value j = bits j*bits .. j*bits+bits-1 of the little-endian word stream (dense),
    or bits (j mod p)*bits .. of word j // p with p = 32 // bits (legacy).

    Args:
      packed: int32 (or uint32) words; numpy accepted. Negative words are read as their 32-bit pattern.
      bits: value width, 1..8 (static).
      n: logical number of values along `axis` (static); the word count there must be exactly
        ceil(n*bits/32) (dense) or ceil(n/(32//bits)) (legacy).
      legacy: read the pre-0.18 layout (static).
      axis: the packed axis (static).

    Returns:
      uint8 unsigned values u in [0, 2^bits) with `axis` of length n (see `unoffset_signed`).

    Raises:
      SchemeError: if the word count does not match n.
    """
    bits, n = _check_bits(bits, "unpack_int32"), _check_n(n, "unpack_int32")
    packed = _as_int_array(packed, "unpack_int32", "words", itemsizes=(4,))
    axis = _check_axis(axis, packed.ndim, "unpack_int32")
    want = packed_length_int32(n, bits, bool(legacy))
    if packed.shape[axis] != want:
        rule = f"ceil({n}/(32//{bits}))" if legacy else f"ceil({n}*{bits}/32)"
        raise SchemeError(
            f"unpack_int32: {n} values of {bits} bits pack into {rule} = {want} "
            f"{'legacy ' if legacy else ''}int32 words along axis {axis}, but the packed array has "
            f"{packed.shape[axis]} (shape {tuple(packed.shape)})"
        )
    w = jax.lax.bitcast_convert_type(jnp.moveaxis(packed, axis, -1), jnp.uint32)
    return jnp.moveaxis(_unpack_stream(w, bits, 32, bool(legacy), n).astype(jnp.uint8), -1, axis)
