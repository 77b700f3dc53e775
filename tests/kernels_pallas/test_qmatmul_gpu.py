"""qmatmul_mgpu (Mosaic GPU) and qmatmul (Pallas Triton) compiled for the GPU, against qformats.dequantize +
jnp.dot. Skipped without a GPU.

Run by bench/gpu_all.sh on the device machine; also runnable as a script (`python -m pytest` or
`python tests/kernels_pallas/test_qmatmul_gpu.py`).
"""

import sys

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import qformats
from qformats.dispatch import select_kernel

import kernels_pallas
from kernels_pallas import BlockSizes, MgpuBlockSizes, prepare, prepare_mgpu, qmatmul, qmatmul_mgpu

try:
    from kernel_cases import SCHEMES, make_x, reference
except ImportError:  # run as a script
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from kernel_cases import SCHEMES, make_x, reference

ON_GPU = jax.default_backend() == "gpu"
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the CPU suite runs interpret=True)")


def _q(name, k, n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(1, n)).astype(np.float32)
    return qformats.quantize(jnp.asarray(w, jnp.bfloat16), SCHEMES[name], axis=0)


def check(y, x, q):
    """The CPU suite's bound, plus for NVFP4 one bf16 ulp of every |x w| term: Triton's f32 division
    (div.full.f32) may be an ulp off the IEEE scale / global that qformats.dequantize computes, which can
    move a weight by one bf16 ulp (the Mosaic kernel takes scale / global precomputed by XLA). Returns the
    worst err / tol."""
    ref, mag = reference(x, q)
    k = q.shape[0]
    eps = float(jnp.finfo(x.dtype).eps)
    tol = eps * np.abs(ref) + 2 * k * 2.0 ** -24 * mag + 1e-30
    if q.global_scale is not None:
        tol = tol + 2.0 ** -8 * mag
    got = np.asarray(y, np.float32)
    assert got.shape == ref.shape and np.isfinite(got).all()
    ratio = float((np.abs(got - ref) / tol).max())
    assert ratio <= 1.0, f"{q.scheme.describe()}: worst err/tol {ratio:.3g}"
    return ratio


NAMES = sorted(SCHEMES)


def _k(name):
    g = SCHEMES[name].group_size or 1
    k = 1000 + (-1000 % g)
    if g < 128 and k % 128 == 0:
        k += g  # K not a multiple of 128 where the group allows
    return k


MOSAIC_STRICT = pytest.mark.filterwarnings("error::DeprecationWarning")  # jax 0.11: no deprecated API


@MOSAIC_STRICT
@pytest.mark.parametrize("name", NAMES)
def test_gpu_mosaic_all_formats(name):
    """The Mosaic GPU kernel (default tilings, weight in registers) at decode (M = 1 and 7 share the 16-token
    tile) and prefill (two 128-token tiles, warp-specialized) sizes."""
    k = _k(name)
    q = _q(name, k, 1000)
    mw = prepare_mgpu(q)
    for m in (1, 7, 256):
        x = make_x((m, k), jnp.bfloat16, seed=m)
        check(qmatmul_mgpu(x, mw, interpret=False), x, q)


@MOSAIC_STRICT
@pytest.mark.parametrize("name", ["FP6_E3M2", "NVFP4A16", "W4A16_ASYM"])
def test_gpu_mosaic_variants(name):
    """f16, the shared-memory weight operand, split-K, other token tiles and stage counts, one or two compute
    warpgroups."""
    q = _q(name, 2048, 512)
    mw = prepare_mgpu(q)
    x = make_x((7, 2048), jnp.float16)
    check(qmatmul_mgpu(x, mw, interpret=False), x, q)
    x = make_x((100, 2048), jnp.bfloat16)
    for bs in (MgpuBlockSizes(16, 4, 2, "smem"), MgpuBlockSizes(32, 2, 3, "regs"), MgpuBlockSizes(64, 1, 4, "regs"),
               MgpuBlockSizes(128, 1, 1, "smem", 2), MgpuBlockSizes(128, 2, 2, "regs", 1)):
        check(qmatmul_mgpu(x, mw, interpret=False, block_sizes=bs), x, q)


@pytest.mark.parametrize("name", NAMES)
def test_gpu_all_formats(name):
    k = _k(name)
    q = _q(name, k, 1000)
    pw = prepare(q)
    for m in (1, 7, 256):  # M = 1: GEMV form (default); 7: 16-row dot, masked rows; 256: 128-row dot
        x = make_x((m, k), jnp.bfloat16, seed=m)
        check(qmatmul(x, pw, interpret=False), x, q)


@pytest.mark.parametrize("name", ["FP6_E3M2", "NVFP4A16", "W4A16_ASYM"])
def test_gpu_dtypes_and_tilings(name):
    q = _q(name, 1024, 512)
    pw = prepare(q)
    for xdt in (jnp.float16, jnp.float32):
        x = make_x((7, 1024), xdt)
        check(qmatmul(x, pw, interpret=False), x, q)
    x = make_x((64, 1024), jnp.bfloat16)
    for bs in (BlockSizes(16, None, 8, 4, 4), BlockSizes(64, None, 1, 8, 3), BlockSizes(128, None, 2, 8, 2),
               BlockSizes(4, None, 2, 4, 3), BlockSizes(8, None, 1, 2, 3)):  # the last two: GEMV form
        check(qmatmul(x, pw, interpret=False, block_sizes=bs), x, q)
    pw128 = prepare(q, block_n=128)
    for bs in (BlockSizes(16, None, 4, 4, 3), BlockSizes(64, None, 1, 8, 3)):
        check(qmatmul(x, pw128, interpret=False, block_sizes=bs), x, q)


@MOSAIC_STRICT
def test_gpu_dispatch():
    q = _q("MXFP4A16", 512, 256)
    x = make_x((2, 3, 512), jnp.bfloat16)
    assert select_kernel(x, q).name == "mosaic_qmatmul"
    assert select_kernel(x.astype(jnp.float32), q).name == "pallas_qmatmul"
    y = jax.jit(qformats.qdot)(x, q)
    check(y.reshape(6, 256), x.reshape(6, 512), q)


def test_gpu_layer_uses_its_cached_layout():
    """On GPU a packed nnx layer prepares its kernel layout once and the jit forward pass uses it."""
    from flax import nnx
    from qformats.nn import Rule, quantize_model

    class Net(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(512, 384, use_bias=False, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                   param_dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.proj(x)

    model = quantize_model(Net(), [Rule(".*", "FP6_E3M2")])
    cache = model.proj.kernel_cache
    assert cache is not None and cache.get_value().name == "mosaic_qmatmul"
    x = make_x((4, 512), jnp.bfloat16)
    y = nnx.jit(lambda m, v: m(v))(model, x)
    check(y, x, model.proj.kernel.get_value())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
