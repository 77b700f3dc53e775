"""Bit packing: exact round trips, known vectors, and byte-identity with compressed-tensors and torchao."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qformats import SchemeError
from qformats.packing import (
    check_codes,
    offset_signed,
    pack,
    pack_int32,
    pack_numpy,
    packed_length,
    packed_length_int32,
    unoffset_signed,
    unpack,
    unpack_int32,
)

ALL_BITS = list(range(1, 9))
# Every example compiles one small XLA program (~0.1 s); keep the counts small, the shapes varied.
FAST = settings(max_examples=24, deadline=None, derandomize=True)


def _codes(rng, shape, bits):
    return rng.integers(0, 1 << bits, size=shape, dtype=np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# round trips


@st.composite
def _case(draw, max_n=70):
    bits = draw(st.sampled_from(ALL_BITS))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n = draw(st.integers(0, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    return bits, lead + (n,), seed


@FAST
@given(_case())
def test_pack_unpack_round_trip(case):
    bits, shape, seed = case
    codes = _codes(np.random.default_rng(seed), shape, bits)
    n = shape[-1]

    @jax.jit
    def round_trip(c):
        p = pack(c, bits)
        return p, unpack(p, bits, n)

    packed, back = round_trip(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == shape[:-1] + (math.ceil(n * bits / 8),)
    np.testing.assert_array_equal(np.asarray(back), codes)
    assert back.dtype == jnp.uint8
    # the zero-padded tail: the bits past n*bits of each row are zero
    if n * bits % 8:
        assert not (np.asarray(packed)[..., -1] >> (n * bits % 8)).any()


@FAST
@given(_case(max_n=100), st.booleans(), st.booleans())
@pytest.mark.slow
def test_pack_int32_round_trip(case, legacy, along_first):
    bits, shape, seed = case
    values = _codes(np.random.default_rng(seed), shape, bits)
    axis = 0 if along_first else -1
    n = shape[axis]

    @jax.jit
    def round_trip(v):
        w = pack_int32(v, bits, legacy=legacy, axis=axis)
        return w, unpack_int32(w, bits, n, legacy=legacy, axis=axis)

    words, back = round_trip(values)
    want = math.ceil(n / (32 // bits)) if legacy else math.ceil(n * bits / 32)
    assert words.dtype == jnp.int32 and words.shape[axis] == want == packed_length_int32(n, bits, legacy)
    np.testing.assert_array_equal(np.asarray(back), values)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_then_pack_is_identity_on_canonical_streams(bits):
    """Every byte pattern whose padding bits are zero is a valid stream: pack(unpack(b)) == b."""
    n = 8 * 3 + 5
    raw = np.random.default_rng(bits).integers(0, 256, size=(2, packed_length(n, bits)), dtype=np.uint8)
    if n * bits % 8:
        raw[:, -1] &= (1 << (n * bits % 8)) - 1
    np.testing.assert_array_equal(np.asarray(pack(unpack(raw, bits, n), bits)), raw)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_signed_offset_round_trip(bits):
    q = np.arange(-(1 << (bits - 1)), 1 << (bits - 1), dtype=np.int8)
    u = offset_signed(q, bits)
    assert u.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(u), np.arange(1 << bits))
    back = unoffset_signed(u, bits)
    assert back.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(back), q)


# ----------------------------------------------------------------------------------------------------------------
# known vectors (by hand)


@pytest.mark.parametrize(
    "bits, codes, expected",
    [
        (4, [1, 2, 3], [0x21, 0x03]),  # element 2i in the low nibble, zero-padded tail
        (4, [0xF, 0x0, 0xA, 0x5], [0x0F, 0x5A]),
        (1, [1, 0, 1, 1, 0, 0, 0, 0, 1], [0b00001101, 0b1]),
        (2, [3, 0, 1, 2, 1], [0b10010011, 0b01]),
        (3, [7, 7, 7], [0xFF, 0x01]),  # 9 bits: code 2 straddles bytes 0/1
        (3, [5, 3, 6], [0b10011101, 0b1]),  # 5 | 3 << 3 | 6 << 6 = 0b1_1001_1101
        # mxfp6: four codes c0..c3 in three bytes, c0 | c1 << 6 | c2 << 12 | c3 << 18 little-endian
        (6, [0x01, 0x02, 0x03, 0x3F], [0x81, 0x30, 0xFC]),
        (6, [0x3F, 0, 0, 0], [0x3F, 0x00, 0x00]),
        (6, [0x2A, 0x15], [0x6A, 0x05]),  # 0x2A | 0x15 << 6 = 0x56A; 12 bits -> 2 bytes
        (7, [0x7F, 0x01], [0xFF, 0x00]),  # 0x7F | 1 << 7 = 0xFF, then 6 zero bits of padding
        (5, [0x1F, 0x10, 0x01, 0x1F], [0x1F, 0x86, 0x0F]),  # 0x1F | 0x10<<5 | 1<<10 | 0x1F<<15 = 0xF861F
        (8, [0, 255, 17], [0, 255, 17]),
    ],
)
def test_pack_known_vectors(bits, codes, expected):
    codes = np.array(codes, np.uint8)
    packed = np.asarray(pack(codes, bits))
    np.testing.assert_array_equal(packed, np.array(expected, np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits, codes.size)), codes)


@pytest.mark.parametrize(
    "bits, legacy, values, expected",
    [
        # dense: 11 codes of 3 bits = 33 bits; word 0 all ones (-1 as int32), code 10's top bit in word 1
        (3, False, [7] * 11, [-1, 1]),
        # legacy: 10 codes per word (30 bits), the 11th starts word 1
        (3, True, [7] * 11, [(1 << 30) - 1, 7]),
        (4, False, [1, 2, 3, 4, 5, 6, 7, 8], [0x87654321 - (1 << 32)]),  # bit 31 set -> negative int32
        (8, False, [0x01, 0x02, 0x03, 0x80, 0xFF], [-0x7FFCFDFF, 0xFF]),  # 0x80030201 wraps; 0xFF in word 1
        # dense 5-bit: element 6 sits at bits 30..34 (2 bits in word 0, 3 in word 1)
        (5, False, [0, 0, 0, 0, 0, 0, 0b10111], [(0b11 << 30) - (1 << 32), 0b101]),
        (5, True, [0, 0, 0, 0, 0, 0, 0b10111], [0, 0b10111]),
        (6, False, [1] * 6, [1 | 1 << 6 | 1 << 12 | 1 << 18 | 1 << 24 | 1 << 30, 0]),
        (6, True, [1] * 6, [1 | 1 << 6 | 1 << 12 | 1 << 18 | 1 << 24, 1]),
    ],
)
def test_pack_int32_known_vectors(bits, legacy, values, expected):
    values = np.array(values, np.uint8)
    words = np.asarray(pack_int32(values, bits, legacy=legacy))
    np.testing.assert_array_equal(words, np.array(expected, np.int32))
    np.testing.assert_array_equal(np.asarray(unpack_int32(words, bits, values.size, legacy=legacy)), values)


# Produced by compressed-tensors 0.17.0's own `pack_to_int32` (the last release with the legacy layout) on
# q = (arange(12) mod 2^b) - 2^(b-1) as int8, one row: legacy files written before 0.18 hold exactly these words.
LEGACY_CT_0_17 = {
    3: [150652552, 26],
    5: [172066848, 379887846],
    6: [67903552, 153121157, 714],
    7: [6324352, 14779012, 23233672],
}


@pytest.mark.parametrize("bits", sorted(LEGACY_CT_0_17))
def test_legacy_matches_compressed_tensors_0_17(bits):
    u = (np.arange(12) % (1 << bits)).astype(np.uint8)[None]
    q = u.astype(np.int16) - (1 << (bits - 1))
    words = np.asarray(pack_int32(offset_signed(q.astype(np.int8), bits), bits, legacy=True))
    np.testing.assert_array_equal(words, np.array([LEGACY_CT_0_17[bits]], np.int32))
    back = unpack_int32(words, bits, 12, legacy=True)
    np.testing.assert_array_equal(np.asarray(unoffset_signed(back, bits)), q)


# ----------------------------------------------------------------------------------------------------------------
# errors and validation


def test_unpack_rejects_wrong_packed_length():
    packed = np.zeros((2, 3), np.uint8)
    with pytest.raises(SchemeError, match=r"ceil\(7\*4/8\) = 4 bytes.*has 3"):
        unpack(packed, 4, 7)
    with pytest.raises(SchemeError, match="bytes"):
        unpack(packed, 6, 5)  # 30 bits -> 4 bytes, not 3
    unpack(packed, 6, 4)  # 24 bits -> 3 bytes: fine


def test_unpack_int32_rejects_wrong_word_count():
    words = np.zeros((4, 2), np.int32)
    with pytest.raises(SchemeError, match=r"ceil\(11\*6/32\) = 3"):
        unpack_int32(words, 6, 11)
    with pytest.raises(SchemeError, match=r"ceil\(11/\(32//6\)\) = 3 legacy"):
        unpack_int32(words, 6, 11, legacy=True)
    with pytest.raises(SchemeError, match="along axis 0"):
        unpack_int32(words, 4, 4, axis=0)  # 4 values of 4 bits -> 1 word along axis 0, but there are 4
    assert unpack_int32(words, 4, 32, axis=0).shape == (32, 2)


@pytest.mark.parametrize("bits", [0, 9, 4.0, None, True])
def test_bad_bits(bits):
    with pytest.raises(SchemeError, match="bits must be an integer in 1..8"):
        pack(np.zeros(4, np.uint8), bits)
    with pytest.raises(SchemeError, match="bits must be an integer in 1..8"):
        pack_int32(np.zeros(4, np.uint8), bits)


def test_bad_inputs():
    with pytest.raises(SchemeError, match="integer codes"):
        pack(np.zeros(4, np.float32), 4)
    with pytest.raises(SchemeError, match="8-bit integer packed bytes"):
        unpack(np.zeros(2, np.int32), 4, 4)
    with pytest.raises(SchemeError, match="32-bit integer words"):
        unpack_int32(np.zeros(2, np.uint8), 4, 8)
    with pytest.raises(SchemeError, match="scalar"):
        pack(np.uint8(3), 4)
    with pytest.raises(SchemeError, match="axis must be"):
        pack_int32(np.zeros((2, 3), np.uint8), 4, axis=2)
    with pytest.raises(SchemeError, match="non-negative"):
        unpack(np.zeros(2, np.uint8), 4, -1)


def test_pack_masks_high_bits_and_check_codes_names_them():
    codes = np.array([[1, 2, 3], [4, 0x15, 0xFF]], np.uint8)
    np.testing.assert_array_equal(np.asarray(pack(codes, 4)), np.asarray(pack(codes & 0xF, 4)))
    check_codes(codes, 8)
    with pytest.raises(SchemeError, match=r"\[0, 15\], but codes\[1, 1\] = 21 \(2 of 6"):
        check_codes(codes, 4)
    with pytest.raises(SchemeError, match=r"codes\[2\] = -1"):
        check_codes(np.array([0, 1, -1, 7], np.int16), 3)
    with pytest.raises(SchemeError, match="integer codes"):
        check_codes(np.zeros(3), 4)


def test_int8_bytes_and_uint32_words_accepted():
    codes = np.array([0xF, 0xE, 0x1, 0x8], np.uint8)
    packed = np.asarray(pack(codes, 4))
    np.testing.assert_array_equal(np.asarray(unpack(packed.view(np.int8), 4, 4)), codes)
    words = np.asarray(pack_int32(codes, 4))
    np.testing.assert_array_equal(np.asarray(unpack_int32(words.view(np.uint32), 4, 4)), codes)


def _stream_bytes(row, bits):
    """The definition, with Python integers: byte i = (sum_j code_j << (j * bits)) >> 8i & 0xFF."""
    v = sum(int(c) << (j * bits) for j, c in enumerate(row))
    return [(v >> (8 * i)) & 0xFF for i in range(-(-len(row) * bits // 8))]


def test_pack_numpy_is_pack_bit_for_bit():
    """The host twin of `pack`: every code of every width at odd and even lengths against the definition, and against
    the jitted `pack` on [2 x 7] and [3 x 66]; codes of other integer dtypes masked to their low bits as `pack` masks
    them; the same refusals."""
    rng = np.random.default_rng(3)
    for bits in ALL_BITS:
        for n in (1, 2, 3, 4, 5, 7, 8, 9, 66):
            c = np.concatenate([np.arange(1 << bits, dtype=np.uint8).repeat(n).reshape(-1, n),
                                _codes(rng, (3, n), bits)])
            np.testing.assert_array_equal(pack_numpy(c, bits), [_stream_bytes(r, bits) for r in c],
                                          err_msg=f"{bits} x {n}")
        for shape in ((2, 7), (3, 66)):
            c = _codes(rng, shape, bits)
            np.testing.assert_array_equal(pack_numpy(c, bits), np.asarray(pack(c, bits)), err_msg=f"{bits} {shape}")
        wide = rng.integers(-70000, 70000, (2, 3, 13)).astype(np.int32)
        low = (wide & ((1 << bits) - 1)).astype(np.uint8)
        np.testing.assert_array_equal(pack_numpy(wide, bits), pack_numpy(low, bits))
        np.testing.assert_array_equal(pack_numpy(wide.astype(np.int8), bits), pack_numpy(low, bits))
    with pytest.raises(SchemeError, match="bits must be an integer in 1..8"):
        pack_numpy(np.zeros(4, np.uint8), 9)
    with pytest.raises(SchemeError, match="integer codes"):
        pack_numpy(np.zeros(4, np.float32), 4)
    with pytest.raises(SchemeError, match="scalar"):
        pack_numpy(np.uint8(3), 4)


def test_under_jit_and_vmap():
    codes = _codes(np.random.default_rng(0), (5, 12), 6)
    f = jax.jit(lambda c: unpack(pack(c, 6), 6, 12))
    np.testing.assert_array_equal(np.asarray(f(codes)), codes)
    g = jax.jit(jax.vmap(lambda c: unpack_int32(pack_int32(c, 5), 5, 12)))
    np.testing.assert_array_equal(np.asarray(g(codes & 0x1F)), codes & 0x1F)


# ----------------------------------------------------------------------------------------------------------------
# byte identity with the real torch implementations


@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp6 import helpers as mxfp6
    from compressed_tensors.compressors.nvfp4 import helpers as nvfp4
    from compressed_tensors.compressors.pack_quantized import helpers as pq

    return pq, nvfp4, mxfp6


def _signed(rng, shape, bits):
    return rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=shape).astype(np.int8)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_to_int32_dense_matches_compressed_tensors(ct, bits):
    import torch

    pq = ct[0]
    rng = np.random.default_rng(100 + bits)
    for shape in [(5, 37), (3, 64), (2, 3, 19)]:  # odd, word-aligned, MoE-style 3-d
        q = _signed(rng, shape, bits)
        ref = pq.pack_to_int32(torch.from_numpy(q.copy()), bits).numpy()
        got = np.asarray(pack_int32(offset_signed(q, bits), bits))
        assert ref.dtype == np.int32 and got.dtype == np.int32
        np.testing.assert_array_equal(got, ref, err_msg=f"bits={bits} shape={shape}")
        back = pq.unpack_from_int32(torch.from_numpy(got.copy()), bits, torch.Size(shape)).numpy()
        np.testing.assert_array_equal(back, q)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_zero_point_packing_along_dim0_matches_compressed_tensors(ct, bits):
    """Asymmetric zero points [N, G] are packed along dim 0; a stacked [E, N, G] along its dim 1 (axis=-2)."""
    import torch

    pq = ct[0]
    rng = np.random.default_rng(200 + bits)
    for shape, axis in [((37, 3), 0), ((2, 19, 4), -2)]:
        zp = _signed(rng, shape, bits)
        ref = pq.pack_to_int32(torch.from_numpy(zp.copy()), bits, packed_dim=0).numpy()
        got = np.asarray(pack_int32(offset_signed(zp, bits), bits, axis=axis))
        np.testing.assert_array_equal(got, ref, err_msg=f"bits={bits} shape={shape}")
        back = pq.unpack_from_int32(torch.from_numpy(got.copy()), bits, torch.Size(shape), packed_dim=0).numpy()
        np.testing.assert_array_equal(back, zp)
        n = shape[axis]
        np.testing.assert_array_equal(np.asarray(unoffset_signed(unpack_int32(ref, bits, n, axis=axis), bits)), zp)


def test_fp4_packing_matches_compressed_tensors_and_torchao(ct):
    import torch

    nvfp4 = ct[1]
    codes = np.random.default_rng(4).integers(0, 16, size=(6, 34), dtype=np.uint8)
    codes[0, :16] = np.arange(16)  # every E2M1 code, -0 (0x8) included
    table = nvfp4.kE2M1ToFloat.float()
    ct_codes = torch.from_numpy(codes.astype(np.int64))
    values = table[ct_codes & 7] * torch.where(ct_codes & 8 != 0, -1.0, 1.0)
    ref = nvfp4.pack_fp4_to_uint8(values).numpy()  # nvfp4 and mxfp4 share this packer
    got = np.asarray(pack(codes, 4))
    np.testing.assert_array_equal(got, ref)
    back = nvfp4.unpack_fp4_from_uint8(torch.from_numpy(got.copy()), 6, 34, dtype=torch.float32)
    torch.testing.assert_close(back, values, rtol=0, atol=0)

    mx_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    np.testing.assert_array_equal(mx_kernels.pack_uint4(torch.from_numpy(codes.copy())).numpy(), got)


def test_fp6_packing_matches_compressed_tensors(ct):
    import torch

    mxfp6 = ct[2]
    codes = np.random.default_rng(6).integers(0, 64, size=(5, 72), dtype=np.uint8)
    codes[0, :64] = np.arange(64)  # every E2M3 code, -0 (0x20) included
    ct_codes = torch.from_numpy(codes.astype(np.int64))
    values = mxfp6.kE2M3ToFloat.float()[ct_codes & 0x1F] * torch.where(ct_codes & 0x20 != 0, -1.0, 1.0)
    ref = mxfp6.pack_fp6_to_uint8(values).numpy()
    got = np.asarray(pack(codes, 6))
    assert got.shape == (5, 54)
    np.testing.assert_array_equal(got, ref)
    back = mxfp6.unpack_fp6_from_uint8(torch.from_numpy(got.copy()), 5, 72, dtype=torch.float32)
    torch.testing.assert_close(back, values, rtol=0, atol=0)
