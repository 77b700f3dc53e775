"""Linen layers holding packed weights: QDense, QDenseGeneral, QEinsum (and their forward passes, shared with
`linen_transform`).

Every quantized weight is a 2-D QArray [K, N] quantized along K (axis 0), exactly as in the NNX layers
(`qformats.nn.modules`): a Dense kernel [K, N] as is, a DenseGeneral kernel [*in, *features] flattened,
an Einsum kernel with its contracted axes moved first and flattened (`modules.einsum_layout`). Existing
linen models are quantized by `qformats.nn.linen_transform.quantize_linen`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from qformats.errors import ModelError, SchemeError
from qformats.nn.modules import _norm_axes, einsum_layout, packed_project, quantize_acts
from qformats.nn.rules import check_fit, resolve_scheme
from qformats.qarray import QArray
from qformats.quantize import dequantize, quantize
from qformats.schemes import QuantScheme, SchemeSet

SchemesLike = Union[str, SchemeSet, QuantScheme]


# ---- shared pieces (the forward passes of the NNX layers, written for linen's attributes) ----------------
def _act(x, schemes: SchemeSet):
    """Qa(x): x quantized and dequantized along its last axis (dynamic scales) when the set has input
    activations, else x. Linen has no calibration: a static activation scheme gets a dynamic scale of the
    same granularity, as an uncalibrated NNX layer does."""
    a = schemes.input_activations
    return x if a is None else quantize_acts(x, a)


def _tuple(v) -> Tuple[int, ...]:
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


def _einsum_layout(einsum_str: str, kernel_shape) -> Tuple[Tuple[int, ...], int, bool]:
    """`modules.einsum_layout`, also for an ellipsis in the input / output (never in the kernel's spec):
    (perm putting the kernel's contracted axes first, K, whether x's last axis is the only contraction)."""
    spec = einsum_str.replace(" ", "")
    if "." not in spec:
        return einsum_layout(spec, kernel_shape)
    if "->" not in spec or spec.count(",") != 1:
        raise ModelError(f"einsum {einsum_str!r}: expected 'x,kernel->out'")
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    if "." in ks or xs.replace("...", "", 1).count(".") or out.replace("...", "", 1).count("."):
        raise ModelError(f"einsum {einsum_str!r}: an ellipsis is supported once in the input and once in the "
                         "output, not in the kernel")
    perm, k, last_only = einsum_layout(f"{xs.replace('...', '')},{ks}->{out.replace('...', '')}", kernel_shape)
    return perm, k, last_only and not xs.endswith("...")


def _einsum_bias_shape(einsum_str: str, kernel_shape, y_ndim: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(bias shape, its broadcast shape against y) as `flax.linen.Einsum`: the kernel axes kept in the output."""
    spec = einsum_str.replace(" ", "")
    ks, out = spec.split("->")[0].split(",")[1], spec.split("->")[1]
    cols = []
    for c in out.replace("...", "."):
        cols.extend([None] * (y_ndim - len(out) + 3) if c == "." else [c])
    bias = tuple(int(kernel_shape[ks.index(c)]) for c in cols if c is not None and c in ks)
    bcast = tuple(int(kernel_shape[ks.index(c)]) if c is not None and c in ks else 1 for c in cols)
    return bias, bcast


def _dense_general(x, kernel: QArray, bias, *, axis, features, dtype, ss: SchemeSet):
    """`QLinearGeneral.__call__`: y = Qa(x_t.reshape(..., K)) @ dequantize(W) reshaped to features, + b."""
    axes = _norm_axes(axis, x.ndim)
    rest = [d for d in range(x.ndim) if d not in axes]
    xt = jnp.transpose(x, rest + list(axes))
    lead = xt.shape[: len(rest)]
    xt = xt.reshape(lead + (int(kernel.shape[0]),))
    if dtype is not None:
        xt = xt.astype(dtype)
    y = packed_project(xt, kernel, ss).reshape(lead + tuple(features))
    return y if bias is None else y + bias.astype(y.dtype)


def _einsum(x, kernel: QArray, bias, *, einsum_str, kernel_shape, perm, contracts_last, dtype, ss: SchemeSet,
            where: str):
    """`QEinsum.__call__`: y = einsum(Qa(x), W) + b, W = dequantize(q) reshaped and transposed back."""
    if contracts_last:
        if dtype is not None:
            x = x.astype(dtype)
        x = _act(x, ss)
    else:
        if ss.input_activations is not None:
            raise ModelError(f"{where}: einsum {einsum_str!r} does not contract the input's last axis alone, so its "
                             f"activations cannot be quantized ({ss.name}); use a weight-only scheme")
        if dtype is not None:
            x = x.astype(dtype)
    w = dequantize(kernel, x.dtype)
    w = w.reshape(tuple(kernel_shape[i] for i in perm))
    w = jnp.transpose(w, tuple(sorted(range(len(perm)), key=lambda i: perm[i])))
    y = jnp.einsum(einsum_str, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if bias is None:
        return y
    return y + bias.reshape(_einsum_bias_shape(einsum_str, kernel_shape, y.ndim)[1]).astype(y.dtype)


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
        if self.dtype is not None:
            x = x.astype(self.dtype)
        y = packed_project(x, kernel, ss)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,), self.param_dtype).astype(y.dtype)
        return y


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
        features = _tuple(self.features)
        axes = _norm_axes(self.axis, x.ndim)
        k, n = math.prod(int(x.shape[a]) for a in axes), math.prod(features)
        check_fit(_where(self), k, ss, static_acts=False)
        kernel = self.param("kernel", lambda rng: quantize(self.kernel_init(rng, (k, n), self.param_dtype),
                                                           ss.weights, 0))
        bias = None
        if self.use_bias:  # drawn flat and reshaped, as DenseGeneral does
            bias = self.param("bias", lambda rng: self.bias_init(rng, (n,), self.param_dtype).reshape(features))
        return _dense_general(x, kernel, bias, axis=self.axis, features=features, dtype=self.dtype, ss=ss)


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
        shape = _tuple(self.shape)
        try:
            perm, k, last = _einsum_layout(self.einsum_str, shape)
        except ModelError as e:
            raise ModelError(f"{where}: {e}") from e
        ss = _module_schemes(self)
        if ss.input_activations is not None and not last:
            raise ModelError(f"{where}: einsum {self.einsum_str!r} does not contract the input's last axis alone, "
                             f"so its activations cannot be quantized ({ss.name}); use a weight-only scheme")
        check_fit(where, k, ss, static_acts=False)

        def init(rng):
            return quantize(jnp.transpose(self.kernel_init(rng, shape, self.param_dtype), perm).reshape(k, -1),
                            ss.weights, 0)

        kernel = self.param("kernel", init)
        bias = None
        if self.use_bias:
            y_ndim = len(jax.eval_shape(lambda a: jnp.einsum(self.einsum_str, a, jnp.zeros(shape, a.dtype)), x).shape)
            bias = self.param("bias", self.bias_init, _einsum_bias_shape(self.einsum_str, shape, y_ndim)[0],
                              self.param_dtype)
        return _einsum(x, kernel, bias, einsum_str=self.einsum_str, kernel_shape=shape, perm=perm,
                       contracts_last=last, dtype=self.dtype, ss=ss, where=where)
