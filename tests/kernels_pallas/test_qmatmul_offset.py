"""QArrays with an additive offset (GGUF minima, w = d q + m) in both kernels: the layouts decode them bit for bit as
`qformats.dequantize`, the kernels run them in interpret mode against dequantize + jnp.dot, the GPU variants lower
for cuda on the CPU, and the dispatch hands them to the kernels (which say they take offsets)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from qformats import dequantize, quantize
from qformats.dispatch import select_kernel
from qformats.qarray import QArray
from qformats.schemes import QuantScheme

import kernels_pallas
from kernels_pallas import (BlockSizes, MgpuBlockSizes, dequantize_mgpu, dequantize_prepared, mgpu_unsupported_reason,
                            prepare, prepare_mgpu, qmatmul, qmatmul_mgpu)
from kernels_pallas.layout import unsupported_reason
from kernels_pallas.qmatmul import _qmatmul_2d_gpu
from kernels_pallas.qmatmul_mgpu import _kernel_jit

from kernel_cases import assert_close, make_x

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")


def _gguf_like(k=160, n=72, fmt="uint4", g=32, sdt=jnp.float16, compute=jnp.float32, seed=0):
    """A Q4_1-like QArray: codes of a random `fmt` group-`g` quantization, random scales and offsets stored in `sdt`
    (float16: the file's d and m), computed in `compute` (None: in `sdt`)."""
    rng = np.random.default_rng(seed)
    base = quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)),
                    QuantScheme(fmt, "group", group_size=g, scale_format="float32"), axis=0)
    s = (rng.standard_normal((n, k // g)) * 0.05).astype(np.float32)
    o = (rng.standard_normal((n, k // g)) * 0.3).astype(np.float32)
    scheme = QuantScheme(fmt, "group", group_size=g, scale_format=jnp.dtype(sdt).name)
    q = QArray(base.codes, jnp.asarray(s, sdt), None, None, scheme=scheme, shape=(k, n), dtype=jnp.float32, axis=0,
               offset=jnp.asarray(o, sdt), compute_dtype=compute)
    q.check()
    return q


CASES = {"q4_1 (f16 d, m; f32 compute)": dict(),
         "q5_1 (f16 d, m; f32 compute)": dict(fmt="uint5"),
         "q4_k (f32 d sc, dmin m)": dict(sdt=jnp.float32, compute=None),
         "bf16 scale and offset, bf16 compute": dict(sdt=jnp.bfloat16, compute=None, g=64, k=256)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layouts_decode_the_offset_bit_exactly(case):
    q = _gguf_like(**CASES[case])
    assert unsupported_reason(q) is None and mgpu_unsupported_reason(q) is None
    pw, mw = prepare(q), prepare_mgpu(q)
    assert pw.meta.has_offset and mw.meta.has_offset
    assert pw.meta.scale_dtype == mw.meta.scale_dtype == q.work_dtype.name
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        ref = np.asarray(dequantize(q, dt), np.float32)
        np.testing.assert_array_equal(np.asarray(dequantize_prepared(pw, dt), np.float32), ref)
        if dt != jnp.float32:  # the Mosaic kernel takes bf16 / f16 activations only
            np.testing.assert_array_equal(np.asarray(dequantize_mgpu(mw, dt), np.float32), ref)


def test_triton_kernel_interpreted_with_offset():
    q = _gguf_like()
    pw = prepare(q)
    for m, xdt in ((3, jnp.bfloat16), (1, jnp.float32)):  # the dot form and the GEMV form
        x = make_x((m, q.shape[0]), xdt)
        assert_close(qmatmul(x, pw, interpret=True), x, q)


def test_mosaic_kernel_interpreted_with_offset():
    q = _gguf_like()
    x = make_x((3, q.shape[0]), jnp.bfloat16)
    assert_close(qmatmul_mgpu(x, prepare_mgpu(q), interpret=True), x, q)


def test_kernels_lower_for_cuda_with_offset():
    q = _gguf_like(k=512, n=128)
    pw = prepare(q)
    txt = _qmatmul_2d_gpu.trace(jnp.zeros((3, pw.meta.K_pad), jnp.bfloat16), pw, bs=BlockSizes(block_m=16, split_k=2),
                                interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in txt
    txt = _qmatmul_2d_gpu.trace(jnp.zeros((3, pw.meta.K_pad), jnp.float16), pw, bs=BlockSizes(block_m=4, split_k=1),
                                interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in txt
    mw = prepare_mgpu(q)
    for bs in (MgpuBlockSizes(16, 2, 2, "regs"), MgpuBlockSizes(128, 1, 2, "regs", 2)):
        xt = jax.ShapeDtypeStruct((mw.meta.K_pad, bs.tile_m), jnp.bfloat16)
        lowered = _kernel_jit.trace(xt, mw, bs=bs, interpret=False).lower(lowering_platforms=("cuda",))
        assert "custom_call @mosaic_gpu" in lowered.as_text()


def test_dispatch_gives_offsets_to_the_kernels_on_gpu():
    q = _gguf_like()
    assert select_kernel(jnp.zeros((1, q.shape[0]), jnp.bfloat16), q, "gpu").name == "mosaic_qmatmul"
    assert select_kernel(jnp.zeros((1, q.shape[0]), jnp.float32), q, "gpu").name == "pallas_qmatmul"
    assert kernels_pallas is not None


def test_offset_with_a_global_scale_is_refused():
    q = _gguf_like(sdt=jnp.float32, compute=None)
    bad = QArray(q.codes, q.scale, None, jnp.ones((1,), jnp.float32), scheme=q.scheme, shape=q.shape, dtype=q.dtype,
                 axis=0, offset=q.offset)
    assert "offset" in unsupported_reason(bad) and "offset" in mgpu_unsupported_reason(bad)
