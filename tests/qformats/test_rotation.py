"""qformats.rotation: the fusing formulas against explicit block-diagonal matrices and the Linear identities they keep."""

import numpy as np
import pytest

from qformats.errors import SchemeError
from qformats.hadamard import sylvester
from qformats.rotation import center_rows, fuse_norm, random_signs, rotate_columns, rotate_rows

RNG = np.random.RandomState(0)


def blockdiag(m, size):
    return np.kron(np.eye(size // m.shape[0]), m)


@pytest.mark.parametrize("k,cols", [(8, 8), (4, 16)])
def test_rotate_columns_and_rows_are_block_diagonal_products(k, cols):
    m = random_signs(k, 0)[:, None] * sylvester(k)
    w = RNG.randn(6, cols)
    np.testing.assert_array_equal(rotate_columns(w, m), (w.reshape(6, -1, k) @ m).reshape(6, cols) / np.sqrt(k))
    np.testing.assert_allclose(rotate_columns(w, m), w @ blockdiag(m, cols) / np.sqrt(k), rtol=0, atol=1e-14)
    v = RNG.randn(cols, 5)
    np.testing.assert_allclose(rotate_rows(v, m), blockdiag(m, cols).T @ v / np.sqrt(k), rtol=0, atol=1e-14)
    b = RNG.randn(cols)
    np.testing.assert_allclose(rotate_rows(b, m), blockdiag(m, cols).T @ b / np.sqrt(k), rtol=0, atol=1e-14)


def test_a_linear_keeps_its_function_when_both_sides_are_rotated():
    """(x R) (W R)^T = x W^T on the input side; x (R^T W)^T + R^T b = (x W^T + b) R on the output side."""
    m = sylvester(16)
    r = m / 4
    x, w, b = RNG.randn(3, 16), RNG.randn(8, 16), RNG.randn(16)
    np.testing.assert_allclose((x @ r) @ rotate_columns(w, m).T, x @ w.T, rtol=0, atol=1e-12)
    w2 = RNG.randn(16, 8)
    x2 = RNG.randn(3, 8)
    np.testing.assert_allclose(x2 @ rotate_rows(w2, m).T + rotate_rows(b, m), (x2 @ w2.T + b) @ r, rtol=0, atol=1e-12)


def test_center_fuse_and_signs():
    e = RNG.randn(5, 7)
    np.testing.assert_allclose(center_rows(e).mean(-1), 0, atol=1e-15)
    np.testing.assert_array_equal(center_rows(e), e - e.mean(-1, keepdims=True))
    g = RNG.rand(7)
    np.testing.assert_array_equal(fuse_norm(e, g), e * g[None, :])
    s = random_signs(1000, 3, 1)
    assert set(np.unique(s)) == {-1.0, 1.0} and 400 < (s > 0).sum() < 600
    np.testing.assert_array_equal(s, random_signs(1000, 3, 1))
    assert not np.array_equal(s, random_signs(1000, 3, 2)) and not np.array_equal(s, random_signs(1000, 4, 1))


def test_sizes_that_do_not_divide_are_scheme_errors():
    with pytest.raises(SchemeError, match="does not divide"):
        rotate_columns(np.ones((2, 12)), sylvester(8))
    with pytest.raises(SchemeError, match="does not divide"):
        rotate_rows(np.ones((12, 2)), sylvester(8))
    with pytest.raises(SchemeError):
        rotate_columns(np.ones((2, 8)), np.ones((8, 4)))
