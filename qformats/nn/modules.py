"""NNX quantized layers: QLinear, QLinearGeneral, QEinsum hold a packed QArray kernel (PTQ) or a float one (QAT).

All three keep their weight as a 2-D matrix [K, N] (K = the contracted size, quantized along axis 0 —
the Flax kernel layout, and compressed-tensors' [out, in] storage once transposed): an nnx.Linear
kernel as is, a LinearGeneral kernel [*in_features, *out_features] flattened, an Einsum kernel with its
contracted axes moved first and flattened. Scales and groups therefore run along the contraction, as
the formats define them.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.dispatch import kernels_enabled, prepare_weight, qdot
from qformats.errors import ModelError
from qformats.gptq import gptq_quantize
from qformats.observers import Observer, mse_quantize, static_scale
from qformats.qarray import QArray
from qformats.quantize import dequantize, fake_quantize, quantize
from qformats.scaled_dot import scaled_dot, scaled_dot_supported
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
    """A packed weight repacked into a registered kernel's own layout (`qformats.dispatch.Prepared`): derived
    from the `kernel` param by `prepare_kernels`, not a parameter (not in `nnx.state(m, nnx.Param)`)."""


def _param(kernel):
    return PackedParam(kernel) if isinstance(kernel, QArray) else nnx.Param(kernel)


def _ste(x, y):
    """y in the forward pass, identity gradient to x (straight-through)."""
    return x + jax.lax.stop_gradient(y - x)


def _dot(x, w):
    # The same contraction and accumulation as qformats.dispatch.xla_qdot, so a QAT layer and the
    # packed layer convert() makes from it give bit-identical outputs on the XLA path.
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


WEIGHT_SEARCHES = (None, "mse", "gptq", "mse+gptq")
NEEDS_HESSIAN = ("gptq", "mse+gptq")


def quantize_weight(kernel, schemes: SchemeSet, weight_search: Optional[str] = None, importance=None,
                    h=None, actorder: Optional[str] = "static") -> QArray:
    """A kernel `[..., K, N]` → QArray along K by `weight_search`:

      None: round-to-nearest, `quantize(w, scheme, 0)`;
      "mse": per-group clipping search minimising sum_k importance_k (w - Q(w))^2 (`observers.mse_quantize`);
      "gptq": GPTQ with H = E[x x^T] `h` [K, K] (`qformats.gptq.gptq_quantize`, llm-compressor's arithmetic),
        round-to-nearest scales, columns in `actorder` (default "static": descending diag(H), as
        llm-compressor's GPTQModifier; None: column order);
      "mse+gptq": GPTQ with the scales of the "mse" search (llm-compressor's MSE observer + GPTQ).

    Leading axes (layers stacked by `nnx.vmap` for `nnx.scan`) are vmapped over, together with those of
    `importance` / `h` when they have them: every leaf of the result has them in front and the QArray's
    static shape is the per-layer `[K, N]`, so slicing the leaves (what `nnx.scan` does) gives a valid
    per-layer QArray.
    """
    if weight_search not in WEIGHT_SEARCHES:
        raise ModelError(f"weight_search must be one of {WEIGHT_SEARCHES}, got {weight_search!r}")
    if weight_search in NEEDS_HESSIAN and h is None:
        raise ModelError(f"weight_search={weight_search!r} needs the layer inputs' second moments H = E[x x^T]: "
                         "quantize with calibration_data")
    ws = schemes.weights

    def one(w, imp, hh):
        if weight_search is None:
            return quantize(w, ws, 0)
        if weight_search == "mse":
            return mse_quantize(w, ws, 0, importance=imp)
        qp = mse_quantize(w, ws, 0, importance=imp) if weight_search == "mse+gptq" else None
        return gptq_quantize(w, ws, hh, qparams=qp, actorder=actorder)

    lead = kernel.ndim - 2
    axes = [0]
    for name, a, base in (("importance", importance, 1), ("h", h, 2)):
        if a is not None and a.ndim not in (base, base + lead):
            raise ModelError(f"quantize_weight: {name} of shape {tuple(a.shape)} does not fit a kernel of shape "
                             f"{tuple(kernel.shape)} (expected {base} or {base + lead} dims)")
        axes.append(0 if a is not None and a.ndim == base + lead and lead else None)
    fn = one
    for _ in range(lead):
        fn = jax.vmap(fn, in_axes=tuple(axes))
    return fn(kernel, importance, h)


def _fake_quantize_weight(kernel, schemes: SchemeSet):
    fn = lambda w: fake_quantize(w, schemes.weights, 0)  # noqa: E731
    for _ in range(kernel.ndim - 2):
        fn = jax.vmap(fn)
    return fn(kernel)


def _output_error(q: QArray, w, h) -> jax.Array:
    d = dequantize(q, jnp.float32) - w.astype(jnp.float32)
    return jnp.sum(d * (h @ d))


def output_error(q: QArray, w, h) -> float:
    """tr(dW^T H dW), dW = dequantize(q) - w: the mean squared output error of x @ W for E[x x^T] = H."""
    return float(_output_error(q, w, h))


def _value(v):
    """The value of an optional nnx.Variable (None stays None)."""
    return None if v is None else v.get_value()


def quantize_acts(x, scheme, scale=None, global_scale=None):
    """Qa(x) = dequantize(quantize(x, scheme, -1)) along the contracted (last) axis, with static scales when given."""
    return dequantize(quantize(x, scheme, -1, scale=scale, global_scale=global_scale))


def on_codes(q: QArray, schemes: SchemeSet) -> bool:
    """Whether `packed_project` multiplies codes for this weight and scheme set (`qformats.scaled_dot`)."""
    a = schemes.input_activations
    return a is not None and kernels_enabled() and scaled_dot_supported(a, q.scheme, q.shape[0])


def packed_project(x, q: QArray, schemes: SchemeSet, *, input_scale=None, input_global_scale=None, prepared=None):
    """y = Qa(x) @ dequantize(q) for x [..., K] (already in the compute dtype) and a packed [K, N] weight.

    Qa quantizes x along K by `schemes.input_activations` (dynamic, or with the static scales given) and is
    the identity for weight-only sets. Where both scales are constant along K, symmetric, both int or both
    fp8 (W8A8, FP8, FP8_DYNAMIC; `on_codes`), y = (sum_k qx qw) * sx * sw on the codes (`scaled_dot`: int8 /
    fp8 GEMM, as vLLM runs such checkpoints); otherwise `qdot(dequantize(Qa(x)), q, prepared)`.
    `qformats.set_kernels_enabled(False)` also turns the code path off (then everything is dequantized).
    """
    a = schemes.input_activations
    if on_codes(q, schemes):
        return scaled_dot(quantize(x, a, -1, scale=input_scale), q)
    if a is not None:
        x = quantize_acts(x, a, input_scale, input_global_scale)
    return qdot(x, q, prepared)


class _QuantizedMatmul(nnx.Module):
    """Shared state and logic: a [K, N] weight (QArray or float), bias, activation quantization, calibration.

    Modes:
      "ptq": `kernel` is an `nnx.Param` holding a packed `QArray` (its leaves — codes, scale, zero point,
        global scale — are the parameter state, so `nnx.state(m, nnx.Param)` holds exactly
        `QArray.nbytes` for the weight); the matmul is `qformats.qdot` (a registered kernel or the XLA
        dequantize-then-dot path).
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
        self.prepared = nnx.data(None)
        # how the packed weight was chosen: "rtn", or the weight search when it won (in any stacked layer)
        self.weight_method = "rtn"
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
        self.prepare_kernel()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def finalize(self, mode: str = "ptq", weight_search: Optional[str] = None,
                 actorder: Optional[str] = "static") -> None:
        """End calibration: static activation scales from the observer, then the kernel for `mode`.

        With weight_search="mse" the per-group clipping search weights errors by E[x_k^2] measured on
        the calibration batches; "gptq" / "mse+gptq" run GPTQ with H = E[x x^T] (full moments needed).
        When the layer tracked full moments the result is kept only if the layer's output error on
        the batches, tr(dW^T H dW), is below round-to-nearest's (a layer that saw no input keeps RTN).
        Layers stacked for `nnx.scan` are finalized layer by layer (vmapped over the stacking axes).
        """
        if self.mode != "calibrate":
            raise ModelError(f"{self.path}: finalize() is for a calibrating layer, mode is {self.mode!r}")
        a = self.schemes.input_activations
        static_acts = a is not None and a.dynamic is not True
        w = self.kernel.get_value()
        sdt = w.dtype if w.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
        observer, schemes = self.observer, self.schemes

        def one(w, amax_state, total, n):
            s = g = None
            if static_acts:
                s, g = static_scale(observer.result(amax_state), a, sdt)
            if mode != "ptq":
                return s, g, None, None
            seen = n > 0
            h = total / jnp.maximum(n, 1.0)
            diag = jnp.diagonal(h) if h.ndim == 2 else h
            if weight_search is None:
                return s, g, quantize_weight(w, schemes, None), None
            q = quantize_weight(w, schemes, weight_search, importance=jnp.where(seen, diag, 1.0),
                                h=h if h.ndim == 2 else None, actorder=actorder)
            if h.ndim == 2:  # keep round-to-nearest where the search does not lower tr(dW^T H dW)
                rtn = quantize_weight(w, schemes, None)
                keep = seen & (_output_error(q, w, h) < _output_error(rtn, w, h))
                q = jax.tree.map(lambda u, v: jnp.where(keep, u, v), q, rtn)
                return s, g, q, keep
            return s, g, q, None

        fn = one
        for _ in self.stacked:
            fn = jax.vmap(fn)
        total, n = self.calib_sq.get_value()
        s, g, q, kept = fn(w, self.calib_amax.get_value(), total, n)
        self.input_scale = None if s is None else QuantStat(s)
        self.input_global_scale = None if g is None else QuantStat(g)
        self.calib_amax = None
        self.calib_sq = None
        self.observer = None
        self.mode = mode
        if mode == "ptq":
            self.kernel = PackedParam(q)
            searched = weight_search is not None and (kept is None or bool(jnp.any(kept)))
            self.weight_method = weight_search if searched else "rtn"
            self.prepare_kernel()

    def convert(self, weight_search: Optional[str] = None) -> None:
        """QAT → PTQ in place: pack the float kernel (same quantization the QAT forward pass used)."""
        if self.mode == "qat":
            self.kernel = PackedParam(quantize_weight(self.kernel.get_value(), self.schemes, weight_search))
            self.mode = "ptq"
            self.prepare_kernel()

    def set_kernel(self, q: QArray) -> None:
        """Replace the packed weight (same [K, N] shape) and refresh the kernel layout cache."""
        if self.mode != "ptq" or not isinstance(q, QArray):
            raise ModelError(f"{self.path}: set_kernel takes a QArray for a PTQ layer (mode {self.mode!r}, "
                             f"got {type(q).__name__})")
        if tuple(q.shape) != (self.k_dim, self.n_dim):
            raise ModelError(f"{self.path}: set_kernel: expected a [{self.k_dim}, {self.n_dim}] weight, got {q.shape}")
        self.kernel = PackedParam(q)
        self.prepare_kernel()

    def prepare_kernel(self, backend: Optional[str] = None) -> bool:
        """Cache the weight in the layout of the kernel `qdot` picks on `backend` (default: jax's), once.

        Returns whether a layout is cached now. Cleared (the XLA path, or a kernel that repacks per call)
        when no registered, enabled kernel takes this weight there, or for layers stacked for `nnx.scan`
        (their cache would have to be split the way the scan splits params). Call again after replacing
        the kernel's values by other means than this module (e.g. `nnx.update` with params only): the cache
        is derived from the codes and is not refreshed on its own.
        """
        p = None
        k = self.kernel.get_value()
        if self.mode == "ptq" and not self.stacked and isinstance(k, QArray) and not on_codes(k, self.schemes):
            p = prepare_weight(k, backend)
        self.prepared = None if p is None else KernelCache(p)
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

    def _project(self, x):
        """x [..., K] → Qa(x) @ W [..., N] (`packed_project` when packed)."""
        if self.mode != "ptq":
            return self._matmul(self._quantize_input(x))
        if self.dtype is not None:
            x = x.astype(self.dtype)
        return packed_project(x, self.kernel.get_value(), self.schemes, input_scale=_value(self.input_scale),
                              input_global_scale=_value(self.input_global_scale), prepared=_value(self.prepared))

    def _matmul(self, x):
        """x [..., K] (already quantized) → x @ W [..., N] for a float kernel (QAT, calibration)."""
        k = self.kernel.get_value()
        if self.mode == "qat":
            return _dot(x, _fake_quantize_weight(k, self.schemes).astype(x.dtype))
        return _dot(x, k.astype(x.dtype))

    def _dense_weight(self, dtype):
        """W [K, N] as the forward pass sees it (dequantized / fake-quantized / float)."""
        k = self.kernel.get_value()
        if self.mode == "ptq":
            return dequantize(k, dtype)
        if self.mode == "qat":
            return _fake_quantize_weight(k, self.schemes).astype(dtype)
        return k.astype(dtype)

    def _add_bias(self, y):
        return y if self.bias is None else y + self.bias.get_value().astype(y.dtype)

    @property
    def weight_nbytes(self) -> int:
        k = self.kernel.get_value()
        return k.nbytes if isinstance(k, QArray) else int(k.size * k.dtype.itemsize)


class QLinear(_QuantizedMatmul):
    """A quantized `nnx.Linear`: y = Qa(x) @ W + b, W `[in, out]` quantized along `in`."""

    @property
    def in_features(self) -> int:
        return self.k_dim

    @property
    def out_features(self) -> int:
        return self.n_dim

    @classmethod
    def from_module(cls, linear: nnx.Linear, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    weight_search: Optional[str] = None, observer: Optional[Observer] = None,
                    full_moments: bool = False) -> "QLinear":
        """The quantized counterpart of `linear` (which is left untouched)."""
        kernel = linear.kernel.get_value()
        bias = None if linear.bias is None else linear.bias.get_value()
        if mode == "ptq":
            kernel = quantize_weight(kernel, schemes, weight_search)
        return cls(kernel, bias, schemes, mode=mode, dtype=linear.dtype, path=path, observer=observer,
                   full_moments=full_moments)

    from_linear = from_module

    def __call__(self, x):
        return self._add_bias(self._project(x))


def _norm_axes(axes, ndim) -> Tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(a % ndim for a in axes)


class QLinearGeneral(_QuantizedMatmul):
    """A quantized `nnx.LinearGeneral` (no batch_axis): contracts `axis` of x with a kernel
    `[*in_features, *out_features]` stored flattened as [prod(in), prod(out)]."""

    def __init__(self, kernel, bias, schemes, *, in_features, out_features, axis, **kw):
        self.in_shape = tuple(int(d) for d in in_features)
        self.out_shape = tuple(int(d) for d in out_features)
        self.axis = (axis,) if isinstance(axis, int) else tuple(axis)
        super().__init__(kernel, bias, schemes, **kw)

    @classmethod
    def from_module(cls, lg: nnx.LinearGeneral, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    weight_search: Optional[str] = None, observer: Optional[Observer] = None,
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
            kernel = quantize_weight(kernel, schemes, weight_search)
        return cls(kernel, bias, schemes, in_features=lg.in_features, out_features=lg.out_features, axis=lg.axis,
                   mode=mode, dtype=lg.dtype, path=path, observer=observer, full_moments=full_moments)

    def __call__(self, x):
        axes = _norm_axes(self.axis, x.ndim)
        rest = [d for d in range(x.ndim) if d not in axes]
        xt = jnp.transpose(x, rest + list(axes))
        lead = xt.shape[: len(rest)]
        y = self._project(xt.reshape(lead + (self.k_dim,)))
        return self._add_bias(y.reshape(lead + self.out_shape))


def einsum_layout(einsum_str: str, kernel_shape) -> Tuple[Tuple[int, ...], int, bool]:
    """(perm putting the kernel's contracted axes first, K, whether x's last axis is the only contraction)."""
    spec = einsum_str.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1 or "." in spec:
        raise ModelError(f"einsum {einsum_str!r}: expected 'x,kernel->out' without ellipsis")
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    if len(ks) != len(kernel_shape):
        raise ModelError(f"einsum {einsum_str!r}: kernel spec {ks!r} does not fit kernel shape {tuple(kernel_shape)}")
    contracted = [i for i, c in enumerate(ks) if c in xs and c not in out]
    if not contracted:
        raise ModelError(f"einsum {einsum_str!r}: the kernel shares no contracted axis with the input")
    perm = tuple(contracted + [i for i in range(len(ks)) if i not in contracted])
    k = math.prod(int(kernel_shape[i]) for i in contracted)
    last_only = len(contracted) == 1 and xs[-1] == ks[contracted[0]]
    return perm, k, last_only


class QEinsum(_QuantizedMatmul):
    """A quantized `nnx.Einsum`: the kernel's contracted axes moved first and flattened to [K, N].

    The forward pass reshapes the (dequantized) weight back and runs the einsum. Activations can be
    quantized (and calibrated) when the contraction is over x's last axis alone.
    """

    def __init__(self, kernel, bias, schemes, *, einsum_str, kernel_shape, **kw):
        self.einsum_str = einsum_str
        self.kernel_shape = tuple(int(d) for d in kernel_shape)
        self.perm, _, self.contracts_last = einsum_layout(einsum_str, kernel_shape)
        super().__init__(kernel, bias, schemes, record_inputs=self.contracts_last, **kw)

    @classmethod
    def from_module(cls, e: nnx.Einsum, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    weight_search: Optional[str] = None, observer: Optional[Observer] = None,
                    full_moments: bool = False):
        kernel = e.kernel.get_value()
        perm, k, _ = einsum_layout(e.einsum_str, kernel.shape)
        kernel = jnp.transpose(kernel, perm).reshape(k, -1)
        bias = None if e.bias is None else e.bias.get_value()
        if mode == "ptq":
            kernel = quantize_weight(kernel, schemes, weight_search)
        return cls(kernel, bias, schemes, einsum_str=e.einsum_str, kernel_shape=e.kernel_shape,
                   mode=mode, dtype=e.dtype, path=path, observer=observer, full_moments=full_moments)

    def __call__(self, x):
        if self.contracts_last:
            x = self._quantize_input(x)
        elif self.dtype is not None:
            x = x.astype(self.dtype)
        w = self._dense_weight(x.dtype)
        w = w.reshape(tuple(self.kernel_shape[i] for i in self.perm))
        w = jnp.transpose(w, tuple(sorted(range(len(self.perm)), key=lambda i: self.perm[i])))
        y = jnp.einsum(self.einsum_str, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return self._add_bias(y)


QUANTIZED = {nnx.Linear: QLinear, nnx.LinearGeneral: QLinearGeneral, nnx.Einsum: QEinsum}
