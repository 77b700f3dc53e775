"""qformats.scales tested directly: the E8M0 rules and the absmax / asymmetric / NVFP4 scales, exhaustively over
every bfloat16 and float16 block maximum, against exact numpy oracles written from the stated formulas (and
against compressed-tensors' own MX rule where torch is installed)."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qformats import QuantScheme, get_format
from qformats.scales import FP8_MAX, compute_scales, e8m0_code

ALL16 = np.arange(1 << 16, dtype=np.uint16)
SIXTEEN = {"bfloat16": ALL16.view(ml_dtypes.bfloat16), "float16": ALL16.view(np.float16)}
MX_ELEMENTS = ["fp8_e4m3fn", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]


def _amaxes(src):
    """Every non-negative finite 16-bit value, as float32 (exact)."""
    x = SIXTEEN[src].astype(np.float32)
    return x[np.isfinite(x) & ~np.signbit(x)]


def _floor_log2(a):
    """floor(log2 a) exactly (frexp: a = m 2^e, m in [0.5, 1)); -inf for 0."""
    m, e = np.frexp(a.astype(np.float64))
    return np.where(a == 0, -np.inf, e - 1)


def _ceil_log2(a):
    m, e = np.frexp(a.astype(np.float64))
    return np.where(a == 0, -np.inf, np.where(m == 0.5, e - 1, e))


def _oracle_e8m0(a, fmt, rule):
    """The docstring formulas of `e8m0_code`, in exact float64 / integer arithmetic."""
    if rule == "floor":
        unb = np.clip(_floor_log2(a) - fmt.emax, -127, 128)
    elif rule == "ceil":
        unb = np.clip(_ceil_log2(a) - fmt.emax, -127, 128)
    elif rule == "even":  # round the significand up at the element's mantissa width (half up), then floor
        m, e = np.frexp(a.astype(np.float64))
        sig = np.floor(2 * m * 2 ** fmt.mbits + 0.5) / 2 ** fmt.mbits  # in [1, 2]
        unb = np.clip(np.where(a == 0, -np.inf, e - 1 + (sig >= 2)) - fmt.emax, -127, 128)
    elif rule == "rceil":
        q = a.astype(np.float64) / fmt.max  # exact enough: a 16-bit over a 4-bit significand is never near 2^n
        # quotients below float32's smallest normal (2^-126) give -127 (the float32 quotient is flushed or
        # subnormal; both count as below 2^-126)
        unb = np.clip(np.where(q < 2.0 ** -126, -127, _ceil_log2(q)), -127, 127)
    else:  # "ct": amax rounded to a power of two at m = 3 (6-bit) / 1 mantissa bits, half up, then
        # floor(log2) - floor(log2 max_elem) with compressed-tensors' offsets {4: 2, 6: 2, 8: 8}; clamp [0, 255]
        mb = 3 if fmt.bits == 6 else 1
        m, e = np.frexp(a.astype(np.float64))
        sig = np.floor(2 * m * 2 ** mb + 0.5) / 2 ** mb
        p2 = np.where(a == 0, -np.inf, e - 1 + (sig >= 2))
        offset = {4: 2, 6: 2, 8: 8}[fmt.bits]
        biased = np.where(p2 < -126, 0, np.clip(p2 + 127 - offset, 0, 255))  # below the f32 normals -> 0
        return biased.astype(np.uint8)
    return (unb + 127).astype(np.uint8)


@pytest.mark.parametrize("src", sorted(SIXTEEN))
@pytest.mark.parametrize("rule", ["floor", "ceil", "even", "rceil", "ct"])
@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_e8m0_code_every_16_bit_amax(name, rule, src):
    fmt = get_format(name)
    a = _amaxes(src)
    got = np.asarray(jax.jit(e8m0_code, static_argnums=(1, 2))(jnp.asarray(a), fmt, rule))
    np.testing.assert_array_equal(got, _oracle_e8m0(a, fmt, rule))


@pytest.mark.parametrize("rule", ["floor", "ceil", "even", "rceil", "ct"])
def test_e8m0_code_nan_amax_is_0xff(rule):
    got = np.asarray(e8m0_code(jnp.array([np.nan, -np.nan], jnp.float32), get_format("fp4_e2m1"), rule))
    np.testing.assert_array_equal(got, [255, 255])


def test_e8m0_floor_matches_ocp_examples():
    """OCP MX v1.0: shared_exp = floor(log2 amax) - emax_elem; fp4 e2m1 (emax 2): amax 6 -> 2^0, amax 7.9 ->
    2^0 (elements then saturate), amax 8 -> 2^1; fp8 e4m3 (emax 8): amax 448 -> 2^0."""
    fp4, fp8 = get_format("fp4_e2m1"), get_format("fp8_e4m3fn")
    got = np.asarray(e8m0_code(jnp.array([6.0, 7.9, 8.0, 0.75]), fp4, "floor")).astype(int) - 127
    np.testing.assert_array_equal(got, [0, 0, 1, -3])
    assert int(e8m0_code(jnp.float32(448.0), fp8, "floor")) == 127


@pytest.mark.parametrize("src", sorted(SIXTEEN))
@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp6_e2m3", "fp4_e2m1"])
def test_e8m0_ct_rule_matches_compressed_tensors(name, src):
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    """Over every normal 16-bit amax. Left out: zero and subnormal amax (compressed-tensors rounds in the input
    dtype's bits, where a subnormal's exponent field is 0 and log2 gives -inf; `compute_scales` maps the float16
    ones to its result) and amax that round up past the dtype's largest power of two (inf there)."""
    fmt = get_format(name)
    a = _amaxes(src)
    info = ml_dtypes.finfo(SIXTEEN[src].dtype)
    mb = 3 if fmt.bits == 6 else 1
    top = (2 - 2.0 ** -(mb + 1)) * 2.0 ** math.floor(math.log2(float(info.max)))  # rounds up to 2^(maxexp + 1)
    a = a[(a >= float(info.smallest_normal)) & (a < top)]
    want = mx.generate_mx_scales(torch.from_numpy(a).to(getattr(torch, src)), num_bits=fmt.bits)
    want = np.clip(want.float().numpy(), 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(e8m0_code(jnp.asarray(a), fmt, "ct")), want)


# ---- absmax, asymmetric and NVFP4 scales -----------------------------------------------------------------------
def _scales_of_amax(a, scheme, dtype):
    """compute_scales on blocks [a, 0, ..., 0] (one scale per block: block max = a)."""
    g = scheme.group_size or 4
    view = jnp.zeros((a.size, g), dtype).at[:, 0].set(jnp.asarray(a).astype(dtype))
    return compute_scales(view, (1,), scheme, dtype=dtype)


@pytest.mark.parametrize("src", sorted(SIXTEEN))
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3fn", "fp6_e3m2", "fp4_e2m1"])
def test_absmax_scale_in_the_input_dtype(fmt, src):
    """scale_format "input": s = dtype(float32(amax) / float32(half_range)) (one rounding, compressed-tensors'
    order), a zero scale replaced by the dtype's eps. Block maxima whose quotient is below float32's normals are
    left out: XLA:CPU flushes that quotient to zero (then eps)."""
    scheme = QuantScheme(fmt, "channel", scale_format="input")
    dt = SIXTEEN[src].dtype
    a = _amaxes(src)
    sr = _scales_of_amax(a, scheme, jnp.dtype(src))
    got = np.asarray(sr.stored).astype(np.float32).ravel()
    q = a / np.float32(scheme.half_range)
    want = q.astype(dt).astype(np.float32)
    want = np.where(want == 0, np.float32(ml_dtypes.finfo(dt).eps if src == "bfloat16" else np.finfo(dt).eps),
                    want)
    keep = (q >= 2.0 ** -126) | (a == 0)
    np.testing.assert_array_equal(got[keep], want[keep])
    assert sr.stored.dtype == jnp.dtype(src) and sr.zero_point is None and sr.global_scale is None
    if src == "float16":
        assert keep.all()


@pytest.mark.parametrize("src", sorted(SIXTEEN))
def test_fp8_scale_format_clamps_then_casts(src):
    """scale_format "fp8_e4m3fn": s = fp8(clamp(float32(amax) / max_elem, +-448)) with the quotient in float32,
    a zero scale replaced by 0.125 (compressed-tensors' fp8 eps)."""
    scheme = QuantScheme("fp4_e2m1", "channel", scale_format="fp8_e4m3fn")
    a = _amaxes(src)
    got = np.asarray(_scales_of_amax(a, scheme, jnp.dtype(src)).stored.astype(jnp.float32)).ravel()
    q = np.clip(a / np.float32(6.0), -FP8_MAX, FP8_MAX).astype(np.float32)
    want = q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = np.where(want == 0, np.float32(0.125), want)
    keep = (q >= 2.0 ** -126) | (a == 0)
    np.testing.assert_array_equal(got[keep], want[keep])


def test_asymmetric_int_scale_and_zero_point():
    """s = (max - min) / (qmax - qmin), z = round_half_even(clamp(qmin - min / s, qmin, qmax)), min <= 0 <= max
    enforced; float32 arithmetic for scale_format "float32"."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((512, 16)) * rng.uniform(0.01, 3, (512, 1))).astype(np.float32)
    x[0] = np.abs(x[0])  # all positive: min becomes 0
    x[1] = -np.abs(x[1])  # all negative: max becomes 0
    scheme = QuantScheme("int4", "channel", symmetric=False)
    sr = compute_scales(jnp.asarray(x), (1,), scheme)
    mn = np.minimum(x.min(1, keepdims=True), 0)
    mx = np.maximum(x.max(1, keepdims=True), 0)
    s = ((mx - mn) / np.float32(15)).astype(np.float32)
    z = np.round(np.clip(np.float32(-8) - mn / s, -8, 7))
    np.testing.assert_array_equal(np.asarray(sr.stored), s)
    np.testing.assert_array_equal(np.asarray(sr.zero_point), z.astype(np.int8))
    # apply: x / s + z, each op rounded in float32
    np.testing.assert_array_equal(np.asarray(sr.apply(jnp.asarray(x))), (x / s + z.astype(np.float32)))


def test_nvfp4_two_level_scale():
    """g = (1 / amax_t) * 448 * 6 in the input dtype; s_G = fp8(clamp(g * (amax_G / 6), +-448)); elements are
    x / (s_G / g), all float32 here."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 16)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    scheme = QuantScheme("fp4_e2m1", "tensor_group", group_size=16, scale_format="fp8_e4m3fn")
    sr = compute_scales(jnp.asarray(x), (1,), scheme)
    amax_t = np.float32(np.abs(x).max())
    g = (np.float32(1) / amax_t) * np.float32(2688)
    np.testing.assert_array_equal(np.asarray(sr.global_scale), [g])
    amax = np.abs(x).max(1, keepdims=True)
    s32 = np.clip(g * (amax / np.float32(6)), -448, 448).astype(np.float32)
    s = s32.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(sr.stored).view(np.uint8), s.view(np.uint8))
    eff = (s.astype(np.float32) / g).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(sr.apply(jnp.asarray(x))), x / eff)


def test_e8m0_apply_is_an_exact_power_of_two_division():
    """floor rule: x / max(2^(e-127), 2^-126), exact; rceil: x * 2^(127-e), and x itself for e == 0."""
    x = np.array([[1.5, -3.0, 2.0 ** -100, 0.5]], np.float32)
    for rule, e, div in [("floor", 130, 8.0), ("floor", 0, 2.0 ** -126), ("rceil", 120, 2.0 ** -7),
                         ("rceil", 0, 1.0)]:
        scheme = QuantScheme("fp4_e2m1", "group", group_size=4, scale_format="e8m0", scale_rule=rule)
        sr = compute_scales(jnp.asarray(x), (1,), scheme, scale=jnp.full((1, 1), e, jnp.uint8))
        want = np.array([v / div for v in x[0].astype(np.float64)], np.float64)
        assert all(math.isfinite(v) for v in want)
        np.testing.assert_array_equal(np.asarray(sr.apply(jnp.asarray(x)), np.float64)[0], want)
