"""quantize_model / convert: swap nnx.Linear (LinearGeneral, Einsum) for quantized layers in place by rules, and pack
any other matmul weight in place (found by one abstract trace: `qformats.nn.traced`, `qformats.nn.nnx_traced`)."""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.algorithms.gptq import DAMPENING_FRAC
from qformats.algorithms.shared_scales import selected_groups, shared_global_scales
from qformats.algorithms.weight_search import NEEDS_HESSIAN, RTN, calibrated_weight, quantize_weight, search_name
from qformats.errors import ModelError
from qformats.nn import host_quantize, nnx_traced, traced
from qformats.nn.graph import module_references, replace_child
from qformats.nn.experts import Experts, QExperts
from qformats.nn.nnx_layers import QUANTIZED, QuantizedMatmul
from qformats.nn.projection import check_einsum_acts, einsum_last_axis_error, einsum_layout
from qformats.matching import Matcher
from qformats.observers import get_observer
from qformats.plan import Candidate, Decision, check_fit, check_fits, plan_quantization, warn_unused_rules
from qformats.quantize import quantize


logger = logging.getLogger("qformats")
_NOTHING = object()
MAX_FULL_MOMENTS_K = 4096
MAX_FULL_MOMENTS_ELEMS = 4 * 4096 * 4096  # per layer incl. stacked ones: 256 MiB of float32
# the module types rules swap, and their quantized classes: Linear layers, and stacked expert projections
_SWAPS = {**QUANTIZED, Experts: QExperts}
_STACKED = (nnx.Linear, Experts)  # kernels [..., K, N] whose leading axes (scan layers, experts) are vmapped


def _default_forward(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def quantize_model(model: nnx.Module, rules: Sequence, mode: str = "ptq", calibration_data: Optional[Iterable] = None,
                   *, weight_search: Optional[str] = RTN, observer: Any = "minmax",
                   forward: Optional[Callable[[nnx.Module, Any], Any]] = None, jit: bool = True,
                   compare_rtn: bool = True, actorder: Optional[str] = "static", dampening_frac: float = DAMPENING_FRAC,
                   fuse_global_scales: Union[bool, Sequence[Sequence[str]]] = True, example: Any = _NOTHING,
                   strict: bool = False, return_summary: bool = False):
    """Swap every `nnx.Linear` / `nnx.LinearGeneral` / `nnx.Einsum` / `qformats.nn.experts.Experts` whose path
    matches a rule for its quantized counterpart (`QLinear` / `QLinearGeneral` / `QEinsum` / `QExperts`: each
    expert of the [E, K, N] stack quantized as its own [K, N] Linear would be), in place; returns `model`.

    Args:
      model: an NNX module; Linear layers may sit in attributes, `nnx.List` / `nnx.Dict`, and be shared.
      rules: `Rule(pattern, scheme)`s, first full match on the "/"-joined path wins (scheme None: skip).
      mode: "ptq" (pack weights now) or "qat" (float weights, fake-quantized forward; see `convert`).
      calibration_data: iterable of batches; each is run through the model (`forward(model, batch)`,
        default `model(**batch)` / `model(*batch)` / `model(batch)`) with observers on the inputs of the
        swapped layers, giving static activation scales (for schemes with dynamic=False / "local") and
        H = E[x x^T] per layer: `weight_search="mse"` weights its per-group error with diag(H) and keeps
        the searched weights only where tr(dW^T H dW) beats round-to-nearest; "gptq" runs GPTQ with H. If
        a batch fails, the original modules are put back and the error propagates.
      weight_search: one of `WEIGHT_SEARCHES` (`qformats.algorithms.weight_search`): "rtn" (round-to-nearest;
        None is accepted as its alias), "mse" (per-group clipping search, `observers.mse_quantize`), "gptq" (GPTQ,
        `qformats.algorithms.gptq.gptq_quantize`: llm-compressor's algorithm, columns in `actorder`; needs
        calibration_data) or "mse+gptq" (GPTQ on the MSE search's scales).
      actorder: GPTQ's column order: "static" (default, llm-compressor's GPTQModifier default: descending
        diag(H); BENCHMARKS.md, "GPTQ parity with llm-compressor") or None (column order).
      dampening_frac: GPTQ's dampening, H += dampening_frac * mean(diag H) * I (default 0.01, llm-compressor's;
        the embedded MiniLM's calibration uses `converters.evaluation.embedded.GPTQ_DAMPENING`, 0.1, chosen on held-out text).
      compare_rtn: with calibration_data and a weight_search, run the calibration batches again with the
        searched weights and with round-to-nearest ones and keep whichever gives the lower squared error
        against the float model's outputs (so a search never makes the model worse on its calibration
        data; costs two more passes and keeps the float outputs of the calibration batches meanwhile).
      observer: "minmax" | "moving_average" | "percentile" | "mse" | an `observers.Observer`.
      fuse_global_scales: NVFP4 (TENSOR_GROUP) weights of fused siblings share one global scale, as
        llm-compressor's oneshot and `converters.pipelines.quantize_checkpoint` do (vLLM runs q/k/v_proj as one qkv_proj
        matmul, gate/up_proj as one gate_up_proj): every member of a group takes
          g = 448 * 6 / max_i max |W_i|   (`qformats.algorithms.shared_scales`: the smallest member's g),
        and its fp8 group scales and codes are computed under that g. True: the groups of
        `shared_scales.sibling_groups` over the model's module paths (same parent, names in
        `shared_scales.FUSED_GROUPS`; a group only partly quantized with one TENSOR_GROUP scheme is left
        unshared with a warning); a sequence of groups of module paths: exactly those (ModelError when a path
        is not a TENSOR_GROUP layer of this call); False: every layer its own. Sharing applies to
        round-to-nearest PTQ (with or without calibration data); in QAT mode or with a weight search the
        layers keep their own global scales (a warning; a ModelError for explicit groups).

      example: a batch for `forward(model, example)` (as calibration batches are given). With it the model is
        traced once (abstractly: `qformats.nn.traced`) and every param fed to a matmul is a candidate, whatever
        module holds it: flax's layer classes are swapped as above; any other matmul weight (a custom layer's
        `jnp.einsum` / `jnp.dot` / `@` / `lax.dot_general` operand, plain, in `nnx.scan` stacks or `nnx.vmap`ped,
        and flax's LinearGeneral / Einsum stacked by `nnx.vmap`) is packed in place as a
        `traced.MatmulWeight` (W [K, N] along its contracted axes) and the modules that use it run through
        `traced.run_packed` (`qformats.nn.nnx_traced`). Such a weight is named by its param path, or by its
        module's path when the param is a `kernel` ("blocks/0/mlp/up"). Weight-only schemes fit every such
        weight; W+A schemes need every matmul of it to contract the input's last axis alone (ModelError
        otherwise). Weights a rule selects that stay dense (used outside a matmul too, e.g. a tied embedding
        gathered and multiplied; shape misfit) are named in a warning. Without `example`, only flax's layer
        classes are reached, and a rule that selects nothing but other 2-D params is a ModelError.
        Not with calibration_data or mode="qat" (those reach flax's layer classes only: ModelError when a rule
        selects another matmul weight).
      strict: ModelError (before anything changes) when a weight a rule selects with a scheme would stay dense.
      return_summary: return (model, plan) instead of model: the plan (`qformats.plan.Plan`) has one decision
        per matmul weight (quantized with which scheme, or dense and why; `plan.summary()` as text).

    Everything (regexes, preset names, shapes against schemes) is checked before the first swap; on a
    bad rule or a layer that does not fit, ModelError names the rule or module path and the model is
    unchanged. A decoder to be rotated (SpinQuant) is rotated first, by one call before this one:
    `qformats.models.decoder.rotate_decoder(model, kind, seed=seed)`; the rules then see the rotated model.
    Rules matching no Linear are reported with a warning.
    """
    if mode not in ("ptq", "qat"):
        raise ModelError(f"quantize_model: mode must be 'ptq' or 'qat', got {mode!r}")
    weight_search = search_name(weight_search, where="quantize_model: weight_search")
    matcher = Matcher.from_rules(rules)
    calibrating = calibration_data is not None
    hessian = weight_search in NEEDS_HESSIAN
    if hessian and not (calibrating and mode == "ptq"):
        raise ModelError(f"quantize_model: weight_search={weight_search!r} needs calibration_data (GPTQ uses the "
                         "layer inputs' H = E[x x^T]) and mode='ptq'")
    plan: List[Tuple[str, nnx.Linear, list, Any]] = []
    full_moments = {}
    refs = [(path, (lin, parents)) for path, lin, parents in module_references(model, tuple(_SWAPS)).values()]
    traced_example = example is not _NOTHING
    if traced_example:  # flax layers stacked by nnx.vmap beyond QLinear's reach go the traced way
        refs = [(path, lp) for path, lp in refs if not _stacked_flax_layer(lp[0])]
    generic, usage_dense, variables = (_traced_candidates(model, refs, forward or _default_forward, example)
                                       if traced_example else ({}, {}, {}))
    chosen = plan_quantization([Candidate(path) for path, _ in refs] + [Candidate(n) for n in generic], matcher)
    chosen.decisions.extend(Decision(Candidate(n), None, why, traced.deciding_rule(matcher, n))
                            for n, why in usage_dense.items())
    chosen.unused = matcher.unused()
    warn_unused_rules(chosen)
    schemes = chosen.schemes()
    if not traced_example:
        _check_untraced(model, matcher, schemes)
    traced_plan, misfit = traced.plan_traced(generic, schemes, calibrating=calibrating, mode=mode)
    chosen = chosen.leave_dense(misfit)
    schemes = chosen.schemes()
    traced.warn_partial(chosen, strict, "quantize_model")
    selected = [(path, lp, schemes[path], _contracted_size(path, lp[0], schemes[path], calibrating))
                for path, lp in refs if path in schemes]
    check_fits([(path, k, ss) for path, _, ss, k in selected], static_acts=calibrating)  # every misfit in one error
    for path, (lin, parents), ss, k in selected:
        # full E[x x^T] only where a weight search uses it: K <= 4096, <= 256 MiB per (stacked) layer
        layers = math.prod(lin.kernel.get_value().shape[:-2]) if isinstance(lin, _STACKED) else 1
        fits = k <= MAX_FULL_MOMENTS_K and layers * k * k <= MAX_FULL_MOMENTS_ELEMS
        full_moments[path] = weight_search != RTN and fits
        if hessian and not fits:
            raise ModelError(f"{path}: GPTQ needs the [K, K] input moments per layer; K = {k} x {layers} layer(s) "
                             f"exceeds the limit (K <= {MAX_FULL_MOMENTS_K}, {MAX_FULL_MOMENTS_ELEMS} elements)")
        if hessian and isinstance(lin, nnx.Einsum) and not einsum_layout(lin.einsum_str,
                                                                          lin.kernel.get_value().shape)[2]:
            raise einsum_last_axis_error(path, lin.einsum_str, "its input moments cannot be collected for GPTQ; "
                                         "leave it out with a rule")
        plan.append((path, lin, parents, ss))
    observers, uncalibrated = {}, []
    for path, _, _, ss in plan:
        a = ss.input_activations
        if a is not None:
            try:
                observers[path] = get_observer(observer, a)
            except Exception as e:
                raise ModelError(f"{path}: {e}") from e
        if not calibrating and a is not None and a.dynamic is not True:
            uncalibrated.append(path)
    if uncalibrated:
        warnings.warn(f"qformats.nn: {len(uncalibrated)} layers ({', '.join(uncalibrated[:3])}"
                      f"{', ...' if len(uncalibrated) > 3 else ''}) have static activation schemes but no "
                      "calibration_data was given; using dynamic scales of the same granularity", stacklevel=2)

    shared = _fused_global_scales([p for p, _ in refs], plan, fuse_global_scales, mode, weight_search)

    if calibrating:  # an empty iterable is bad input: find out before touching the model
        batches = iter(calibration_data)
        first = next(batches, _NOTHING)
        if first is _NOTHING:
            raise ModelError("quantize_model: calibration_data gave no batches")
        batches = itertools.chain([first], batches)

    # -- swap (one layer at a time: only one float + packed copy of a weight is alive at once) --
    swapped = []
    for path, lin, parents, ss in plan:
        cls = next(q for base, q in _SWAPS.items() if isinstance(lin, base))
        if calibrating:
            obs = observers.get(path) or get_observer("minmax", ss.weights)
            new = cls.from_module(lin, ss, mode="calibrate", path=path, observer=obs,
                                  full_moments=full_moments[path])
        elif path in shared:
            # the float kernel in the layer's [K, N] layout (no quantization), packed under the group's g
            new = cls.from_module(lin, ss, mode="qat", path=path)
            new.mode = "ptq"
            new.set_weight(_pack_under(new.kernel.get_value(), ss.weights, shared[path]))
            new.weight_method = RTN
        else:
            new = cls.from_module(lin, ss, mode=mode, path=path,
                                  pack=lambda k, ss=ss: host_quantize.quantize_weight(k, ss, weight_search))
            if mode == "ptq":
                new.weight_method = weight_search
        for parent, key in parents:
            replace_child(parent, key, new)
        swapped.append(new)

    _pack_traced(model, traced_plan, variables, weight_search)
    logger.info("qformats.nn: quantize_model:\n%s", chosen.summary())
    if calibrating:
        fwd = forward or _default_forward
        guard = weight_search != RTN and mode == "ptq" and compare_rtn
        # with the guard, keep the batches and the float model's outputs (the calibrating layers run float)
        step = _jitted(lambda m, b: fwd(m, b) if guard else (fwd(m, b), None)[1], jit)
        kept, reference = [], []
        try:
            for batch in batches:
                out = step(model, batch)
                if guard:
                    kept.append(batch)
                    reference.append(out)
        except BaseException:
            # the calibrating layers hold the float weights: put the original modules back, unchanged
            for (_, lin, parents, _), new in zip(plan, swapped):
                for parent, key in parents:
                    replace_child(parent, key, lin)
            raise
        floats = [q.kernel.get_value() for q in swapped] if guard else []
        fused = [(q, q.kernel.get_value(), shared[p]) for (p, *_), q in zip(plan, swapped) if p in shared]
        for q in swapped:  # the layers hold the statistics; the weight search decides the packed weight
            packed, method = None, RTN
            if mode == "ptq":
                moments, count = q.input_moments
                packed, method = calibrated_weight(q.kernel.get_value(), q.schemes, weight_search, moments, count,
                                                   actorder=actorder, dampening_frac=dampening_frac)
            q.finalize(mode, packed, method)
        for q, w, g in fused:  # round-to-nearest under the group's shared global scale
            q.set_weight(_pack_under(w, q.schemes.weights, g))
        if guard:
            _keep_better_of_search_and_rtn(model, swapped, floats, kept, reference, _jitted(fwd, jit))
    return (model, chosen) if return_summary else model


# ---- matmul weights outside flax's layer classes (qformats.nn.traced) ------------------------------------------
def _stacked_flax_layer(m) -> bool:
    """A LinearGeneral / Einsum whose kernel has axes in front of its own (stacked by nnx.vmap)."""
    k = m.kernel.get_value()
    if isinstance(m, nnx.LinearGeneral):
        return getattr(k, "ndim", 0) > len(m.in_features) + len(m.out_features)
    if isinstance(m, nnx.Einsum):
        return getattr(k, "ndim", 0) > len(tuple(m.kernel_shape))
    return False


def _traced_candidates(model, refs, forward, example):
    """(generic, dense, variables): `traced.traced_candidates` over the model's float params outside the flax
    layers that `refs` swaps (and outside quantized layers), and param path -> Variable."""
    usages = nnx_traced.analyse(model, forward, example)
    params = nnx_traced.float_params(model, skip=(QuantizedMatmul,))
    taken = {f"{path}/kernel" for path, _ in refs}
    generic, dense = traced.traced_candidates({p: u for p, u in usages.items() if p in params}, taken)
    return generic, dense, params


def _check_untraced(model, matcher: Matcher, schemes) -> None:
    """Without example inputs: say loudly when the rules select 2-D params outside flax's layer classes."""
    # nnx.Embed tables are gathered (their `attend` is a matmul only where a model calls it): not named here
    outside = [traced.weight_name(p) for p in nnx_traced.float_params(model, skip=(nnx.Linear, nnx.LinearGeneral,
                                                                                     nnx.Einsum, nnx.Embed, Experts,
                                                                                     QuantizedMatmul))]
    selected = [n for n in outside if matcher.match(n)[1] is not None]
    if not selected:
        return
    shown = ", ".join(selected[:5]) + (f", ... ({len(selected)} in all)" if len(selected) > 5 else "")
    msg = (f"the rules select {len(selected)} params outside nnx.Linear / LinearGeneral / Einsum ({shown}); "
           "pass example=<a batch for forward(model, batch)> so the model is traced once to find which of them "
           "its matmuls use")
    if not schemes:
        raise ModelError(f"quantize_model: nothing would be quantized: {msg}")
    warnings.warn(f"qformats.nn: {msg}; they stay float", stacklevel=3)


def _pack_traced(model, items, variables, weight_search: str) -> None:
    """Pack each selected traced weight in place and let its users run packed (`traced.pack_many`: weights
    of equal layout share one compilation; each is installed as soon as its chunk is packed)."""
    items = list(items)

    def done(i, mw):
        name, ppath, _, _ = items[i]
        nnx_traced.install(model, variables[ppath], mw, name)

    traced.pack_many([(variables[ppath].get_value(), u, ss) for _, ppath, u, ss in items], weight_search,
                     done=done, release=True)


def _pack_under(kernel, scheme, g):
    """kernel [..., K, N] quantized along K with the given global scale g [..., 1] (leading axes: stacked
    layers, vmapped as `quantize_weight` does)."""
    fn = lambda w, gg: quantize(w, scheme, 0, global_scale=gg)  # noqa: E731
    for _ in range(kernel.ndim - 2):
        fn = jax.vmap(fn)
    return fn(kernel, g)


def _fused_global_scales(paths: Sequence[str], plan, fuse, mode: str, weight_search: str) -> Dict[str, Any]:
    """path -> the global scale its fused group shares (`quantize_model`'s fuse_global_scales), from the float
    kernels before any swap."""
    if fuse is False or fuse is None:
        return {}
    tg = {path: (lin, ss.weights) for path, lin, _, ss in plan
          if ss.weights is not None and ss.weights.strategy == "tensor_group"}
    explicit = fuse is not True

    def refuse(msg, depth=0):  # depth: frames between this function and refuse (the warning names the caller)
        if explicit:
            raise ModelError(f"quantize_model: fuse_global_scales: {msg}")
        warnings.warn(f"qformats.nn: {msg}; their global scales are not shared", stacklevel=4 + depth)

    groups: List[Tuple[str, ...]] = []
    if explicit:
        if isinstance(fuse, str) or not all(not isinstance(g, str) and len(g) >= 2 for g in fuse):
            raise ModelError(f"quantize_model: fuse_global_scales: expected True, False or a sequence of groups of "
                             f"two or more module paths, got {fuse!r}")
        seen = set()
        for g in fuse:
            g = tuple(g)
            bad = [p for p in g if p not in tg]
            if bad:
                raise ModelError(f"quantize_model: fuse_global_scales: {', '.join(map(str, bad))} "
                                 f"{'is' if len(bad) == 1 else 'are'} not quantized with a tensor_group (NVFP4) "
                                 f"weight scheme by these rules (TENSOR_GROUP layers: "
                                 f"{', '.join(sorted(tg)[:6]) or 'none'}{' ...' if len(tg) > 6 else ''})")
            if seen & set(g):
                raise ModelError(f"quantize_model: fuse_global_scales: {', '.join(sorted(seen & set(g)))} in two "
                                 f"groups")
            seen |= set(g)
            groups.append(g)
    elif tg:
        groups = selected_groups(paths, tg, sep="/", partial=lambda g, inside: refuse(
            f"{', '.join(g)} are fused siblings (vLLM runs them as one matmul with one NVFP4 global "
            f"scale) but only {', '.join(inside)} take a tensor_group weight scheme", depth=2))
    if groups and (mode != "ptq" or weight_search != RTN):
        refuse(f"{len(groups)} fused groups ({', '.join(groups[0])}{', ...' if len(groups) > 1 else ''}) with "
               f"mode={mode!r}, weight_search={weight_search!r}: only round-to-nearest PTQ shares global scales")
        return {}

    def member(p):
        lin, scheme = tg[p]
        k = lin.kernel.get_value()
        # layers stacked by nnx.vmap for nnx.scan: one g per stacked layer (only nnx.Linear stacks)
        return scheme, k.dtype, k.shape[:-2] if isinstance(lin, _STACKED) else ()

    return shared_global_scales(groups, lambda p: tg[p][0].kernel.get_value(),
                                {p: member(p) for g in groups for p in g},
                                mismatch=lambda g: refuse(f"{', '.join(g)} are fused siblings with different weight "
                                                          f"schemes, stacking or dtypes", depth=2))


def _jitted(fn, jit: bool):
    return nnx.jit(fn) if jit else fn


def _output_sq_error(model, run, batches, reference) -> float:
    """sum over batches and float output leaves of |model(batch) - reference|^2 (float32)."""
    total = 0.0
    for batch, ref in zip(batches, reference):
        for y, r in zip(jax.tree.leaves(run(model, batch)), jax.tree.leaves(ref)):
            if jnp.issubdtype(jnp.result_type(r), jnp.floating):
                total += float(jnp.sum(jnp.square(y.astype(jnp.float32) - r.astype(jnp.float32))))
    return total


def _keep_better_of_search_and_rtn(model, layers, floats, batches, reference, run) -> None:
    """Model-level check of a weight search: the calibration batches' outputs against the float model's,
    with the searched weights and with round-to-nearest ones; the lower squared error stays."""
    searched = [q.kernel.get_value() for q in layers]
    err_search = _output_sq_error(model, run, batches, reference)
    for q, w in zip(layers, floats):
        q.set_weight(quantize_weight(w, q.schemes, RTN))
    err_rtn = _output_sq_error(model, run, batches, reference)
    chosen = RTN if err_rtn <= err_search else None
    if chosen is None:
        for q, s in zip(layers, searched):
            q.set_weight(s)
    for q in layers:
        q.weight_method = chosen or q.weight_method
    logger.info("qformats.nn: weight search output error %.6g vs round-to-nearest %.6g on the calibration "
                "batches: kept %s", err_search, err_rtn, "round-to-nearest" if chosen else "the search")


def _contracted_size(path: str, m, ss, calibrating: bool) -> int:
    """K of the [K, N] matrix the layer's weight becomes (ModelError for layouts that cannot be quantized)."""
    kernel = m.kernel.get_value()
    if isinstance(m, nnx.LinearGeneral):
        if m.batch_axis:
            raise ModelError(f"{path}: LinearGeneral with batch_axis {dict(m.batch_axis)} is not supported")
        return math.prod(m.in_features)
    if isinstance(m, nnx.Einsum):
        try:
            _, k, last_only = einsum_layout(m.einsum_str, kernel.shape)
        except ModelError as e:
            raise ModelError(f"{path}: {e}") from e
        check_einsum_acts(path, m.einsum_str, last_only, ss)
        return k
    if getattr(kernel, "ndim", 2) < 2:
        raise ModelError(f"{path}: expected a Linear kernel [..., K, N], found shape {tuple(kernel.shape)}")
    if kernel.ndim > 2:  # layers stacked by nnx.vmap for nnx.scan
        if ss.weights.strategy == "block":
            raise ModelError(f"{path}: block scales ({ss.name}) need a 2-D kernel; this one is stacked "
                             f"{tuple(kernel.shape)}")
    return int(kernel.shape[-2])


def convert(model: nnx.Module, *, weight_search: Optional[str] = RTN) -> nnx.Module:
    """Every QAT QLinear → packed PTQ QLinear, in place; returns model. Outputs are identical on the XLA path
    where the packed layer dequantizes (weight-only schemes, MX, NVFP4, ...); W8A8 / FP8 layers multiply codes
    (`qformats.scaled_dot`) and agree with the QAT forward pass to float rounding."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, QuantizedMatmul) and m.mode == "qat":
            m.convert(quantize_weight(m.kernel.get_value(), m.schemes, weight_search))
    return model


def prepare_kernels(model: nnx.Module, backend: Optional[str] = None) -> int:
    """Cache, on every packed layer, its weight in the layout of the Pallas kernel `qdot` picks on `backend`
    (the layer's `kernel_cache`, see `QuantizedMatmul.cache_kernel_layout`); clears caches where none applies.
    Returns how many are cached.

    quantize_model, convert and the checkpoint loaders do this already; call it after turning kernels on or
    off, after `kernels_pallas.set_interpret`, or after replacing packed params by other means (e.g.
    `nnx.update` with params only), since the cache is derived from the codes.
    """
    return sum(bool(m.cache_kernel_layout(backend)) for m in quantized_layers(model).values())


def quantized_layers(model: nnx.Module) -> dict:
    """path → QLinear / QLinearGeneral / QEinsum for every quantized layer (first path of shared ones)."""
    return {p: m for p, m, _ in module_references(model, QuantizedMatmul).values()}
