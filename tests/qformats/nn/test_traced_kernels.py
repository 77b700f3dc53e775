"""The registered Pallas kernels reached from weights packed through qformats.nn.traced (interpret mode on CPU):
a custom layer's matmul dispatches to the kernel `qformats.dispatch` picks for its packed weight, and the result
is the XLA path's within the kernel tests' accumulation-order bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas
import kernels_pallas.register as reg
from qformats.dispatch import select_kernel
from qformats.nn import Rule, quantize_model
from qformats.nn.nnx_traced import packed_weights
from qformats.quantize import dequantize


class Custom(nnx.Module):
    """EasyDeL-style: its own kernel [K, N] and a lax.dot_general (no flax layer class)."""

    def __init__(self, k, n, dtype):
        w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) * k ** -0.5
        self.kernel = nnx.Param(jnp.asarray(w, dtype))

    def __call__(self, x):
        return jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))


def assert_close(y, x, q):
    """The kernel tests' bound (tests/kernels_pallas/kernel_cases.py): |y - x @ W| <= eps(x) |x @ W| +
    2 K 2^-24 (|x| @ |W|), W = dequantize(q) in x's dtype, products summed in f32 at full precision."""
    w = dequantize(q, x.dtype)
    hi = jax.lax.Precision.HIGHEST
    ref = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32, precision=hi))
    mag = np.asarray(jnp.dot(jnp.abs(x).astype(jnp.float32), jnp.abs(w).astype(jnp.float32), precision=hi))
    tol = float(jnp.finfo(x.dtype).eps) * np.abs(ref) + 2 * q.shape[0] * 2.0 ** -24 * mag + 1e-30
    err = np.abs(np.asarray(y, np.float32) - ref)
    assert (err <= tol).all(), f"worst err {err.max():.3g}"


@pytest.mark.parametrize("scheme,dtype,kernel", [("W4A16", jnp.bfloat16, "mosaic_qmatmul"),
                                                 ("W4A16", jnp.float32, "pallas_qmatmul")])
def test_a_traced_weight_dispatches_to_the_registered_kernel(monkeypatch, scheme, dtype, kernel):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 256)), dtype)
    model = Custom(256, 64, dtype)
    quantize_model(model, [Rule(".*", scheme)], example=x)
    q = packed_weights(model)["kernel"].q
    calls = []
    for name in ("qmatmul", "qmatmul_mgpu"):
        orig = getattr(reg, name)
        monkeypatch.setattr(reg, name, lambda *a, _n=name, _o=orig, **k: calls.append(_n) or _o(*a, **k))
    y_xla = model(x)  # CPU, not interpreting: the XLA path
    assert calls == []
    kernels_pallas.set_interpret(True)
    try:
        assert select_kernel(x.reshape(6, 256), q).name == kernel
        y = model(x)
        y_jit = nnx.jit(lambda m, v: m(v))(model, x)
    finally:
        kernels_pallas.set_interpret(False)
    assert calls == [{"mosaic_qmatmul": "qmatmul_mgpu", "pallas_qmatmul": "qmatmul"}[kernel]] * 2
    for out in (y, y_jit, y_xla):
        assert out.shape == (2, 3, 64) and out.dtype == dtype
        assert_close(out.reshape(6, 64), x.reshape(6, 256), q)
