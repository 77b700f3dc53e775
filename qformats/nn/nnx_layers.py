"""NNX quantized layers: QLinear, QLinearGeneral, QEinsum hold a packed QArray kernel (PTQ) or a float one (QAT).

All three keep their weight as a 2-D matrix [K, N] quantized along K (`qformats.nn.projection`, whose pure
functions compute the packed forward passes, shared with linen): an nnx.Linear kernel as is, a LinearGeneral
kernel [*in_features, *out_features] flattened, an Einsum kernel with its contracted axes moved first and
flattened. This module adds what NNX needs around them: the variable types, the QAT and calibration modes.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.algorithms.weight_search import RTN, quantize_weight
from qformats.dispatch import prepare_weight
from qformats.errors import ModelError
from qformats.nn.projection import (add_bias, add_einsum_bias, check_einsum_acts, dot, einsum_apply, einsum_layout,
                                    einsum_matrix, fake_quantize_weight, on_codes, packed_einsum, packed_linear,
                                    packed_linear_general, quantize_acts, to_rows)
from qformats.observers import Observer, static_scale
from qformats.qarray import QArray
from qformats.schemes import SchemeSet

MODES = ("ptq", "qat", "calibrate")


class QuantStat(nnx.Variable):
    """Static quantization parameters computed by calibration (activation scales); not trained."""


class CalibStat(nnx.Variable):
    """Observer state accumulated while calibrating; removed when the layer is finalized."""


class PackedParam(nnx.Param):
    """A Param holding a packed QArray (integer codes: not differentiable). It is an `nnx.Param`, so
    `nnx.state(model, nnx.Param)` counts it; train the remaining float params of a packed model with
    `wrt=nnx.All(nnx.Param, nnx.Not(PackedParam))`."""


class KernelCache(nnx.Cache):
    """A packed weight repacked into a registered Pallas kernel's own layout (`qformats.dispatch.KernelWeight`):
    derived from the `kernel` param by `cache_kernel_layout` / `prepare_kernels`, not a parameter (not in
    `nnx.state(m, nnx.Param)`)."""


def _param(kernel):
    return PackedParam(kernel) if isinstance(kernel, QArray) else nnx.Param(kernel)


def _pack(kernel, schemes: SchemeSet, pack: Optional[Callable]) -> QArray:
    """The packed weight of a float [..., K, N] kernel: `pack(kernel)` when given (the caller's weight search), else
    round-to-nearest along K."""
    return quantize_weight(kernel, schemes, RTN) if pack is None else pack(kernel)


def _ste(x, y):
    """y in the forward pass, identity gradient to x (straight-through)."""
    return x + jax.lax.stop_gradient(y - x)


def _value(v):
    """The value of an optional nnx.Variable (None stays None)."""
    return None if v is None else v.get_value()


class QuantizedMatmul(nnx.Module):
    """The base of QLinear, QLinearGeneral, QEinsum: a [K, N] weight (QArray or float), bias, activation
    quantization, calibration.

    Modes:
      "ptq": `kernel` is an `nnx.Param` holding a packed `QArray` (its leaves — codes, scale, zero point,
        global scale — are the parameter state, so `nnx.state(m, nnx.Param)` holds exactly
        `QArray.nbytes` for the weight); the forward pass is `projection.packed_linear` / `packed_linear_general`
        / `packed_einsum` (`qformats.qdot`: a registered kernel or the XLA dequantize-then-dot path, or
        `qformats.scaled_dot` on the codes).
      "qat": `kernel` is a float `nnx.Param`, the forward pass uses `fake_quantize` (straight-through
        gradient inside the representable range); `convert()` packs it.
      "calibrate": float forward pass that records activation statistics (see `quantize_model`).

    Activations (`schemes.input_activations`, optional): quantized along the contracted (last) axis —
    per token / group at run time when the scheme is dynamic, else with the static `input_scale` (and
    NVFP4's `input_global_scale`) from calibration. Without calibration a static scheme falls back to a
    dynamic scale of the same granularity.
    """

    def __init__(self, kernel, bias, schemes: SchemeSet, *, mode: str = "ptq", dtype=None, path: str = "",
                 observer: Optional[Observer] = None, record_inputs: bool = True, full_moments: bool = False):
        kind = type(self).__name__
        if mode not in MODES:
            raise ModelError(f"{kind} {path or '<module>'}: mode must be one of {MODES}, got {mode!r}")
        if schemes.weights is None:
            raise ModelError(f"{kind} {path or '<module>'}: scheme set {schemes.name!r} has no weight scheme")
        if len(kernel.shape) < 2:
            raise ModelError(f"{kind} {path or '<module>'}: expected a [..., K, N] kernel, got {tuple(kernel.shape)}")
        # layers stacked for nnx.scan (else ()): a QArray made by quantize_weight keeps its per-layer shape
        # [K, N] and carries the stacking axes on its leaves only
        lead = kernel.codes.shape[:-2] if isinstance(kernel, QArray) else kernel.shape[:-2]
        self.stacked = tuple(int(d) for d in lead)
        self.schemes = schemes
        self.mode = mode
        self.dtype = dtype
        self.path = path
        self.record_inputs = record_inputs
        self.k_dim, self.n_dim = (int(d) for d in kernel.shape[-2:])
        self.kernel = _param(kernel)
        self.bias = None if bias is None else nnx.Param(bias)
        # data attributes that calibration fills in (nnx.data: they may later hold Variables)
        self.input_scale = nnx.data(None)
        self.input_global_scale = nnx.data(None)
        self.kernel_cache = nnx.data(None)  # a KernelCache when a Pallas kernel takes the packed weight
        # how the packed weight was chosen: "rtn", or the weight search when it won (in any stacked layer)
        self.weight_method = RTN
        self.observer = observer
        self.calib_amax = nnx.data(None)
        self.calib_sq = nnx.data(None)
        if mode == "calibrate":
            if observer is None:
                raise ModelError(f"{kind} {path}: calibrate mode needs an observer")
            # one state per stacked layer: nnx.scan hands each step its slice and stacks the updates back
            stack = lambda v: jnp.broadcast_to(v, self.stacked + jnp.shape(v))  # noqa: E731
            self.calib_amax = CalibStat(jax.tree.map(stack, observer.init()))
            # sum x x^T over tokens ([K, K], for the MSE search's output-error check) or only its diagonal
            k = self.k_dim
            shape = (k, k) if full_moments else (k,)
            self.calib_sq = CalibStat((jnp.zeros(self.stacked + shape, jnp.float32),
                                       jnp.zeros(self.stacked, jnp.float32)))
        self.cache_kernel_layout()

    # ---- lifecycle ----------------------------------------------------------------------------------
    @property
    def input_moments(self):
        """(moments, count) recorded while calibrating: the sum over the layer's input tokens of x x^T
        ([..., K, K], with full_moments) or of x * x ([..., K]), and the number of tokens (leading axes: stacked
        layers). What the weight searches (`qformats.algorithms.weight_search.calibrated_weight`) take."""
        if self.mode != "calibrate":
            raise ModelError(f"{self.path}: input moments are recorded in calibrate mode, mode is {self.mode!r}")
        return self.calib_sq.get_value()

    def finalize(self, mode: str = "ptq", weight: Optional[QArray] = None, weight_method: str = RTN) -> None:
        """End calibration: static activation scales from the observer, the calibration statistics dropped, and
        for `mode` "ptq" the packed `weight` (a QArray of the layer's [K, N] kernel, chosen by the caller from
        `input_moments`, e.g. by `qformats.algorithms.weight_search.calibrated_weight`; `weight_method` records
        how); "qat" keeps the float kernel. Layers stacked for `nnx.scan` take their scales layer by layer
        (vmapped over the stacking axes)."""
        if self.mode != "calibrate":
            raise ModelError(f"{self.path}: finalize() is for a calibrating layer, mode is {self.mode!r}")
        if mode == "ptq" and (not isinstance(weight, QArray) or tuple(weight.shape) != (self.k_dim, self.n_dim)):
            raise ModelError(f"{self.path}: finalize('ptq') takes the packed [{self.k_dim}, {self.n_dim}] weight "
                             f"(a QArray), got {getattr(weight, 'shape', type(weight).__name__)}")
        a = self.schemes.input_activations
        s = g = None
        if a is not None and a.dynamic is not True:
            w = self.kernel.get_value()
            sdt = w.dtype if w.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
            observer = self.observer
            fn = lambda state: static_scale(observer.result(state), a, sdt)  # noqa: E731
            for _ in self.stacked:
                fn = jax.vmap(fn)
            s, g = fn(self.calib_amax.get_value())
        self.input_scale = None if s is None else QuantStat(s)
        self.input_global_scale = None if g is None else QuantStat(g)
        self.calib_amax = None
        self.calib_sq = None
        self.observer = None
        self.mode = mode
        if mode == "ptq":
            self.kernel = PackedParam(weight)
            self.weight_method = weight_method
            self.cache_kernel_layout()

    def convert(self, weight: Optional[QArray] = None) -> None:
        """QAT → PTQ in place with the packed `weight` (a QArray of the float [K, N] kernel, chosen by the caller,
        e.g. `qformats.nn.convert` by its weight search); default round-to-nearest, the same quantization the QAT
        forward pass used."""
        if self.mode == "qat":
            if weight is None:
                weight = quantize_weight(self.kernel.get_value(), self.schemes, RTN)
            self.kernel = PackedParam(weight)
            self.mode = "ptq"
            self.cache_kernel_layout()

    def set_weight(self, q: QArray) -> None:
        """Replace the packed weight (the `kernel` param, same [K, N] shape) and refresh the Pallas kernel
        layout cache."""
        if self.mode != "ptq" or not isinstance(q, QArray):
            raise ModelError(f"{self.path}: set_weight takes a QArray for a PTQ layer (mode {self.mode!r}, "
                             f"got {type(q).__name__})")
        if tuple(q.shape) != (self.k_dim, self.n_dim):
            raise ModelError(f"{self.path}: set_weight: expected a [{self.k_dim}, {self.n_dim}] weight, got {q.shape}")
        self.kernel = PackedParam(q)
        self.cache_kernel_layout()

    def cache_kernel_layout(self, backend: Optional[str] = None) -> bool:
        """Cache the packed weight in the layout of the Pallas kernel `qdot` picks on `backend` (default: jax's),
        once (`kernel_cache`: a KernelCache of a `qformats.dispatch.KernelWeight`, or None).

        Returns whether a layout is cached now. Cleared (the XLA path, or a kernel that repacks per call)
        when no registered, enabled kernel takes this weight there, or for layers stacked for `nnx.scan`
        (their cache would have to be split the way the scan splits params). Call again after replacing
        the weight's values by other means than this module (e.g. `nnx.update` with params only): the cache
        is derived from the codes and is not refreshed on its own.
        """
        p = None
        k = self.kernel.get_value()
        if self.mode == "ptq" and not self.stacked and isinstance(k, QArray) and not on_codes(k, self.schemes):
            p = prepare_weight(k, backend)
        self.kernel_cache = None if p is None else KernelCache(p)
        return p is not None

    # ---- forward pieces -----------------------------------------------------------------------------
    def _quantize_input(self, x):
        """x [..., K] → the activations the matmul sees (and calibration statistics while calibrating)."""
        if self.dtype is not None:
            x = x.astype(self.dtype)
        a = self.schemes.input_activations
        if self.mode == "calibrate":
            if self.record_inputs:  # sum x x^T over tokens: H for the MSE search and its output-error check
                total, n = self.calib_sq.get_value()
                xf = x.astype(jnp.float32).reshape(-1, x.shape[-1])
                moments = xf.T @ xf if total.ndim == 2 else jnp.sum(xf * xf, axis=0)
                self.calib_sq.set_value((total + moments, n + xf.shape[0]))
                if a is not None:
                    self.calib_amax.set_value(self.observer.update(self.calib_amax.get_value(), x))
            return x
        if a is None:
            return x
        y = quantize_acts(x, a, _value(self.input_scale), _value(self.input_global_scale))
        return _ste(x, y) if self.mode == "qat" else y

    def _packed(self) -> dict:
        """The keyword arguments of the `projection.packed_*` forward passes (PTQ mode)."""
        return dict(dtype=self.dtype, input_scale=_value(self.input_scale),
                    input_global_scale=_value(self.input_global_scale))

    def _float_project(self, x):
        """x [..., K] → Qa(x) @ W [..., N] for a float kernel (QAT: fake-quantized, calibration: float)."""
        x = self._quantize_input(x)
        k = self.kernel.get_value()
        if self.mode == "qat":
            return dot(x, fake_quantize_weight(k, self.schemes).astype(x.dtype))
        return dot(x, k.astype(x.dtype))

    def _dense_weight(self, dtype):
        """W [K, N] as the QAT / calibration forward pass sees it (fake-quantized / float)."""
        k = self.kernel.get_value()
        if self.mode == "qat":
            return fake_quantize_weight(k, self.schemes).astype(dtype)
        return k.astype(dtype)

    def _add_bias(self, y):
        return add_bias(y, _value(self.bias))

    @property
    def weight_nbytes(self) -> int:
        k = self.kernel.get_value()
        return k.nbytes if isinstance(k, QArray) else int(k.size * k.dtype.itemsize)


class QLinear(QuantizedMatmul):
    """A quantized `nnx.Linear`: y = Qa(x) @ W + b, W `[in, out]` quantized along `in`."""

    @property
    def in_features(self) -> int:
        return self.k_dim

    @property
    def out_features(self) -> int:
        return self.n_dim

    @classmethod
    def from_module(cls, linear: nnx.Linear, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    pack: Optional[Callable] = None, observer: Optional[Observer] = None,
                    full_moments: bool = False) -> "QLinear":
        """The quantized counterpart of `linear` (which is left untouched). In "ptq" mode the [K, N] kernel is
        packed by `pack(kernel) -> QArray` (the caller's weight search; default round-to-nearest)."""
        kernel = linear.kernel.get_value()
        bias = None if linear.bias is None else linear.bias.get_value()
        if mode == "ptq":
            kernel = _pack(kernel, schemes, pack)
        return cls(kernel, bias, schemes, mode=mode, dtype=linear.dtype, path=path, observer=observer,
                   full_moments=full_moments)

    def __call__(self, x):
        if self.mode == "ptq":
            return packed_linear(x, self.kernel.get_value(), _value(self.bias), self.schemes,
                                 kernel_weight=_value(self.kernel_cache), **self._packed())
        return self._add_bias(self._float_project(x))


class QLinearGeneral(QuantizedMatmul):
    """A quantized `nnx.LinearGeneral` (no batch_axis): contracts `axis` of x with a kernel
    `[*in_features, *out_features]` stored flattened as [prod(in), prod(out)]."""

    def __init__(self, kernel, bias, schemes, *, in_features, out_features, axis, **kw):
        self.in_shape = tuple(int(d) for d in in_features)
        self.out_shape = tuple(int(d) for d in out_features)
        self.axis = (axis,) if isinstance(axis, int) else tuple(axis)
        super().__init__(kernel, bias, schemes, **kw)

    @classmethod
    def from_module(cls, lg: nnx.LinearGeneral, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    pack: Optional[Callable] = None, observer: Optional[Observer] = None,
                    full_moments: bool = False):
        if lg.batch_axis:
            raise ModelError(f"{path}: LinearGeneral with batch_axis {dict(lg.batch_axis)} is not supported")
        kernel = lg.kernel.get_value()
        if kernel.ndim != len(lg.in_features) + len(lg.out_features):
            raise ModelError(f"{path}: stacked (scanned) LinearGeneral kernels are not supported")
        k, n = math.prod(lg.in_features), math.prod(lg.out_features)
        kernel = kernel.reshape(k, n)
        bias = None if lg.bias is None else lg.bias.get_value()
        if mode == "ptq":
            kernel = _pack(kernel, schemes, pack)
        return cls(kernel, bias, schemes, in_features=lg.in_features, out_features=lg.out_features, axis=lg.axis,
                   mode=mode, dtype=lg.dtype, path=path, observer=observer, full_moments=full_moments)

    def __call__(self, x):
        if self.mode == "ptq":
            return packed_linear_general(x, self.kernel.get_value(), _value(self.bias), self.schemes, axis=self.axis,
                                         out_shape=self.out_shape, kernel_weight=_value(self.kernel_cache),
                                         **self._packed())
        xr, lead = to_rows(x, self.axis)
        return self._add_bias(self._float_project(xr).reshape(lead + self.out_shape))


class QEinsum(QuantizedMatmul):
    """A quantized `nnx.Einsum`: the kernel's contracted axes moved first and flattened to W [K, N]
    (`projection.einsum_layout`):

      y = einsum(einsum_str, Qa(x), W') + b,   W' = W (dequantized / fake-quantized) back in the kernel's layout,

    b broadcast as `nnx.Einsum` does. Activations can be quantized (and calibrated) when the contraction is
    over x's last axis alone (ModelError naming the path otherwise); an ellipsis may stand in x and the output.
    """

    def __init__(self, kernel, bias, schemes, *, einsum_str, kernel_shape, **kw):
        self.einsum_str = einsum_str
        self.kernel_shape = tuple(int(d) for d in kernel_shape)
        self.perm, _, self.contracts_last = einsum_layout(einsum_str, kernel_shape)
        check_einsum_acts(f"QEinsum {kw.get('path') or '<module>'}", einsum_str, self.contracts_last, schemes)
        super().__init__(kernel, bias, schemes, record_inputs=self.contracts_last, **kw)

    @classmethod
    def from_module(cls, e: nnx.Einsum, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    pack: Optional[Callable] = None, observer: Optional[Observer] = None,
                    full_moments: bool = False):
        kernel = e.kernel.get_value()
        perm, k, _ = einsum_layout(e.einsum_str, kernel.shape)
        kernel = einsum_matrix(kernel, perm, k)
        bias = None if e.bias is None else e.bias.get_value()
        if mode == "ptq":
            kernel = _pack(kernel, schemes, pack)
        return cls(kernel, bias, schemes, einsum_str=e.einsum_str, kernel_shape=e.kernel_shape,
                   mode=mode, dtype=e.dtype, path=path, observer=observer, full_moments=full_moments)

    def __call__(self, x):
        if self.mode == "ptq":
            return packed_einsum(x, self.kernel.get_value(), _value(self.bias), self.schemes,
                                 einsum_str=self.einsum_str, kernel_shape=self.kernel_shape, perm=self.perm,
                                 contracts_last=self.contracts_last, where=self.path, **self._packed())
        if self.contracts_last:
            x = self._quantize_input(x)
        elif self.dtype is not None:
            x = x.astype(self.dtype)
        y = einsum_apply(self.einsum_str, x, self._dense_weight(x.dtype), self.kernel_shape, self.perm)
        return add_einsum_bias(y, _value(self.bias), self.einsum_str, self.kernel_shape)


QUANTIZED = {nnx.Linear: QLinear, nnx.LinearGeneral: QLinearGeneral, nnx.Einsum: QEinsum}
