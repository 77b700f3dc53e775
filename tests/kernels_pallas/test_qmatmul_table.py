"""Table formats (IQ4_NL's 16-entry grid) and the kernels: both layouts refuse them by name (their decode is bit
arithmetic on float / int codes, no gather), `prepare` raises a KernelError, and the dispatch sends them to the XLA
path (the fused GEMV), which equals dequantize + dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import dequantize
from qformats.dispatch import qdot, select_kernel
from qformats.errors import KernelError
from qformats.formats import IQ4_NL
from qformats.packing import pack
from qformats.qarray import QArray
from qformats.schemes import QuantScheme

import kernels_pallas  # noqa: F401  (registers the kernels)
from kernels_pallas import mgpu_unsupported_reason, prepare, prepare_mgpu
from kernels_pallas.layout import unsupported_reason

EPS = float(np.finfo(np.float32).eps)


def _iq4(k=256, n=64, seed=0):
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    return QArray(pack(jnp.asarray(u), 4), jnp.asarray(s), None, None,
                  scheme=QuantScheme(IQ4_NL, "group", group_size=32, scale_format="float16"), shape=(k, n),
                  dtype=jnp.float32, axis=0, compute_dtype=jnp.float32)


def test_layouts_refuse_a_table_by_name():
    q = _iq4()
    for why in (unsupported_reason(q), mgpu_unsupported_reason(q)):
        assert "iq4_nl is a 16-entry table" in why
    for prep in (prepare, prepare_mgpu):
        with pytest.raises(KernelError, match="iq4_nl is a 16-entry table"):
            prep(q)


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_dispatch_sends_a_table_to_the_xla_path(backend):
    q = _iq4()
    assert select_kernel(None, q, backend) is None
    assert select_kernel(jnp.zeros((2, 256), jnp.bfloat16), q, backend) is None
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    y = np.asarray(jax.jit(qdot)(jnp.asarray(x), q), np.float64)
    w = np.asarray(dequantize(q), np.float64)
    bound = 2 * 256 * EPS * (np.abs(x.astype(np.float64)) @ np.abs(w))
    assert np.all(np.abs(y - x.astype(np.float64) @ w) <= bound)
