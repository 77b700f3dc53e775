"""Exhaustive bit-exactness of encode/decode against ml_dtypes and a brute-force oracle."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qformats import FloatFormat, FormatError, IntFormat, decode, encode, encode_e8m0, get_format
from qformats.codec import code_table
from qformats.formats import EXAMPLE_NAMES

ALL16 = np.arange(1 << 16, dtype=np.uint16)
INPUTS = {"bfloat16": ALL16.view(ml_dtypes.bfloat16), "float16": ALL16.view(np.float16)}
ML_DTYPES_FORMATS = ["fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp8_e4m3b11fnuz", "fp8_e4m3",
                     "fp8_e3m4", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]

_encode_jit = jax.jit(encode, static_argnames=("fmt", "overflow"))
_decode_jit = jax.jit(decode, static_argnames=("fmt", "dtype"))
_encode_e8m0_jit = jax.jit(encode_e8m0)


def _ref_cast(x, fmt):
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float32).astype(getattr(ml_dtypes, fmt.ml_dtypes_name)).view(np.uint8)


@pytest.mark.parametrize("src", sorted(INPUTS))
@pytest.mark.parametrize("name", ML_DTYPES_FORMATS)
def test_encode_matches_ml_dtypes_exhaustively(name, src):
    """overflow="nan" is ml_dtypes' cast, bit for bit, for all 2^16 inputs (NaNs, infs, subnormals included)."""
    fmt = get_format(name)
    x = INPUTS[src]
    got = np.asarray(_encode_jit(jnp.asarray(x), fmt=fmt, overflow="nan"))
    np.testing.assert_array_equal(got, _ref_cast(x, fmt))


@pytest.mark.parametrize("src", sorted(INPUTS))
@pytest.mark.parametrize("name", ML_DTYPES_FORMATS)
def test_encode_saturate_exhaustively(name, src):
    """overflow="saturate": in-range values as ml_dtypes; finite overflow -> +-max; inf kept if representable."""
    fmt = get_format(name)
    x = INPUTS[src]
    got = np.asarray(_encode_jit(jnp.asarray(x), fmt=fmt, overflow="saturate"))
    xf = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        clipped = np.where(np.isinf(xf) & fmt.has_inf, xf, np.clip(xf, -fmt.max, fmt.max))
    want = _ref_cast(clipped.astype(np.float32), fmt)
    np.testing.assert_array_equal(got, want)
    finite = np.isfinite(xf)
    vals = code_table(fmt)[got[finite]]
    assert np.all(np.abs(vals) <= fmt.max)


@pytest.mark.parametrize("name", ML_DTYPES_FORMATS)
def test_decode_matches_ml_dtypes_all_codes(name):
    fmt = get_format(name)
    codes = np.arange(1 << fmt.bits, dtype=np.uint8)
    want = codes.view(getattr(ml_dtypes, fmt.ml_dtypes_name)).astype(np.float32)
    got = np.asarray(_decode_jit(jnp.asarray(codes), fmt=fmt))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for dtype in (jnp.bfloat16, jnp.float16):
        got_d = np.asarray(_decode_jit(jnp.asarray(codes), fmt=fmt, dtype=dtype)).astype(np.float32)
        np.testing.assert_array_equal(got_d, want.astype(dtype).astype(np.float32))


def _oracle(x: np.ndarray, fmt: FloatFormat, overflow: str) -> np.ndarray:
    """Brute force: nearest finite code by value, ties to the even code; specials per the docstring."""
    mags = np.arange(fmt.max_code + 2)  # one past max: the "overflow" neighbour
    nxt = fmt.max_code + 1  # its value as if the exponent range were unbounded (IEEE's overflow rule)
    nxt_val = (1 + (nxt & ((1 << fmt.mbits) - 1)) / 2 ** fmt.mbits) * 2.0 ** ((nxt >> fmt.mbits) - fmt.bias)
    vals = np.array([fmt.code_value(c) for c in range(fmt.max_code + 1)] + [nxt_val])
    with np.errstate(invalid="ignore"):
        ax = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(vals, ax, side="left"), 1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = ax - vals[lo], vals[hi] - ax
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(mags[lo] % 2 == 0, lo, hi)))
    code = np.where(ax > vals[-1], fmt.max_code + 1, pick)
    over = code > fmt.max_code
    sbit = 1 << (fmt.bits - 1)
    if overflow == "saturate" or fmt.specials == "finite":
        code = np.where(over, fmt.max_code, code)
    elif fmt.specials == "ieee":
        code = np.where(over, fmt.inf_code, code)
    else:
        code = np.where(over, fmt.nan_code & (sbit - 1), code)
    isinf = np.isinf(ax)
    if fmt.has_inf:
        code = np.where(isinf, fmt.inf_code, code)
    elif overflow == "nan" and fmt.has_nan:
        code = np.where(isinf, fmt.nan_code & (sbit - 1), code)
    else:
        code = np.where(isinf, fmt.max_code, code)
    neg = np.signbit(x.astype(np.float32))
    out = code | np.where(neg, sbit, 0)
    isnan = np.isnan(x.astype(np.float32))
    if fmt.specials == "fnuz":
        out = np.where(code == 0, 0, out)
        if overflow == "nan":
            out = np.where(over | isinf, fmt.nan_code, out)
        out = np.where(isnan, fmt.nan_code, out)
    elif fmt.has_nan:
        out = np.where(isnan, fmt.nan_code | np.where(neg, sbit, 0), out)
    else:
        out = np.where(isnan, np.where(neg, 0, sbit), out)
    return out.astype(np.uint8)


ORACLE_FORMATS = [
    FloatFormat(2, 2), FloatFormat(3, 1), FloatFormat(3, 0), FloatFormat(2, 0), FloatFormat(1, 1),
    FloatFormat(3, 3), FloatFormat(2, 4), FloatFormat(4, 2), FloatFormat(5, 1), FloatFormat(1, 5),
    FloatFormat(2, 5), FloatFormat(6, 1), FloatFormat(7, 0), FloatFormat(3, 2, "ieee"), FloatFormat(2, 3, "fn"),
    FloatFormat(4, 1, "fnuz"), FloatFormat(4, 3, "finite"), FloatFormat(2, 1, "fn"), FloatFormat(4, 0, "fnuz"),
    # the ml_dtypes ones too, so the oracle itself is checked against ml_dtypes
    get_format("fp8_e4m3fn"), get_format("fp8_e5m2"), get_format("fp8_e4m3fnuz"), get_format("fp6_e3m2"),
]


@pytest.mark.parametrize("overflow", ["saturate", "nan"])
@pytest.mark.parametrize("fmt", ORACLE_FORMATS, ids=lambda f: f.name)
def test_encode_matches_bruteforce_oracle_all_bf16(fmt, overflow):
    x = INPUTS["bfloat16"]
    got = np.asarray(_encode_jit(jnp.asarray(x), fmt=fmt, overflow=overflow))
    np.testing.assert_array_equal(got, _oracle(x, fmt, overflow))


def test_oracle_agrees_with_ml_dtypes():
    x = INPUTS["bfloat16"]
    for name in ["fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]:
        fmt = get_format(name)
        np.testing.assert_array_equal(_oracle(x, fmt, "nan"), _ref_cast(x, fmt))


@pytest.mark.parametrize("fmt", ORACLE_FORMATS, ids=lambda f: f.name)
def test_decode_roundtrip_every_code(fmt):
    """decode is exact: every finite code decodes to its value and encodes back to itself."""
    codes = np.arange(1 << fmt.bits, dtype=np.uint8)
    vals = np.asarray(_decode_jit(jnp.asarray(codes), fmt=fmt))
    table = code_table(fmt)
    finite = np.isfinite(table)
    np.testing.assert_array_equal(vals[finite], table[finite].astype(np.float32))
    assert np.all(np.isnan(vals[np.isnan(table)]))
    back = np.asarray(_encode_jit(jnp.asarray(vals[finite]), fmt=fmt))
    want = codes[finite].copy()
    if fmt.specials == "fnuz":
        want = np.where(table[finite] == 0, 0, want)  # there is only +0
    np.testing.assert_array_equal(back, want)


@pytest.mark.parametrize("name,mx,mnn,mns,bias", [
    ("fp8_e4m3fn", 448, 2 ** -6, 2 ** -9, 7), ("fp8_e5m2", 57344, 2 ** -14, 2 ** -16, 15),
    ("fp8_e4m3fnuz", 240, 2 ** -7, 2 ** -10, 8), ("fp8_e5m2fnuz", 57344, 2 ** -15, 2 ** -17, 16),
    ("fp8_e4m3b11fnuz", 30, 2 ** -10, 2 ** -13, 11), ("fp8_e4m3", 240, 2 ** -6, 2 ** -9, 7),
    ("fp8_e3m4", 15.5, 2 ** -2, 2 ** -6, 3),
    ("fp6_e3m2", 28, 0.25, 0.0625, 3), ("fp6_e2m3", 7.5, 1, 0.125, 1), ("fp5_e2m2", 7, 1, 0.25, 1),
    ("fp5_e3m1", 24, 0.25, 0.125, 3), ("fp4_e2m1", 6, 1, 0.5, 1), ("fp4_e3m0", 16, 0.25, 0.25, 3),
    ("fp3_e2m0", 4, 1, 1, 1),
])
def test_format_facts(name, mx, mnn, mns, bias):
    fmt = get_format(name)
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.bias) == (mx, mnn, mns, bias)
    assert fmt.name == name
    assert get_format(fmt.name) == fmt
    if fmt.ml_dtypes_name:
        fi = ml_dtypes.finfo(getattr(ml_dtypes, fmt.ml_dtypes_name))
        assert (float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal)) == (mx, mnn, mns)


def test_emax_elem_matches_ocp():
    assert [get_format(n).emax for n in ["fp8_e4m3fn", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]] == \
        [8, 15, 2, 4, 2]


def test_default_specials_ocp_rule():
    assert FloatFormat(4, 3).specials == "fn"
    assert FloatFormat(5, 2).specials == "ieee"
    assert FloatFormat(3, 2).specials == FloatFormat(2, 1).specials == "finite"
    assert get_format("float6_e2m3fn") == get_format("fp6_e2m3") == FloatFormat(2, 3)


@pytest.mark.parametrize("bad", ["fp7_e4m3", "fp9_e5m3", "fp2_e1m0", "bf17", "int9", "int0", "uint0", "", "fp8_e4m3xx"])
def test_get_format_rejects(bad):
    with pytest.raises(FormatError, match="unknown format|FloatFormat"):
        get_format(bad)


def test_get_format_error_lists_valid_names():
    """An unknown name: the error lists every example name; a fpX name whose widths do not add up: says so."""
    with pytest.raises(FormatError) as e:
        get_format("fp8_e4m3xx")
    for example in EXAMPLE_NAMES:
        assert example in str(e.value)
    with pytest.raises(FormatError, match=r"fp8 must have 1 \+ e \+ m = 8 bits, e9m9 has 19"):
        get_format("fp8_e9m9")


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("signed", [True, False])
def test_int_format_names_parse_back(bits, signed):
    """IntFormat takes 1..8 bits (compressed-tensors packs 1..8); every name parses back to its format."""
    fmt = IntFormat(bits, signed)
    assert get_format(fmt.name) == fmt
    assert (fmt.qmin, fmt.qmax) == ((-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1))


@pytest.mark.parametrize("bits", [0, 9, 2.0, "4"])
def test_int_format_rejects_bits(bits):
    with pytest.raises(FormatError, match="1..8"):
        IntFormat(bits)


def test_invalid_float_format():
    with pytest.raises(FormatError):
        FloatFormat(0, 3)
    with pytest.raises(FormatError):
        FloatFormat(4, 3, specials="weird")
    with pytest.raises(FormatError):
        FloatFormat(2, 0, specials="ieee")


def test_encode_rejects_non_float():
    with pytest.raises(FormatError, match="int32"):
        encode(jnp.arange(4), "fp8_e4m3fn")
    with pytest.raises(FormatError, match="overflow"):
        encode(jnp.ones(4), "fp8_e4m3fn", overflow="clip")


def test_e8m0_encode_exhaustive_and_decode():
    for x in INPUTS.values():
        with np.errstate(invalid="ignore"):
            want = x.astype(np.float32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
        np.testing.assert_array_equal(np.asarray(_encode_e8m0_jit(jnp.asarray(x))), want)
    f32 = np.arange(0, 1 << 24, 7, dtype=np.uint32).view(np.float32)  # f32 subnormals and the lowest binades
    want = f32.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(_encode_jit(jnp.asarray(f32), fmt="e8m0")), want)
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(_decode_jit(jnp.asarray(codes), fmt="e8m0")).view(np.uint32),
                                  want.view(np.uint32))


def test_e8m0_subnormal_binade_rounds_to_nearest_where_torch_rounds_up():
    """[2^-127, 2^-126) rounds at its midpoint 1.5 * 2^-127 like every other binade (ml_dtypes >= 0.7); torch's
    float8_e8m0fnu cast sends all of (2^-127, 1.5 * 2^-127) up to 2^-126 and agrees everywhere else."""
    torch = pytest.importorskip("torch")
    a = np.arange(0, 1 << 24, dtype=np.uint32)  # every f32 below 2^-125
    ours = np.asarray(_encode_e8m0_jit(jnp.asarray(a.view(np.float32))))
    np.testing.assert_array_equal(ours[1:], a[1:].view(np.float32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))
    theirs = torch.from_numpy(a.view(np.float32)).to(torch.float8_e8m0fnu).view(torch.uint8).numpy()
    differ = np.nonzero(ours[1:] != theirs[1:])[0] + 1
    np.testing.assert_array_equal(differ, np.arange(0x400001, 0x600000))
    assert set(ours[differ]) == {0} and set(theirs[differ]) == {1}


def test_int_encode_round_half_even_and_clamp():
    x = jnp.array([-9.0, -8.5, -7.5, -0.5, 0.5, 1.5, 2.5, 7.49, 7.5, 100.0, jnp.nan])
    np.testing.assert_array_equal(np.asarray(encode(x, "int4")), [-8, -8, -8, 0, 0, 2, 2, 7, 7, 7, 0])
    np.testing.assert_array_equal(np.asarray(encode(x, "uint4")), [0, 0, 0, 0, 0, 2, 2, 7, 8, 15, 0])


# ---- float32 inputs: the sticky bits below bf16/f16 precision -------------------------------------------------
def _random_f32(n, seed):
    return np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _f32_inputs(fmt: FloatFormat, seed: int = 0) -> np.ndarray:
    """2^20 uniformly random float32 bit patterns, 2^20 random patterns with exponents around the format's range
    (normals, subnormals, overflow; random low bits), and every midpoint between neighbouring codes (finite
    and the overflow neighbour past max) exactly, one float32 ulp below and above, and with random sticky bits."""
    rng = np.random.default_rng(seed)
    uniform = _random_f32(1 << 20, seed).view(np.uint32)
    lo_e = max(127 + fmt.emin - fmt.mbits - 3, 0)
    hi_e = min(127 + fmt.emax + 2, 254)
    e = rng.integers(lo_e, hi_e + 1, 1 << 20, dtype=np.uint64).astype(np.uint32)
    near = (e << 23) | rng.integers(0, 1 << 23, e.size, dtype=np.uint64).astype(np.uint32)
    vals = np.array([fmt.code_value(c) for c in range(fmt.max_code + 1)], np.float64)
    nxt = fmt.max_code + 1  # the next value past max, as if the exponent range went on (IEEE's overflow rule)
    nxt_val = (1 + (nxt & ((1 << fmt.mbits) - 1)) / 2 ** fmt.mbits) * 2.0 ** ((nxt >> fmt.mbits) - fmt.bias)
    vals = np.append(vals, nxt_val)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)  # exact: one bit more than the format has
    assert np.all(mids.astype(np.float64) == (vals[:-1] + vals[1:]) / 2)
    mb = mids.view(np.uint32)
    sticky = rng.integers(1, 1 << 12, (8, mb.size), dtype=np.uint64).astype(np.uint32)
    ties = np.concatenate([mb, mb - 1, mb + 1, (mb + sticky).ravel(), (mb - sticky).ravel()])
    x = np.concatenate([uniform, near, ties, ties | np.uint32(1 << 31)])
    return x.view(np.float32)


def _saturate_oracle(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """overflow="saturate": ml_dtypes' cast of x clamped to [-max, max] (inf kept where the format has inf; NaN
    as the cast gives it)."""
    with np.errstate(invalid="ignore"):
        clipped = np.where(np.isinf(x) & fmt.has_inf, x, np.clip(x, -fmt.max, fmt.max)).astype(np.float32)
    return _ref_cast(clipped, fmt)


@pytest.mark.parametrize("overflow", ["nan", "saturate"])
@pytest.mark.parametrize("name", ML_DTYPES_FORMATS)
def test_encode_float32_matches_ml_dtypes(name, overflow):
    """Torch-free float32 check of every ml_dtypes format: overflow="nan" is ml_dtypes' cast bit for bit;
    overflow="saturate" is the cast of the clamped input (`_saturate_oracle`)."""
    fmt = get_format(name)
    x = _f32_inputs(fmt, seed=len(name))
    got = np.asarray(_encode_jit(jnp.asarray(x), fmt=fmt, overflow=overflow))
    want = _ref_cast(x, fmt) if overflow == "nan" else _saturate_oracle(x, fmt)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("overflow", ["saturate", "nan"])
@pytest.mark.parametrize("fmt", ORACLE_FORMATS, ids=lambda f: f.name)
def test_encode_float32_near_ties_match_bruteforce_oracle(fmt, overflow):
    """Formats without an ml_dtypes type: float32 midpoints and their sticky-bit neighbours against the brute
    force oracle (nearest code by exact float64 distance, ties to even)."""
    x = _f32_inputs(fmt, seed=7)[2 << 20:]  # the midpoint part
    got = np.asarray(_encode_jit(jnp.asarray(x), fmt=fmt, overflow=overflow))
    np.testing.assert_array_equal(got, _oracle(x, fmt, overflow))


def test_e8m0_encode_float32_random_bits():
    x = _random_f32(1 << 20, 11)
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(_encode_e8m0_jit(jnp.asarray(x))), want)
