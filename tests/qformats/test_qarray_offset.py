"""QArray's additive offset (x = (v - z) s + o): dequantize, the fused GEMV, kernels, sharding and writers honour it
or refuse it; an array without one is unchanged (same pytree, same values)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from qformats import dequantize, quantize
from qformats import dispatch
from qformats.errors import SchemeError
from qformats.packed_dot import packed_dot
from qformats.qarray import QArray
from qformats.schemes import QuantScheme
from qformats.sharding import qarray_specs


def _with_offset(k=64, n=8, g=32, seed=0, fmt="uint4"):
    """A uint4 group-32 QArray with random float32 scales and offsets; and its reference in float32 numpy,
    w[n, k] = q s + o computed the same way (the product exact: s of 11 significant bits, q of 4)."""
    rng = np.random.default_rng(seed)
    base = quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)),
                    QuantScheme(fmt, "group", group_size=g, scale_format="float32"), axis=0)
    s = rng.standard_normal((n, k // g)).astype(np.float16).astype(np.float32)
    o = rng.standard_normal((n, k // g)).astype(np.float32)
    q = QArray(base.codes, jnp.asarray(s), None, None, scheme=base.scheme, shape=base.shape, dtype=base.dtype,
               axis=0, offset=jnp.asarray(o))
    v = np.asarray(q.element_values()).reshape(n, k // g, g)
    ref = (v * s[..., None] + o[..., None]).reshape(n, k).T
    return q, ref


def test_without_offset_the_pytree_is_unchanged():
    q = quantize(jnp.ones((64, 8)), QuantScheme("int4", "group", group_size=32), axis=0)
    children, _ = q.tree_flatten()
    assert len(children) == 4 and q.offset is None
    assert len(jax.tree_util.tree_leaves(q)) == 2  # codes, scale


def test_offset_is_a_leaf_and_survives_jit():
    q, ref = _with_offset()
    assert len(jax.tree_util.tree_leaves(q)) == 3
    q2 = jax.jit(lambda a: a)(q)
    assert q2.offset is not None
    np.testing.assert_array_equal(np.asarray(dequantize(q2)), ref)
    assert q.nbytes == 8 * 32 + 2 * 8 * 2 * 4


def test_dequantize_adds_the_offset_after_the_product():
    q, ref = _with_offset()
    out = np.asarray(dequantize(q))
    np.testing.assert_array_equal(out.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_check_refuses_a_misshapen_offset():
    q, _ = _with_offset()
    bad = QArray(q.codes, q.scale, None, None, scheme=q.scheme, shape=q.shape, dtype=q.dtype, axis=0,
                 offset=q.offset[:, :1])
    with pytest.raises(SchemeError, match="offset expected the scale's shape"):
        bad.check()


def test_packed_dot_and_qdot_honour_the_offset():
    q, ref = _with_offset(k=256, n=16)
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ ref.astype(np.float64)
    bound = 2 * 256 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(ref))
    for f in (packed_dot, dispatch.qdot):
        y = np.asarray(jax.jit(f)(jnp.asarray(x), q), np.float64)
        assert np.all(np.abs(y - exact) <= bound)
    y3 = np.asarray(dispatch.qdot(jnp.asarray(np.tile(x, (3, 1))), q), np.float64)  # dequantize-then-dot path
    assert np.all(np.abs(y3 - exact) <= bound)


def test_no_kernel_is_given_an_offset():
    dispatch.register_kernel("takes-all", lambda x, q, b: True, lambda x, q, p: None, priority=100)
    try:
        q, _ = _with_offset()
        assert dispatch.select_kernel(None, q, "cpu") is None
        plain = quantize(jnp.ones((64, 8)), QuantScheme("int4", "group", group_size=32), axis=0)
        assert dispatch.select_kernel(None, plain, "cpu").name == "takes-all"
    finally:
        dispatch._REGISTRY[:] = [e for e in dispatch._REGISTRY if e.name != "takes-all"]


def test_sharding_specs_lay_out_the_offset_like_the_scale():
    q, _ = _with_offset()
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    specs = qarray_specs(q, PartitionSpec(None, "tp"), mesh)
    assert specs.offset == specs.scale == PartitionSpec("tp", None)


def test_compressed_tensors_writer_refuses_an_offset():
    from converters.formats.compressed_tensors.write import qarray_to_tensors
    from qformats.errors import CheckpointError

    q, _ = _with_offset()
    with pytest.raises(CheckpointError, match="layer.weight: .*additive float offset"):
        qarray_to_tensors(q, "pack-quantized", "layer.weight")
