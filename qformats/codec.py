"""Exact element codecs: float32/bf16/f16 <-> uint8 codes of any FloatFormat, and E8M0, by integer bit ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qformats.errors import FormatError
from qformats.rounding import FLOAT_DTYPES
from qformats.formats import E8M0Format, FloatFormat, Format, IntFormat, get_format

OVERFLOW_MODES = ("saturate", "nan")


def _as_f32_bits(x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in FLOAT_DTYPES:
        raise FormatError(f"encode: expected float32, bfloat16 or float16 input, got {x.dtype}")
    if x.dtype == jnp.bfloat16:  # a 16-bit shift: exact, and vectorised by XLA:CPU (its convert is not)
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def encode(x, fmt: "Format | str", overflow: str = "saturate") -> jax.Array:
    """Round x to the nearest code of `fmt` (ties to the even code) and return the codes as uint8.

    For a float format with m mantissa bits and emin = 1 - bias, |x| = sig * 2^(e - 23) (f32 fields) is
    divided into quanta of 2^(max(e, emin) - m); the quotient is rounded half-to-even on the resulting
    code, which carries into the exponent on mantissa overflow. Subnormals are kept.

    Special values (`overflow` = "saturate" | "nan"):
      - finite overflow: "saturate" -> +-max;  "nan" -> inf ("ieee"), NaN ("fn"/"fnuz"), +-max ("finite").
      - +-inf input: inf if the format has inf; else "saturate" -> +-max, "nan" -> NaN (or +-max if finite).
      - NaN input: the format's NaN keeping the sign (fnuz: its single NaN); formats without NaN give a
        zero whose sign is the opposite of the NaN's sign (ml_dtypes' convention, kept for bit-exactness).
      - "fnuz" has no -0: negative values that round to zero give +0.
    With overflow="nan" the result equals ml_dtypes' `astype` bit for bit.
    Integer formats round half to even and clamp to [qmin, qmax] (returned as int8/uint8 two's complement).
    E8M0: see `encode_e8m0`.
    """
    fmt = get_format(fmt)
    if overflow not in OVERFLOW_MODES:
        raise FormatError(f"encode: overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if isinstance(fmt, IntFormat):
        return _encode_int(x, fmt)
    if isinstance(fmt, E8M0Format):
        return encode_e8m0(x)
    return _encode_float(x, fmt, overflow)


def _encode_float(x, fmt: FloatFormat, overflow: str) -> jax.Array:
    u = _as_f32_bits(x)
    m = fmt.mbits
    sign = u >> 31
    a = u & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    is_inf = a == 0x7F800000
    e_field = (a >> 23).astype(jnp.int32)
    e_eff = jnp.maximum(e_field, 1)  # f32 subnormals share the exponent of the smallest normal
    sig = (a & 0x7FFFFF) | jnp.where(e_field > 0, jnp.uint32(0x800000), jnp.uint32(0))
    e_x = e_eff - 127  # unbiased exponent of the leading bit position 2^23 of `sig`
    below = jnp.maximum(fmt.emin - e_x, 0)  # extra right shift in the subnormal range
    shift = jnp.minimum(23 - m + below, 31).astype(jnp.uint32)
    q = sig >> shift
    rem = sig & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    exp_part = (jnp.maximum(e_x - fmt.emin, 0).astype(jnp.uint32)) << m
    code = exp_part + q
    up = (rem > half) | ((rem == half) & ((code & 1) == 1))
    code = code + up.astype(jnp.uint32)
    code = jnp.where(sig == 0, jnp.uint32(0), code)

    max_code = jnp.uint32(fmt.max_code)
    over = code > max_code
    if overflow == "saturate" or fmt.specials == "finite":
        over_code = max_code
    elif fmt.specials == "ieee":
        over_code = jnp.uint32(fmt.inf_code)
    else:
        over_code = jnp.uint32(fmt.nan_code & ((1 << (fmt.bits - 1)) - 1))  # sign added below
    code = jnp.where(over, over_code, code)
    if fmt.has_inf:
        code = jnp.where(is_inf, jnp.uint32(fmt.inf_code), code)
    elif overflow == "nan" and fmt.has_nan:
        code = jnp.where(is_inf, jnp.uint32(fmt.nan_code & ((1 << (fmt.bits - 1)) - 1)), code)
    else:
        code = jnp.where(is_inf, max_code, code)

    sbit = jnp.uint32(1 << (fmt.bits - 1))
    signed = code | jnp.where(sign == 1, sbit, jnp.uint32(0))
    if fmt.specials == "fnuz":
        nan = jnp.uint32(fmt.nan_code)
        signed = jnp.where(code == 0, jnp.uint32(0), signed)  # no negative zero
        signed = jnp.where(over & (overflow == "nan"), nan, signed)
        signed = jnp.where(is_inf & (overflow == "nan"), nan, signed)
        signed = jnp.where(is_nan, nan, signed)
    elif fmt.has_nan:
        signed = jnp.where(is_nan, jnp.uint32(fmt.nan_code) | jnp.where(sign == 1, sbit, 0), signed)
    else:
        signed = jnp.where(is_nan, jnp.where(sign == 1, jnp.uint32(0), sbit), signed)
    return signed.astype(jnp.uint8)


def _round_half_even_int(x: jax.Array) -> jax.Array:
    return jnp.round(x)  # jnp.round rounds half to even


def _encode_int(x, fmt: IntFormat) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in FLOAT_DTYPES:
        raise FormatError(f"encode: expected float32, bfloat16 or float16 input, got {x.dtype}")
    q = jnp.clip(_round_half_even_int(x.astype(jnp.float32)), fmt.qmin, fmt.qmax)
    q = jnp.where(jnp.isnan(q), 0.0, q)
    return q.astype(jnp.int8 if fmt.signed else jnp.uint8)


def encode_e8m0(x) -> jax.Array:
    """Nearest E8M0 code of x > 0, rounding the f32 bit pattern as ml_dtypes' float8_e8m0fnu does.

    code = f32 exponent field + (mantissa >= 2^22), i.e. to the nearest power of two with ties upward;
    the binade [2^-127, 2^-126) (f32 subnormals) rounds the same way, its midpoint being 1.5 * 2^-127, and
    everything below 2^-127 gives code 0; x <= 0 (including -0), inf and NaN -> 0xFF (NaN). ml_dtypes >= 0.7
    rounds this way (0.5 and 0.6 sent the whole binade above 2^-127 to code 1).
    """
    u = _as_f32_bits(x)
    a = u & 0x7FFFFFFF
    code = (a >> 23)
    rem = a & 0x7FFFFF
    code = code + (rem >= 0x400000).astype(jnp.uint32)  # ties go up (ml_dtypes' e8m0fnu rounding)
    # f32 subnormals (a * 2^-149): 2^-127 is a = 2^22, the midpoint to 2^-126 is a = 3 * 2^21.
    code = jnp.where(a < 0x800000, (a >= 0x600000).astype(jnp.uint32), code)
    bad = (u >> 31 == 1) | (a >= 0x7F800000) | (a == 0) | (code > 254)
    return jnp.where(bad, jnp.uint32(255), code).astype(jnp.uint8)


def decode(codes, fmt: "Format | str", dtype=jnp.float32) -> jax.Array:
    """Exact value of each code: (-1)^s 2^(E-bias) (1 + M/2^m), or 2^(1-bias) M/2^m when E = 0.

    Specials decode per the format's convention (inf, NaN keeping the code's sign). E8M0: 2^(E-127),
    0xFF -> NaN. Int formats: the integer itself. Bits above `fmt.bits` must be zero. The f32 result is
    exact; a narrower `dtype` rounds it as `astype` does.
    """
    fmt = get_format(fmt)
    codes = jnp.asarray(codes)
    if isinstance(fmt, IntFormat):
        return codes.astype(dtype)
    if codes.dtype != jnp.uint8:
        if not jnp.issubdtype(codes.dtype, jnp.integer):
            raise FormatError(f"decode: expected uint8 codes for {fmt.name}, got {codes.dtype}")
        codes = codes.astype(jnp.uint8)
    c = codes.astype(jnp.uint32)
    if isinstance(fmt, E8M0Format):
        bits = jnp.where(c == 0, jnp.uint32(0x00400000), c << 23)  # 2^-127 is an f32 subnormal
        bits = jnp.where(c == 255, jnp.uint32(0x7FC00000), bits)
        return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
    m = fmt.mbits
    sign = (c >> (fmt.bits - 1)) & 1
    mag = c & ((1 << (fmt.bits - 1)) - 1)
    e = (mag >> m).astype(jnp.int32)
    man = mag & ((1 << m) - 1)
    # Normal: f32 exponent field e - bias + 127, mantissa shifted into place. Subnormal: man * 2^(emin-m).
    normal_bits = ((e - fmt.bias + 127).astype(jnp.uint32) << 23) | (man << (23 - m))
    normal = jax.lax.bitcast_convert_type(normal_bits, jnp.float32)
    sub = man.astype(jnp.float32) * np.float32(2.0 ** (fmt.emin - m))
    val = jnp.where(e == 0, sub, normal)
    val = jnp.where(sign == 1, -val, val)
    nan = jnp.where(sign == 1, -jnp.float32(jnp.nan), jnp.float32(jnp.nan))
    if fmt.specials == "ieee":
        top = e == (1 << fmt.ebits) - 1
        inf = jnp.where(sign == 1, -jnp.inf, jnp.inf).astype(jnp.float32)
        val = jnp.where(top, jnp.where(man == 0, inf, nan), val)
    elif fmt.specials == "fn":
        val = jnp.where(mag == fmt.nan_code, nan, val)
    elif fmt.specials == "fnuz":
        val = jnp.where(c == fmt.nan_code, nan, val)
    return val.astype(dtype)


def code_table(fmt: "FloatFormat | str") -> np.ndarray:
    """All 2^bits values of a float format as float64, indexed by code (for oracles and inspection)."""
    fmt = get_format(fmt)
    if not isinstance(fmt, FloatFormat):
        raise FormatError(f"code_table: expected a float format, got {fmt.name}")
    return np.array([fmt.code_value(c) for c in range(1 << fmt.bits)], dtype=np.float64)
