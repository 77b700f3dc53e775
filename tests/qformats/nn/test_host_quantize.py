"""qformats.nn.host_quantize: integer channel / group, FP8 / FP6 channel and NVFP4 round-to-nearest on the host equals
the jitted XLA:CPU path bit for bit (codes, scales, global scales), on every bfloat16 value and every float32 high
half, subnormals, infinities, tiny channels, stacked layers and einsum layouts."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qformats.algorithms.weight_search import quantize_weight as jitted
from qformats.nn import host_quantize as H
from qformats.presets import parse_scheme as resolve, presets

# one scheme per distinct host path: float channel formats (FP8_DYNAMIC's weights are FP8_E4M3's, the same
# QuantScheme, so the same path), NVFP4, integer group / channel scales over the code widths 2, 3, 4, 6, 8
SCHEMES = ("FP8_E4M3", "NVFP4A16", "FP6_E3M2", "FP6_E2M3", "W8A16", "W4A16", "W8A8", "W3A16", "W6A16:g64",
           "W2A16:g32")


def same_bits(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def all_values(dtype, seed=0):
    """Every bfloat16 bit pattern, or every float32 high half (with random low halves), NaNs dropped, shuffled,
    as [256, 256]."""
    rng = np.random.default_rng(seed)
    hi = np.arange(65536, dtype=np.uint32)
    if dtype == jnp.float32:
        v = ((hi << 16) | rng.integers(0, 65536, 65536, dtype=np.uint32)).view(np.float32)
    else:
        v = hi.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    v = np.where(np.isnan(v), np.float32(0), v)
    rng.shuffle(v)
    return v.reshape(256, 256)


# each row-set: all values (inf, subnormals, huge and tiny mixed), finite and moderate, channels whose absmax
# is just above / below the flush threshold (subnormal elements next to a tiny scale), subnormals only
CASES = {"all": lambda v: v, "finite": lambda v: np.clip(v, -1e3, 1e3),
         "tiny": lambda v: np.clip(v, -1e-26, 1e-26), "tinier": lambda v: np.clip(v, -1e-30, 1e-30),
         "subnormal": lambda v: np.clip(v, -2e-38, 2e-38)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_host_equals_the_jitted_path_bit_for_bit(dtype, scheme):
    """Every row-set of CASES. Channel and group scales see one output channel (a column of W [K, N]) each, so
    the row-sets side by side along N, [256, 5 * 256], are quantized as each alone, in one call per path; NVFP4's
    global scale is the whole tensor's: one call per row-set."""
    ss = resolve(scheme)
    v = all_values(dtype)
    parts = [jnp.asarray(case(v), dtype) for case in CASES.values()]
    for w in (parts if H._kind(ss.weights) == "nvfp4" else [jnp.concatenate(parts, axis=1)]):
        assert H.host_quantizable(w, ss, "rtn")
        same_bits(H.host_quantize_weight(w, ss), jitted(w, ss, "rtn"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_stacked_layers_and_an_einsum_layout_in_any_chunking(monkeypatch, scheme):
    ss = resolve(scheme)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 128, 48)) * rng.uniform(1e-3, 10, (3, 1, 48)), jnp.float32)
    # [N1, K, N2] contracted along K (gemma's "BTD,NDH->BTNH"): W = transpose(w, (1, 0, 2)).reshape(K, N1 * N2)
    e = jnp.asarray(rng.standard_normal((2, 4, 128, 16)), jnp.bfloat16)  # one stacked axis
    # two contracted axes (K = 16 * 8, groups across both) and two free ones, in a permuted order
    f = jnp.asarray(rng.standard_normal((8, 3, 16, 10)), jnp.float32)
    want = (jitted(w, ss, "rtn"), jitted(jnp.transpose(e, (0, 2, 1, 3)).reshape(2, 128, 64), ss, "rtn"),
            jitted(jnp.transpose(f, (2, 0, 1, 3)).reshape(128, 30), ss, "rtn"))
    for chunk in (H.CHUNK, 1000):  # the jitted results do not depend on the host's chunking: computed once
        monkeypatch.setattr(H, "CHUNK", chunk)
        same_bits(H.host_quantize_weight(w, ss), want[0])
        same_bits(H.host_quantize(e, (1, 0, 2), 1, 1, ss), want[1])
        same_bits(H.host_quantize(f, (2, 0, 1, 3), 2, 0, ss), want[2])


def test_fp4_rounding_is_ml_dtypes_on_every_bfloat16_and_each_cut():
    v = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    cuts = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    near = np.concatenate([cuts, np.nextafter(cuts, np.float32(0)), np.nextafter(cuts, np.float32(9))])
    y = np.concatenate([v, near, -near, np.float32([np.nan, -np.nan])])
    y = np.clip(y, -6, 6).astype(np.float32)  # NaN stays NaN
    np.testing.assert_array_equal(H._fp4_codes(y.copy()), y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F)


def test_nan_weights_and_other_schemes_take_the_jitted_path():
    w = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    w[5, 7] = np.nan
    for scheme in ("FP8_E4M3", "NVFP4A16"):
        assert H.host_quantize_weight(jnp.asarray(w), presets[scheme]) is None
        same_bits(H.quantize_weight(jnp.asarray(w), presets[scheme]), jitted(jnp.asarray(w), presets[scheme], "rtn"))
    assert not H.host_quantizable(jnp.asarray(w), presets["W4A16_ASYM"], "rtn")
    assert not H.host_quantizable(jnp.asarray(w), presets["MXFP4A16"], "rtn")
    assert not H.host_quantizable(jnp.asarray(w), presets["NVFP4A16"], "mse")
    assert not H.host_quantizable(jnp.asarray(w, jnp.float16), presets["FP8_E4M3"], "rtn")
    assert not H.host_quantizable(jnp.zeros((24, 32)), presets["NVFP4A16"], "rtn")  # K not a multiple of 16


@pytest.mark.parametrize("scheme", ["W4A16_ASYM", "MXFP4A16"])
def test_stacked_kernels_off_the_host_path_are_quantized_layer_by_layer_bit_for_bit(scheme):
    """A stacked kernel the host does not cover is quantized one layer at a time: the bits of the vmapped
    `quantize_weight`, with one layer's temporaries in the compiled function instead of the whole stack's."""
    k = jax.random.normal(jax.random.key(3), (2, 3, 128, 64))
    same_bits(H.quantize_weight(k, presets[scheme]), jitted(k, presets[scheme], "rtn"))
    flat = k.reshape(6, 128, 64)
    by_layer = H._stack_quantizer(presets[scheme], "rtn", 1).lower(flat).compile().memory_analysis()
    vmapped = jax.jit(lambda w: jitted(w, presets[scheme], "rtn")).lower(flat).compile().memory_analysis()
    if vmapped is not None and by_layer is not None:  # a backend without the analysis: nothing to compare
        # XLA:CPU's temporaries: a transposed float copy of one layer (+ its scales) against the stack's
        assert by_layer.temp_size_in_bytes <= 2 * flat.nbytes // 6 < vmapped.temp_size_in_bytes


def test_layer_by_layer_is_nested_vmap():
    x = jax.random.normal(jax.random.key(4), (2, 3, 5, 7))
    fn = lambda w: {"s": w.sum(0), "m": w * 2}  # noqa: E731
    got = H.layer_by_layer(fn, x, 2)
    want = jax.vmap(jax.vmap(fn))(x)
    same_bits(got, want)
    same_bits(H.layer_by_layer(fn, x[0, 0], 0), fn(x[0, 0]))
