"""qformats.algorithms.smoothquant: llm-compressor's SmoothQuant smoothing factors, and their fold into a norm and
its projections."""

import jax.numpy as jnp
import numpy as np
import pytest

from qformats.algorithms.smoothquant import check_alpha, fold_scales, smoothing_scales
from qformats.errors import ModelError


def test_scales_formula():
    r = jnp.asarray([4.0, 1.0, 0.0, 9.0])
    k1 = jnp.asarray([[1.0, -2.0], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    k2 = jnp.asarray([[-3.0], [0.25], [0.0], [0.0]])
    s = np.asarray(smoothing_scales(r, [k1, k2], 0.5))
    # w = 2 * [3, .5, 0, 0]; s = r^.5 / w^.5, r where w == 0, at least 1e-5
    np.testing.assert_allclose(s, [2 / 6 ** 0.5, 1.0, 1e-5, 9.0], rtol=1e-6)


def test_fold_scales_divides_the_norm_and_scales_the_rows():
    s = jnp.asarray([2.0, 0.5, 4.0])
    nw = jnp.asarray([1.0, 3.0, -2.0], jnp.bfloat16)
    k = jnp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2))
    w, (k2,) = fold_scales(nw, [k], s)
    assert w.dtype == jnp.bfloat16 and k2.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(w, np.float32), [0.5, 6.0, -0.5])
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k) * np.asarray(s)[:, None])
    assert check_alpha(1) == 1.0
    with pytest.raises(ModelError, match="alpha"):
        check_alpha(True)
