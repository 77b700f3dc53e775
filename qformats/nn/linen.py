"""Linen layers holding packed weights: QDense, QDenseGeneral, QEinsum.

Every quantized weight is a 2-D QArray [K, N] quantized along K (axis 0), exactly as in the NNX layers: a
Dense kernel [K, N] as is, a DenseGeneral kernel [*in, *features] flattened, an Einsum kernel with its
contracted axes moved first and flattened. The forward passes are `qformats.nn.projection`'s, the same
functions the NNX layers run. Existing linen models are quantized by `qformats.nn.linen_transform.quantize_linen`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from qformats.errors import ModelError, SchemeError
from qformats.nn.projection import (check_einsum_acts, einsum_bias_shape, einsum_layout, einsum_matrix, norm_axes,
                                    packed_einsum, packed_linear, packed_linear_general)
from qformats.matching import resolve_scheme
from qformats.plan import check_fit
from qformats.quantize import quantize
from qformats.schemes import QuantScheme, SchemeSet

SchemesLike = Union[str, SchemeSet, QuantScheme]


def as_shape(v) -> Tuple[int, ...]:
    """An int or a sequence of ints (a linen `features` / `shape` field) as a tuple of ints."""
    return (int(v),) if isinstance(v, int) else tuple(int(d) for d in v)


def _where(mod: nn.Module) -> str:
    path = "/".join(mod.scope.path) if mod.scope is not None else ""
    return path or mod.name or type(mod).__name__


def _module_schemes(mod: nn.Module) -> SchemeSet:
    try:
        ss = resolve_scheme(mod.schemes)
    except SchemeError as e:
        raise ModelError(f"{type(mod).__name__} {_where(mod)}: {e}") from e
    if ss is None or ss.weights is None:
        raise ModelError(f"{type(mod).__name__} {_where(mod)}: scheme {getattr(ss, 'name', None)!r} "
                         "quantizes no weights")
    return ss


# ---- modules ----------------------------------------------------------------------------------------------
class QDense(nn.Module):
    """A linen Dense with a packed QArray `kernel` param ([in, out] quantized along in):
    y = Qa(x) @ dequantize(W) + b.

    `init` draws a float kernel with `kernel_init` and quantizes it; activations are quantized at run
    time (dynamic scales) when the scheme set has input activations (Qa = identity otherwise).
    `schemes`: a preset name, a SchemeSet, or a QuantScheme (weight-only).
    """

    features: int
    schemes: SchemesLike
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        ss = _module_schemes(self)
        k = x.shape[-1]
        check_fit(_where(self), k, ss, static_acts=False)
        kernel = self.param("kernel", lambda rng: quantize(self.kernel_init(rng, (k, self.features),
                                                                             self.param_dtype), ss.weights, 0))
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return packed_linear(x, kernel, bias, ss, dtype=self.dtype)


class QDenseGeneral(nn.Module):
    """A linen DenseGeneral with a packed QArray `kernel` param: the kernel [*in, *features] (in = the sizes
    of x's `axis`) held flattened as W [K, N] = [prod(in), prod(features)], quantized along K:

      y = (Qa(x_t.reshape(..., K)) @ dequantize(W)).reshape(..., *features) + b,

    x_t = x with the contracted `axis` moved last (in their order). Fields as `flax.linen.DenseGeneral`;
    `batch_dims` must be empty (ModelError naming the module otherwise). `init` draws the float kernel with
    `kernel_init` as DenseGeneral does (on the flat [K, N] shape) and quantizes it, so the codes equal
    `quantize(DenseGeneral(...).init(...)["kernel"].reshape(K, N))` for the same key.
    """

    features: Union[int, Sequence[int]]
    schemes: SchemesLike
    axis: Union[int, Sequence[int]] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        if tuple(self.batch_dims):
            raise ModelError(f"QDenseGeneral {_where(self)}: batch_dims {tuple(self.batch_dims)} are not supported "
                             "(a quantized weight is one [K, N] matrix)")
        ss = _module_schemes(self)
        features = as_shape(self.features)
        axes = norm_axes(self.axis, x.ndim)
        k, n = math.prod(int(x.shape[a]) for a in axes), math.prod(features)
        check_fit(_where(self), k, ss, static_acts=False)
        kernel = self.param("kernel", lambda rng: quantize(self.kernel_init(rng, (k, n), self.param_dtype),
                                                           ss.weights, 0))
        bias = None
        if self.use_bias:  # drawn flat and reshaped, as DenseGeneral does
            bias = self.param("bias", lambda rng: self.bias_init(rng, (n,), self.param_dtype).reshape(features))
        return packed_linear_general(x, kernel, bias, ss, axis=self.axis, out_shape=features, dtype=self.dtype)


class QEinsum(nn.Module):
    """A linen Einsum with a packed QArray `kernel` param: the kernel (`shape`) with its contracted axes
    moved first and flattened to W [K, N], quantized along K:

      y = einsum(einsum_str, Qa(x), W') + b,   W' = dequantize(W) reshaped and transposed back to `shape`.

    Qa quantizes along x's last axis, so a scheme with input activations needs an einsum that contracts
    x's last axis alone (ModelError naming the module otherwise); an ellipsis may stand in x and the output.
    Fields as `flax.linen.Einsum` (the equation is a field, not a call argument); `init` draws the float
    kernel with `kernel_init(rng, shape)` and quantizes it. Not exported by `qformats.nn` (whose `QEinsum`
    is the NNX layer): use `qformats.nn.linen.QEinsum`.
    """

    shape: Sequence[int]
    einsum_str: str
    schemes: SchemesLike
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        where = f"QEinsum {_where(self)}"
        shape = as_shape(self.shape)
        try:
            perm, k, last = einsum_layout(self.einsum_str, shape)
        except ModelError as e:
            raise ModelError(f"{where}: {e}") from e
        ss = _module_schemes(self)
        check_einsum_acts(where, self.einsum_str, last, ss)
        check_fit(where, k, ss, static_acts=False)

        def init(rng):
            return quantize(einsum_matrix(self.kernel_init(rng, shape, self.param_dtype), perm, k), ss.weights, 0)

        kernel = self.param("kernel", init)
        bias = None
        if self.use_bias:
            y_ndim = len(jax.eval_shape(lambda a: jnp.einsum(self.einsum_str, a, jnp.zeros(shape, a.dtype)), x).shape)
            bias = self.param("bias", self.bias_init, einsum_bias_shape(self.einsum_str, shape, y_ndim)[0],
                              self.param_dtype)
        return packed_einsum(x, kernel, bias, ss, einsum_str=self.einsum_str, kernel_shape=shape, perm=perm,
                             contracts_last=last, where=where, dtype=self.dtype)
