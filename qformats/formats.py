"""Element formats: FloatFormat (any 1-sign-bit EyMz and its special-value convention), IntFormat, TableFormat, E8M0."""

from __future__ import annotations

import dataclasses
import re
from typing import Tuple, Union

from qformats.errors import FormatError

SPECIALS = ("ieee", "fn", "fnuz", "finite")


def _default_specials(ebits: int, mbits: int) -> str:
    """OCP rule ("automatic OCP definition"): 8-bit e4m3 -> fn, other 8-bit -> ieee, fewer bits -> finite.

    An 8-bit format with no mantissa bit has no room for an IEEE NaN and gets "fn".
    """
    if 1 + ebits + mbits == 8:
        return "fn" if (ebits, mbits) == (4, 3) or mbits == 0 else "ieee"
    return "finite"


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A sign + `ebits` exponent + `mbits` mantissa float format, 3 <= 1 + ebits + mbits <= 8.

    Value of a code with exponent field E and mantissa field M (bias b = 2^(ebits-1) - 1, +1 for fnuz):
      E > 0: (-1)^s * 2^(E - b) * (1 + M / 2^mbits);   E == 0: (-1)^s * 2^(1 - b) * M / 2^mbits.

    `specials` says which codes are not numbers:
      - "ieee":   all-ones exponent is inf (M == 0) and NaN (M != 0)  (e5m2, ml_dtypes' e4m3/e3m4);
      - "fn":     only all-ones exponent with all-ones mantissa is NaN; no inf  (e4m3fn);
      - "fnuz":   NaN is the code 1000...0 (negative zero); no inf, no -0; bias one larger (e4m3fnuz);
      - "finite": every code is a number (fp6/fp5/fp4/fp3 of Quant-LLM and OCP MX elements).
    The code is held in the low `bits` bits of a uint8: sign at bit bits-1, then exponent, then mantissa.
    """

    ebits: int
    mbits: int
    specials: str = None  # type: ignore[assignment]
    bias: int = None  # type: ignore[assignment]

    def __post_init__(self):
        if not isinstance(self.ebits, int) or not isinstance(self.mbits, int):
            raise FormatError(f"FloatFormat: ebits and mbits must be ints, got {self.ebits!r}, {self.mbits!r}")
        if self.ebits < 1 or self.mbits < 0 or not 3 <= 1 + self.ebits + self.mbits <= 8:
            raise FormatError(
                f"FloatFormat(ebits={self.ebits}, mbits={self.mbits}): expected ebits >= 1, mbits >= 0 and "
                f"3 <= 1 + ebits + mbits <= 8")
        specials = self.specials or _default_specials(self.ebits, self.mbits)
        if specials not in SPECIALS:
            raise FormatError(f"FloatFormat: specials must be one of {SPECIALS}, got {specials!r}")
        object.__setattr__(self, "specials", specials)
        if specials == "ieee" and self.mbits == 0:
            raise FormatError(f"FloatFormat(ebits={self.ebits}, mbits=0): 'ieee' needs a mantissa bit for NaN")
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (self.ebits - 1) - 1 + (1 if specials == "fnuz" else 0))
        if self.max_code < 1:
            raise FormatError(f"{self.name}: convention {specials!r} leaves no finite non-zero value")

    # ---- derived facts -------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def kind(self) -> str:
        return "float"

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials != "finite"

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal: 1 - bias."""
        return 1 - self.bias

    @property
    def max_code(self) -> int:
        """Largest magnitude code (sign bit clear) that is a finite number."""
        top = (1 << (self.bits - 1)) - 1  # all ones below the sign
        if self.specials == "ieee":
            return ((1 << self.ebits) - 2) << self.mbits | ((1 << self.mbits) - 1)
        if self.specials == "fn":
            return top - 1
        return top

    @property
    def nan_code(self) -> int | None:
        """The canonical (positive) NaN code, or None when the format has no NaN."""
        if self.specials == "ieee":
            return ((1 << self.ebits) - 1) << self.mbits | (1 << (self.mbits - 1) if self.mbits else 0)
        if self.specials == "fn":
            return (1 << (self.bits - 1)) - 1
        if self.specials == "fnuz":
            return 1 << (self.bits - 1)
        return None

    @property
    def inf_code(self) -> int | None:
        return ((1 << self.ebits) - 1) << self.mbits if self.specials == "ieee" else None

    def code_value(self, code: int) -> float:
        """Exact value of one magnitude-or-signed code, in Python floats (for tables and oracles)."""
        sign = -1.0 if code >> (self.bits - 1) & 1 else 1.0
        mag = code & ((1 << (self.bits - 1)) - 1)
        if self.specials == "fnuz" and code == self.nan_code:
            return float("nan")
        if self.specials == "fn" and mag == self.nan_code:
            return float("nan")
        e, m = mag >> self.mbits, mag & ((1 << self.mbits) - 1)
        if self.specials == "ieee" and e == (1 << self.ebits) - 1:
            return sign * float("inf") if m == 0 else float("nan")
        if e == 0:
            return sign * m * 2.0 ** (self.emin - self.mbits)
        return sign * (1 + m / 2 ** self.mbits) * 2.0 ** (e - self.bias)

    @property
    def max(self) -> float:
        """Largest finite value."""
        return self.code_value(self.max_code)

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits) if self.mbits else 2.0 ** self.emin

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value (OCP's emax_elem: e4m3 8, e5m2 15, e2m1 2)."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def name(self) -> str:
        base = f"fp{self.bits}_e{self.ebits}m{self.mbits}"
        default_bias = 2 ** (self.ebits - 1) - 1 + (1 if self.specials == "fnuz" else 0)
        bias = f"b{self.bias}" if self.bias != default_bias else ""
        if self.specials == "fnuz":
            return base + bias + "fnuz"
        if self.specials == "fn":
            return base + bias + ("fn" if self.bits == 8 else "fnnan")
        if self.specials == "ieee":
            return base + bias + ("" if self.bits == 8 else "ieee")
        return base + bias + ("finite" if self.bits == 8 else "")

    @property
    def ml_dtypes_name(self) -> str | None:
        """The ml_dtypes type with exactly this format, or None."""
        table = {
            "fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp8_e4m3fnuz": "float8_e4m3fnuz",
            "fp8_e5m2fnuz": "float8_e5m2fnuz", "fp8_e4m3b11fnuz": "float8_e4m3b11fnuz",
            "fp8_e4m3": "float8_e4m3", "fp8_e3m4": "float8_e3m4", "fp6_e2m3": "float6_e2m3fn",
            "fp6_e3m2": "float6_e3m2fn", "fp4_e2m1": "float4_e2m1fn",
        }
        return table.get(self.name)

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class IntFormat:
    """A two's complement (signed) or unsigned integer format of 1..8 bits: q in [qmin, qmax].

    qmin = -2^(bits-1), qmax = 2^(bits-1) - 1 when signed, else 0 and 2^bits - 1. compressed-tensors packs
    1..8-bit integers (pack-quantized), so 1 bit is accepted (int1: {-1, 0}, uint1: {0, 1}); the presets use
    2..8 bits.
    """

    bits: int
    signed: bool = True

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise FormatError(f"IntFormat: bits must be an int in 1..8, got {self.bits!r}")

    @property
    def kind(self) -> str:
        return "int"

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def max(self) -> float:
        return float(self.qmax)

    @property
    def name(self) -> str:
        return f"{'' if self.signed else 'u'}int{self.bits}"

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class TableFormat:
    """A lookup-table (codebook) format: a b-bit code c, 0 <= c < 2^b, stands for `values[c]`.

    `values` holds exactly 2^b finite numbers (b = 1..8), strictly ascending; the element value of code c is
    values[c] (then scaled as any element: w = values[c] * s). Each value has at most 8 significant bits (an
    integer or dyadic number m 2^e, m < 2^8), so decoding is exact in float32 and bfloat16, and in float16 for values
    inside its range (IQ4_NL's integers up to 127 are). Codes are stored packed like integer codes (two 4-bit codes per byte, element 2i in the
    low nibble). `quantize` does not choose table codes (the codebook's own quantizer picks codes and scales
    together, e.g. llama.cpp's IQ4_NL search); tables come from files (`IQ4_NL`: GGUF IQ4_NL / IQ4_XS).
    """

    table_name: str
    values: Tuple[float, ...]

    def __post_init__(self):
        vals = tuple(float(v) for v in self.values)
        n = len(vals)
        if n < 2 or n > 256 or n & (n - 1):
            raise FormatError(f"TableFormat {self.table_name!r}: expected 2^b values, b in 1..8, got {n}")
        if any(not (v == v and abs(v) < float("inf")) for v in vals) or any(b <= a for a, b in zip(vals, vals[1:])):
            raise FormatError(f"TableFormat {self.table_name!r}: expected strictly ascending finite values, got {vals}")
        for v in vals:
            if _significant_bits(v) > 8:
                raise FormatError(f"TableFormat {self.table_name!r}: value {v} has more than 8 significant bits "
                                  f"(not exact in bfloat16)")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.table_name or ""):
            raise FormatError(f"TableFormat: expected a lower-case name ([a-z][a-z0-9_]*), got {self.table_name!r}")
        object.__setattr__(self, "values", vals)

    @property
    def bits(self) -> int:
        return len(self.values).bit_length() - 1

    @property
    def kind(self) -> str:
        return "table"

    @property
    def max(self) -> float:
        """Largest magnitude in the table."""
        return max(abs(v) for v in self.values)

    @property
    def name(self) -> str:
        return self.table_name

    def __str__(self) -> str:
        return self.name


def _significant_bits(v: float) -> int:
    """Significant bits of a float v: the bit length of the odd integer m with |v| = m 2^e (0 for v = 0)."""
    num, _ = abs(v).as_integer_ratio()  # denominator a power of two, numerator odd unless v is an integer
    while num and num % 2 == 0:
        num //= 2
    return num.bit_length()


#: GGUF's IQ4_NL / IQ4_XS non-linear 4-bit grid (llama.cpp's `kvalues_iq4nl`): w = d * IQ4_NL.values[code].
IQ4_NL = TableFormat("iq4_nl", (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113))

#: Table formats by name (`get_format`).
TABLE_FORMATS = {IQ4_NL.name: IQ4_NL}


@dataclasses.dataclass(frozen=True)
class E8M0Format:
    """OCP MX scale format: an unsigned power of two 2^(E - 127), E in 0..254; E = 255 is NaN. No zero."""

    @property
    def bits(self) -> int:
        return 8

    @property
    def bias(self) -> int:
        return 127

    @property
    def kind(self) -> str:
        return "e8m0"

    @property
    def name(self) -> str:
        return "e8m0"

    @property
    def max(self) -> float:
        return 2.0 ** 127

    def __str__(self) -> str:
        return self.name


E8M0 = E8M0Format()
Format = Union[FloatFormat, IntFormat, TableFormat, E8M0Format]

_ALIASES = {
    # ml_dtypes / jnp names (their sub-byte "fn" means finite: no inf, no NaN).
    "float8_e4m3fn": "fp8_e4m3fn", "float8_e5m2": "fp8_e5m2", "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2fnuz": "fp8_e5m2fnuz", "float8_e4m3b11fnuz": "fp8_e4m3b11fnuz", "float8_e4m3": "fp8_e4m3",
    "float8_e3m4": "fp8_e3m4", "float6_e2m3fn": "fp6_e2m3", "float6_e3m2fn": "fp6_e3m2",
    "float4_e2m1fn": "fp4_e2m1", "float8_e8m0fnu": "e8m0", "e8m0fnu": "e8m0",
    "fp8": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn", "e5m2": "fp8_e5m2", "fp6": "fp6_e3m2", "fp4": "fp4_e2m1",
    "nvfp4": "fp4_e2m1", "mxfp4": "fp4_e2m1",
}

_FP_RE = re.compile(r"^fp(\d)_e(\d)m(\d)(?:b(\d+))?(fnuz|fnnan|fn|ieee|finite)?$")
_INT_RE = re.compile(r"^(u?)int(\d)$")

EXAMPLE_NAMES = (
    "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp8_e4m3b11fnuz", "fp8_e3m4", "fp8_e4m3",
    "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp5_e3m1", "fp4_e2m1", "fp4_e3m0", "fp3_e2m0", "fpX_eYmZ",
    "int1..int8", "uint1..uint8", "e8m0", *TABLE_FORMATS,
)


def get_format(name: "str | Format") -> Format:
    """Parse a format name: `fpX_eYmZ[b<bias>][fn|fnuz|ieee|finite]`, `intN`, `uintN`, `e8m0`, a table format's name
    (`TABLE_FORMATS`: `iq4_nl`), or an ml_dtypes name.

    Without a suffix an 8-bit name is IEEE-like (`fp8_e5m2`, `fp8_e4m3`, `fp8_e3m4`) and a narrower one is
    finite (`fp6_e3m2`). X must equal 1 + Y + Z.
    """
    if isinstance(name, (FloatFormat, IntFormat, TableFormat, E8M0Format)):
        return name
    if not isinstance(name, str):
        raise FormatError(f"format name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key == "e8m0":
        return E8M0
    if key in TABLE_FORMATS:
        return TABLE_FORMATS[key]
    m = _INT_RE.match(key)
    if m:
        bits = int(m.group(2))
        if not 1 <= bits <= 8:
            raise FormatError(f"unknown format {name!r}: integer formats have 1..8 bits")
        return IntFormat(bits, signed=not m.group(1))
    m = _FP_RE.match(key)
    if m:
        total, e, mant = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if total != 1 + e + mant:
            raise FormatError(f"unknown format {name!r}: fp{total} must have 1 + e + m = {total} bits, "
                              f"e{e}m{mant} has {1 + e + mant}")
        suffix = m.group(5) or ("ieee" if total == 8 else "finite")
        specials = {"fnnan": "fn", "fn": "fn" if total == 8 else "finite"}.get(suffix, suffix)
        bias = int(m.group(4)) if m.group(4) else None
        return FloatFormat(e, mant, specials=specials, bias=bias)
    raise FormatError(f"unknown format {name!r}; valid names: {', '.join(EXAMPLE_NAMES)}")
