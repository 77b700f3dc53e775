"""qmatmul (Pallas, interpret=True on CPU) against qformats.dequantize + jnp.dot, its layout, errors,
dispatch, and the lowering of every kernel variant to Triton IR (cross-platform lowering, no GPU needed)."""

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
from kernels_pallas import BlockSizes, dequantize_prepared, prepare, qmatmul
from kernels_pallas.layout import plane_split
from kernels_pallas.qmatmul import _qmatmul_2d_gpu, default_block_sizes

from kernel_cases import SCHEMES, assert_close, awkward_k, make_q, make_x

ALL = sorted(SCHEMES)
FEW = ["FP6_E3M2", "MXFP4A16", "NVFP4A16", "W4A16_ASYM"]
F32_TOO = ("NVFP4A16", "W8A16_ASYM", "FP8_BLOCK", "FP5_E3M1")


def _q(name):
    """Each format's weight at an awkward K (`awkward_k`) and N = 200 (N_pad 256: not a multiple of the blocks)."""
    return make_q(name, awkward_k(SCHEMES[name]), 200)


@functools.lru_cache(maxsize=None)
def _pw(name):
    """The kernel layout of `_q(name)`, prepared once for the layout, interpret and lowering tests."""
    return prepare(_q(name))


_dequantize = jax.jit(dequantize, static_argnums=1)
_dequantize_prepared = jax.jit(dequantize_prepared, static_argnums=1)


# ---- layout ---------------------------------------------------------------------------------------------------
def test_plane_split():
    assert plane_split(8) == ((8, 0),)
    assert plane_split(6) == ((4, 0), (2, 4))
    assert plane_split(5) == ((4, 0), (1, 4))
    assert plane_split(4) == ((4, 0),)
    assert plane_split(7) == ((4, 0), (2, 4), (1, 6))
    assert plane_split(3) == ((2, 0), (1, 2))


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e4m3", "fp7_e3m3", "fp6_e3m2",
                                 "fp6_e2m3", "fp5_e2m2", "fp5_e3m1", "fp4_e2m1", "fp4_e3m0", "fp3_e2m0",
                                 "int8", "int4", "int3", "uint4"])
def test_in_kernel_decode_is_exact_for_every_code(fmt):
    """The kernel's SWAR decode (four codes per word, through f16 patterns) times the 2^(15 - bias) that the
    scale row carries equals qformats.decode for all 2^bits codes in every lane, bit for bit."""
    from kernels_pallas.layout import LANES, LayoutMeta, decode_words
    f = qformats.get_format(fmt)
    n = 1 << f.bits
    codes = np.arange(n, dtype=np.uint32)
    # every code in every lane: word i holds codes i, i+1, i+2, i+3 (mod n)
    words = sum(np.roll(codes, -q) << (8 * q) for q in range(LANES)).astype(np.uint32)
    meta = LayoutMeta(fmt=f, K=1, N=1, K_pad=1, N_pad=4, block_k=16, block_n=64, chunk=16, group=1,
                      planes=(), scale_kind="float", scale_dtype="float32", has_zero=False, has_global=False,
                      dtype="float32", scheme_desc=fmt)
    lanes = jax.jit(lambda w: decode_words(w, meta))(jnp.asarray(words))
    if isinstance(f, qformats.IntFormat):
        ref = (codes.astype(np.int64) + f.qmin).astype(np.float32)
        factor = 1.0
    else:
        ref = np.asarray(qformats.decode(jnp.asarray(codes, jnp.uint8), f))
        factor = np.float32(2.0 ** (15 - f.bias))
    for q in range(LANES):
        got = np.asarray(lanes[q]) * factor
        want = np.roll(ref, -q)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got.view(np.uint32)[ok], want.view(np.uint32)[ok])


@pytest.mark.parametrize("name", ALL)
def test_prepared_dequantizes_bit_exactly(name):
    """The kernel's arithmetic (same functions) on the prepared layout equals qformats.dequantize bit for bit."""
    q = _q(name)
    pw = _pw(name)
    assert pw.meta.K_pad % pw.meta.block_k == 0 and pw.meta.N_pad % 128 == 0
    packed_bytes = sum(int(np.prod(p.shape)) * 4 for p in pw.planes)  # uint32 words
    assert packed_bytes == pw.meta.K_pad * pw.meta.N_pad * q.scheme.bits // 8  # no wasted bits
    for dt in (jnp.bfloat16, jnp.float32) if name in F32_TOO else (jnp.bfloat16,):
        ref = np.asarray(_dequantize(q, dt), np.float32)
        got = np.asarray(_dequantize_prepared(pw, dt), np.float32)
        np.testing.assert_array_equal(got, ref)


def test_prepared_layout_is_k_major_planes():
    """FP6 [K=128, N=16], block_n 64: plane 0 holds the low 4 bits of rows r and r+64 in one byte, plane 1
    the top 2 bits of rows r, r+32, r+64, r+96; byte q of word j is column 16 q + j."""
    q = make_q("FP6_E3M2", 128, 16)
    pw = prepare(q)
    codes = np.asarray(q.element_codes()).T.astype(np.int64)  # [K, N]
    codes = np.pad(codes, ((0, 0), (0, 48)))  # N_pad = 64
    p0, p1 = (np.asarray(p).astype(np.int64) for p in pw.planes)
    assert p0.shape == (64, 16) and p1.shape == (32, 16) and pw.planes[0].dtype == jnp.uint32
    byte0 = (codes[:64] & 15) | (codes[64:] & 15) << 4
    byte1 = sum(((codes[32 * i: 32 * i + 32] >> 4) & 3) << (2 * i) for i in range(4))
    for plane, byte in ((p0, byte0), (p1, byte1)):
        want = sum(byte[:, 16 * lane: 16 * lane + 16] << (8 * lane) for lane in range(4))
        np.testing.assert_array_equal(plane, want)


# ---- qmatmul vs reference -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_all_formats_small_m(name):
    """Every format at M=3 (one 16-row block), awkward K and N (not multiples of the blocks)."""
    q = _q(name)
    x = make_x((3, q.shape[0]), jnp.bfloat16)
    assert_close(qmatmul(x, _pw(name), interpret=True), x, q)


@pytest.mark.parametrize("name,m", [(n, m) for n in FEW for m in (1, 16)]
                         + [("FP6_E3M2", 64), ("W4A16_ASYM", 64), ("MXFP4A16", 256), ("NVFP4A16", 256)])
def test_m_sweep(name, m):
    """M = 1 takes the GEMV form (block_m 1); M = 16 shares the 16-row dot tiling with M = 3 above (one
    compile per format); M = 64 (one 64-row block) and 256 (two 128-row blocks) are the prefill tilings,
    each compiled for two formats."""
    q = _q(name)
    x = make_x((m, q.shape[0]), jnp.bfloat16, seed=m + 1)
    assert_close(qmatmul(x, _pw(name), interpret=True), x, q)


@pytest.mark.parametrize("name,xdt", [("FP6_E2M3", jnp.float16), ("W4A16_ASYM", jnp.float32),
                                      ("MXFP8A16", jnp.float32)])
def test_x_dtypes(name, xdt):
    q = make_q(name, awkward_k(SCHEMES[name]), 48)
    x = make_x((5, q.shape[0]), xdt)
    y = qmatmul(x, q, interpret=True)
    assert y.dtype == xdt
    assert_close(y, x, q)


def test_f32_weights_f16_activations_mixed_scale_dtype():
    """Scale stored in f32 (weights were f32), activations f16: scale applied in f32, then cast to f16."""
    q = make_q("FP5_E2M2_G32" if "FP5_E2M2_G32" in SCHEMES else "FP5_E2M2", 160, 40, dtype=jnp.float32)
    x = make_x((2, 160), jnp.float16)
    assert_close(qmatmul(x, q, interpret=True), x, q)


def test_batch_dims_split_k_and_block_sizes():
    q = make_q("FP6_E3M2", 512, 136)  # 4 K tiles, N_pad 256
    pw = prepare(q)
    x = make_x((2, 3, 512), jnp.bfloat16)
    y = qmatmul(x, pw, interpret=True, block_sizes=BlockSizes(block_m=16, split_k=4))
    assert y.shape == (2, 3, 136)
    assert_close(y.reshape(6, 136), x.reshape(6, 512), q)
    y2 = qmatmul(x, prepare(q, block_n=128), interpret=True, block_sizes={"split_k": 3, "block_m": 32})
    assert_close(y2.reshape(6, 136), x.reshape(6, 512), q)  # 4 tiles in 3 splits: 2, 2, 0


@pytest.mark.parametrize("name,m,bm,split,xdt", [("FP5_E3M1", 3, 4, 2, jnp.bfloat16),
                                                 ("W8A16_ASYM", 2, 2, 1, jnp.float16),
                                                 ("MXFP6_E3M2", 5, 4, 1, jnp.float32),
                                                 ("FP8_E4M3", 1, 1, 2, jnp.bfloat16)])  # chunk 128 in 32s
def test_gemv_form(name, m, bm, split, xdt):
    """block_m < 16: FMAs into per-row accumulators, no dot; the last block's rows past M are masked."""
    q = _q(name)
    x = make_x((m, q.shape[0]), xdt)
    assert_close(qmatmul(x, _pw(name), interpret=True, block_sizes=BlockSizes(block_m=bm, split_k=split)), x, q)


def test_block_k_256():
    q = make_q("FP5_E3M1", 300, 40)
    pw = prepare(q, block_k=256)
    assert pw.meta.chunk == 32 and pw.meta.K_pad == 512
    x = make_x((4, 300), jnp.bfloat16)
    assert_close(qmatmul(x, pw, interpret=True), x, q)


def test_default_block_sizes_fill_the_gpu_at_decode():
    pw = prepare(make_q("FP6_E3M2", 128, 16))
    assert default_block_sizes(1, pw.meta).block_m == 1  # GEMV form
    assert default_block_sizes(2, pw.meta).block_m == 2
    assert default_block_sizes(3, pw.meta).block_m == 16
    from kernels_pallas.layout import LayoutMeta
    big = LayoutMeta(**{**pw.meta.__dict__, "K": 4096, "K_pad": 4096, "N": 4096, "N_pad": 4096})
    bs = default_block_sizes(1, big)
    assert (4096 // bs.block_n) * bs.split_k >= 2 * 132 and (4096 // 128) // bs.split_k >= 4
    big2 = LayoutMeta(**{**big.__dict__, "K": 11008, "K_pad": 11008})  # 86 tiles: uneven splits allowed
    assert (4096 // 64) * default_block_sizes(1, big2).split_k >= 2 * 132
    assert default_block_sizes(256, big).block_m == 128


# ---- bad input --------------------------------------------------------------------------------------------------
def test_errors_name_shapes_and_formats():
    q = make_q("FP6_E3M2", 160, 40)
    with pytest.raises(KernelError, match=r"K = 100.*fp6_e3m2.*K = 160"):
        qmatmul(jnp.ones((2, 100), jnp.bfloat16), q, interpret=True)
    with pytest.raises(KernelError, match=r"int32.*fp6_e3m2"):
        qmatmul(jnp.ones((2, 160), jnp.int32), q, interpret=True)
    with pytest.raises(KernelError, match=r"block_n must be a power of two >= 64, got 48"):
        qmatmul(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True, block_sizes=BlockSizes(block_n=48))
    with pytest.raises(KernelError, match=r"block_n=128 \(fixed by prepare at 64"):
        qmatmul(jnp.ones((2, 160), jnp.bfloat16), prepare(q), interpret=True, block_sizes=BlockSizes(block_n=128))
    with pytest.raises(KernelError, match=r"block_m=12 \(1, 2, 4, 8: GEMV form"):
        qmatmul(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True, block_sizes=BlockSizes(block_m=12))
    with pytest.raises(KernelError, match=r"split_k=3 \(1 .. the 2 K tiles"):
        qmatmul(jnp.ones((2, 160), jnp.bfloat16), q, interpret=True, block_sizes=BlockSizes(split_k=3))
    g8 = quantize(jnp.ones((64, 8)), QuantScheme("fp4_e2m1", "group", group_size=8), axis=0)
    with pytest.raises(KernelError, match=r"group 8"):
        qmatmul(jnp.ones((1, 64)), g8, interpret=True)
    q1 = quantize(jnp.ones((8, 64)), presets["FP6_E3M2"].weights, axis=1)
    with pytest.raises(KernelError, match=r"axis 0"):
        qmatmul(jnp.ones((1, 8)), q1, interpret=True)


# ---- dispatch -----------------------------------------------------------------------------------------------
@pytest.fixture
def triton_only():
    """The Pallas Triton kernel as the only registered kernel (the Mosaic GPU one, first on GPU, takes no
    weight) for the dispatch tests of this kernel; both registered again afterwards."""
    import kernels_pallas.register as reg
    qformats.dispatch.register_kernel(reg.MGPU_KERNEL_NAME, lambda x, q, backend: False, lambda x, q, p=None: None,
                                      priority=20)
    try:
        yield
    finally:
        reg.register()


def test_registered_for_gpu_only_by_default(triton_only):
    q = make_q("MXFP4A16", 64, 32)
    x = jnp.ones((1, 64), jnp.bfloat16)
    assert "pallas_qmatmul" in qformats.dispatch.registered_kernels()
    assert select_kernel(x, q, "gpu").name == "pallas_qmatmul"
    assert select_kernel(x, q, "cpu") is None
    assert select_kernel(x, q, "tpu") is None
    assert select_kernel(x.astype(jnp.int8), q, "gpu") is None  # unsupported dtype -> XLA path
    g8 = quantize(jnp.ones((64, 8)), QuantScheme("fp4_e2m1", "group", group_size=8), axis=0)
    assert select_kernel(x, g8, "gpu") is None  # no layout -> XLA path
    tok = quantize(jnp.ones((64, 8)), QuantScheme("int8", "token"), axis=0)
    assert select_kernel(x, tok, "gpu") is None
    qformats.set_kernels_enabled(False)
    try:
        assert select_kernel(x, q, "gpu") is None
    finally:
        qformats.set_kernels_enabled(True)


@pytest.mark.slow
def test_qdot_uses_the_kernel_when_forced_to_interpret(monkeypatch, triton_only):
    q = make_q("W4A16", 384, 200)  # cheap to compile: the nested jit below compiles at full optimization
    x = make_x((2, 384), jnp.bfloat16)
    calls = []
    import kernels_pallas.register as reg
    orig = reg.qmatmul
    monkeypatch.setattr(reg, "qmatmul", lambda *a, **k: calls.append(1) or orig(*a, **k))
    kernels_pallas.set_interpret(True)
    try:
        y = qformats.qdot(x, q)
        y_jit = jax.jit(qformats.qdot)(x, q)  # under an outer jit too
    finally:
        kernels_pallas.set_interpret(False)
    assert calls == [1, 1]
    assert_close(y, x, q)
    assert_close(y_jit, x, q)
    y_xla = qformats.qdot(x, q)  # CPU, not forced: the XLA path
    assert_close(y_xla, x, q)


# ---- lowering to Triton (runs on CPU: jax lowers the Pallas kernel to Triton IR for "cuda") ---------------
def _lower_gpu(x, pw, bs):
    txt = _qmatmul_2d_gpu.trace(x, pw, bs=bs, interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in txt


@pytest.mark.parametrize("name", ALL)
def test_lowers_to_triton(name):
    pw = _pw(name)
    tiles = pw.meta.K_pad // pw.meta.block_k
    # decode: 3 rows under a mask, split-K (uneven when 3 tiles: a dynamic trip count), bf16;
    # prefill: 64-row blocks, f32 (IEEE dot), no mask
    _lower_gpu(jnp.zeros((3, pw.meta.K_pad), jnp.bfloat16), pw, BlockSizes(block_m=16, split_k=min(2, tiles)))
    _lower_gpu(jnp.zeros((64, pw.meta.K_pad), jnp.float32), pw, default_block_sizes(64, pw.meta))
    # GEMV form: 3 rows in a 4-row block (clamped loads, masked stores), split-K, f16
    _lower_gpu(jnp.zeros((3, pw.meta.K_pad), jnp.float16), pw, BlockSizes(block_m=4, split_k=min(2, tiles)))


def test_flax_layer_runs_the_kernel(monkeypatch, triton_only):
    """A qformats.nn-quantized nnx.Linear calls qdot, which takes the kernel (forced to interpret here)."""
    from flax import nnx
    from qformats.nn import Rule, quantize_model

    class Net(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(160, 200, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.proj(x)

    model = Net()
    quantize_model(model, [Rule(".*", "FP6_E3M2")])
    assert isinstance(model.proj.kernel.get_value(), qformats.QArray)
    x = make_x((2, 3, 160), jnp.bfloat16)
    calls = []
    import kernels_pallas.register as reg
    orig = reg.qmatmul
    monkeypatch.setattr(reg, "qmatmul", lambda *a, **k: calls.append(1) or orig(*a, **k))
    kernels_pallas.set_interpret(True)
    try:
        y = np.asarray(model(x), np.float32)
    finally:
        kernels_pallas.set_interpret(False)
    assert calls, "the quantized layer did not dispatch to the Pallas kernel"
    y_xla = np.asarray(model(x), np.float32)  # CPU, not forced: the XLA path
    assert y.shape == (2, 3, 200)
    np.testing.assert_allclose(y, y_xla, rtol=0, atol=2.0 ** -7 * np.abs(y_xla).max())


def test_layers_cache_the_kernel_layout(monkeypatch, triton_only):
    """Packed layers keep the kernel's layout (prepared once): the forward pass never repacks, the cache is
    not a parameter, and it is dropped (XLA path) when kernels are turned off."""
    from flax import nnx
    from qformats.nn import KernelCache, Rule, param_bytes, prepare_kernels, quantize_model
    import kernels_pallas.layout as layout_mod
    import sys
    qm_mod = sys.modules["kernels_pallas.qmatmul"]  # the package attribute of that name is the function

    class Net(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(160, 200, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.proj(x)

    x = make_x((2, 3, 160), jnp.bfloat16)
    kernels_pallas.set_interpret(True)
    try:
        model = Net()
        quantize_model(model, [Rule(".*", "MXFP4A16")])
        cache = model.proj.kernel_cache
        assert isinstance(cache, KernelCache) and cache.get_value().name == "pallas_qmatmul"
        assert isinstance(cache.get_value().payload, kernels_pallas.PreparedWeight)
        assert param_bytes(model) == model.proj.kernel.get_value().nbytes + 200 * 2  # cache is not a Param
        calls = []
        monkeypatch.setattr(qm_mod, "prepare", lambda *a, **k: calls.append("repack") or layout_mod.prepare(*a, **k))
        y = np.asarray(model(x), np.float32)
        y_jit = np.asarray(nnx.jit(lambda m, v: m(v))(model, x), np.float32)
        assert calls == [], "the layer repacked its weight in the forward pass"
        qformats.set_kernels_enabled(False)
        try:
            assert prepare_kernels(model) == 0 and model.proj.kernel_cache is None
        finally:
            qformats.set_kernels_enabled(True)
        assert prepare_kernels(model) == 1
    finally:
        kernels_pallas.set_interpret(False)
    assert prepare_kernels(model) == 0  # CPU, not forced: no kernel, no cache
    y_xla = np.asarray(model(x), np.float32)
    np.testing.assert_allclose(y, y_xla, rtol=0, atol=2.0 ** -7 * np.abs(y_xla).max())
    np.testing.assert_array_equal(y, y_jit)


def test_qdot_ignores_a_payload_its_kernel_does_not_take(triton_only):
    """A cached layout is used only by the kernel that made it, and only when it takes (x, q) here."""
    q = make_q("W4A16", 128, 64)
    x = make_x((2, 128), jnp.bfloat16)
    kernels_pallas.set_interpret(True)
    try:
        p = qformats.prepare_weight(q)
    finally:
        kernels_pallas.set_interpret(False)
    assert p is not None and p.name == "pallas_qmatmul"
    # on CPU without interpret the kernel does not take it: the XLA path, exactly
    np.testing.assert_array_equal(np.asarray(qformats.qdot(x, q, p)), np.asarray(qformats.dispatch.xla_qdot(x, q)))
    assert qformats.prepare_weight(q) is None
