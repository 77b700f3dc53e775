"""qformats.grouping: group/ungroup are inverses, contract/keepdims are inverses, expand is the per-element
scale, expected_shapes is what quantize produces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats import QuantScheme, SchemeError, quantize
from qformats.grouping import (check_fit, contract, expand, expected_shapes, group, keepdims, normalize_axis,
                               transposed_shape, ungroup)

SCHEMES = {
    "tensor": QuantScheme("int8", "tensor"),
    "channel": QuantScheme("int8", "channel"),
    "group8": QuantScheme("int4", "group", group_size=8),
    "tensor_group8": QuantScheme("fp4_e2m1", "tensor_group", group_size=8, scale_format="fp8_e4m3fn"),
    "block4x8": QuantScheme("fp8_e4m3fn", "block", block=(4, 8)),
    "asym_group8": QuantScheme("int4", "group", group_size=8, symmetric=False),
}
X = jnp.arange(6 * 24, dtype=jnp.float32).reshape(6, 24)  # distinct values: every element is identifiable


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_group_ungroup_contract_keepdims_expand(name):
    scheme = SCHEMES[name]
    view, red = group(X, scheme)
    np.testing.assert_array_equal(np.asarray(ungroup(view, scheme, X.shape)), np.asarray(X))
    amax = jnp.max(view, axis=red, keepdims=True)
    stored = contract(amax, scheme)
    assert stored.shape == expected_shapes(scheme, X.shape, -1)["scale"]
    np.testing.assert_array_equal(np.asarray(keepdims(stored, scheme, X.ndim)), np.asarray(amax))
    # expand: each element gets the max of its own group, which an explicit loop computes independently
    want = np.empty(X.shape, np.float32)
    xs = np.asarray(X)
    for o in range(6):
        for k in range(24):
            if scheme.strategy == "tensor":
                want[o, k] = xs.max()
            elif scheme.strategy == "channel":
                want[o, k] = xs[o].max()
            elif scheme.strategy == "block":
                want[o, k] = xs[o // 4 * 4: o // 4 * 4 + 4, k // 8 * 8: k // 8 * 8 + 8].max()
            else:
                want[o, k] = xs[o, k // 8 * 8: k // 8 * 8 + 8].max()
    np.testing.assert_array_equal(np.asarray(expand(stored, scheme, X.shape)), want)


def test_block_padding_is_zeros_and_cropped():
    scheme = SCHEMES["block4x8"]
    x = -jnp.ones((5, 9))
    view, red = group(x, scheme)
    assert view.shape == (2, 4, 2, 8)
    assert float(jnp.max(view)) == 0.0  # the padding
    np.testing.assert_array_equal(np.asarray(ungroup(view, scheme, x.shape)), np.asarray(x))
    assert expand(contract(jnp.max(view, axis=red, keepdims=True), scheme), scheme, x.shape).shape == (5, 9)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_expected_shapes_are_what_quantize_stores(name, axis):
    scheme = SCHEMES[name]
    x = jax.random.normal(jax.random.key(0), (16, 24))
    q = quantize(x, scheme, axis)
    want = expected_shapes(scheme, x.shape, axis)
    got = {p: None if getattr(q, p) is None else tuple(getattr(q, p).shape)
           for p in ("codes", "scale", "zero_point", "global_scale")}
    assert got == want


def test_axis_and_shape_helpers():
    assert normalize_axis(-1, 3, "t") == 2 and normalize_axis(1, 3, "t") == 1
    assert transposed_shape((2, 3, 4), 1) == (2, 4, 3)
    with pytest.raises(SchemeError, match="t: axis 3 out of range"):
        normalize_axis(3, 3, "t")
    with pytest.raises(SchemeError, match="0-d"):
        normalize_axis(0, 0, "t")
    with pytest.raises(SchemeError, match="group size 8 does not divide .* length 12"):
        check_fit(SCHEMES["group8"], (4, 12), "t")
    with pytest.raises(SchemeError, match="2-D"):
        check_fit(SCHEMES["block4x8"], (2, 4, 8), "t")
