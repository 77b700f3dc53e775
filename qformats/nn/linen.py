"""Linen: QDense, and the same rules applied to an existing linen model (params transform + method interceptor).

A linen model's structure lives in its code, not in objects, so it cannot be edited in place. Instead
`quantize_linen(module, params, rules)` returns the params with each matching `Dense` kernel replaced by
a packed QArray, and a thin wrapper whose `apply` runs the unchanged module under
`flax.linen.intercept_methods`: a `Dense.__call__` whose kernel is a QArray is computed with `qdot`
(activations quantized by the rule's scheme). Only `Dense` calls are intercepted — nothing global
(no `jax.lax` patching), and only inside that `apply`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Union

import flax.linen as nn
import jax.numpy as jnp

from qformats.dispatch import qdot
from qformats.errors import ModelError
from qformats.nn.modules import quantize_weight
from qformats.nn.rules import check_fit, compile_rules, resolve_scheme, select
from qformats.qarray import QArray
from qformats.quantize import dequantize, quantize
from qformats.schemes import QuantScheme, SchemeSet


def _act(x, schemes: SchemeSet):
    a = schemes.input_activations
    return x if a is None else dequantize(quantize(x, a, -1))


class QDense(nn.Module):
    """A linen Dense with a packed QArray `kernel` param ([in, out] quantized along in).

    `init` draws a float kernel with `kernel_init` and quantizes it; activations are quantized at run
    time (dynamic scales) when the scheme set has input activations.
    """

    features: int
    schemes: Union[str, SchemeSet, QuantScheme]
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        ss = resolve_scheme(self.schemes)
        k = x.shape[-1]
        kernel = self.param("kernel", lambda rng: quantize(self.kernel_init(rng, (k, self.features),
                                                                             self.param_dtype), ss.weights, 0))
        if self.dtype is not None:
            x = x.astype(self.dtype)
        y = qdot(_act(x, ss), kernel)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,), self.param_dtype).astype(y.dtype)
        return y


def _dense_paths(params, prefix=()):
    """("a", "b") paths of dicts that look like a Dense's params: a 2-D 'kernel' (and optional 'bias')."""
    if not isinstance(params, dict):
        return
    k = params.get("kernel")
    if k is not None and not isinstance(k, dict) and getattr(k, "ndim", None) == 2:
        yield prefix
    for name, sub in params.items():
        if isinstance(sub, dict):
            yield from _dense_paths(sub, prefix + (name,))


def quantize_params(params: Dict, rules: Sequence, *, weight_search: Optional[str] = None):
    """Params tree (with or without the top "params" key) → (new tree with matching Dense kernels as
    QArrays, {path: SchemeSet}). Validates every rule and shape first; the input tree is not modified."""
    compiled = compile_rules(rules)
    root = params["params"] if "params" in params and isinstance(params["params"], dict) else params
    plan = {}
    for path, p, ss in select(compiled, (("/".join(p), p) for p in _dense_paths(root))):
        node = root
        for name in p:
            node = node[name]
        check_fit(path, int(node["kernel"].shape[0]), ss, static_acts=False)
        plan[path] = (p, ss)

    def rebuild(tree, prefix=()):
        out = {}
        for name, sub in tree.items():
            here = prefix + (name,)
            if isinstance(sub, dict):
                out[name] = rebuild(sub, here)
            elif name == "kernel" and "/".join(prefix) in plan:
                out[name] = quantize_weight(sub, plan["/".join(prefix)][1], weight_search)
            else:
                out[name] = sub
        return out

    new_root = rebuild(root)
    new = dict(params, params=new_root) if root is not params else new_root
    return new, {path: ss for path, (_, ss) in plan.items()}


@dataclasses.dataclass(frozen=True)
class QuantizedLinen:
    """`module` run with packed Dense kernels: `apply(variables, *args, **kwargs)` as `module.apply`."""

    module: nn.Module
    schemes: Dict[str, SchemeSet]

    def _interceptor(self, next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__" or not isinstance(mod, nn.Dense):
            return next_fun(*args, **kwargs)
        kernel = mod.get_variable("params", "kernel")
        if not isinstance(kernel, QArray):
            return next_fun(*args, **kwargs)
        ss = self.schemes.get("/".join(mod.scope.path))
        if ss is None:
            raise ModelError(f"{'/'.join(mod.scope.path)}: packed kernel without a scheme (params and rules differ)")
        (x,) = args
        if mod.dtype is not None:
            x = x.astype(mod.dtype)
        y = qdot(_act(x, ss), kernel)
        if mod.use_bias:
            y = y + mod.get_variable("params", "bias").astype(y.dtype)
        return y

    def apply(self, variables, *args, **kwargs):
        with nn.intercept_methods(self._interceptor):
            return self.module.apply(variables, *args, **kwargs)


def quantize_linen(module: nn.Module, params: Dict, rules: Sequence, *, weight_search: Optional[str] = None):
    """(module, params) → (QuantizedLinen wrapper, quantized params) under the same Rule semantics as NNX."""
    qparams, schemes = quantize_params(params, rules, weight_search=weight_search)
    return QuantizedLinen(module, schemes), qparams

