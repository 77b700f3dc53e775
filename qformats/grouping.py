"""Scale-group algebra: the reduction axis, the grouped view of an array, and contracted/expanded scale shapes.

Every quantized array is handled with its reduction (contraction) axis moved last: a logical shape `shape`
quantized along `axis` has the transposed shape `tshape = shape[:axis] + shape[axis+1:] + (K,)`,
K = shape[axis]. A scheme's strategy then cuts `tshape` into scale groups:

  strategy              grouped view of x[..., K]          reduced axes   stored (contracted) scale
  tensor                x                                  all            [1]
  channel, token        x                                  last           tshape[:-1] + (1,)
  group, tensor_group   x.reshape(..., K / g, g)           last           tshape[:-1] + (K / g,)
  block (2-D, [O, K])   pad(x).reshape(O'/bh, bh, K'/bw, bw)  1 and 3      [ceil(O / bh), ceil(K / bw)]

(O' and K' are O and K rounded up to whole blocks; the padding is zeros, as compressed-tensors pads.) A scale
computed with `keepdims=True` over the reduced axes broadcasts against the grouped view; `contract` drops its
broadcast axes to the stored shape, `keepdims` restores them, and `expand` broadcasts a stored scale to
`tshape` element by element (a derived view, never stored).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from qformats.errors import SchemeError
from qformats.schemes import QuantScheme

__all__ = ["normalize_axis", "transposed_shape", "check_fit", "group", "ungroup", "contract", "keepdims",
           "expand", "expected_shapes"]


def normalize_axis(axis: int, ndim: int, where: str) -> int:
    """The reduction axis as a non-negative index: axis mod ndim, for -ndim <= axis < ndim.

    Raises SchemeError (prefixed with `where`) for a 0-d array or an axis out of range.
    """
    if ndim == 0:
        raise SchemeError(f"{where}: cannot quantize a 0-d array (no reduction axis)")
    if not -ndim <= axis < ndim:
        raise SchemeError(f"{where}: axis {axis} out of range for an array of {ndim} dims")
    return axis % ndim


def transposed_shape(shape: Sequence[int], axis: int) -> Tuple[int, ...]:
    """tshape = shape[:axis] + shape[axis+1:] + (shape[axis],): the shape with the reduction axis moved last
    (`axis` already normalised)."""
    s = [int(d) for d in shape]
    k = s.pop(axis)
    return tuple(s) + (k,)


def check_fit(scheme: QuantScheme, tshape: Sequence[int], where: str) -> None:
    """Raise SchemeError unless the scheme's groups tile `tshape`: g divides K for group / tensor_group, and
    block needs a 2-D tensor (partial blocks at the edges are allowed: they are zero-padded)."""
    k = tshape[-1]
    if scheme.strategy in ("group", "tensor_group") and k % scheme.group_size:
        raise SchemeError(f"{where}: {scheme.strategy} size {scheme.group_size} does not divide the reduction "
                          f"axis of length {k} (logical shape with that axis last: {tuple(tshape)})")
    if scheme.strategy == "block" and len(tshape) != 2:
        raise SchemeError(f"{where}: block strategy needs a 2-D tensor, got shape {tuple(tshape)}")


def group(xt: jax.Array, scheme: QuantScheme) -> Tuple[jax.Array, Tuple[int, ...]]:
    """(view, reduce_axes): `xt` (reduction axis last) reshaped so each scale group is the set of elements
    that share all non-reduced indices of `view` (see the module table).

    A scale of the group is `f(view, axis=reduce_axes, keepdims=True)`, e.g. amax_G = max |view| over
    reduce_axes; block tensors are zero-padded to whole blocks first.
    """
    st = scheme.strategy
    if st == "tensor":
        return xt, tuple(range(xt.ndim))
    if st in ("channel", "token"):
        return xt, (xt.ndim - 1,)
    if st in ("group", "tensor_group"):
        g = scheme.group_size
        return xt.reshape(xt.shape[:-1] + (xt.shape[-1] // g, g)), (xt.ndim,)
    bh, bw = scheme.block
    o, k = xt.shape
    po, pk = -o % bh, -k % bw
    if po or pk:  # compressed-tensors pads blocks with zeros (maybe_pad_tensor_for_block_quant)
        xt = jnp.pad(xt, ((0, po), (0, pk)))
    return xt.reshape((o + po) // bh, bh, (k + pk) // bw, bw), (1, 3)


def ungroup(v: jax.Array, scheme: QuantScheme, tshape: Sequence[int]) -> jax.Array:
    """Inverse of `group`: the grouped view back to `tshape` (block padding cropped):
    ungroup(group(xt)[0], scheme, xt.shape) == xt."""
    if scheme.strategy == "block":
        ob, bh, kb, bw = v.shape
        return v.reshape(ob * bh, kb * bw)[: tshape[0], : tshape[1]]
    return v.reshape(tuple(tshape))


def contract(s: jax.Array, scheme: QuantScheme) -> jax.Array:
    """A keepdims per-group array (scale, zero point, per-group error) reshaped to its stored, contracted
    shape: tensor [1]; channel/token unchanged (..., 1); group/tensor_group (..., K / g); block [O/bh, K/bw]."""
    st = scheme.strategy
    if st == "tensor":
        return s.reshape(1)
    if st in ("group", "tensor_group"):
        return s.reshape(s.shape[:-1])
    if st == "block":
        return s.reshape(s.shape[0], s.shape[2])
    return s


def keepdims(s: jax.Array, scheme: QuantScheme, ndim: int) -> jax.Array:
    """Inverse of `contract`: a stored per-group array reshaped to broadcast against the grouped view.

    `ndim` (the rank of `tshape`) matters only for "tensor": the scalar scale becomes shape (1,) * ndim.
    keepdims(contract(s)) == s for any s of the keepdims shape.
    """
    st = scheme.strategy
    if st == "tensor":
        return s.reshape((1,) * ndim)
    if st in ("group", "tensor_group"):
        return s[..., None]
    if st == "block":
        return s[:, None, :, None]
    return s


def expand(s: jax.Array, scheme: QuantScheme, tshape: Sequence[int]) -> jax.Array:
    """A stored per-group array broadcast to one value per element of `tshape`:

      out[..., k] = s[...]                  (tensor: s[0]; channel/token: s[..., 0])
      out[..., k] = s[..., k // g]          (group, tensor_group)
      out[o, k]   = s[o // bh, k // bw]     (block)

    A derived view (for inspection, straight-through masks and per-element arithmetic), never stored.
    """
    tshape = tuple(tshape)
    if scheme.strategy == "block":
        bh, bw = scheme.block
        full = jnp.repeat(jnp.repeat(s, bh, axis=0), bw, axis=1)
        return full[: tshape[0], : tshape[1]]
    sk = keepdims(s, scheme, len(tshape))
    if scheme.strategy in ("group", "tensor_group"):
        return jnp.broadcast_to(sk, tshape[:-1] + (tshape[-1] // scheme.group_size,
                                                   scheme.group_size)).reshape(tshape)
    return jnp.broadcast_to(sk, tshape)


def expected_shapes(scheme: QuantScheme, shape: Sequence[int], axis: int) -> Dict[str, Optional[tuple]]:
    """Shapes of the parts of a QArray of this scheme, logical `shape` and reduction `axis`:

      codes:        tshape[:-1] + (ceil(K * bits / 8),)      (packed along the last axis)
      scale:        the contracted shape of the module table
      zero_point:   the scale's shape for asymmetric schemes, else None
      global_scale: (1,) for tensor_group, else None
    """
    axis = normalize_axis(axis, len(shape), "expected_shapes")
    ts = transposed_shape(shape, axis)
    k = ts[-1]
    codes = ts[:-1] + ((k * scheme.bits + 7) // 8,)
    st = scheme.strategy
    if st == "tensor":
        scale = (1,)
    elif st in ("channel", "token"):
        scale = ts[:-1] + (1,)
    elif st in ("group", "tensor_group"):
        scale = ts[:-1] + (k // scheme.group_size,)
    else:
        scale = (-(-ts[0] // scheme.block[0]), -(-ts[1] // scheme.block[1]))
    return {"codes": codes, "scale": scale, "zero_point": None if scheme.symmetric else scale,
            "global_scale": (1,) if st == "tensor_group" else None}
