"""NNX quantized layers: QLinear holds a packed QArray kernel (PTQ) or a float kernel with fake quantization (QAT)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.dispatch import qdot
from qformats.errors import ModelError
from qformats.observers import Observer, mse_quantize, static_scale
from qformats.qarray import QArray
from qformats.quantize import dequantize, fake_quantize, quantize
from qformats.schemes import SchemeSet

MODES = ("ptq", "qat", "calibrate")


class QuantStat(nnx.Variable):
    """Static quantization parameters computed by calibration (activation scales); not trained."""


class CalibStat(nnx.Variable):
    """Observer state accumulated while calibrating; removed when the layer is finalized."""


def _ste(x, y):
    """y in the forward pass, identity gradient to x (straight-through)."""
    return x + jax.lax.stop_gradient(y - x)


def _dot(x, w):
    # The same contraction and accumulation as qformats.dispatch.xla_qdot, so a QAT layer and the
    # packed layer convert() makes from it give bit-identical outputs on the XLA path.
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


class QLinear(nnx.Module):
    """A quantized `nnx.Linear`: y = Qa(x) @ W + b, W `[in, out]` quantized along `in` (axis 0).

    Modes:
      "ptq": `kernel` is an `nnx.Param` holding a packed `QArray` (its leaves — codes, scale, zero point,
        global scale — are the parameter state, so `nnx.state(m, nnx.Param)` holds exactly
        `QArray.nbytes` for the weight); the matmul is `qformats.qdot` (a registered kernel or the XLA
        dequantize-then-dot path).
      "qat": `kernel` is a float `nnx.Param`, the forward pass uses `fake_quantize` (straight-through
        gradient inside the representable range); `convert()` packs it.
      "calibrate": float forward pass that records activation statistics (see `quantize_model`).

    Activations (`schemes.input_activations`, optional): quantized along the last axis before the
    matmul — per token / group at run time when the scheme is dynamic, else with the static
    `input_scale` (and NVFP4's `input_global_scale`) from calibration. Without calibration a static
    scheme falls back to a dynamic scale of the same granularity.
    """

    def __init__(self, kernel, bias, schemes: SchemeSet, *, mode: str = "ptq", dtype=None,
                 path: str = "", observer: Optional[Observer] = None):
        if mode not in MODES:
            raise ModelError(f"QLinear {path or '<module>'}: mode must be one of {MODES}, got {mode!r}")
        if schemes.weights is None:
            raise ModelError(f"QLinear {path or '<module>'}: scheme set {schemes.name!r} has no weight scheme")
        self.schemes = schemes
        self.mode = mode
        self.dtype = dtype
        self.path = path
        self.in_features, self.out_features = (int(d) for d in kernel.shape)
        self.kernel = nnx.Param(kernel)
        self.bias = None if bias is None else nnx.Param(bias)
        # data attributes that calibration fills in (nnx.data: they may later hold Variables)
        self.input_scale = nnx.data(None)
        self.input_global_scale = nnx.data(None)
        self.observer = observer
        self.calib_amax = nnx.data(None)
        self.calib_sq = nnx.data(None)
        if mode == "calibrate":
            self._start_calibration(observer)

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nnx.Linear, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    weight_search: Optional[str] = None, observer: Optional[Observer] = None) -> "QLinear":
        """The quantized counterpart of `linear` (which is left untouched)."""
        kernel = linear.kernel.get_value()
        bias = None if linear.bias is None else linear.bias.get_value()
        if mode == "ptq":
            kernel = quantize_weight(kernel, schemes, weight_search)
        return cls(kernel, bias, schemes, mode=mode, dtype=linear.dtype, path=path, observer=observer)

    def _start_calibration(self, observer):
        if observer is None:
            raise ModelError(f"QLinear {self.path}: calibrate mode needs an observer")
        self.calib_amax = CalibStat(observer.init())
        k = self.in_features
        self.calib_sq = CalibStat((jnp.zeros((k, k), jnp.float32), jnp.zeros((), jnp.float32)))

    def finalize(self, mode: str = "ptq", weight_search: Optional[str] = None) -> None:
        """End calibration: static activation scales from the observer, then the kernel for `mode`.

        With weight_search="mse" the per-group clipping search weights errors by E[x_k^2] measured on
        the calibration batches, and the result is kept only if the layer's output error on them,
        tr(dW^T H dW) with H = E[x x^T], is below round-to-nearest's (else RTN is kept).
        """
        if self.mode != "calibrate":
            raise ModelError(f"QLinear {self.path}: finalize() is for a calibrating layer, mode is {self.mode!r}")
        a = self.schemes.input_activations
        kdt = self.kernel.get_value().dtype
        if a is not None and a.dynamic is not True:
            amax = self.observer.result(self.calib_amax.get_value())
            s, g = static_scale(amax, a, jnp.float32 if kdt not in (jnp.bfloat16, jnp.float16) else kdt)
            self.input_scale = None if s is None else QuantStat(s)
            self.input_global_scale = None if g is None else QuantStat(g)
        total, n = self.calib_sq.get_value()
        h = total / jnp.maximum(n, 1.0)
        self.calib_amax = None
        self.calib_sq = None
        self.mode = mode
        if mode == "ptq":
            w = self.kernel.get_value()
            q = quantize_weight(w, self.schemes, weight_search, importance=jnp.diagonal(h))
            if weight_search is not None:
                rtn = quantize_weight(w, self.schemes, None)
                if output_error(rtn, w, h) <= output_error(q, w, h):
                    q = rtn
            self.kernel = nnx.Param(q)

    def convert(self, weight_search: Optional[str] = None) -> None:
        """QAT → PTQ in place: pack the float kernel (same quantization the QAT forward pass used)."""
        if self.mode == "qat":
            self.kernel = nnx.Param(quantize_weight(self.kernel.get_value(), self.schemes, weight_search))
            self.mode = "ptq"

    # ---- forward ------------------------------------------------------------------------------------
    def _activations(self, x):
        a = self.schemes.input_activations
        if a is None:
            return x
        if self.mode == "calibrate":
            self.calib_amax.set_value(self.observer.update(self.calib_amax.get_value(), x))
            return x
        scale = None if self.input_scale is None else self.input_scale.get_value()
        g = None if self.input_global_scale is None else self.input_global_scale.get_value()
        y = dequantize(quantize(x, a, -1, scale=scale, global_scale=g))
        return _ste(x, y) if self.mode == "qat" else y

    def __call__(self, x):
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if self.mode == "calibrate":  # sum x x^T over tokens: H for the MSE search and its output-error check
            total, n = self.calib_sq.get_value()
            xf = x.astype(jnp.float32).reshape(-1, x.shape[-1])
            self.calib_sq.set_value((total + xf.T @ xf, n + xf.shape[0]))
        x = self._activations(x)
        k = self.kernel.get_value()
        if self.mode == "ptq":
            y = qdot(x, k)
        elif self.mode == "qat":
            y = _dot(x, fake_quantize(k, self.schemes.weights, 0).astype(x.dtype))
        else:
            y = _dot(x, k.astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias.get_value().astype(y.dtype)
        return y

    @property
    def weight_nbytes(self) -> int:
        k = self.kernel.get_value()
        return k.nbytes if isinstance(k, QArray) else int(k.size * k.dtype.itemsize)


def quantize_weight(kernel, schemes: SchemeSet, weight_search: Optional[str] = None, importance=None) -> QArray:
    """A Flax kernel `[in, out]` → QArray along axis 0: round-to-nearest, or the MSE clipping search."""
    if weight_search is None:
        return quantize(kernel, schemes.weights, 0)
    if weight_search == "mse":
        return mse_quantize(kernel, schemes.weights, 0, importance=importance)
    raise ModelError(f"weight_search must be None or 'mse', got {weight_search!r}")


def output_error(q: QArray, w, h) -> float:
    """tr(dW^T H dW), dW = dequantize(q) - w: the mean squared output error of x @ W for E[x x^T] = H."""
    d = dequantize(q, jnp.float32) - w.astype(jnp.float32)
    return float(jnp.sum(d * (h @ d)))
