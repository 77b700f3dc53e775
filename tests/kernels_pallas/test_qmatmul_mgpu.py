"""qmatmul_mgpu (Mosaic GPU) in GPU interpret mode on the CPU against qformats.dequantize + jnp.dot, its layout,
errors, dispatch, and every kernel variant lowered for cuda on the CPU (Mosaic GPU's own lowering checks)."""

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import qformats
from qformats import KernelError, dequantize, presets, quantize
from qformats.dispatch import select_kernel
from qformats.schemes import QuantScheme

import kernels_pallas
from kernels_pallas import MgpuBlockSizes, dequantize_mgpu, mgpu_unsupported_reason, prepare_mgpu, qmatmul_mgpu
from kernels_pallas.qmatmul_mgpu import _kernel_jit, default_mgpu_block_sizes

from kernel_cases import SCHEMES, assert_close, awkward_k, make_q, make_x

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")

ALL = sorted(SCHEMES)
N_SMALL = 72  # N_pad 128: two 64-channel programs, the second half padding


def _q(name, n=N_SMALL):
    return make_q(name, awkward_k(SCHEMES[name]), n)


@functools.lru_cache(maxsize=None)
def _mw(name):
    """The Mosaic GPU layout of `_q(name)`, prepared once for the layout, interpret and dispatch tests."""
    return prepare_mgpu(_q(name))


_dequantize = jax.jit(dequantize, static_argnums=1)
_dequantize_mgpu = jax.jit(dequantize_mgpu, static_argnums=1)


# ---- layout -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_layout_dequantizes_bit_exactly(name):
    """The kernel's decode and scale arithmetic (the same functions) on the Mosaic GPU layout equals
    qformats.dequantize bit for bit, in both activation dtypes."""
    q = _q(name)  # N 72: N_pad 128, the last 56 channels padding
    assert mgpu_unsupported_reason(q) is None
    mw = _mw(name)
    m = mw.meta
    assert m.K_pad % m.tile_k == 0 and m.N_pad % 64 == 0
    assert sum(int(np.prod(p.shape)) for p in mw.planes) == m.K_pad * m.N_pad * q.scheme.bits // 8  # no waste
    for dt in (jnp.bfloat16, jnp.float16):
        ref = np.asarray(_dequantize(q, dt), np.float32)
        got = np.asarray(_dequantize_mgpu(mw, dt), np.float32)
        np.testing.assert_array_equal(got, ref)


def test_layout_byte_planes():
    """FP6 (planes 4 | 2), tile_k 256: plane 0 chunk s of tile t holds the low nibbles of rows s*64 + c (low)
    and 128 + s*64 + c (high); plane 1 the top two bits of rows c, 64 + c, 128 + c, 192 + c."""
    q = make_q("FP6_E3M2", 256, 64)
    mw = prepare_mgpu(q)
    codes = np.asarray(q.element_codes()).astype(np.int64)  # [N, K]
    p0, p1 = (np.asarray(p).astype(np.int64) for p in mw.planes)
    assert mw.meta.tile_k == 256 and p0.shape == (2, 64, 64) and p1.shape == (1, 64, 64)
    for s in range(2):
        want = (codes[:, s * 64:(s + 1) * 64] & 15) | (codes[:, 128 + s * 64:128 + (s + 1) * 64] & 15) << 4
        np.testing.assert_array_equal(p0[s], want)
    want = sum(((codes[:, 64 * i:64 * i + 64] >> 4) & 3) << (2 * i) for i in range(4))
    np.testing.assert_array_equal(p1[0], want)


def test_nvfp4_scale_table_or_f32_scales():
    """NVFP4 keeps its e4m3 scale codes (plus an 8-entry table, no division in the kernel) when the table
    form equals IEEE scale / global on all 256 codes; a global scale that pushes scales into f32 subnormals,
    or a prepare under a trace (global scale unknown), gets f32 scales. All three dequantize bit-exactly."""
    q = make_q("NVFP4A16", 160, 72)
    mw = prepare_mgpu(q)
    assert mw.meta.scale_kind == "e4m3_table" and mw.scale.dtype == jnp.uint8
    assert mw.table.shape == (mw.meta.K_pad // mw.meta.tile_k, 32)
    leaves, tree = jax.tree_util.tree_flatten(q)
    codes, scale, gscale = leaves  # no zero point
    tiny = jax.tree_util.tree_unflatten(tree, [codes, scale, jnp.full_like(gscale, 2.0 ** 120)])
    mw_tiny = prepare_mgpu(tiny)
    assert mw_tiny.meta.scale_kind == "float" and mw_tiny.table is None
    traced = jax.jit(prepare_mgpu)(q)
    assert traced.meta.scale_kind == "float"
    for qq, w in ((q, mw), (tiny, mw_tiny), (q, traced)):
        for dt in (jnp.bfloat16, jnp.float16):
            np.testing.assert_array_equal(np.asarray(dequantize_mgpu(w, dt), np.float32),
                                          np.asarray(dequantize(qq, dt), np.float32))


# ---- interpret mode vs reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_interpret_all_formats(name):
    """Every format at M = 3 (one 16-token tile), awkward K (not a multiple of the K tile) and N."""
    q = _q(name)
    x = make_x((3, q.shape[0]), jnp.bfloat16)
    assert_close(qmatmul_mgpu(x, _mw(name), interpret=True), x, q)


@pytest.mark.parametrize("name,m,bs", [("MXFP4A16", 1, None), ("NVFP4A16", 16, None), ("FP6_E3M2", 64, None),
                                       ("W4A16_ASYM", 64, None), ("NVFP4A16", 64, {"compute_wgs": 1}),
                                       ("FP8_E4M3", 256, None), ("MXFP4A16", 256, None)])
def test_interpret_m_sweep(name, m, bs):
    """M = 1 and 16 pad to the 16-token tile of M = 3 above (same compiled kernel); 64 is one 64-token tile
    and 256 two 128-token tiles, warp-specialized by default (a memory warpgroup, two compute warpgroups of
    64 channels each); one 64-token case with a single warpgroup."""
    q = _q(name)
    x = make_x((m, q.shape[0]), jnp.bfloat16, seed=m + 1)
    mw = _mw(name)
    want = 2 if bs is None and m >= 64 else 1
    assert dataclasses.replace(default_mgpu_block_sizes(m, mw.meta), **(bs or {})).compute_wgs == want
    assert_close(qmatmul_mgpu(x, mw, interpret=True, block_sizes=bs), x, q)


def test_interpret_f16_batch_dims_split_k():
    """f16 activations with bf16 scales (rounded in bf16, then cast to f16), batch dims, 4 K tiles in 2 splits
    of 2 tiles (f32 partial sums added outside the kernel)."""
    q = make_q("W4A16", 512, 136)
    x = make_x((2, 3, 512), jnp.float16)
    y = qmatmul_mgpu(x, prepare_mgpu(q), interpret=True, block_sizes={"split_k": 2, "stages": 2})
    assert y.shape == (2, 3, 136) and y.dtype == jnp.float16
    assert_close(y.reshape(6, 136), x.reshape(6, 512), q)


def test_default_block_sizes():
    big = prepare_mgpu(make_q("FP6_E3M2", 256, 64)).meta
    from kernels_pallas.layout_mgpu import MgpuMeta
    big = MgpuMeta(**{**big.__dict__, "K": 4096, "K_pad": 4096, "N": 4096, "N_pad": 4096})
    bs = default_mgpu_block_sizes(1, big)
    assert bs.tile_m == 16 and bs.lhs == "regs" and bs.compute_wgs == 1
    assert (4096 // 64) * bs.split_k >= 132 and (4096 // 256) % bs.split_k == 0
    assert default_mgpu_block_sizes(64, big).tile_m == 64 and default_mgpu_block_sizes(64, big).compute_wgs == 2
    assert default_mgpu_block_sizes(256, big).tile_m == 128
    odd = MgpuMeta(**{**big.__dict__, "N": 4000, "N_pad": 4032})  # 63 blocks of 64: no pairs
    assert default_mgpu_block_sizes(256, odd).compute_wgs == 1


# ---- lowering for cuda (no GPU needed) ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _lowering_weight(name):
    """The layout of a [4 awkward_k, 200] weight (several K tiles, N_pad 256). A lowering reads only the shapes
    and the static meta, so quantize + prepare_mgpu are traced (jax.eval_shape: no values, nothing compiled),
    except for a global scale (NVFP4): its e4m3 table form is chosen on the concrete value (traced, it would be
    f32 scales), so that one is prepared from a real weight."""
    scheme = SCHEMES[name]
    k = 4 * awkward_k(scheme)
    if scheme.strategy == "tensor_group":
        mw = prepare_mgpu(make_q(name, k, 200))
        assert mw.meta.scale_kind == "e4m3_table"
        return mw
    q = jax.eval_shape(lambda w: quantize(w, scheme, axis=0), jax.ShapeDtypeStruct((k, 200), jnp.bfloat16))
    return jax.eval_shape(prepare_mgpu, q)


def _lower(mw, bs, xdt=jnp.bfloat16):
    xt = jax.ShapeDtypeStruct((mw.meta.K_pad, bs.tile_m), xdt)
    lowered = _kernel_jit.trace(xt, mw, bs=bs, interpret=False).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()  # a Mosaic GPU kernel, not a fallback
    return lowered


@pytest.mark.parametrize("name", ALL)
def test_lowered_for_cuda(name):
    """The GPU variant (weight in registers) of every format at decode (16-token tile, split-K, one
    warpgroup) and prefill (128-token tile, warp-specialized) tilings passes Mosaic GPU's lowering (layouts,
    swizzles, wgmma operand rules)."""
    mw = _lowering_weight(name)
    meta = mw.meta
    tiles = meta.K_pad // meta.tile_k
    prefill = default_mgpu_block_sizes(256, meta)
    assert prefill.compute_wgs == 2
    for bs in (MgpuBlockSizes(16, 2 if tiles % 2 == 0 else 1, 2, "regs"), prefill):
        _lower(mw, bs)


@pytest.mark.parametrize("name,bs,xdt", [
    ("FP6_E3M2", MgpuBlockSizes(32, 1, 3, "regs"), jnp.float16),
    ("NVFP4A16", MgpuBlockSizes(64, 1, 4, "smem"), jnp.bfloat16),
    ("NVFP4A16", MgpuBlockSizes(64, 2, 2, "smem", 2), jnp.float16),
    ("MXFP4A16", MgpuBlockSizes(256, 1, 2, "regs"), jnp.bfloat16),
    ("W4A16_ASYM", MgpuBlockSizes(16, 1, 2, "smem"), jnp.float16),
    ("W4A16_ASYM", MgpuBlockSizes(128, 1, 2, "regs", 2), jnp.bfloat16),
    ("FP5_E2M2", MgpuBlockSizes(128, 1, 1, "regs"), jnp.bfloat16),
    ("FP8_E4M3_G128", MgpuBlockSizes(192, 2, 2, "regs"), jnp.bfloat16),
    ("FP8_BLOCK", MgpuBlockSizes(128, 1, 2, "smem"), jnp.bfloat16)])
def test_lowered_variants(name, bs, xdt):
    """Other tile sizes, stage counts, f16, one or two compute warpgroups, and the shared-memory weight
    operand (what interpret mode runs)."""
    _lower(_lowering_weight(name), bs, xdt)


# ---- bad input ------------------------------------------------------------------------------------------------
def test_errors_name_shapes_and_formats():
    q = _q("FP6_E3M2")
    with pytest.raises(KernelError, match=r"K = 100.*fp6_e3m2.*K = 160"):
        qmatmul_mgpu(jnp.ones((2, 100), jnp.bfloat16), q, interpret=True)
    with pytest.raises(KernelError, match=r"float32 is not supported.*tf32.*fp6_e3m2"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.float32), q, interpret=True)
    with pytest.raises(KernelError, match=r"tile_m=24 \(16, 32 or a multiple of 64"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True, block_sizes={"tile_m": 24})
    with pytest.raises(KernelError, match=r"split_k=3 \(must divide the 1 K tiles"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True, block_sizes={"split_k": 3})
    with pytest.raises(KernelError, match=r"compute_wgs=2 \(1, or 2 when N_pad = 64"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), make_q("FP6_E3M2", 160, 40), interpret=True,
                     block_sizes={"compute_wgs": 2})
    with pytest.raises(KernelError, match=r"lhs='tmem'"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True, block_sizes={"lhs": "tmem"})
    with pytest.raises(KernelError, match=r"tile_m=256 x stages=4: \d+ bytes of shared memory"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True,
                     block_sizes={"tile_m": 256, "stages": 4})
    q5 = _q("FP5_E2M2")  # 512-row K tiles: 192 tokens x 512 x 2 bytes of x alone fill shared memory
    with pytest.raises(KernelError, match=r"tile_m=192 x stages=1"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), q5, interpret=True, block_sizes={"tile_m": 192, "stages": 1})
    with pytest.raises(KernelError, match=r"expected a QArray or MgpuWeight"):
        qmatmul_mgpu(jnp.ones((2, 160), jnp.bfloat16), np.ones((192, 8)), interpret=True)


@pytest.mark.parametrize("scheme,axis,match", [
    (QuantScheme("fp4_e2m1", "group", group_size=8), 0, r"group 8 along K.*16, 32 or a multiple of 64"),
    (QuantScheme("int4", "group", group_size=48), 0, r"group 48"),
    (QuantScheme("int8", "token"), 0, r"strategy 'token'"),
    (presets["FP6_E3M2"].weights, 1, r"axis 0"),
    (QuantScheme("fp8_e5m2", "channel"), 0, None)])
def test_unsupported_weights_raise(scheme, axis, match):
    """Weights without a Mosaic GPU layout raise KernelError naming why (never a silent wrong answer); e5m2
    (five exponent bits, IEEE) is taken."""
    q = quantize(jnp.asarray(np.random.default_rng(0).standard_normal((192, 64)), jnp.float32), scheme, axis=axis)
    if match is None:
        assert mgpu_unsupported_reason(q) is None
        return
    assert mgpu_unsupported_reason(q) is not None
    with pytest.raises(KernelError, match=match):
        prepare_mgpu(q)
    x = jnp.ones((1, q.shape[0]), jnp.bfloat16)
    with pytest.raises(KernelError, match=match):
        qmatmul_mgpu(x, q, interpret=True)


# ---- dispatch -------------------------------------------------------------------------------------------------
def test_dispatch_prefers_mosaic_on_gpu():
    """On GPU the Mosaic kernel is the first choice; the Triton kernel takes what it does not (f32
    activations, groups it has no layout for); the CPU gets neither unless forced to interpret."""
    assert qformats.dispatch.registered_kernels()[:2] == ["mosaic_qmatmul", "pallas_qmatmul"]
    q = make_q("MXFP4A16", 64, 32)
    x = jnp.ones((1, 64), jnp.bfloat16)
    assert select_kernel(x, q, "gpu").name == "mosaic_qmatmul"
    assert select_kernel(None, q, "gpu").name == "mosaic_qmatmul"
    assert select_kernel(x.astype(jnp.float32), q, "gpu").name == "pallas_qmatmul"
    assert select_kernel(x, q, "cpu") is None and select_kernel(x, q, "tpu") is None
    g48 = quantize(jnp.ones((96, 8)), QuantScheme("int4", "group", group_size=48), axis=0)
    assert mgpu_unsupported_reason(g48) is not None
    assert select_kernel(jnp.ones((1, 96), jnp.bfloat16), g48, "gpu").name == "pallas_qmatmul"
    g8 = quantize(jnp.ones((64, 8)), QuantScheme("fp4_e2m1", "group", group_size=8), axis=0)
    assert select_kernel(jnp.ones((1, 64), jnp.bfloat16), g8, "gpu") is None  # neither has a layout: XLA
    assert qformats.prepare_weight(q, "gpu").name == "mosaic_qmatmul"


def test_qdot_runs_the_mosaic_kernel_from_a_cached_layout(monkeypatch):
    """qdot with the layout from prepare_weight hands the MgpuWeight to the Mosaic kernel (no repack), also
    under an outer jit; a cached layout is ignored where its kernel does not take (x, q)."""
    import kernels_pallas.register as reg
    q = _q("W4A16")
    x = make_x((2, q.shape[0]), jnp.bfloat16)
    seen = []
    orig = reg.qmatmul_mgpu
    monkeypatch.setattr(reg, "qmatmul_mgpu", lambda x, w, **k: seen.append(type(w).__name__) or orig(x, w, **k))
    kernels_pallas.set_interpret(True)
    try:
        kw = qformats.prepare_weight(q)
        assert kw.name == "mosaic_qmatmul" and isinstance(kw.payload, kernels_pallas.MgpuWeight)
        y = qformats.qdot(x, q, kw)
    finally:
        kernels_pallas.set_interpret(False)
    assert seen == ["MgpuWeight"]
    assert_close(y, x, q)
    # on CPU without interpret the kernel does not take it: the XLA path, exactly
    np.testing.assert_array_equal(np.asarray(qformats.qdot(x, q, kw)), np.asarray(qformats.dispatch.xla_qdot(x, q)))


def test_layers_cache_the_mosaic_layout(monkeypatch):
    """A packed nnx layer keeps the Mosaic GPU layout (an MgpuWeight in its KernelCache, prepared once): the
    forward pass, eager and under nnx.jit, never repacks and matches the XLA path within the bound."""
    from flax import nnx
    from qformats.nn import KernelCache, Rule, quantize_model
    import sys
    mod = sys.modules["kernels_pallas.qmatmul_mgpu"]  # the package attribute of that name is the function

    class Net(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(160, 72, use_bias=False, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                   param_dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.proj(x)

    x = make_x((2, 3, 160), jnp.bfloat16)
    kernels_pallas.set_interpret(True)
    try:
        model = Net()
        quantize_model(model, [Rule(".*", "MXFP4A16")])
        cache = model.proj.kernel_cache
        assert isinstance(cache, KernelCache) and cache.get_value().name == "mosaic_qmatmul"
        assert isinstance(cache.get_value().payload, kernels_pallas.MgpuWeight)
        calls = []
        orig = mod.prepare_mgpu
        monkeypatch.setattr(mod, "prepare_mgpu", lambda *a, **k: calls.append("repack") or orig(*a, **k))
        y = np.asarray(model(x), np.float32)
        y_jit = np.asarray(nnx.jit(lambda m, v: m(v))(model, x), np.float32)
        assert calls == [], "the layer repacked its weight in the forward pass"
    finally:
        kernels_pallas.set_interpret(False)
    assert_close(jnp.asarray(y).reshape(6, 72), x.reshape(6, 160), model.proj.kernel.get_value())
    np.testing.assert_array_equal(y, y_jit)
