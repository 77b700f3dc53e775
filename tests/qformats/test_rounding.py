"""qformats.rounding against numpy / ml_dtypes: exact upcasts, one rounding to bf16/f16, per-op arithmetic."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qformats import rounding as R

ALL16 = np.arange(1 << 16, dtype=np.uint16)
SIXTEEN = {"bfloat16": ALL16.view(ml_dtypes.bfloat16), "float16": ALL16.view(np.float16)}
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
F32_MIN_NORMAL = np.float32(2.0 ** -126)


def _random_f32(n=1 << 20, seed=0):
    """n random float32 bit patterns (every sign, exponent and mantissa, NaNs and infs included)."""
    return np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _ties(dtype_mbits, seed=1):
    """float32 values at, just below and just above the rounding midpoints of a format with `dtype_mbits`
    mantissa bits: every exponent, random upper mantissas, the dropped bits set to exactly half, half - 1 ulp,
    half + 1 ulp and half + a random sticky pattern."""
    rng = np.random.default_rng(seed)
    drop = 23 - dtype_mbits
    e = np.repeat(np.arange(0, 255, dtype=np.uint32), 64)
    upper = rng.integers(0, 1 << dtype_mbits, e.size, dtype=np.uint64).astype(np.uint32)
    base = (e << 23) | (upper << drop)
    half = np.uint32(1 << (drop - 1))
    sticky = rng.integers(1, half, e.size, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([base | half, base | (half - 1), base | (half + 1), base | half | sticky])
    bits = np.concatenate([bits, bits | np.uint32(1 << 31)])
    return bits.view(np.float32)


def _same_bits(got, want):
    """Bitwise equality, any NaN matching any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    both_nan = np.isnan(got) & np.isnan(want)
    bad = ~both_nan & (got.view(np.uint32) != want.view(np.uint32))
    assert not bad.any(), f"{bad.sum()} mismatches, first inputs at {np.flatnonzero(bad)[:5]}: " \
                          f"got {got[bad][:5]}, want {want[bad][:5]}"


@pytest.mark.parametrize("src", sorted(SIXTEEN))
def test_to_f32_is_exact_for_every_16_bit_value(src):
    x = SIXTEEN[src]
    _same_bits(R.to_f32(jnp.asarray(x)), x.astype(np.float32))


@pytest.mark.parametrize("dtype,mbits", [("bfloat16", 7), ("float16", 10), ("float32", 23)])
def test_rnd_is_one_nearest_even_rounding(dtype, mbits):
    """rnd(v, dtype) == v.astype(dtype) (ml_dtypes / numpy: round to nearest, ties to even, subnormals kept,
    overflow to inf) on 2^20 random float32 patterns and on every kind of midpoint with sticky bits."""
    x = _random_f32()
    if mbits < 23:
        x = np.concatenate([x, _ties(mbits)])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(NP_DTYPES[dtype]).astype(np.float32)
    _same_bits(jax.jit(R.rnd, static_argnums=1)(jnp.asarray(x), jnp.dtype(dtype)), want)


def test_rnd_rejects_other_dtypes():
    with pytest.raises(TypeError, match="int8"):
        R.rnd(jnp.ones(3), jnp.int8)


def _flush(a):
    """XLA:CPU arithmetic flushes float32 subnormal operands and results to a zero of the same sign."""
    return np.where(np.abs(a) < F32_MIN_NORMAL, np.copysign(np.float32(0), a), a).astype(np.float32)


OPS = {"div": np.divide, "mul": np.multiply, "add": np.add, "sub": np.subtract}
OTHER = np.array([3.0, -0.1, 7.5, 1e-3, 448.0, 2.0 ** -20, 1e30], np.float32)


@pytest.mark.parametrize("src", sorted(SIXTEEN))
@pytest.mark.parametrize("op", sorted(OPS))
def test_arithmetic_rounds_once_in_the_target_dtype(op, src):
    """R.<op>(a, b, dtype) == dtype(float32(a) <op> float32(b)) for every 16-bit a (torch's per-op rule), with
    b broadcast (the path XLA:CPU would turn into a multiplication by 1/b for div) and full-shaped.

    Operands and results in the float32 subnormal range: on CPU the result is that of the flushed operation
    (a zero of the same sign for a subnormal; float16 data never gets there); other backends are compared
    elsewhere only."""
    a = SIXTEEN[src]
    dt = NP_DTYPES[src]
    fn = jax.jit(getattr(R, op), static_argnums=2)
    af = a.astype(np.float32)
    for b in OTHER:
        for bshape in ((), af.shape):
            bb = np.broadcast_to(b, bshape).astype(np.float32)
            got = np.asarray(fn(jnp.asarray(a), jnp.asarray(bb), jnp.dtype(src)))
            with np.errstate(all="ignore"):
                r32 = OPS[op](af, b)
                exact = r32.astype(dt).astype(np.float32)
                want = _flush(OPS[op](_flush(af), b)).astype(dt).astype(np.float32)
                tiny_a = (np.abs(af) < F32_MIN_NORMAL) & (af != 0)
                normal = ~tiny_a & ~((np.abs(r32) < F32_MIN_NORMAL) & (r32 != 0))
            _same_bits(got[normal], exact[normal])
            if jax.default_backend() == "cpu":
                _same_bits(got, want)
            if src == "float16":
                assert normal.all()
