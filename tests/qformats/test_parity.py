"""Same inputs -> same codes and scales as compressed-tensors (every preset) and torchao (MX, NVFP4)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ct_q = pytest.importorskip("compressed_tensors.quantization")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from compressed_tensors.quantization import QuantizationStrategy  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

from qformats import presets, quantize  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _weights(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero group/row start
    w[1, 5] = 0.9  # an outlier
    return w.to(dtype)


def _ct_qparams(w, args):
    """What llm-compressor's min-max observer + calculate_qparams give for weight w [N, K]."""
    st = args.strategy
    if st == QuantizationStrategy.TENSOR:
        mn, mx = torch.aminmax(w)
        return calculate_qparams(mn.reshape(1), mx.reshape(1), args) + (None,)
    if st == QuantizationStrategy.CHANNEL:
        return calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args) + (None,)
    if st in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        wg = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        g = None
        if st == QuantizationStrategy.TENSOR_GROUP:
            g = generate_gparam(w.amin(), w.amax())
        s, z = calculate_qparams(wg.amin(-1), wg.amax(-1), args, global_scale=g)
        return s, z, g
    if st == QuantizationStrategy.BLOCK:
        bh, bw = args.block_structure
        n, k = w.shape
        wb = w.reshape(n // bh, bh, k // bw, bw)
        return calculate_qparams(wb.amin((1, 3)), wb.amax((1, 3)), args) + (None,)
    raise AssertionError(st)


WEIGHT_PRESETS = ["FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W8A16", "W4A16", "W4A16_ASYM", "W3A16", "W2A16",
                  "W5A16", "W6A16", "W7A16", "W4AFP8", "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP6A16", "MXFP8A16"]


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("preset", WEIGHT_PRESETS)
def test_weights_match_compressed_tensors(preset, dtype):
    args = PRESET_SCHEMES[preset]["weights"]
    w = _weights((256, 384), TORCH_DTYPES[dtype], seed=len(preset))
    scale, zp, g = _ct_qparams(w, args)
    want_vals = ct_quantize(w, scale, zp if not args.symmetric else None, args, global_scale=g)

    scheme = presets[preset].weights
    q = quantize(jnp.asarray(w.float().numpy()).astype(dtype), scheme, axis=-1)
    got_vals = np.asarray(q.element_values(jnp.float32))
    if not args.symmetric:
        got_vals = got_vals + 0  # element values are the raw integers; ct returns integers too
    np.testing.assert_array_equal(got_vals, want_vals.float().numpy())
    got_scale = np.asarray(q.scale_values(jnp.float32))
    want_scale = scale.float().numpy().reshape(got_scale.shape)
    np.testing.assert_array_equal(got_scale, want_scale)
    if g is not None:
        np.testing.assert_array_equal(np.asarray(q.global_scale), g.numpy())
    if not args.symmetric:
        np.testing.assert_array_equal(np.asarray(q.zero_point), zp.numpy().reshape(q.zero_point.shape))
    # stored scale dtype follows compressed-tensors: the weight's dtype unless the args set one
    if args.scale_dtype is None:
        assert q.scale.dtype == jnp.dtype(dtype)


# ---- torchao MX (to_mx) and NVFP4 (nvfp4_quantize) -------------------------------------------------------------
mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

from qformats import QuantScheme  # noqa: E402

_ELEM = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp6_e2m3": "fp6_e2m3",
         "fp6_e3m2": "fp6_e3m2", "fp4_e2m1": torch.float4_e2m1fn_x2}


def _elem(name):
    from torchao.prototype.mx_formats import constants
    if name == "fp6_e2m3":
        return constants.DTYPE_FP6_E2M3
    if name == "fp6_e3m2":
        return constants.DTYPE_FP6_E3M2
    return _ELEM[name]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # torchao's to_mx takes these two
@pytest.mark.parametrize("rule", ["floor", "rceil", "ceil", "even"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
def test_mx_matches_torchao_to_mx(fmt, rule, dtype):
    w = _weights((64, 512), TORCH_DTYPES[dtype], seed=7)
    w[2, 64:96] = torch.tensor(np.geomspace(1e-3, 300, 32), dtype=w.dtype)  # spans many binades
    mode = getattr(ScaleCalculationMode, rule.upper())
    scale_e8m0, data = mx.to_mx(w, _elem(fmt), 32, mode)
    q = quantize(jnp.asarray(w.float().numpy()).astype(dtype),
                 QuantScheme(fmt, "group", group_size=32, scale_format="e8m0", scale_rule=rule), axis=-1)
    np.testing.assert_array_equal(np.asarray(q.scale), scale_e8m0.view(torch.uint8).numpy().reshape(64, 16))
    if fmt == "fp4_e2m1":
        np.testing.assert_array_equal(np.asarray(q.codes), data.view(torch.uint8).numpy())
    elif fmt.startswith("fp6"):
        np.testing.assert_array_equal(np.asarray(q.element_codes()), data.numpy())
    else:
        np.testing.assert_array_equal(np.asarray(q.codes), data.view(torch.uint8).numpy())


def test_nvfp4_scales_match_torchao_reciprocal_convention():
    """torchao's per_tensor_scale = amax / (448 * 6) is the reciprocal of our (compressed-tensors') global."""
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    w = _weights((64, 256), torch.float32, seed=3)
    amax = w.abs().amax()
    pts = amax / (448.0 * 6.0)
    t_scale, t_data = nv.nvfp4_quantize(w, 16, per_tensor_scale=pts)
    q = quantize(jnp.asarray(w.numpy()), presets["NVFP4A16"].weights, axis=-1)
    g = float(np.asarray(q.global_scale)[0])
    np.testing.assert_allclose(1.0 / g, float(pts), rtol=1e-6)
    ours = np.asarray(q.scale).astype(np.float32)
    theirs = t_scale.view(torch.float8_e4m3fn).float().numpy().reshape(ours.shape)
    # block scales: fp8(amax_b / 6 * g) vs fp8(amax_b / 6 / pts): equal unless the f32 products differ by an ulp
    # at an fp8 rounding boundary; codes agree wherever the scales agree up to that reciprocal rounding.
    agree = np.mean(ours == theirs)
    assert agree > 0.99, agree
    rows = np.all(ours == theirs, axis=1)
    got = np.asarray(q.codes)[rows]
    want = t_data.view(torch.uint8).numpy()[rows]
    assert np.mean(got == want) > 0.99


ACT_PRESETS = ["W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "W4AFP8", "MXFP8", "MXFP4", "W4A8"]


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("preset", ACT_PRESETS)
def test_dynamic_activations_match_compressed_tensors(preset, dtype):
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    args = PRESET_SCHEMES[preset]["input_activations"]
    g = torch.Generator().manual_seed(11)
    x = (torch.randn((2, 5, 256), generator=g) * 3).to(TORCH_DTYPES[dtype])
    scale, zp = compute_dynamic_scales_and_zp(x, args, module=None)
    want = ct_quantize(x, scale, None, args)
    q = quantize(jnp.asarray(x.float().numpy()).astype(dtype), presets[preset].input_activations, axis=-1)
    np.testing.assert_array_equal(np.asarray(q.element_values(jnp.float32)), want.float().numpy())
    np.testing.assert_array_equal(np.asarray(q.scale_values(jnp.float32)).ravel(), scale.float().numpy().ravel())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # nvfp4_quantize takes these two
def test_nvfp4_torchao_rule_matches_nvfp4_quantize_exactly(dtype):
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    w = _weights((128, 512), TORCH_DTYPES[dtype], seed=5)
    pts = w.float().abs().amax() / (448.0 * 6.0)
    t_scale, t_data = nv.nvfp4_quantize(w, 16, per_tensor_scale=pts)
    scheme = QuantScheme("fp4_e2m1", "tensor_group", group_size=16, scale_format="fp8_e4m3fn", scale_rule="torchao")
    q = quantize(jnp.asarray(w.float().numpy()).astype(dtype), scheme, axis=-1)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), t_scale.view(torch.uint8).numpy().reshape(128, 32))
    np.testing.assert_array_equal(np.asarray(q.codes), t_data.view(torch.uint8).numpy())
