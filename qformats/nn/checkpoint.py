"""Fill an NNX model from already-quantized tensors (e.g. a compressed-tensors checkpoint read by
`converters`), and export a quantized model's tensors the other way — pure functions, no file I/O.

The tensors are given per Flax module path ("encoder/layers/0/attention/query") as a dict of local names:
"weight" (a QArray of logical shape [in, out] = the Flax kernel, quantized along axis 0 — the layout
`converters.formats.compressed_tensors.read` returns) and optionally "bias", "input_scale", "input_global_scale". Mapping checkpoint
names to module paths is the caller's (the model knows its names).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import jax.numpy as jnp
from flax import nnx

from qformats.errors import ModelError
from qformats.nn.graph import module_references, replace_child
from qformats.nn.experts import Experts, QExperts
from qformats.nn.nnx_layers import QLinear, QuantizedMatmul, QuantStat
from qformats.qarray import QArray
from qformats.schemes import QuantScheme, SchemeSet


def load_quantized(model: nnx.Module, modules: Mapping[str, Mapping[str, Any]],
                   input_schemes: Optional[Mapping[str, Optional[QuantScheme]]] = None) -> list:
    """Swap each `nnx.Linear` named in `modules` for a packed `QLinear` holding the given QArray, in place (and each
    `Experts` stack for a `QExperts`, its QArray's leaves carrying the expert axis first, per-expert shape [in, out]).

    Args:
      model: the NNX model (float, e.g. built with `nnx.eval_shape` or loaded dense).
      modules: module path → {"weight": QArray [in, out], "bias"?: array, "input_scale"?: array,
        "input_global_scale"?: array}; for an expert stack the static input scales are [E, ...], one per expert.
        Entries whose weight is not a QArray are skipped.
      input_schemes: module path → activation scheme (the checkpoint's input_activations), if any.

    Everything is checked first (path exists and is a Linear, QArray shape equals the kernel's, bias shape);
    a mismatch raises ModelError naming the module path and nothing is swapped. Returns the swapped paths.
    """
    input_schemes = input_schemes or {}
    refs = {path: (lin, parents) for path, lin, parents in module_references(model, (nnx.Linear, Experts)).values()}
    plan = []
    for path, tensors in modules.items():
        q = tensors.get("weight")
        if not isinstance(q, QArray):
            continue
        if path not in refs:
            raise ModelError(f"{path}: the checkpoint has a quantized weight for this module but the model has "
                             f"no nnx.Linear there (Linear paths: {', '.join(sorted(refs)[:5])}, ...)")
        lin, parents = refs[path]
        want = tuple(lin.kernel.get_value().shape)
        lead = ()
        if isinstance(lin, Experts):
            lead, want = want[:1], want[1:]
            if tuple(q.codes.shape[:1]) != lead or q.codes.ndim != len(q.tshape) + 1:
                raise ModelError(f"{path}: expected a QArray stacked over {lead[0]} experts (leaves [E, ...]), found "
                                 f"codes of shape {tuple(q.codes.shape)}")
        if q.shape != want or q.axis != 0:
            raise ModelError(f"{path}: expected a QArray of shape {want} along axis 0 (the Flax kernel), found "
                             f"shape {q.shape} axis {q.axis}")
        bias = tensors.get("bias")
        if (bias is None) != (lin.bias is None):
            raise ModelError(f"{path}: the model's Linear {'has' if lin.bias is not None else 'has no'} bias, the "
                             f"checkpoint {'has' if bias is not None else 'has no'} bias")
        if bias is not None and tuple(bias.shape) != tuple(lin.bias.get_value().shape):
            raise ModelError(f"{path}: bias shape {tuple(bias.shape)}, expected {tuple(lin.bias.get_value().shape)}")
        new = None
        if isinstance(lin, Experts):  # built (and its per-expert static input scales checked) before any swap
            ss = SchemeSet(q.scheme.describe(), weights=q.scheme, input_activations=input_schemes.get(path))
            b = None if bias is None else jnp.asarray(bias, lin.bias.get_value().dtype)
            new = QExperts.from_packed(q, b, ss, dtype=lin.dtype, path=path, input_scale=tensors.get("input_scale"),
                                       input_global_scale=tensors.get("input_global_scale"))
        plan.append((path, lin, parents, q, bias, tensors, new))
    done = []
    for path, lin, parents, q, bias, tensors, new in plan:
        ss = SchemeSet(q.scheme.describe(), weights=q.scheme, input_activations=input_schemes.get(path))
        b = None if bias is None else jnp.asarray(bias, lin.bias.get_value().dtype)
        if new is not None:
            for parent, key in parents:
                replace_child(parent, key, new)
            done.append(path)
            continue
        new = QLinear(q, b, ss, mode="ptq", dtype=lin.dtype, path=path)
        if tensors.get("input_scale") is not None:
            new.input_scale = QuantStat(jnp.asarray(tensors["input_scale"]).reshape(1))
        if tensors.get("input_global_scale") is not None:
            new.input_global_scale = QuantStat(jnp.asarray(tensors["input_global_scale"], jnp.float32).reshape(1))
        for parent, key in parents:
            replace_child(parent, key, new)
        done.append(path)
    return done


def export_quantized(model: nnx.Module) -> Dict[str, Dict[str, Any]]:
    """module path → {"weight": QArray, "bias"?, "input_scale"?, "input_global_scale"?} of every packed layer,
    plus its SchemeSet under "schemes" — what a compressed-tensors writer needs (the inverse of load_quantized).
    QAT layers must be `convert`ed first (ModelError otherwise)."""
    out = {}
    for path, m, _ in module_references(model, QuantizedMatmul).values():
        if m.mode != "ptq":
            raise ModelError(f"{path}: layer is in {m.mode!r} mode; call qformats.nn.convert(model) first")
        t: Dict[str, Any] = {"weight": m.kernel.get_value(), "schemes": m.schemes}
        if m.bias is not None:
            t["bias"] = m.bias.get_value()
        if m.input_scale is not None:
            t["input_scale"] = m.input_scale.get_value()
        if m.input_global_scale is not None:
            t["input_global_scale"] = m.input_global_scale.get_value()
        out[path] = t
    return out
