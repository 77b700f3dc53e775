"""qformats.hadamard against compressed-tensors' deterministic_hadamard_matrix / random_hadamard_matrix and its
stored Hadamard matrices (transform/utils/hadamards.safetensors)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.transform.utils.hadamard import (_fetch_hadamard_divisor,  # noqa: E402
                                                         deterministic_hadamard_matrix, random_hadamard_matrix)

from qformats.errors import SchemeError  # noqa: E402
from qformats.hadamard import (  # noqa: E402
    base_order, hadamard_apply, hadamard_matrix, random_hadamard_signs, reduce_base, sylvester
)

KNOWN = [1, 2] + list(range(4, 257, 4))  # the orders compressed-tensors 0.20 stores


def ct_base(n):
    return _fetch_hadamard_divisor(n, torch.float64).numpy()


@pytest.mark.parametrize("n", [1, 2, 4, 32, 256, 1024])
def test_sylvester_equals_deterministic_hadamard_matrix(n):
    h = sylvester(n)
    np.testing.assert_array_equal(h, deterministic_hadamard_matrix(n, torch.float64).numpy())
    np.testing.assert_array_equal(hadamard_matrix(n), h)  # the butterflies alone give H_n


@pytest.mark.parametrize("n", [12, 64, 192, 576, 768])
def test_random_hadamard_matrix_is_signs_times_butterflies(n):
    """random_hadamard_matrix(n) == diag(s) @ Had_n(base) exactly, Had_n from the stored base of the order
    base_order picks (576 = 4 * 144 -> 144)."""
    base = ct_base(n)
    assert base.shape[0] == base_order(n, KNOWN)
    if n == 576:
        assert base.shape[0] == 144
    r = random_hadamard_matrix(n, torch.float64, gen=torch.Generator().manual_seed(n)).numpy()
    s = random_hadamard_signs(r, base)
    assert s is not None and set(np.unique(s)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(s[:, None] * hadamard_matrix(n, base), r)
    # a stored power-of-two base equal to Sylvester's reduces to butterflies only
    red = reduce_base(base)
    np.testing.assert_array_equal(hadamard_matrix(n, red), hadamard_matrix(n, base))
    assert (red is None) == (n in (64,))
    assert random_hadamard_signs(r[::-1], base) is None  # not of the form diag(s) @ Had_n


@pytest.mark.parametrize("n", [64, 576])
def test_fast_transform_equals_dense_product(n):
    """Integer inputs: every partial sum is an integer below 2^24, so float32 is exact. Random normal inputs:
    float32 against the float64 product, stated tolerance 2e-6 * sqrt(n) * max|x| (measured 6e-7 relative)."""
    base = reduce_base(ct_base(n))
    had = hadamard_matrix(n, base)
    rs = np.random.RandomState(0)
    xi = rs.randint(-8, 9, (3, 5, n)).astype(np.float32)
    got = np.asarray(jax.jit(hadamard_apply, static_argnums=())(jnp.asarray(xi), base))
    np.testing.assert_array_equal(got, xi.astype(np.float64) @ had)
    x = rs.standard_normal((4, n)).astype(np.float32)
    got = np.asarray(hadamard_apply(jnp.asarray(x), base), np.float64) / np.sqrt(n)
    want = x.astype(np.float64) @ had / np.sqrt(n)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(n) * np.abs(x).max())
    np.testing.assert_allclose(had @ had.T, n * np.eye(n))  # a Hadamard matrix


def test_errors():
    with pytest.raises(SchemeError, match="power-of-two order, found 12"):
        sylvester(12)
    with pytest.raises(SchemeError, match="not 2\\^k times the base order 12"):
        hadamard_apply(jnp.ones((2, 40)), np.ones((12, 12)))
    with pytest.raises(SchemeError, match="no known Hadamard matrix"):
        base_order(7 * 512, KNOWN[:3])
