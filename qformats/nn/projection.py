"""The math of the quantized projections (Linear, LinearGeneral, Einsum) as pure functions of arrays.

Shared by the NNX layers (`qformats.nn.nnx_layers`) and linen (`qformats.nn.linen`, `qformats.nn.linen_transform`),
so both frameworks compute the same numbers by the same code. Every quantized weight is a 2-D matrix W [K, N]
quantized along K (axis 0; K = the contracted size — the Flax kernel layout, and compressed-tensors' [out, in]
storage once transposed): a Linear / Dense kernel as is, a LinearGeneral kernel [*in, *out] flattened, an
Einsum kernel with its contracted axes moved first and flattened (`einsum_layout`). Scales and groups
therefore run along the contraction, as the formats define them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from qformats.dispatch import KernelWeight, kernels_enabled, qdot
from qformats.errors import ModelError
from qformats.qarray import QArray
from qformats.quantize import dequantize, fake_quantize, quantize
from qformats.scaled_dot import scaled_dot, scaled_dot_supported
from qformats.schemes import QuantScheme, SchemeSet

Axes = Union[int, Sequence[int]]


# ---- activations --------------------------------------------------------------------------------------------
def quantize_acts(x, scheme: QuantScheme, scale=None, global_scale=None) -> jax.Array:
    """Qa(x) = dequantize(quantize(x, scheme, -1)) along the contracted (last) axis, with static scales when given."""
    return dequantize(quantize(x, scheme, -1, scale=scale, global_scale=global_scale))


# ---- Linear: y = Qa(x) @ W ----------------------------------------------------------------------------------
def on_codes(q: QArray, schemes: SchemeSet) -> bool:
    """Whether `packed_project` multiplies codes for this weight and scheme set (`qformats.scaled_dot`)."""
    a = schemes.input_activations
    return (a is not None and kernels_enabled() and q.offset is None  # an offset does not factor out of the codes
            and scaled_dot_supported(a, q.scheme, q.shape[0]))


def packed_project(x, q: QArray, schemes: SchemeSet, *, input_scale=None, input_global_scale=None,
                   kernel_weight: Optional[KernelWeight] = None) -> jax.Array:
    """y = Qa(x) @ dequantize(q) for x [..., K] (already in the compute dtype) and a packed [K, N] weight.

    Qa quantizes x along K by `schemes.input_activations` (dynamic, or with the static scales given) and is
    the identity for weight-only sets. Where both scales are constant along K, symmetric, both int or both
    fp8 (W8A8, FP8, FP8_DYNAMIC; `on_codes`), y = (sum_k qx qw) * sx * sw on the codes (`scaled_dot`: int8 /
    fp8 GEMM, as vLLM runs such checkpoints); otherwise `qdot(Qa(x), q, kernel_weight)` (`kernel_weight`: q in
    a registered kernel's layout, from `qformats.dispatch.prepare_weight`, or None).
    `qformats.set_kernels_enabled(False)` also turns the code path off (then everything is dequantized).
    """
    a = schemes.input_activations
    if on_codes(q, schemes):
        return scaled_dot(quantize(x, a, -1, scale=input_scale), q)
    if a is not None:
        x = quantize_acts(x, a, input_scale, input_global_scale)
    return qdot(x, q, kernel_weight)


def dot(x, w) -> jax.Array:
    """y[..., n] = sum_k x[..., k] w[k, n] for a float w [K, N], accumulated in float32, in x's dtype.

    The same contraction and accumulation as `qformats.dispatch.xla_qdot`, so a QAT layer and the packed
    layer made from it give bit-identical outputs on the XLA path."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


def fake_quantize_weight(kernel, schemes: SchemeSet) -> jax.Array:
    """W~ = fake_quantize(W, schemes.weights, 0) for a kernel [..., K, N] (leading stacked axes vmapped over):
    the QAT forward pass's weight, straight-through gradient inside the representable range."""
    fn = lambda w: fake_quantize(w, schemes.weights, 0)  # noqa: E731
    for _ in range(kernel.ndim - 2):
        fn = jax.vmap(fn)
    return fn(kernel)


# ---- LinearGeneral: the contracted axes of x moved last and flattened -------------------------------------------
def norm_axes(axes: Axes, ndim: int) -> Tuple[int, ...]:
    """`axes` (an int or a sequence, -ndim <= a < ndim) as non-negative axes of an ndim-array (a mod ndim), in
    the given order; ModelError for an axis out of range. (A layer's contracted axes; the quantization axis of
    an array is `qformats.grouping.normalize_axis`.)"""
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    bad = [a for a in axes if not -ndim <= a < ndim]
    if bad:
        raise ModelError(f"axes {axes}: {bad} out of range for an input of {ndim} dims")
    return tuple(a % ndim for a in axes)


def to_rows(x, axis: Axes) -> Tuple[jax.Array, Tuple[int, ...]]:
    """(x_r, lead): x_r [*lead, K] = x with the contracted `axis` moved last (in their order) and flattened,
    K = prod of their sizes, lead = the sizes of x's other axes. A LinearGeneral computes
    y = (x_r @ W).reshape(*lead, *out_features)."""
    axes = norm_axes(axis, x.ndim)
    rest = [d for d in range(x.ndim) if d not in axes]
    xt = jnp.transpose(x, rest + list(axes))
    lead = tuple(xt.shape[: len(rest)])
    return xt.reshape(lead + (math.prod(int(x.shape[a]) for a in axes),)), lead


def add_bias(y, bias) -> jax.Array:
    """y + b (b cast to y's dtype); y itself when bias is None."""
    return y if bias is None else y + bias.astype(y.dtype)


def packed_linear(x, q: QArray, bias, schemes: SchemeSet, *, dtype=None, input_scale=None, input_global_scale=None,
                  kernel_weight: Optional[KernelWeight] = None) -> jax.Array:
    """The packed Linear / Dense: y = Qa(x) @ dequantize(q) + b (`packed_project`), x cast to `dtype` first
    when given; bias None: no bias."""
    if dtype is not None:
        x = x.astype(dtype)
    return add_bias(packed_project(x, q, schemes, input_scale=input_scale, input_global_scale=input_global_scale,
                                   kernel_weight=kernel_weight), bias)


def packed_linear_general(x, q: QArray, bias, schemes: SchemeSet, *, axis: Axes, out_shape: Sequence[int],
                          dtype=None, input_scale=None, input_global_scale=None,
                          kernel_weight: Optional[KernelWeight] = None) -> jax.Array:
    """The packed LinearGeneral / DenseGeneral: y = (Qa(x_r) @ dequantize(q)).reshape(*lead, *out_shape) + b,
    (x_r, lead) = `to_rows(x, axis)` (x_r cast to `dtype` when given); bias None: no bias."""
    xr, lead = to_rows(x, axis)
    y = packed_linear(xr, q, None, schemes, dtype=dtype, input_scale=input_scale,
                      input_global_scale=input_global_scale, kernel_weight=kernel_weight)
    return add_bias(y.reshape(lead + tuple(out_shape)), bias)


# ---- Einsum: kernel axes contracted first, flattened to [K, N] --------------------------------------------------
def einsum_layout(einsum_str: str, kernel_shape) -> Tuple[Tuple[int, ...], int, bool]:
    """(perm, K, contracts_last) of `einsum_str` = "x,kernel->out" for a kernel of `kernel_shape`.

    W [K, N] = transpose(kernel, perm).reshape(K, N): perm puts the kernel's contracted axes (in the kernel's
    order) first, K = the product of their sizes. `contracts_last`: whether x's last axis is the only
    contraction (then activations can be quantized along it). An ellipsis may stand once in the input and once
    in the output, never in the kernel's spec (ModelError otherwise, or when the kernel shares no contracted
    axis with the input).
    """
    spec = einsum_str.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1:
        raise ModelError(f"einsum {einsum_str!r}: expected 'x,kernel->out'")
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    if "." in ks or xs.replace("...", "", 1).count(".") or out.replace("...", "", 1).count("."):
        raise ModelError(f"einsum {einsum_str!r}: an ellipsis is supported once in the input and once in the "
                         "output, not in the kernel")
    x_axes, out_axes = xs.replace("...", ""), out.replace("...", "")
    if len(ks) != len(kernel_shape):
        raise ModelError(f"einsum {einsum_str!r}: kernel spec {ks!r} does not fit kernel shape {tuple(kernel_shape)}")
    contracted = [i for i, c in enumerate(ks) if c in x_axes and c not in out_axes]
    if not contracted:
        raise ModelError(f"einsum {einsum_str!r}: the kernel shares no contracted axis with the input")
    perm = tuple(contracted + [i for i in range(len(ks)) if i not in contracted])
    k = math.prod(int(kernel_shape[i]) for i in contracted)
    contracts_last = len(contracted) == 1 and not xs.endswith("...") and xs[-1] == ks[contracted[0]]
    return perm, k, contracts_last


def einsum_last_axis_error(where: str, einsum_str: str, consequence: str) -> ModelError:
    """The ModelError for an einsum at `where` that does not contract the input's last axis alone
    (`consequence`: what therefore cannot be done)."""
    return ModelError(f"{where}: einsum {einsum_str!r} does not contract the input's last axis alone, so "
                      f"{consequence}")


def check_einsum_acts(where: str, einsum_str: str, contracts_last: bool, schemes: SchemeSet) -> None:
    """ModelError naming `where` when `schemes` quantizes activations (along x's last axis) but the einsum
    does not contract x's last axis alone."""
    if schemes.input_activations is not None and not contracts_last:
        raise einsum_last_axis_error(where, einsum_str, f"its activations cannot be quantized ({schemes.name}); "
                                     "use a weight-only scheme")


def einsum_matrix(kernel, perm: Sequence[int], k: int, lead: Tuple[int, ...] = ()) -> jax.Array:
    """kernel [*lead, *kernel_shape] → W [*lead, K, N] = transpose(kernel, perm).reshape(K, N) per layer
    (`perm`, `k` from `einsum_layout`; `lead`: axes stacked in front by scan / vmap, kept in front)."""
    nl = len(lead)
    full = tuple(range(nl)) + tuple(nl + p for p in perm)
    return jnp.transpose(kernel, full).reshape(tuple(lead) + (k, -1))


def einsum_kernel(w, kernel_shape: Sequence[int], perm: Sequence[int]) -> jax.Array:
    """W [K, N] → the kernel [*kernel_shape] it was made from (`einsum_matrix` inverted)."""
    w = w.reshape(tuple(kernel_shape[i] for i in perm))
    return jnp.transpose(w, tuple(sorted(range(len(perm)), key=lambda i: perm[i])))


def einsum_apply(einsum_str: str, x, w, kernel_shape: Sequence[int], perm: Sequence[int]) -> jax.Array:
    """y = einsum(einsum_str, x, W') for W [K, N] (already dequantized, in x's dtype), W' = `einsum_kernel(W)`;
    accumulated in float32, in x's dtype."""
    wk = einsum_kernel(w, kernel_shape, perm)
    return jnp.einsum(einsum_str, x, wk, preferred_element_type=jnp.float32).astype(x.dtype)


def einsum_bias_shape(einsum_str: str, kernel_shape: Sequence[int], y_ndim: int) -> Tuple[Tuple[int, ...],
                                                                                         Tuple[int, ...]]:
    """(bias shape, its broadcast shape against y [y_ndim dims]) as Flax's Einsum (linen and NNX) has them: the
    kernel axes kept in the output, in the output's order."""
    spec = einsum_str.replace(" ", "")
    ks, out = spec.split("->")[0].split(",")[1], spec.split("->")[1]
    cols = []
    for c in out.replace("...", "."):
        cols.extend([None] * (y_ndim - len(out) + 3) if c == "." else [c])
    bias = tuple(int(kernel_shape[ks.index(c)]) for c in cols if c is not None and c in ks)
    bcast = tuple(int(kernel_shape[ks.index(c)]) if c is not None and c in ks else 1 for c in cols)
    return bias, bcast


def add_einsum_bias(y, bias, einsum_str: str, kernel_shape: Sequence[int]) -> jax.Array:
    """y + b with b reshaped to its broadcast shape (`einsum_bias_shape`); y itself when bias is None."""
    if bias is None:
        return y
    return y + bias.reshape(einsum_bias_shape(einsum_str, kernel_shape, y.ndim)[1]).astype(y.dtype)


def packed_einsum(x, q: QArray, bias, schemes: SchemeSet, *, einsum_str: str, kernel_shape: Sequence[int],
                  perm: Sequence[int], contracts_last: bool, where: str, dtype=None, input_scale=None,
                  input_global_scale=None) -> jax.Array:
    """The packed Einsum: y = einsum(einsum_str, Qa(x), W') + b.

    x is cast to `dtype` (when given); W' = dequantize(q) [K, N] in x's dtype, reshaped and transposed back
    to `kernel_shape` (`einsum_kernel`); Qa as in `packed_project` (dequantized, along x's last axis;
    ModelError naming `where` when activations are quantized but the einsum does not contract x's last
    axis alone); b broadcast as Flax's Einsum does (`add_einsum_bias`; None: no bias).
    """
    check_einsum_acts(where, einsum_str, contracts_last, schemes)
    if dtype is not None:
        x = x.astype(dtype)
    a = schemes.input_activations
    if a is not None:
        x = quantize_acts(x, a, input_scale, input_global_scale)
    y = einsum_apply(einsum_str, x, dequantize(q, x.dtype), kernel_shape, perm)
    return add_einsum_bias(y, bias, einsum_str, kernel_shape)
