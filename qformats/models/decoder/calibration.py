"""Calibration of the decoder family: the layer-by-layer driver and the AWQ / SmoothQuant mappings onto its modules.

The algorithms are pure functions in `qformats.algorithms` (weight searches, GPTQ, AWQ, SmoothQuant, shared
NVFP4 global scales, calibration batches); this module knows the decoder's module names and runs them on a
`CausalLM`, one decoder layer at a time.

As llm-compressor's sequential pipeline does it, with the decoder layer as the unit:

    x_0 = embed(ids)                                  (every calibration sample, packed into batches)
    for layer i = 0 .. L-1:
        [transforms: SmoothQuant / AWQ scales folded into the layer, from a float pass over x_i]
        calibration pass: layer_i(x_i) in float, recording H_p = E[x x^T] over real tokens for each projection p,
                          the range of each projection's input (static activation scales: NVFP4's input
                          global scale 448*6 / max|x|) and of the keys / values entering the cache (kv_cache)
        each projection p: W_p -> Q_p by the weight search with H_p (GPTQ, llm-compressor 0.14's arithmetic);
                          NVFP4 weight global scales shared by q/k/v and by gate/up (as vLLM fuses them)
        propagation pass: x_{i+1} = layer_i(x_i) with the quantized weights and float activations
                                                                                        (propagate="quantized")
                          or the calibration pass's float outputs                       (propagate="float")
                          (none for the last layer: its outputs feed no layer)

This is llm-compressor 0.14's order: its sequential pipeline runs both passes under `DisableQuantization`, so
the calibration pass sees the layer in float and the propagation pass sees the weights GPTQ has written back
(fake-quantized) with activations, keys and values unquantized; its QuantizationModifier (round-to-nearest)
leaves the weights float until saving, which is propagate="float" here. Static activation ranges use its
NVFP4 input observer `static_minmax` (max |x| over every calibration token); the KV-cache ranges too (its own
default for `kv_cache_scheme` is the moving-average `minmax`, which depends on the sample order).

DeepSeek-V3's latent attention, dense first layers and shared experts, and gpt-oss's fused experts: which Linears a
layer has and what each reads are in `qformats.models.decoder.calibration_families` (every Linear's H from its own
input; gpt-oss's gate / up quantized apart as llm-compressor linearizes them, then interleaved back).

Mixture-of-experts layers (qwen2_moe, qwen3_moe, mixtral, gpt_oss, deepseek_v3): the attention's and the shared
expert's projections as above; the router and the shared expert's gate stay float; every expert's gate / up / down
is quantized like its own Linear with its own H, recorded with llm-compressor's `moe_calibrate_all_experts` semantics
by default (every token through every expert for the statistics, the routed experts only for the layer's output:
`MOE_STATISTICS`), and the stack becomes a `QExperts`; a static activation scheme (FP8, NVFP4) gives each expert's
gate / up / down its own input scale from the max |x| of the tokens it observed under the same semantics
(`expert_ranges`).

So only one layer's activations (its inputs and outputs for every sample) and its Hessians are alive at
once: peak memory grows with one layer, not with the model. Samples of different lengths are packed into rows
of one length (`pack_batches`: each token attends only to the earlier tokens of its own sample, positions restart
per sample) or, with pack=False, right-padded to a bucket length; padding positions are zeroed at every
projection's input, so they add nothing to H, and the real tokens' activations are those of each sample alone.
Each group's H = sum x x^T is summed on the host from the inputs the calibration pass captures (BLAS syrk), batch j's
while the device runs batches j+1.. (`CALIBRATION_AHEAD`), the last batch's as the groups' searches start (a group's
as soon as its H is complete): the same sums in the same order, on both cores at once.
Each layer's projections are built with paths relative to the layer, so every layer has the same graph and each
(batch, length) shape compiles once for the whole model (packed: one shape).

Takes a `CausalLM` and token arrays, quantizes it in place; no file I/O (converters.pipelines.calibrate drives it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import time
from typing import Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.algorithms import awq, smoothquant
from qformats.algorithms.gptq import GPTQOptions, _one_blas_thread
from qformats.algorithms.sequential import Batches, input_groups, make_batches, pack_batches, packed_mask
from qformats.algorithms.shared_scales import fused_global_scales
from qformats.algorithms.weight_search import RTN, quantize_group, quantize_projection, search_name
from qformats import dispatch
from qformats.errors import ModelError
from qformats.kv_cache import KVCacheScheme, amax_of, scale_from_amax
from qformats.models.decoder import CausalLM, attention_mask, enable_kv_cache_quantization, inv_freq, rope_tables
from qformats.models.decoder.calibration_families import (attention_projections, check_fused_experts, expert_gate_up,
                                                          refuse_scaling)
from qformats.models.decoder.model import MLP
from qformats.models.decoder.moe import DeepseekRouter, MoEBlock, MoEConfig, activation, route
from qformats.models.decoder.params import interleave_gate_up
from qformats.matching import resolve_scheme
from qformats.nn import CalibStat, QLinear
from qformats.nn.projection import add_bias, dot
from qformats.nn.experts import Experts, QExperts
from qformats.qarray import QArray
from qformats.plan import check_fits
from qformats.quantize import dequantize
from qformats.observers import get_observer, static_scale
from qformats.schemes import SchemeSet
from qformats.threads import each

__all__ = ["PROJECTIONS", "AWQ_MAPPINGS", "MLA_AWQ_MAPPINGS", "AWQMapping", "SMOOTHQUANT_MAPPINGS", "calibrate_decoder",
           "awq_transform", "smoothquant_transform",
           # mixture-of-experts layers
           "MOE_STATISTICS", "MOE_SMOOTHQUANT_MAPPINGS", "expert_moments", "quantized_paths", "moe_ignored"]

PROJECTIONS = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
               "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
"""The seven projections of a decoder layer, by path relative to the layer (HF's module names)."""
PROPAGATE = ("quantized", "float")
SHAPE_COST_PARAMS = 20_000_000_000
"""`calibrate_decoder`'s default shape_cost numerator: the cost of compiling the layer passes for one more batch
shape, as token positions times (layers * parameters per layer) run through them (measured on XLA:CPU, SmolLM2-135M:
~1.7 CPU s per shape, ~0.28 ms per position per layer of 3.3M parameters)."""


class _Masked(nnx.Module):
    """Calibration wrapper of one projection: the calibrating QLinear inside sees its input with padding rows
    zeroed (`valid` is set before each batch), so they add nothing to its sum of x x^T or activation range.
    With `tap`, that masked input is also sown (nnx.Intermediate "x") for H to be summed on the host
    (`_host_moments`)."""

    def __init__(self, inner: QLinear, tap: bool = False):
        self.inner = inner
        self.tap = tap
        self.valid = CalibStat(jnp.ones((1, 1), jnp.float32))

    def __call__(self, x):
        v = self.valid.get_value().reshape(x.shape[:-1])  # [B, T], or [M] inside an MoE block (flattened tokens)
        x = x * v[..., None].astype(x.dtype)
        if self.tap:
            self.sow(nnx.Intermediate, "x", x)
        return self.inner(x)


def _tap_items(taps, inside: Optional[str] = None) -> List[Tuple[str, object]]:
    """(path relative to the layer, sown Variable or tuple) of each input a layer's tapped projections (`_Masked`
    with tap) sowed in one pass (`taps`, as nnx.capture returns them). `inside`: the attribute name of a `_CalibMoE`
    wrapping the layer's MoE block, whose taps (the shared expert's) are keyed at the block's own path
    ("mlp/shared_expert/gate_proj", not "mlp/block/shared_expert/gate_proj")."""
    items = []
    for path, var in nnx.to_flat_state(taps):  # path: the _Masked module's, then "x"; value: the sown tuple
        rel = "/".join(str(p) for p in path[:-1])
        if inside is not None and rel.startswith(f"{inside}/block/"):
            rel = f"{inside}/" + rel[len(f"{inside}/block/"):]
        items.append((rel, var))
    return items


def _tap_width(item) -> int:
    """The input width K of a `_tap_items` item (its x x^T costs tokens * K^2 multiply-adds)."""
    var = item[1]
    values = var.get_value() if isinstance(var, nnx.Variable) else var
    return int(values[0].shape[-1]) if values else 0


def _add_moments(rel: str, var, sums: Dict[str, np.ndarray], products: Dict[int, np.ndarray]) -> None:
    """sums[rel] += x^T x (float32 [K, K]) of each input in one `_tap_items` item, x its [tokens, K] rows.

    On the host: NumPy's `x.T @ x` is BLAS syrk (one triangle, half the multiply-adds of XLA:CPU's general product);
    the caller holds `gptq._one_blas_thread`. `products`: a scratch [K, K] per K that each product is written into
    before it is added (the caller's, kept across calls): the same syrk and the same sums, bit for bit, without a
    fresh 9 MiB block (K = 1536) mapped and zeroed for every batch."""
    for x in (var.get_value() if isinstance(var, nnx.Variable) else var):
        a = np.asarray(x)
        a = a.reshape(-1, a.shape[-1]).astype(np.float32, copy=False)
        if rel not in sums:
            sums[rel] = a.T @ a
        else:
            k = a.shape[1]
            if k not in products:
                products[k] = np.empty((k, k), np.float32)
            sums[rel] += np.matmul(a.T, a, out=products[k])
    if isinstance(var, nnx.Variable):  # flax keeps the captured Variables referenced: let go of the arrays
        var.set_value(())


def _host_moments(taps, sums: Dict[str, np.ndarray], products: Dict[int, np.ndarray],
                  inside: Optional[str] = None) -> None:
    """Adds x^T x of each input sown in one pass (`taps`) to `sums[path]` (`_tap_items`, `_add_moments`), on one
    BLAS thread (`gptq._one_blas_thread`)."""
    with _one_blas_thread():
        for rel, var in _tap_items(taps, inside):
            _add_moments(rel, var, sums, products)


def _search_as_summed(groups, last, sums: Dict[str, np.ndarray], products: Dict[int, np.ndarray],
                      inside: Optional[str], search: Callable, workers: int, where: str, weight_search: str) -> list:
    """[search(group) for group in groups], each group's search started as soon as its H is complete: the last
    batch's taps (`last`, or None) are summed here, narrowest input first, while the searches of the groups already
    complete run on `workers` threads (the last batch's x x^T would otherwise leave a core idle: the device is done).
    The same sums and the same searches as summing everything first. Call under `gptq._one_blas_thread`.

    Raises ModelError (once every started search has returned) when a group's first member recorded no input."""
    items = sorted(_tap_items(last, inside), key=_tap_width) if last is not None else []
    later = {rel for rel, _ in items}
    by_first = {group[0]: group for group in groups}
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        started = {g[0]: pool.submit(search, g) for g in groups if g[0] in sums and g[0] not in later}
        for rel, var in items:
            _add_moments(rel, var, sums, products)
            if rel in by_first and rel not in started:
                started[rel] = pool.submit(search, by_first[rel])
        for group in groups:
            if group[0] not in started:  # never a silent round-to-nearest
                raise ModelError(f"{where}/{group[0]}: the calibration pass recorded no input statistics for this "
                                 f"projection's {weight_search} search")
        return [started[g[0]].result() for g in groups]


def _get(layer, rel: str):
    """The submodule at `rel` ("self_attn/q_proj", "input_layernorm"), a path relative to the layer."""
    m = layer
    for part in rel.split("/"):
        m = getattr(m, part)
    return m


def _set(layer, rel: str, new) -> None:
    *head, last = rel.split("/")
    setattr(_get(layer, "/".join(head)) if head else layer, last, new)


def _set_valid(layer, valid) -> None:
    """Hands the batch's [B, T] real-token mask to every calibrating module of the layer (`_Masked`, `_CalibMoE`)."""
    for _, m in nnx.iter_modules(layer):
        if isinstance(m, (_Masked, _CalibMoE)):
            m.valid.set_value(valid.astype(jnp.float32))


# The layer passes are jax.jit functions of (graphdef, state), not nnx.jit ones of the layer: nnx.jit returns every
# variable of the module as an output, so each run copied the layer's weights (14 MiB on SmolLM2) into fresh buffers.
@functools.partial(jax.jit, static_argnames=("graphdef", "keep_output", "kv_scheme", "rows"))
def _calibration_run(graphdef, state, x, valid, cos, sin, mask, keep_output, kv_scheme=None, rows=None):
    """`_calibration_pass` on the split layer: (output or None, taps, its non-Param state after the run, the KV
    ranges or None)."""
    layer = nnx.merge(graphdef, state)
    _set_valid(layer, valid)
    (out, kv), taps = nnx.capture(lambda m: m(x, cos, sin, mask), nnx.Intermediate)(layer)
    b = x.shape[0]
    if rows is not None and rows != b:  # [B', T, K] or [B' T, K] -> B = rows: zero rows after the real ones
        taps = jax.tree.map(lambda a: jnp.pad(a, [(0, a.shape[0] // b * (rows - b))] + [(0, 0)] * (a.ndim - 1)), taps)
    amax = None
    if kv_scheme is not None:  # kv: the layer's (keys, values)
        real = valid[:, None, :, None]
        amax = tuple(amax_of(jnp.where(real, s, jnp.zeros((), s.dtype)), kv_scheme) for s in kv[:2])
    return (out if keep_output else None), taps, nnx.state(layer, nnx.Not(nnx.Param)), amax


def _calibration_pass(layer, x, valid, cos, sin, mask, keep_output, kv_scheme=None, rows=None):
    """Runs the calibrating layer (its projections record their statistics, written back into `layer`); returns
    (its output, the inputs its tapped projections sowed: `_host_moments`), the output only with `keep_output`:
    otherwise XLA drops what no statistic needs (down_proj's product and the residual after it). With `kv_scheme`,
    also max |state| of the keys / values this batch's real tokens put into the cache (shapes
    `kv_scheme.scale_shape`: per tensor or per KV head). `rows`: the taps of a batch of fewer rows (`pack_batches`'
    last) padded with zero rows to that many, so the host's x^T x runs on the shape, and gives the bits, of the
    batch filled up with empty rows (BLAS splits the summed dimension by its length)."""
    graphdef, state = nnx.split(layer)
    out, taps, stats, amax = _calibration_run(graphdef, state, x, valid, cos, sin, mask, keep_output, kv_scheme,
                                              rows)
    nnx.update(layer, stats)
    return (out, taps) if kv_scheme is None else (out, taps, amax)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward_state(graphdef, state, x, cos, sin, mask):
    """The layer's output for x, the layer split (graphdef, state) once for many batches."""
    return nnx.merge(graphdef, state)(x, cos, sin, mask)[0]


def _forward(layer, x, cos, sin, mask):
    """The layer's output for x (`_forward_state` on the layer split)."""
    return _forward_state(*nnx.split(layer), x, cos, sin, mask)


class _Dequantized(nnx.Module):
    """A packed QLinear's weight-only forward pass on its weight dequantized once, for a pass that runs one layer
    over many batches: y = dot(x, W) + b, W = dequantize(q) in the compute dtype (the layer's `dtype`, else x's):
    `dispatch.xla_qdot`'s path for more than FUSED_GEMV_ROWS rows, the same values, without a dequantize (and its
    temporaries, mapped afresh on XLA:CPU) in every batch's run. W is kept as W^T [N, K], the layout `dequantize`
    makes it in (QArray.tshape) and xla_qdot's dot reads: XLA:CPU picks its dot kernel by the operand's layout, and
    on an AVX-512 CPU the kernel for a [K, N] operand sums in another order (other bits)."""

    def __init__(self, lin: QLinear, dtype):
        self.dtype = lin.dtype
        self.weight_t = nnx.Variable(_dequantize_t(lin.kernel.get_value(), dtype))
        self.bias = None if lin.bias is None else nnx.Variable(lin.bias.get_value())

    def __call__(self, x):
        if self.dtype is not None:
            x = x.astype(self.dtype)
        # the transpose folds into the dot, as the one of xla_qdot's dequantized weight does
        return add_bias(dot(x, self.weight_t.get_value().T), None if self.bias is None else self.bias.get_value())


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_t(q, dtype):
    """dequantize(q, dtype=dtype)^T: [N, K] for a [K, N] QArray."""
    return jnp.swapaxes(dequantize(q, dtype=dtype), 0, 1)


def _dequantizable(lin, x) -> bool:
    """Whether `lin`'s forward pass on x (a [rows, K] ShapeDtypeStruct; activations already unquantized) is the XLA
    dequantize-then-dot path, which `_Dequantized` reproduces: a packed QLinear, no activation scheme, no kernel
    that would take (x, its weight), more rows than the fused matrix-vector path takes."""
    if type(lin) is not QLinear or lin.mode != "ptq" or lin.schemes.input_activations is not None:
        return False
    q = lin.kernel.get_value()
    return (isinstance(q, QArray) and q.ndim == 2 and lin.kernel_cache is None
            and x.shape[0] > dispatch.FUSED_GEMV_ROWS and dispatch.select_kernel(x, q) is None)


def _propagate(layer, xs, layer_inputs) -> None:
    """Replaces each batch of `xs` by the layer's output with the quantized weights and float activations (each
    projection runs with its weight scheme alone while propagating: llm-compressor's propagation pass is under
    DisableQuantization, the weights GPTQ wrote back, unquantized inputs). In place, so a batch's input is freed
    as its output is made. Projections on the XLA dequantize-then-dot path run on their weights dequantized once
    for all batches (`_Dequantized`), then are put back."""
    saved, swapped = {}, {}
    for rel in _linear_projections(layer) + _expert_paths(layer):
        lin = _get(layer, rel)
        if lin.schemes.input_activations is not None or lin.schemes.output_activations is not None:
            saved[rel] = lin.schemes
            lin.schemes = SchemeSet(lin.schemes.name, lin.schemes.weights)
    try:
        if xs:
            rows = int(np.prod(xs[0].shape[:-1]))
            for rel in _linear_projections(layer):
                lin = _get(layer, rel)
                dtype = lin.dtype if lin.dtype is not None else xs[0].dtype
                if _dequantizable(lin, jax.ShapeDtypeStruct((rows, lin.kernel.get_value().shape[0]), dtype)):
                    swapped[rel] = lin
                    _set(layer, rel, _Dequantized(lin, dtype))
        graphdef, state = nnx.split(layer)
        for j in range(len(xs)):
            xs[j] = _forward_state(graphdef, state, xs[j], *layer_inputs(j))
    finally:
        for rel, lin in swapped.items():
            _set(layer, rel, lin)
        for rel, schemes in saved.items():
            _get(layer, rel).schemes = schemes


@nnx.jit
def _embed(model, ids):
    return model.model.embed_tokens(ids)


_OBSERVERS: Dict = {}


def _observer(scheme):
    """One minmax observer per scheme: the calibrating layers of every decoder layer then share one graph (an
    observer is a static attribute, compared by identity), so the calibration pass compiles once."""
    if scheme not in _OBSERVERS:
        _OBSERVERS[scheme] = get_observer("minmax", scheme)
    return _OBSERVERS[scheme]


def _layer_inputs(config, batches: Batches, j: int, window):
    """(cos, sin, mask) of batch j: [T, D] tables and a [T, T] causal mask for one sample a row, or per-row
    [B, T, D] tables of each token's position in its sample and a [B, T, T] mask within samples (packed rows)."""
    t = batches.ids[j].shape[1]
    if batches.positions is None:
        positions = jnp.arange(t, dtype=jnp.int32)
        mask = attention_mask(positions, t, window)
    else:
        positions = jnp.asarray(batches.positions[j])
        mask = jnp.asarray(packed_mask(batches.positions[j], batches.segments[j], window))
    cos, sin = rope_tables(positions, inv_freq(config), config.rope.attention_scaling)
    return cos, sin, mask


CALIBRATION_AHEAD = 2
"""How many batches `calibrate_decoder`'s calibration pass dispatches to the device past the one whose x x^T the host
is summing (`_host_moments`, in batch order: the same sums whatever the value): with 1 the device waits for the
host's next dispatch whenever its batch finishes first; each one more keeps one more batch's sown inputs alive
(25.5 MiB a batch of 2048 SmolLM2 tokens)."""

SEARCH_WORKERS = 2
"""How many of a layer's projection groups (q/k/v, o, gate/up, down: one H each) `calibrate_decoder` searches at once
(GPTQ and the other H-driven searches), from as many threads: one search's column loop, host factorizations and
read-backs leave a core idle that the other's fill. The same codes; 1: one after the other."""


def calibrate_decoder(model: CausalLM, samples, scheme, *, weight_search: str = "gptq",
                      gptq: GPTQOptions = GPTQOptions(), propagate: str = "quantized", guard: bool = True,
                      transform: Optional[Callable] = None, kv_cache: Optional[KVCacheScheme] = None,
                      tokens_per_batch: int = 2048, bucket: int = 32, max_padding: float = 0.125,
                      shape_cost: Optional[int] = None, pack: bool = True,
                      embed: Optional[Callable] = None, load_layer: Optional[Callable] = None,
                      store_layer: Optional[Callable] = None, between_phases: Optional[Callable[[], None]] = None,
                      timings: Optional[Dict[str, float]] = None, log: Callable[[str], None] = lambda m: None,
                      moe_statistics: str = "all", moe_record: Optional[list] = None) -> dict:
    """Quantize the seven projections of every decoder layer of `model` in place, layer by layer (module docstring).

    Args:
      model: a float `CausalLM` (its projections nnx.Linear; lm_head and embeddings stay dense).
      samples: calibration token arrays (a list of 1-D int arrays, e.g. `converters.evaluation.calibration_data`), or Batches.
      scheme: a scheme string ("W4A16:g64", ...) or SchemeSet for every projection.
      weight_search: "rtn", "mse", "gptq" or "mse+gptq" (`qformats.algorithms.weight_search.quantize_projection`).
      gptq: GPTQ's options (llm-compressor 0.14's defaults).
      propagate: "quantized" (layer i+1 calibrates on layer i's outputs with its quantized weights: llm-compressor's
        default) or "float" (on the float outputs: then the result equals `quantize_model` on the whole model).
      guard: keep round-to-nearest for a projection where the search does not lower tr(dW^T H dW).
      transform: optional `transform(layer, index, xs, valid, layer_inputs)` run on the float layer before its
        calibration pass (e.g. `smoothquant_transform` folding scales into the layer): `xs`
        the layer's input batches [B, T, d], `valid` their [B, T] real-token masks, `layer_inputs(j) -> (cos,
        sin, mask)` batch j's other arguments. It may return the float layer's outputs for every batch, computed
        before it changed the layer (a function-preserving fold): with propagate="float" and a calibration pass
        that would record nothing (weight_search "rtn", dynamic or no activation scales, no static KV-cache
        scales, no MoE layer) they are the next layer's inputs and the pass is skipped (with propagate=
        "quantized" such a pass is skipped anyway).
      kv_cache: quantize the KV cache too (`qformats.kv_cache`): static scales k_scale = max|keys| / 448 (per
        tensor or per KV head) over the real tokens of every layer's calibration pass, i.e. from that layer's
        float projections fed by the propagated (quantized-weight) outputs of the layers below, as
        llm-compressor 0.14 observes them; a dynamic scheme is enabled as is.
      pack: several samples per row (`pack_batches`: one batch shape, so each layer pass compiles once, and
        few padded positions; each sample attends to itself only, so the statistics are those of one sample a
        row); False: one sample a row (`make_batches`, with the options below).
      tokens_per_batch, bucket, max_padding, shape_cost: batching (`make_batches`; with `pack`, `pack_batches`:
        all but max_padding, and shape_cost only without a transform or experts). shape_cost None: the
        layer passes' compilation cost in token positions, SHAPE_COST_PARAMS / (layers * parameters per layer)
        (one [B, T] shape's two compilations cost about what running that many positions through every layer
        does: measured on SmolLM2, ~200 positions); 0: bucket merging by max_padding only. A layer pass's temporaries grow with the
        batch ([B, heads, T, T] attention scores, [B, T, intermediate] MLP activations): 2048 tokens a batch keep
        them to a few tens of MiB on SmolLM2-sized layers.
      embed, load_layer, store_layer: streaming (the model need not be resident: `converters.pipelines.calibrate` reads
        one layer at a time from the checkpoint and writes it out when done). `embed(ids)` -> [B, T, d]
        embeddings of a batch's token ids (default: the model's embed_tokens); `load_layer(i, layer)` fills
        layer i's parameters just before its turn; `store_layer(i, layer)` receives layer i once quantized
        and propagated (full module paths set), after which calibration never touches it again.
      between_phases: optional `between_phases()` called after each layer's transform, calibration pass, the weight
        search of each of its input groups (q/k/v, o, gate/up, down) and its propagation (e.g.
        `converters.process.trim_malloc`: the temporaries of one phase, its first compilation included, handed back
        before the next).
      timings: optional dict; the wall seconds of each phase are added to it under "embed", "load layer",
        "transform", "calibration pass" (the last batch's host sums, which overlap the searches, counted in the
        weight search), "weight search", "propagation" (every layer but the last: the last one's
        outputs feed no layer, so its propagation pass is skipped), "store layer", and the process's CPU
        seconds under the same name + " cpu" (compilations included: each phase waits for its results before
        the clock is read, so the figures add up to the call's time); the same after the first layer under
        NAME + " (layer 1)" (the first layer compiles the layer passes and the weight search).
      log: progress messages.
      moe_statistics: mixture-of-experts layers (`MOE_STATISTICS`): "all" (default, llm-compressor 0.14's
        `moe_calibrate_all_experts=True`): in the calibration pass every real token goes through every expert for
        the statistics (expert e's gate / up H = the block input's E[x x^T], its down H = E[a_e a_e^T] over all
        tokens, `expert_moments`) while the layer's output, and so what the next layer sees, uses the routed
        experts only; "routed": each expert's statistics over the tokens routed to it, an expert that receives
        none is a ModelError naming layer and expert; "routed-or-all": such an expert takes the all-token
        statistics instead. Each expert is then quantized like a Linear with its H (`_quantize_experts`); routers
        and the shared expert's gate stay float.
      moe_record: optional list; per sparse layer one dict {"layer", "statistics", "tokens" (routed real tokens per
        expert), "h_in", "h_mid" (and "h_in_all", "h_mid_all")}: the `expert_moments` sums (not divided).

    Returns {"layers": L, "searched": projections whose search won, "projections": quantized projections (each
    expert's three counted apart), "tokens": n}.

    Raises:
      ModelError: a scheme that does not fit a projection, a bad weight_search / propagate, no samples, or a
        model whose projections are already quantized; gpt-oss with weight scales per tensor or 2-D block (they would
        span its fused gate / up rows: `calibration_families.check_fused_experts`); a KV-cache scheme on latent
        attention; AWQ / SmoothQuant transforms on gpt-oss layers
        (`calibration_families.refuse_scaling`). Static activation scales (FP8's per-tensor input scale =
        max|x| / 448, NVFP4's input global scale = 448 * 6 / max|x|, compressed-tensors' generate_gparam) come from
        each projection's max |x| over the real tokens of the calibration pass (llm-compressor's static_minmax),
        for each expert over the tokens `moe_statistics` gives it (`expert_ranges`; an expert without tokens under
        "routed" is the same ModelError).
    """
    if model.config.mla is not None and kv_cache is not None:
        raise ModelError(f"calibrate_decoder: KV-cache quantization of the {model.config.model_type} model's latent "
                         "cache (multi-head latent attention) is not supported; calibrate without kv_cache")
    weight_search = search_name(weight_search)
    if propagate not in PROPAGATE:
        raise ModelError(f"calibrate_decoder: propagate must be one of {PROPAGATE}, got {propagate!r}")
    ss = resolve_scheme(scheme)
    if ss is None or ss.weights is None:
        raise ModelError(f"calibrate_decoder: scheme {scheme!r} quantizes no weights")
    _check_moe(model, ss, moe_statistics, weight_search)
    if shape_cost is None:
        per_layer = sum(int(np.prod(_get(model.model.layers[0], rel).kernel.get_value().shape))
                        for rel in _linear_projections(model.model.layers[0]) + _expert_paths(model.model.layers[0]))
        shape_cost = SHAPE_COST_PARAMS // max(1, len(model.model.layers) * per_layer)
    if isinstance(samples, Batches):
        batches = samples
    elif pack:
        # with a transform or a mixture of experts one shape: their float statistics (AWQ's means, the experts' H)
        # reduce over whole batches on the device, and a last batch without its empty rows would move them by roundoff
        batches = pack_batches(samples, tokens_per_batch=tokens_per_batch, bucket=bucket,
                               shape_cost=shape_cost if transform is None and model.config.moe is None else 0)
    else:
        batches = make_batches(samples, tokens_per_batch=tokens_per_batch, bucket=bucket, max_padding=max_padding,
                               shape_cost=shape_cost)
    cfg = model.config
    layers = model.model.layers
    fits = []
    for i, layer in enumerate(layers):
        for rel in _linear_projections(layer):
            lin = _get(layer, rel)
            if type(lin) is not nnx.Linear:
                raise ModelError(f"model/layers/{i}/{rel}: expected a float nnx.Linear to calibrate, found "
                                 f"{type(lin).__name__}")
            fits.append((f"model/layers/{i}/{rel}", int(lin.kernel.get_value().shape[0]), ss))
        for rel in _expert_paths(layer):
            ex = _get(layer, rel)
            if type(ex) is not Experts:
                raise ModelError(f"model/layers/{i}/{rel}: expected float Experts to calibrate, found "
                                 f"{type(ex).__name__}")
            fits.append((f"model/layers/{i}/{rel}", int(ex.kernel.get_value().shape[1]), ss))
    a = ss.input_activations
    static = a is not None and a.dynamic is not True
    check_fits(fits, static_acts=static)

    tables = {}

    def layer_inputs(j: int, window):
        key = (batches.ids[j].shape[1] if batches.positions is None else j, window)
        if key not in tables:
            tables[key] = _layer_inputs(cfg, batches, j, window)
        return tables[key]

    # packed batches (one row length): a last batch of fewer rows has its taps padded to a whole batch's rows
    full = max(a.shape[0] for a in batches.ids) if batches.positions is not None else None
    clock = _Clock(timings)
    xs = [_embed(model, jnp.asarray(ids)) if embed is None else jnp.asarray(embed(ids)) for ids in batches.ids]
    valid = [jnp.asarray(v) for v in batches.valid]
    clock("embed", xs)
    searched = projections = 0
    kv_static = kv_cache is not None and not kv_cache.dynamic
    kv_scales = []
    products: Dict[int, np.ndarray] = {}  # `_host_moments`' scratch, one [K, K] per input width, for every layer
    for i, layer in enumerate(layers):
        window = cfg.sliding_windows[i]
        if load_layer is not None:
            load_layer(i, layer)
            clock("load layer")
        outputs = None
        if transform is not None:
            outputs = transform(layer, i, xs, valid, lambda j: layer_inputs(j, window))
            clock("transform", nnx.state(layer))
            if between_phases is not None:
                between_phases()
        projs = _linear_projections(layer)
        groups = input_groups(projs)
        floats = {}
        for group in groups:
            for rel in group:
                lin = _get(layer, rel)
                floats[rel] = lin.kernel.get_value()
                obs = _observer(a if a is not None else ss.weights)
                cal = QLinear.from_module(lin, ss, mode="calibrate", path=rel, observer=obs)
                # the group's members read the same input: its first member records the input range, and its
                # input is tapped for H = sum x x^T (summed on the host, `_host_moments`)
                cal.record_inputs = rel == group[0]
                _set(layer, rel, _Masked(cal, tap=weight_search != RTN and rel == group[0]))
        sums: Dict[str, np.ndarray] = {}
        moe = _moe_calibrating(layer, weight_search, moe_statistics, static)
        # the calibration pass's outputs are the next layer's inputs only with float propagation; otherwise
        # the propagation pass makes them, and this pass keeps none (nor computes what only they need)
        keep = propagate == "float"
        # round-to-nearest weights with dynamic (or no) activation scales, no static KV-cache scales and no MoE
        # statistics: the pass records nothing; it runs for the next layer's inputs only, unless the transform
        # has handed back the float layer's outputs (computed before it rescaled the layer: the same function)
        records = weight_search != RTN or static or kv_static or moe is not None
        if not records and keep and outputs is not None:
            xs[:] = outputs
        skip = not records and (not keep or outputs is not None)
        del outputs
        amax = None
        # the masks get a batch's shape before the first pass: the pass sets them as state, so a placeholder
        # shape would make its second batch (of every layer) a second compilation
        _set_valid(layer, valid[0])
        inside = None if moe is None else moe.name
        pending = collections.deque()  # taps of dispatched batches, summed on the host CALIBRATION_AHEAD behind
        for j, (x, v) in enumerate(zip(xs, valid) if not skip else ()):
            args = (layer, x, v, *layer_inputs(j, window))
            if kv_static:
                out, taps, cur = _calibration_pass(*args, keep, kv_cache, rows=full)
                amax = cur if amax is None else tuple(jnp.maximum(a, c) for a, c in zip(amax, cur))
            else:
                out, taps = _calibration_pass(*args, keep, rows=full)
            if keep:
                xs[j] = out
            pending.append(taps)
            del taps
            if len(pending) > CALIBRATION_AHEAD:
                _host_moments(pending.popleft(), sums, products, inside)
        while len(pending) > (1 if weight_search != RTN else 0):  # the last batch's: summed as the searches start
            _host_moments(pending.popleft(), sums, products, inside)
        last = pending.popleft() if pending else None
        if kv_static:
            kv_scales.append(tuple(scale_from_amax(a) for a in amax))
        moe_stats = None if moe is None else moe.finish(layer)  # the MoE block back in place, its statistics out
        clock("calibration pass", (nnx.state(layer), xs))
        if between_phases is not None:
            between_phases()
        shared = fused_global_scales(floats, ss.weights) if weight_search in (RTN, "gptq") else {}
        results = {}

        def search(group, tokens=np.float32(batches.tokens)):
            h = jnp.asarray(sums[group[0]] / tokens) if group[0] in sums else None
            return quantize_group({r: floats[r] for r in group}, ss, h, weight_search, gptq, guard, shared)

        # the groups' searches two at a time (`SEARCH_WORKERS`), each as soon as its H is complete; one BLAS thread
        # around them all (their own limits nest)
        with _one_blas_thread():
            if weight_search == RTN:
                found = each(search, groups, 1)
            else:
                found = _search_as_summed(groups, last, sums, products, inside, search, SEARCH_WORKERS,
                                          f"model/layers/{i}", weight_search)
        del last
        for group, got in zip(groups, found):
            results.update(got)
            first = _get(layer, group[0]).inner
            for rel in group[1:]:  # the input range the first member observed is theirs too
                _get(layer, rel).inner.calib_amax.set_value(first.calib_amax.get_value())
        sums.clear()
        del found
        if between_phases is not None:
            between_phases()
        for rel in projs:
            inner = _get(layer, rel).inner
            q, method = results[rel]
            if static:
                inner.finalize("ptq", q, method)  # static activation scales from the observer
            else:
                bias = inner.bias
                inner = QLinear(q, None if bias is None else bias.get_value(), ss, mode="ptq", dtype=inner.dtype,
                                path=rel)
            inner.weight_method = method
            searched += method != RTN
            _set(layer, rel, inner)
        projections += len(projs)
        if moe is not None:
            n_searched, n_experts = _quantize_experts(layer, moe_stats, ss, weight_search, gptq, guard, moe_statistics,
                                                      batches.tokens, f"model/layers/{i}", moe_record, i)
            searched += n_searched
            projections += n_experts
        clock("weight search", nnx.state(layer))
        if propagate == "quantized" and i < len(layers) - 1:  # the last layer's outputs feed no layer
            _propagate(layer, xs, lambda j: layer_inputs(j, window))
            clock("propagation", xs)
            if between_phases is not None:
                between_phases()
        for rel in projs + _expert_paths(layer):  # full paths for messages and exports, now that layer i runs no more
            _get(layer, rel).path = f"model/layers/{i}/{rel}"
        if store_layer is not None:
            store_layer(i, layer)
            clock("store layer")
        if timings is not None and i == 0:  # layer 1 alone: its excess over the others' mean is compilation
            timings.update({f"{k} (layer 1)": v for k, v in list(timings.items()) if "(layer 1)" not in k})
        log(f"layer {i + 1}/{len(layers)}: {weight_search}")
    if kv_cache is not None:
        enable_kv_cache_quantization(model, kv_cache, kv_scales if kv_static else None)
    return {"layers": len(layers), "searched": searched, "projections": projections,
            "tokens": batches.tokens}


class _Clock:
    """Adds the wall seconds since its last reading to `timings[phase]` and the process's CPU seconds (all threads)
    to `timings[phase + " cpu"]`, after waiting for `arrays`; a no-op when `timings` is None."""

    def __init__(self, timings: Optional[Dict[str, float]]):
        self.timings = timings
        self.t, self.c = time.perf_counter(), time.process_time()

    def __call__(self, phase: str, arrays=None) -> None:
        if self.timings is None:
            return
        if arrays is not None:
            jax.block_until_ready(arrays)
        now, cpu = time.perf_counter(), time.process_time()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.t
        self.timings[phase + " cpu"] = self.timings.get(phase + " cpu", 0.0) + cpu - self.c
        self.t, self.c = now, cpu


# ---- Mixture-of-experts layers -----------------------------------------------------------------------------
MOE_STATISTICS = ("all", "routed", "routed-or-all")
"""What each expert's calibration statistics (GPTQ / MSE Hessians) are taken over, `calibrate_decoder`'s
moe_statistics: "all" (every real token goes through every expert for its statistics while the layer's output uses
only the routed experts: llm-compressor 0.14's `moe_calibrate_all_experts=True`, its default), "routed" (only the
tokens routed to the expert; an expert that receives none is refused with a ModelError naming layer and expert) or
"routed-or-all" (routed tokens, and every token for an expert that receives none)."""


def _moe_block(layer):
    """(attribute name, MoEBlock) of a sparse decoder layer (also while `_CalibMoE` wraps it), else None."""
    name = getattr(layer, "ffn_name", "mlp")
    blk = getattr(layer, name, None)
    if isinstance(blk, _CalibMoE):
        blk = blk.block
    return (name, blk) if isinstance(blk, MoEBlock) else None


def _linear_projections(layer) -> Tuple[str, ...]:
    """The nnx.Linear projections a layer's calibration quantizes, by path relative to the layer: the attention's
    (q/k/v/o, or DeepSeek's latent attention: `calibration_families.attention_projections`), then the dense MLP's
    gate / up / down, or in a sparse layer the shared expert's (qwen2_moe `shared_expert`, deepseek_v3
    `shared_experts`). The router and the shared expert's sigmoid gate stay float (llm-compressor's MoE recipes
    ignore `mlp.gate`, `mlp.router` and `shared_expert_gate`)."""
    attn = attention_projections(layer)
    found = _moe_block(layer)
    if found is None:
        return attn + PROJECTIONS[4:]
    name, blk = found
    c = blk.cfg
    out = attn
    if c.shared_expert_intermediate_size:
        out += tuple(f"{name}/{c.shared_name}/{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    return out


def _expert_paths(layer) -> Tuple[str, ...]:
    """The stacked expert projections (`Experts` [E, in, out]) of a sparse layer, by path relative to the layer, in
    (gate, up, down) order; () for a dense layer."""
    found = _moe_block(layer)
    if found is None:
        return ()
    name, blk = found
    return tuple(f"{name}/experts/{p}" for p in blk.cfg.projections if p is not None)


def quantized_paths(layer) -> Tuple[str, ...]:
    """Every weight `calibrate_decoder` quantizes in a decoder layer, by module path relative to the layer: its
    nnx.Linear projections, then its stacked experts (sparse layers)."""
    return _linear_projections(layer) + _expert_paths(layer)


def moe_ignored(config) -> List[str]:
    """HF module names of the float Linears `calibrate_decoder` leaves in sparse layers (routers, the shared expert's
    gate): the compressed-tensors `ignore` entries llm-compressor's MoE recipes give them."""
    m = config.moe
    if m is None:
        return []
    out = []
    for i, sparse in enumerate(config.moe_layers):
        if sparse:
            out.append(f"model.layers.{i}.{m.block_name}.{m.router_name}")
            if m.shared_expert_intermediate_size and m.shared_expert_gated:
                out.append(f"model.layers.{i}.{m.block_name}.shared_expert_gate")
    return out


def _check_moe(model, ss: SchemeSet, statistics: str, weight_search: str) -> None:
    """ModelError for MoE calibrations this driver does not do (before any work)."""
    if statistics not in MOE_STATISTICS:
        raise ModelError(f"calibrate_decoder: moe_statistics must be one of {MOE_STATISTICS}, got {statistics!r}")
    m = model.config.moe
    if m is None:
        return
    check_fused_experts(model.config.model_type, m, ss.weights, weight_search)


def expert_moments(x, valid, experts, gate, up, cfg: MoEConfig, statistics: str = "all", gate_bias=None,
                   up_bias=None) -> Dict[str, jax.Array]:
    """The calibration statistics of an MoE block's experts for one batch of tokens, as sums over tokens.

    x [M, d]: the block's input tokens; valid [M]: 1 for a real token, 0 for padding; experts [M, k]: each token's
    routed experts; gate, up [E, d, I]: the experts' kernels (gate_bias, up_bias [E, I]: their biases, gpt-oss).
    With a_e(x) = act(x W_gate[e] + b_gate[e], x W_up[e] + b_up[e]) (the block's activation, `moe.activation`) and
    the real tokens T (all of them) or T_e (those routed to expert e):

        tokens[e] = |T_e|
        "all":    h_in = sum_{t in T} x_t x_t^T [d, d] (every expert's gate / up input),
                  h_mid[e] = sum_{t in T} a_e(x_t) a_e(x_t)^T [E, I, I] (expert e's down_proj input)
        "routed": h_in[e] = sum_{t in T_e} x_t x_t^T [E, d, d], h_mid[e] = sum_{t in T_e} a_e a_e^T [E, I, I]
        "routed-or-all": the routed sums, plus the "all" ones as h_in_all, h_mid_all

    Routing weights do not enter (they scale an expert's output, after its down_proj). float32 throughout.
    """
    f32 = jnp.float32
    m = x.shape[0]
    valid = valid.astype(f32)
    xm = x.astype(f32) * valid[:, None]
    n = gate.shape[0]
    onehot = jnp.zeros((m, n), f32).at[jnp.arange(m)[:, None], experts].set(1.0) * valid[:, None]
    out = {"tokens": jnp.sum(onehot, axis=0)}

    def mid(e, mask):
        a = _expert_activation(xm, gate, up, gate_bias, up_bias, e, cfg) * mask[:, None]
        return a.T @ a

    if statistics != "routed":
        suffix = "" if statistics == "all" else "_all"
        out["h_in" + suffix] = xm.T @ xm
        out["h_mid" + suffix] = jax.lax.map(lambda e: mid(e, valid), jnp.arange(n))
    if statistics != "all":
        def routed(e):
            mask = onehot[:, e]
            xe = xm * mask[:, None]
            return xe.T @ xe, mid(e, mask)

        out["h_in"], out["h_mid"] = jax.lax.map(routed, jnp.arange(n))
    return out


def _expert_activation(x, gate, up, gate_bias, up_bias, e, cfg: MoEConfig):
    """a_e(x) = act(x W_gate[e] (+ b_gate[e]), x W_up[e] (+ b_up[e])) in float32: expert e's down_proj input."""
    f32 = jnp.float32
    g, u = x @ gate[e].astype(f32), x @ up[e].astype(f32)
    if gate_bias is not None:
        g, u = g + gate_bias[e].astype(f32), u + up_bias[e].astype(f32)
    return activation(g, u, cfg)


def expert_ranges(x, valid, experts, gate, up, cfg: MoEConfig, statistics: str = "all", gate_bias=None,
                  up_bias=None) -> Dict[str, jax.Array]:
    """The static activation ranges of an MoE block's experts for one batch of tokens (maxima over tokens).

    With `expert_moments`' notation (x [M, d], valid [M], experts [M, k], gate / up [E, d, I] and their biases):

        "all":    amax_in[e] = max_{t in T} max|x_t| (every expert's gate / up input, the same for all e),
                  amax_mid[e] = max_{t in T} max|a_e(x_t)| (expert e's down_proj input)
        "routed": the same maxima over T_e (0 for an expert that receives no token)
        "routed-or-all": the routed maxima, plus the "all" ones as amax_in_all, amax_mid_all

    Each is [E] float32, llm-compressor's `static_minmax` observer (the running max of |x|) of each expert's
    gate / up / down input, fed the tokens `moe_calibrate_all_experts` gives it."""
    f32 = jnp.float32
    m = x.shape[0]
    real = valid.astype(bool)
    xa = jnp.max(jnp.where(real[:, None], jnp.abs(x.astype(f32)), 0.0), axis=-1)  # [M]
    n = gate.shape[0]
    onehot = jnp.zeros((m, n), bool).at[jnp.arange(m)[:, None], experts].set(True) & real[:, None]
    xf = x.astype(f32)

    def mid(e):
        return jnp.max(jnp.abs(_expert_activation(xf, gate, up, gate_bias, up_bias, e, cfg)), axis=-1)

    mids = jax.lax.map(mid, jnp.arange(n))  # [E, M]
    out = {}
    if statistics != "routed":
        suffix = "" if statistics == "all" else "_all"
        out["amax_in" + suffix] = jnp.broadcast_to(jnp.max(xa), (n,))
        out["amax_mid" + suffix] = jnp.max(jnp.where(real[None, :], mids, 0.0), axis=1)
    if statistics != "all":
        out["amax_in"] = jnp.max(jnp.where(onehot.T, xa[None, :], 0.0), axis=1)
        out["amax_mid"] = jnp.max(jnp.where(onehot.T, mids, 0.0), axis=1)
    return out


class _CalibMoE(nnx.Module):
    """Calibration wrapper of an MoE block: the output is the block's own (routed experts only, float weights); the
    experts' statistics (`expert_moments`, summed over the batches, when `record`) and static activation ranges
    (`expert_ranges`, their maxima over the batches, when `ranges`) are recorded beside it."""

    def __init__(self, block: MoEBlock, name: str, statistics: str, record: bool, ranges: bool = False):
        self.block = block
        self.name = name
        self.statistics = statistics
        self.record = record
        self.ranges = ranges
        self.valid = CalibStat(jnp.ones((1, 1), jnp.float32))
        c = block.cfg
        gate, up, gb, ub = expert_gate_up(block.experts, c)
        d = int(gate.shape[1])
        args = (jax.ShapeDtypeStruct((1, d), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32),
                jax.ShapeDtypeStruct((1, c.top_k), jnp.int32), gate, up)
        zeros = lambda fn: {k: jnp.zeros(v.shape, v.dtype) for k, v in jax.eval_shape(  # noqa: E731
            functools.partial(fn, cfg=c, statistics=statistics, gate_bias=gb, up_bias=ub), *args).items()}
        self.sums = CalibStat(zeros(expert_moments) if record else
                              {"tokens": jnp.zeros((c.num_experts,), jnp.float32)} if ranges else {})
        self.maxima = CalibStat(zeros(expert_ranges) if ranges else {})

    def __call__(self, x):
        out = self.block(x)
        if not (self.record or self.ranges):
            return out
        b = self.block
        c = b.cfg
        xf = x.reshape(-1, x.shape[-1])
        router = getattr(b, c.router_name)
        _, idx = route(b.router_logits(xf), c, getattr(router, "e_score_correction_bias", None))
        gate, up, gb, ub = expert_gate_up(b.experts, c)
        args = (xf, self.valid.get_value().reshape(-1), idx, gate, up, c, self.statistics)
        bias = dict(gate_bias=gb, up_bias=ub)
        if self.record:
            cur = expert_moments(*args, **bias)
        else:  # the routed token counts alone (the empty-expert check of "routed" statistics)
            real = args[1].astype(jnp.float32)
            cur = {"tokens": jnp.zeros((xf.shape[0], c.num_experts), jnp.float32).at[
                jnp.arange(xf.shape[0])[:, None], idx].set(1.0).T @ real}
        self.sums.set_value({k: v + cur[k] for k, v in self.sums.get_value().items()})
        if self.ranges:
            cur = expert_ranges(*args, **bias)
            self.maxima.set_value({k: jnp.maximum(v, cur[k]) for k, v in self.maxima.get_value().items()})
        return out

    def finish(self, layer) -> Dict[str, jax.Array]:
        """Puts the block back into `layer`; returns the summed statistics and the ranges' maxima."""
        setattr(layer, self.name, self.block)
        return {**self.sums.get_value(), **self.maxima.get_value()}


def _moe_calibrating(layer, weight_search: str, statistics: str, static: bool) -> Optional[_CalibMoE]:
    """Wraps a sparse layer's MoE block for the calibration pass (statistics only when the weight search uses them,
    activation ranges only for a static activation scheme); None for a dense layer."""
    found = _moe_block(layer)
    if found is None:
        return None
    name, blk = found
    w = _CalibMoE(blk, name, statistics, record=weight_search != RTN, ranges=static)
    setattr(layer, name, w)
    return w


_EXPERT_COLUMNS = 8192
"""Under "all" statistics every expert's gate / up share one H: their GPTQ runs as one problem
(`gptq_quantize_shared`, the same codes as one call per expert) over chunks of about this many output columns."""


def _quantize_experts(layer, stats: Dict[str, jax.Array], ss: SchemeSet, weight_search: str, gptq: GPTQOptions,
                      guard: bool, statistics: str, tokens: int, where: str, record: Optional[list],
                      index: int) -> Tuple[int, int]:
    """Quantizes a sparse layer's stacked experts in place (each `Experts` becomes a `QExperts` whose expert e holds
    exactly what `quantize_group` / `quantize_projection` give expert e's own kernels for its own H), from the
    calibration pass's `stats` (`expert_moments` sums): H = sum / token count, per expert (moe_statistics); a static
    activation scheme's per-expert input scales from `expert_ranges`' maxima (`qformats.observers.static_scale`:
    FP8 input_scale = amax / 448, NVFP4 input_global_scale = 448 * 6 / amax).
    NVFP4 weight global scales are shared by each expert's gate and up (vLLM fuses them per expert). gpt-oss's fused
    gate_up_proj: its gate (even) and up (odd) columns are quantized as two Linears, as llm-compressor's linearized
    experts are, and interleaved back (`params.interleave_gate_up`). Returns (expert projections whose search won,
    expert projections), gate and up counted apart."""
    name, blk = _moe_block(layer)
    c = blk.cfg
    ex = blk.experts
    fused_name = c.projections[1] if c.fused_gate_up else None  # gpt-oss: gate / up quantized apart, then fused
    gname, uname, dname = ("gate_proj", "up_proj", c.projections[2]) if fused_name else c.projections
    n = c.num_experts
    gk, uk, _, _ = expert_gate_up(ex, c)
    kernels = {gname: gk, uname: uk, dname: getattr(ex, dname).kernel.get_value()}
    if record is not None and stats:
        record.append({"layer": index, "statistics": statistics, **{k: np.asarray(v) for k, v in stats.items()}})
    h_in: List = [None] * n
    h_mid: List = [None] * n
    a = ss.input_activations
    static = a is not None and a.dynamic is not True
    counts = np.asarray(stats["tokens"]) if stats else None
    if counts is not None and statistics != "all":
        empty = [e for e in range(n) if counts[e] == 0]
        if empty and statistics == "routed":
            what = " and ".join(x for x, on in (("GPTQ / MSE Hessians", weight_search != RTN),
                                                ("static activation ranges", static)) if on)
            raise ModelError(f"{where}/{name}/experts: expert{'s' if len(empty) > 1 else ''} "
                             f"{', '.join(map(str, empty))} of {n} received no calibration tokens under routed-only "
                             f"statistics (moe_statistics='routed'); their {what} would be empty. Calibrate "
                             "every expert on every token (moe_statistics='all', llm-compressor's default), use "
                             "all tokens for the empty ones (moe_statistics='routed-or-all'), or add samples")
    scales = {}
    if static:  # per-expert static input scales: gate / up share the block input's range, down its own
        amax = {k: np.asarray(stats[k]).copy() for k in ("amax_in", "amax_mid")}
        if statistics == "routed-or-all":
            for k in amax:
                amax[k][counts == 0] = np.asarray(stats[k + "_all"])[counts == 0]
        sdt = kernels[gname].dtype if kernels[gname].dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
        per = jax.vmap(lambda m: static_scale(m, a, sdt))
        for key, projs in (("amax_in", (fused_name,) if fused_name else (gname, uname)), ("amax_mid", (dname,))):
            sc, gl = per(jnp.asarray(amax[key], jnp.float32))
            for p in projs:
                scales[p] = {"input_scale": sc, "input_global_scale": gl}
    if weight_search != RTN:
        if statistics == "all":
            shared_h = stats["h_in"] / tokens
            h_in = [shared_h] * n
            h_mid = [stats["h_mid"][e] / tokens for e in range(n)]
        else:
            for e in range(n):
                if counts[e]:
                    h_in[e], h_mid[e] = stats["h_in"][e] / counts[e], stats["h_mid"][e] / counts[e]
                else:
                    h_in[e], h_mid[e] = stats["h_in_all"] / tokens, stats["h_mid_all"][e] / tokens
    shared = {}
    if weight_search in (RTN, "gptq"):
        for e in range(n):
            shared.update(fused_global_scales({f"{e}/{gname}": kernels[gname][e], f"{e}/{uname}": kernels[uname][e]},
                                              ss.weights))
    results: Dict[str, Tuple[QArray, str]] = {}
    inter = int(kernels[gname].shape[-1])
    chunk = max(1, _EXPERT_COLUMNS // (2 * inter)) if statistics == "all" and weight_search != RTN else 1
    for e0 in range(0, n, chunk):
        members = range(e0, min(n, e0 + chunk))
        group = {f"{e}/{p}": kernels[p][e] for e in members for p in (gname, uname)}
        results.update(quantize_group(group, ss, h_in[e0], weight_search, gptq, guard,
                                      {k: v for k, v in shared.items() if k in group}))
    for e in range(n):
        results[f"{e}/{dname}"] = quantize_projection(kernels[dname][e], ss, h_mid[e], weight_search, gptq, guard)
    searched = sum(r[1] != RTN for r in results.values())
    targets = (((fused_name, (gname, uname)), (dname, (dname,))) if fused_name else
               tuple((p, (p,)) for p in (gname, uname, dname)))
    for p, parts in targets:
        per = [[results[f"{e}/{q}"] for q in parts] for e in range(n)]
        qs = [rs[0][0] if len(rs) == 1 else interleave_gate_up(rs[0][0], rs[1][0], f"{where}/{name}/experts/{p}/{e}")
              for e, rs in enumerate(per)]
        q = jax.tree.map(lambda *leaves: jnp.stack([jnp.asarray(x) for x in leaves]), *qs)
        old = getattr(ex, p)
        new = QExperts.from_packed(q, None if old.bias is None else old.bias.get_value(), ss, dtype=old.dtype,
                                   path=f"{name}/experts/{p}", **scales.get(p, {}))
        new.weight_method = weight_search if any(r[1] != RTN for rs in per for r in rs) else RTN
        setattr(ex, p, new)
    return searched, 3 * n


# ---- AWQ on the decoder's modules --------------------------------------------------------------------------
class AWQMapping(tuple):
    """(smooth, balances, parent): paths relative to a decoder layer ("self_attn/v_proj", "input_layernorm")."""

    __slots__ = ()

    def __new__(cls, smooth: str, balances: Tuple[str, ...], parent: str):
        return super().__new__(cls, (smooth, tuple(balances), parent))

    smooth = property(lambda self: self[0])
    balances = property(lambda self: self[1])
    parent = property(lambda self: self[2])


AWQ_MAPPINGS: Tuple[AWQMapping, ...] = (
    AWQMapping("input_layernorm", ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj"), "self_attn"),
    AWQMapping("self_attn/v_proj", ("self_attn/o_proj",), "self_attn/o_proj"),
    AWQMapping("post_attention_layernorm", ("mlp/gate_proj", "mlp/up_proj"), "mlp"),
    AWQMapping("mlp/up_proj", ("mlp/down_proj",), "mlp/down_proj"),
)
"""llm-compressor 0.14's AWQ default_mappings for the decoder family; the parent is the balance projections'
lowest common ancestor (the projection itself when there is one). v_proj -> o_proj is skipped when v_proj's outputs
differ from o_proj's inputs, as under GQA (llm-compressor's exact rule)."""


class _Tap(nnx.Module):
    """Passes its arguments to the wrapped module and hands `sink` its first argument, or with output=True its output
    (the first element of a tuple output) under "out:" + rel (used inside one trace only)."""

    def __init__(self, inner, rel: str, sink: dict, output: bool = False):
        self.inner = inner
        self.rel = rel
        self.sink = nnx.data(sink)
        self.output = output

    def __call__(self, x, *rest):
        if not self.output:
            self.sink[self.rel] = x
        y = self.inner(x, *rest)
        if self.output:
            self.sink[OUT + self.rel] = y[0] if isinstance(y, tuple) else y
        return y


OUT = "out:"
"""`_capture`'s tap prefix for a module's output (a parent's reference output) rather than its input."""


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def _capture(graphdef, state, x, cos, sin, mask, taps):
    """One float pass of the layer over a batch; returns ({tap: array}: a module's input for a path in `taps`, its
    output for OUT + path; the layer's output)."""
    layer = nnx.merge(graphdef, state)
    seen: dict = {}
    for tap in taps:
        rel = tap[len(OUT):] if tap.startswith(OUT) else tap
        _set(layer, rel, _Tap(_get(layer, rel), rel, seen, output=tap.startswith(OUT)))
    y, _ = layer(x, cos, sin, mask)
    return {tap: seen[tap] for tap in taps}, y


def _run_parent(layer, parent: str, x, cos, sin, mask):
    y = _get(layer, parent)(x, cos, sin, mask) if parent == "self_attn" else _get(layer, parent)(x)
    return y[0] if isinstance(y, tuple) else y


@functools.partial(jax.jit, static_argnames=("graphdef", "parent"))
def _parent_out(graphdef, state, x, cos, sin, mask, parent):
    return _run_parent(nnx.merge(graphdef, state), parent, x, cos, sin, mask)


def _fused_mlp(mlp: MLP, x):
    """mlp(x) = down(silu(gate(x)) * up(x)) with gate_proj and up_proj run as one Linear, their kernels side by side
    ([d, 2 I]: one matmul, ~15% faster than two on XLA:CPU at the AWQ race's chunk sizes); the same function, float32
    summation order apart."""
    g, u = mlp.gate_proj, mlp.up_proj
    n = g.kernel.get_value().shape[-1]
    g.kernel.set_value(jnp.concatenate([g.kernel.get_value(), u.kernel.get_value()], axis=-1))
    if g.bias is not None:
        g.bias.set_value(jnp.concatenate([g.bias.get_value(), u.bias.get_value()]))
    gu = g(x)
    return mlp.down_proj(jax.nn.silu(gu[..., :n]) * gu[..., n:])


@functools.partial(jax.jit, static_argnames=("graphdef", "parent", "balances"))
def _parent_sse(graphdef, state, kernels, x, cos, sin, mask, ref, valid, parent, balances):
    """sum over the real tokens of |parent(x) - ref|^2 with the balance projections' kernels replaced by `kernels`
    (a dense MLP with both gate and up replaced: `_fused_mlp`)."""
    layer = nnx.merge(graphdef, state)
    for rel, k in zip(balances, kernels):
        _get(layer, rel).kernel.set_value(k)
    mod = _get(layer, parent)
    if type(mod) is MLP and mod.rotations is None and {f"{parent}/gate_proj", f"{parent}/up_proj"} <= set(balances):
        y = _fused_mlp(mod, x)
    else:
        y = _run_parent(layer, parent, x, cos, sin, mask)
    d = (y - ref).astype(jnp.float32)
    return jnp.sum(jnp.where(valid[..., None], d * d, 0.0))


def _kernel(lin):
    return lin.kernel.get_value()


@jax.jit
def _gram(x, valid):
    """H = sum over real tokens of x_t^T x_t (float32 [K, K]) for a batch x [B, T, K]."""
    v = jnp.where(valid[..., None], x.astype(jnp.float32), 0.0).reshape(-1, x.shape[-1])
    return v.T @ v


@jax.jit
def _gram_sse(h, new, orig):
    """sum over the real tokens of |x_t (W' - W)|^2 = sum(dW * (H dW)), dW = W' - W (Flax kernels [K, N])."""
    d = (new - orig).astype(jnp.float32)
    return jnp.sum(d * (h @ d))


AWQ_CHUNK_TOKENS = 512
"""Token positions per chunk of the AWQ race (`qformats.algorithms.awq.race_scales`): small enough that a losing grid
point stops after a fraction of the tokens, large enough to keep the matmuls efficient."""


@jax.jit
def _token_norms(x):
    """|x_t|^2 (float32) of every token of a batch [B, T, d]: [B, T]."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1)


@functools.partial(jax.jit, static_argnames=("flat", "size"))
def _take(arrays, idx, flat, size):
    """Rows idx of the batches `arrays` ([B, T, ...] each) concatenated: along B, or with flat=True along B * T
    (tokens), as a tuple of chunks of `size` rows; an index past the end gives a row of zeros."""
    a = jnp.concatenate([x.reshape((-1,) + x.shape[2:]) if flat else x for x in arrays])
    a = jnp.take(a, idx, axis=0, mode="fill", fill_value=0)
    return tuple(a[c:c + size] for c in range(0, a.shape[0], size))


def _token_chunks(inputs, valid, size: Optional[int] = None, outs=None):
    """The real tokens of batches [B, T, d], largest |x_t|^2 first (ties in token order), as chunks [1, size, d]
    with their masks [1, size] (the last padded with zero rows): the inputs of a token-wise parent (the MLP).
    size: AWQ_CHUNK_TOKENS by default. With `outs` (batches [B, T, e] beside the inputs: the parent's outputs),
    returns (chunks, the outputs' chunks [1, size, e] in the same order)."""
    size = AWQ_CHUNK_TOKENS if size is None else size
    keep = np.concatenate([np.asarray(v).reshape(-1) for v in valid])
    norms = np.concatenate([np.asarray(_token_norms(b)).reshape(-1) for b in inputs])
    real = np.flatnonzero(keep)
    n = real.shape[0]
    pad = -n % size
    idx = np.concatenate([real[np.argsort(-norms[real], kind="stable")], np.full(pad, keep.shape[0])])
    v = np.arange(n + pad) < n

    def gathered(batches):
        return [x[None] for x in _take(tuple(batches), jnp.asarray(idx), True, size)]

    chunks = [(x, None, jnp.asarray(v[None, c:c + size])) for x, c in zip(gathered(inputs), range(0, n + pad, size))]
    return chunks if outs is None else (chunks, gathered(outs))


def _row_chunks(inputs, valid, extras, size: Optional[int] = None, outs=None):
    """The rows of batches [B, T, d] regrouped, largest sum of real |x_t|^2 first, into chunks of r rows (r the
    largest divisor of B with r T <= size, at least 1) with their (cos, sin, mask) and masks [r, T] (a last chunk
    filled up with masked copies of a row): the inputs of a parent that mixes the tokens of a row (the attention).
    Only rows of batches of one shape share a chunk; per-row tables ([B, T, D] cos / sin, [B, T, T] masks of
    packed batches) follow their rows, shared ones ([T, D], [T, T]) are passed as they are. size: 2 *
    AWQ_CHUNK_TOKENS by default. With `outs` (batches [B, T, e] beside the inputs: the parent's outputs), returns
    (chunks, the outputs' chunks [r, T, e] in the same order)."""
    size = 2 * AWQ_CHUNK_TOKENS if size is None else size
    groups: Dict[tuple, list] = {}
    for j, (x, v) in enumerate(zip(inputs, valid)):
        w = np.sum(np.where(np.asarray(v), np.asarray(_token_norms(x)), np.float32(0)), axis=1)
        groups.setdefault(tuple(x.shape), []).extend((-float(w[i]), j, i) for i in range(x.shape[0]))
    chunks, out_chunks = [], []
    for shape, rows in groups.items():
        b, t = shape[0], shape[1]
        r = max(d for d in range(1, b + 1) if b % d == 0 and (d * t <= size or d == 1))
        rows.sort()
        real = len(rows)
        rows += [rows[0]] * (-real % r)
        js = sorted({j for _, j, _ in rows})
        at = {j: n * b for n, j in enumerate(js)}
        order = np.array([at[j] + i for _, j, i in rows])
        idx = jnp.asarray(order)

        def stacked(arrays):
            return _take(tuple(arrays[j] for j in js), idx, False, r)

        xs = stacked(inputs)
        vs = np.concatenate([np.asarray(valid[j]) for j in js])[order] & (np.arange(len(rows)) < real)[:, None]
        vs = [jnp.asarray(vs[c:c + r]) for c in range(0, len(rows), r)]
        first = extras[js[0]]
        per_row = {k: stacked([ex[k] for ex in extras]) for k, e in enumerate(first) if e.ndim == 3}
        ys = stacked(outs) if outs is not None else None
        for n in range(len(xs)):
            chunks.append((xs[n], tuple(per_row[k][n] if k in per_row else e for k, e in enumerate(first)), vs[n]))
            if ys is not None:
                out_chunks.append(ys[n])
    return chunks if outs is None else (chunks, out_chunks)


MLA_AWQ_MAPPINGS: Tuple[AWQMapping, ...] = (
    AWQMapping("input_layernorm", ("self_attn/q_a_proj", "self_attn/kv_a_proj_with_mqa"), "self_attn"),
    AWQMapping("self_attn/q_a_layernorm", ("self_attn/q_b_proj",), "self_attn/q_b_proj"),
    AWQMapping("self_attn/kv_a_layernorm", ("self_attn/kv_b_proj",), "self_attn/kv_b_proj"),
)
"""The latent attention's mappings, llm-compressor 0.14's `_deepseek_mappings` (DeepseekV3ForCausalLM): input_layernorm
over q_a_proj (q_proj without query LoRA: its `re:.*(q|q_a)_proj$`) and kv_a_proj_with_mqa with the attention as
parent, each LoRA norm over the projection it feeds (a linear parent). Without query LoRA the q_a_layernorm mapping
matches nothing and is skipped, as their regexes are. Its MLP mappings are the dense ones on a dense
(first_k_dense_replace) layer and `_awq_moe`'s on a sparse one."""
AWQ_BALANCED_SHARED = ("shared_experts",)
"""Shared-expert names whose gate / up are balance layers of post_attention_layernorm's MoE mapping: DeepSeek's
(`_deepseek_mappings` balances every `gate_proj$` / `up_proj$` of the layer); Qwen2-MoE's `shared_expert` is not
(`_moe_default_mappings` balances `mlp.experts.*` only) and is compensated without entering the search (`_awq_moe`)."""


def _awq_mappings(layer, index: int) -> Tuple[List[AWQMapping], List[AWQMapping]]:
    """(the mappings applied before a sparse layer's MoE mappings, those applied after: the shared expert's
    up_proj -> down_proj), in llm-compressor's order: the attention's (`AWQ_MAPPINGS`' first two, or
    `MLA_AWQ_MAPPINGS`), then on a dense layer the MLP's. v_proj -> o_proj is dropped when v_proj's output size
    differs from o_proj's input size (llm-compressor's `_check_layers_are_compatible`); a mapping whose modules the
    layer lacks only when llm-compressor's regexes would match nothing either (no query LoRA)."""
    where = f"model/layers/{index}"
    found = _moe_block(layer)
    sparse = found is not None
    mla = getattr(layer.self_attn, "mla", None) is not None
    for mod in ("self_attn",) if sparse else ("self_attn", "mlp"):
        if getattr(_get(layer, mod), "rotations", None) is not None:
            raise ModelError(f"{where}/{mod}: AWQ cannot scale projections that carry online rotations")
    attn = AWQ_MAPPINGS[:2]
    if mla:
        q = "self_attn/q_proj" if layer.self_attn.mla.q_lora_rank is None else "self_attn/q_a_proj"
        attn = (AWQMapping("input_layernorm", (q, "self_attn/kv_a_proj_with_mqa"), "self_attn"),) + \
            tuple(m for m in MLA_AWQ_MAPPINGS[1:] if q == "self_attn/q_a_proj" or "q_a" not in m.smooth)
    head = list(attn) + ([] if sparse else list(AWQ_MAPPINGS[2:]))
    tail = []
    if sparse and found[1].cfg.shared_expert_intermediate_size:
        sh = f"{found[0]}/{found[1].cfg.shared_name}"
        if getattr(_get(layer, sh), "rotations", None) is not None:
            raise ModelError(f"{where}/{sh}: AWQ cannot scale projections that carry online rotations")
        tail = [AWQMapping(f"{sh}/up_proj", (f"{sh}/down_proj",), f"{sh}/down_proj")]
    out = ([], [])
    for part, maps in zip(out, (head, tail)):
        for m in maps:
            for rel in (m.smooth,) + m.balances:
                try:
                    mod = _get(layer, rel)
                except AttributeError:
                    raise ModelError(f"{where}/{rel}: AWQ mapping {m.smooth} -> {', '.join(m.balances)} needs this "
                                     "module; the layer has none") from None
                if rel in m.balances or isinstance(mod, nnx.Module) and hasattr(mod, "kernel"):
                    if type(mod) is not nnx.Linear:
                        raise ModelError(f"{where}/{rel}: AWQ scales a float nnx.Linear, found {type(mod).__name__}")
                elif not hasattr(mod, "weight") or mod.weight.get_value().ndim != 1:
                    raise ModelError(f"{where}/{rel}: AWQ divides a norm's 1-D weight by its scales, found "
                                     f"{type(mod).__name__}")
            if m.smooth == "self_attn/v_proj":
                if _kernel(_get(layer, m.smooth)).shape[1] != _kernel(_get(layer, m.balances[0])).shape[0]:
                    continue
            part.append(m)
    return out


def awq_transform(scheme, *, n_grid: int = 20, duo_scaling: awq.DuoScaling = True, prune: bool = True,
                  record: Optional[list] = None) -> Callable:
    """A `calibrate_decoder` transform: per decoder layer, one float pass over the calibration batches records each
    mapping's input (`AWQ_MAPPINGS`), then, mapping by mapping, the grid search (`qformats.algorithms.awq`) picks
    the scales s that minimise the parent's output error under the weight scheme's fake quantization, and s is
    folded into the smooth module (norm weight / s, or a linear's rows / s) and the balance projections
    (columns * s). DeepSeek-V3's latent attention takes `MLA_AWQ_MAPPINGS` (llm-compressor's `_deepseek_mappings`)
    instead of the attention's two. A sparse layer (qwen3_moe, qwen2_moe, mixtral, deepseek_v3) then takes
    llm-compressor 0.14's MoE ones (`_awq_moe`: post_attention_layernorm over the router and every expert's gate / up,
    plus DeepSeek's shared experts' gate / up, each expert's up_proj over its down_proj, every expert observing every
    real token), then the shared expert's up_proj over its down_proj. Every Linear reading a smoothed norm is
    compensated (rows * s), so the transformed float model computes the original's function: the router
    (llm-compressor registers its MoE mappings for Qwen2/3-MoE and DeepSeek-V3, and Mixtral, falling back to its
    default mappings, gets its router fed the smoothed norm uncompensated: routing shifted) and Qwen2-MoE's shared
    expert and its gate (outside their balances, uncompensated there). Dense layers of a sparse model
    (mlp_only_layers, first_k_dense_replace) take the dense MLP mappings: llm-compressor's `_moe_default_mappings` /
    `_deepseek_mappings` cannot group such a layer (its `mlp.gate` target never matches there, and its
    `match_modules_set` fails or merges every layer's norm into one set), so this is what their mappings do on a
    model without them, and what their dense mappings do on a dense layer. gpt-oss is refused
    (`calibration_families.refuse_scaling`: llm-compressor has no mapping for GptOssForCausalLM).

    Args:
      scheme: the weight scheme of the projections (a preset string such as "W4A16:g64", a SchemeSet or a
        QuantScheme), the one `calibrate_decoder` then quantizes with.
      n_grid, duo_scaling: llm-compressor's AWQModifier options (`qformats.algorithms.awq.grid`).
      prune: the dense mappings' grid search as a race (`qformats.algorithms.awq.race_scales`: a grid point stops
        being evaluated once its partial loss cannot win; the same choice as evaluating every point). The loss of a
        linear parent (v_proj -> o_proj, up_proj -> down_proj) is sum(dW * (H dW)) / count with H = sum x_t^T x_t
        over the real tokens (float32), that of the attention summed over chunks of rows and that of the MLP over
        chunks of tokens, largest |x| first (`AWQ_CHUNK_TOKENS`).
      record: optional list; one dict per applied mapping is appended ({"layer", "smooth", "balances", "ratio",
        "duo", "scales", "x_mean", "w_mean" (None without duo scaling), "errors" (the loss at each grid point; None
        where the race pruned it), "initial_error", "best_error", "evaluated" (the fraction of the race's terms
        evaluated)}).

    The transform returns the float layer's outputs from the pass that captured the mappings' inputs (before any
    fold): `calibrate_decoder` propagates them under round-to-nearest with float propagation (the folded layer
    computes the same function, float32 rounding apart), without a second pass over the layer.

    Raises:
      ModelError: a scheme without weights, duo scaling with per-tensor weights (llm-compressor refuses it), bad
        grid options; per layer (naming it): a missing or non-float module, online rotations, no finite loss.
    """
    ss = resolve_scheme(scheme)
    if ss is None or ss.weights is None:
        raise ModelError(f"AWQ: scheme {scheme!r} quantizes no weights; AWQ scales need a weight scheme")
    ws = ss.weights
    points = awq.grid(n_grid, duo_scaling)
    if duo_scaling is not False and ws.strategy == "tensor":
        raise ModelError(f"AWQ: duo_scaling needs per-channel, group or block weight scales, but {ss.name} has one "
                         "scale per tensor; pass duo_scaling=False")

    def transform(layer, index: int, xs, valid, layer_inputs) -> None:
        refuse_scaling(layer, index, "AWQ")
        head, tail = _awq_mappings(layer, index)
        moe = _moe_block(layer)
        if moe is not None:
            _check_awq_moe(layer, index, moe)
        # every mapping's input from the float layer before any smoothing (llm-compressor caches them so), and the
        # outputs of the attention / MLP parents: their reference outputs while no earlier mapping has changed them
        taps = tuple(dict.fromkeys([m.balances[0] for m in head + tail] + ([] if moe is None else [moe[0]]) +
                                   [OUT + m.parent for m in head if m.balances != (m.parent,)]))
        graphdef, state = nnx.split(layer)
        extras = [layer_inputs(j) for j in range(len(xs))]
        # inputs taken inside an MoE block (the shared expert's, over flattened tokens) back to [B, T, K]
        seen, outputs = [], []
        for x, e in zip(xs, extras):
            got, y = _capture(graphdef, state, x, *e, taps)
            seen.append({k: v.reshape(x.shape[:2] + v.shape[-1:]) for k, v in got.items()})
            outputs.append(y)
        tokens = int(sum(int(np.sum(np.asarray(v))) for v in valid))
        changed: List[str] = []  # the modules the mappings applied so far have rescaled

        def apply(m: AWQMapping) -> None:
            where = f"model/layers/{index}/{m.smooth}"
            inputs = [s[m.balances[0]] for s in seen]
            x_mean = awq.activation_means(inputs, valid)
            lins = [_get(layer, rel) for rel in m.balances]
            origs = [_kernel(lin) for lin in lins]
            w_mean = awq.weight_means(origs, ws, where) if duo_scaling is not False else None
            graphdef, state = nnx.split(layer)
            if m.balances == (m.parent,):  # a linear parent: its output error x_t (W' - W), summed through H
                h = _gram(inputs[0], valid[0])
                for x, v in zip(inputs[1:], valid[1:]):
                    h = h + _gram(x, v)
                parts, count = [None], tokens * int(origs[0].shape[-1])

                def chunk_sse(ks, c, h=h, orig=origs[0]):
                    return float(_gram_sse(h, ks[0], orig))
            else:  # the attention mixes a row's tokens; the MLP acts token by token
                kept = not any(rel == m.parent or rel.startswith(m.parent + "/") for rel in changed)
                outs = [s[OUT + m.parent] for s in seen] if kept else None
                if m.parent == "self_attn":
                    got = _row_chunks(inputs, valid, extras, outs=outs)
                else:
                    got = _token_chunks(inputs, valid, outs=outs)
                parts, refs = got if kept else (got, None)
                for s in seen:
                    s.pop(OUT + m.parent, None)
                if refs is None:  # an earlier mapping rescaled part of the parent: its outputs now
                    refs = [_parent_out(graphdef, state, x, *(e or (None,) * 3), m.parent) for x, e, _ in parts]
                count = tokens * int(refs[0].shape[-1])

                def chunk_sse(ks, c, m=m, graphdef=graphdef, state=state, parts=parts, refs=refs):
                    x, e, v = parts[c]
                    return float(_parent_sse(graphdef, state, ks, x, *(e or (None,) * 3), refs[c], v, m.parent,
                                             m.balances))

            found = awq.race_scales(x_mean, w_mean, origs, ws, points, chunk_sse, len(parts), count, where=where,
                                    parent=m.parent, prune=prune)
            best = found.scales
            changed.extend((m.smooth,) + m.balances)
            for lin, k in zip(lins, origs):
                lin.kernel.set_value(awq.scale_rows(k, best))
            sm = _get(layer, m.smooth)
            if isinstance(sm, nnx.Linear):
                sm.kernel.set_value(awq.unscale_cols(_kernel(sm), best))
                if sm.bias is not None:
                    sm.bias.set_value(awq.unscale(sm.bias.get_value(), best))
            else:
                sm.weight.set_value(awq.unscale(sm.weight.get_value(), best))
            if record is not None:
                record.append({"layer": index, "smooth": m.smooth, "balances": m.balances, "ratio": found.ratio,
                               "duo": found.duo, "scales": np.asarray(best), "x_mean": x_mean,
                               "w_mean": None if w_mean is None else np.asarray(w_mean), "errors": found.errors,
                               "initial_error": found.initial_error,
                               "best_error": found.best_error, "evaluated": found.evaluated})

        for m in head:
            apply(m)
        if moe is not None:
            _awq_moe(layer, index, moe, [s[moe[0]] for s in seen], valid, extras, tokens, ws, points,
                     duo_scaling is not False, record)
        for m in tail:
            apply(m)
        return outputs

    return transform


# ---- AWQ on a mixture-of-experts block ---------------------------------------------------------------------
def _check_awq_moe(layer, index: int, found) -> None:
    """ModelError for a sparse layer AWQ's MoE mappings do not cover (before any work on it): a router that is neither
    a float nnx.Linear nor DeepSeek's float32 router, quantized or biased expert stacks, a quantized shared expert or
    shared-expert gate."""
    name, blk = found
    c = blk.cfg
    where = f"model/layers/{index}/{name}"
    router = getattr(blk, c.router_name)
    if type(router) not in (nnx.Linear, DeepseekRouter):
        raise ModelError(f"{where}/{c.router_name}: AWQ balances the router against post_attention_layernorm and "
                         f"needs a float nnx.Linear router, found {type(router).__name__}")
    for p in c.projections:
        ex = getattr(blk.experts, p)
        if type(ex) is not Experts or ex.bias is not None:
            raise ModelError(f"{where}/experts/{p}: AWQ scales float, bias-free expert stacks, found "
                             f"{type(ex).__name__}{' with biases' if type(ex) is Experts else ''}")
    for rel in _shared_scaled(c):
        if type(_get(blk, rel)) is not nnx.Linear:
            raise ModelError(f"{where}/{rel}: AWQ scales a float nnx.Linear, found {type(_get(blk, rel)).__name__}")


def _shared_scaled(c: MoEConfig) -> Tuple[str, ...]:
    """The shared expert's Linears that read post_attention_layernorm's output (paths relative to the MoE block): its
    gate / up, and Qwen2-MoE's sigmoid gate `shared_expert_gate`; () without a shared expert."""
    if not c.shared_expert_intermediate_size:
        return ()
    return (f"{c.shared_name}/gate_proj", f"{c.shared_name}/up_proj") + (
        ("shared_expert_gate",) if c.shared_expert_gated else ())


@functools.partial(jax.jit, static_argnames=("cfg",))
def _expert_act(x, gate, up, cfg):
    """a_e = act(x W_gate[e], x W_up[e]) for x [B, T, d] (float32): expert e's down_proj input."""
    f32 = jnp.float32
    return activation(x.astype(f32) @ gate.astype(f32), x.astype(f32) @ up.astype(f32), cfg)


@jax.jit
def _down_sse(a, kernel, ref, valid):
    d = (a @ kernel - ref).astype(jnp.float32)
    return jnp.sum(jnp.where(valid[..., None], d * d, 0.0))


def _awq_moe(layer, index: int, found, inputs, valid, extras, tokens: int, ws, points, duo: bool,
             record: Optional[list]) -> None:
    """AWQ on a sparse layer's MoE block, llm-compressor 0.14's MoE mappings (`_moe_default_mappings` for Qwen2/3-MoE,
    `_deepseek_mappings` for DeepSeek-V3) with `moe_calibrate_all_experts` semantics (every expert observes every real
    token), after the attention's mappings and before the shared expert's up_proj -> down_proj:

      post_attention_layernorm -> (router, every expert's gate / up [, DeepSeek's shared_experts gate / up]), parent
        the block: x_mean = E_t |x_t| over the block's input tokens; w_mean over the quantized balances' rows (every
        expert's gate, the shared gate, every expert's up, the shared up: their order; the router, left unquantized
        by the MoE recipes, has no quantization scheme and takes no part in it); loss = the block's mean squared
        output error (routed experts only, as the model runs) with each balanced gate / up fake-quantized as
        Q(W diag(s)) diag(s)^-1, the router and anything not balanced float; then the norm's weight / s and the
        rows of every Linear reading the norm's output * s: the router (its logits, hence the routing, unchanged
        up to rounding), the balances, and Qwen2-MoE's shared expert gate / up and `shared_expert_gate`
        (`_shared_scaled`). llm-compressor's Qwen2-MoE mapping leaves those three out of its balances, so they read
        the smoothed norm uncompensated and its float model's output changes; here they are compensated (the float
        model's function is kept) without entering the search, whose scales therefore equal theirs;
      expert e's up_proj -> its down_proj, parent the down_proj: x_mean = E_t |a_e(x_t)| and loss = the mean squared
        error of a_e(x_t) Q(W_down[e] diag(s)) diag(s)^-1 over every real token t, a_e from the block's inputs and
        the unsmoothed gate / up (the activations llm-compressor's hooks cached before smoothing); then W_down[e]
        rows * s and W_up[e] columns / s.

    The grid search is `qformats.algorithms.awq.search_scales` (stacked kernels fake-quantized expert by expert)."""
    name, blk = found
    c = blk.cfg
    ex = blk.experts
    g, u, dn = c.projections
    where = f"model/layers/{index}"
    gk0, uk0 = _kernel(getattr(ex, g)), _kernel(getattr(ex, u))
    shared = _shared_scaled(c)
    balanced = shared[:2] if c.shared_name in AWQ_BALANCED_SHARED else ()
    sk0 = {rel: _kernel(_get(blk, rel)) for rel in shared}
    # post_attention_layernorm -> router + experts' gate / up (+ the balanced shared gate / up)
    x_mean = awq.activation_means(inputs, valid)
    gates = [gk0[e] for e in range(c.num_experts)] + [sk0[r] for r in balanced[:1]]
    ups = [uk0[e] for e in range(c.num_experts)] + [sk0[r] for r in balanced[1:]]
    w_mean = awq.weight_means(gates + ups, ws, f"{where}/post_attention_layernorm") if duo else None
    graphdef, state = nnx.split(layer)
    refs = [_parent_out(graphdef, state, x, *e, name) for x, e in zip(inputs, extras)]
    balances = (f"{name}/experts/{g}", f"{name}/experts/{u}") + tuple(f"{name}/{r}" for r in balanced)
    count = tokens * int(refs[0].shape[-1])

    def loss(ks):
        return sum(float(_parent_sse(graphdef, state, ks, x, *e, r, v, name, balances))
                   for x, e, r, v in zip(inputs, extras, refs, valid)) / count

    found_s = awq.search_scales(x_mean, w_mean, (gk0, uk0) + tuple(sk0[r] for r in balanced), ws, points, loss,
                                where=f"{where}/post_attention_layernorm", parent=f"{where}/{name}")
    s = found_s.scales
    router = getattr(blk, c.router_name)
    getattr(ex, g).kernel.set_value(awq.scale_rows(gk0, s))
    getattr(ex, u).kernel.set_value(awq.scale_rows(uk0, s))
    for rel in shared:
        _get(blk, rel).kernel.set_value(awq.scale_rows(sk0[rel], s))
    router.kernel.set_value(awq.scale_rows(_kernel(router), s))
    norm = layer.post_attention_layernorm
    norm.weight.set_value(awq.unscale(norm.weight.get_value(), s))
    if record is not None:
        record.append({"layer": index, "smooth": "post_attention_layernorm",
                       "balances": (f"{name}/{c.router_name}",) + balances,
                       "compensated": tuple(f"{name}/{r}" for r in shared if r not in balanced),
                       "ratio": found_s.ratio, "duo": found_s.duo, "scales": np.asarray(s), "x_mean": x_mean,
                       "errors": found_s.errors, "initial_error": found_s.initial_error,
                       "best_error": found_s.best_error})
    # each expert's up_proj -> down_proj, over every real token
    dk_all = _kernel(getattr(ex, dn))
    new_down, new_up = [], []
    uk1 = _kernel(getattr(ex, u))
    for e in range(c.num_experts):
        acts = [_expert_act(x, gk0[e], uk0[e], c) for x in inputs]
        x_mean = awq.activation_means(acts, valid)
        dk = dk_all[e]
        w_mean = awq.weight_means([dk], ws, f"{where}/{name}/experts/{dn}/{e}") if duo else None
        refs = [a @ dk for a in acts]
        count = tokens * int(dk.shape[-1])

        def loss(ks, acts=acts, refs=refs, count=count):
            return sum(float(_down_sse(a, ks[0], r, v)) for a, r, v in zip(acts, refs, valid)) / count

        found_e = awq.search_scales(x_mean, w_mean, (dk,), ws, points, loss,
                                    where=f"{where}/{name}/experts/{u}/{e}", parent=f"{where}/{name}/experts/{dn}/{e}")
        se = found_e.scales
        new_down.append(awq.scale_rows(dk, se))
        new_up.append(awq.unscale_cols(uk1[e], se))
        if record is not None:
            record.append({"layer": index, "smooth": f"{name}/experts/{u}/{e}",
                           "balances": (f"{name}/experts/{dn}/{e}",), "ratio": found_e.ratio, "duo": found_e.duo,
                           "scales": np.asarray(se), "x_mean": x_mean, "errors": found_e.errors,
                           "initial_error": found_e.initial_error, "best_error": found_e.best_error})
    getattr(ex, dn).kernel.set_value(jnp.stack(new_down))
    getattr(ex, u).kernel.set_value(jnp.stack(new_up))


# ---- SmoothQuant on the decoder's modules ------------------------------------------------------------------
SMOOTHQUANT_MAPPINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("input_layernorm", ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj")),
    ("post_attention_layernorm", ("mlp/gate_proj", "mlp/up_proj")),
)
"""(norm, projections reading its output) of a decoder layer: llm-compressor's DEFAULT_SMOOTHQUANT_MAPPINGS."""
MOE_SMOOTHQUANT_MAPPINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = SMOOTHQUANT_MAPPINGS[:1]
"""The attention's mapping only: llm-compressor's QWEN_MOE_SMOOTHQUANT_MAPPINGS / MIXTRAL_SMOOTHQUANT_MAPPINGS (one
smoothing scale across all experts unbalances them, so post_attention_layernorm is not smoothed), on every layer of
a mixture-of-experts model."""


def _mla_smoothquant_mappings(layer) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """DeepSeek-V3's latent attention: llm-compressor's DEEPSEEK_V2_SMOOTHQUANT_MAPPINGS (DeepseekV2/V3ForCausalLM),
    input_layernorm over q_a_proj (q_proj without query LoRA: its `re:.*q(_a)?_proj$`) and kv_a_proj_with_mqa, on
    every layer (dense or sparse); nothing else is smoothed."""
    q = "self_attn/q_proj" if layer.self_attn.mla.q_lora_rank is None else "self_attn/q_a_proj"
    return (("input_layernorm", (q, "self_attn/kv_a_proj_with_mqa")),)


class _RangeTap(nnx.Module):
    """Wraps a norm: its output passes unchanged; the per-channel min and max over valid tokens are recorded."""

    def __init__(self, inner, dim: int):
        self.inner = inner
        self.valid = nnx.Variable(jnp.ones((1, 1), bool))
        self.lo = nnx.Variable(jnp.full((dim,), jnp.inf, jnp.float32))
        self.hi = nnx.Variable(jnp.full((dim,), -jnp.inf, jnp.float32))

    def __call__(self, x):
        y = self.inner(x)
        v = self.valid.get_value()[..., None]
        yf = y.astype(jnp.float32)
        self.lo.set_value(jnp.minimum(self.lo.get_value(), jnp.min(jnp.where(v, yf, jnp.inf), axis=(0, 1))))
        self.hi.set_value(jnp.maximum(self.hi.get_value(), jnp.max(jnp.where(v, yf, -jnp.inf), axis=(0, 1))))
        return y


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _range_run(graphdef, state, x, valid, cos, sin, mask):
    """`_range_pass` on the split layer: its non-Param state after the run (the ranges; XLA drops what they do not
    need, the MLP)."""
    layer = nnx.merge(graphdef, state)
    for _, m in nnx.iter_modules(layer):
        if isinstance(m, _RangeTap):
            m.valid.set_value(valid)
    layer(x, cos, sin, mask)
    return nnx.state(layer, nnx.Not(nnx.Param))


def _range_pass(layer, x, valid, cos, sin, mask):
    """Records the mapped norms' output ranges into their taps (`_RangeTap`) in `layer` (a jax.jit function of the
    split layer, as `_calibration_pass`: no copy of its weights out of every run)."""
    nnx.update(layer, _range_run(*nnx.split(layer), x, valid, cos, sin, mask))


def smoothquant_transform(alpha: float, moe: Optional[bool] = None) -> Callable:
    """A `calibrate_decoder` transform: per decoder layer, one float pass over the calibration batches records each
    mapped norm's output range (`SMOOTHQUANT_MAPPINGS`; `MOE_SMOOTHQUANT_MAPPINGS` on every layer when `moe`, and
    on a sparse layer when `moe` is None; DeepSeek-V3's latent attention on every layer: `_mla_smoothquant_mappings`;
    gpt-oss refused, `calibration_families.refuse_scaling`), then the SmoothQuant factors
    (`qformats.algorithms.smoothquant.smoothing_scales`) are folded into the norm and its projections (float
    nnx.Linear kernels and the norm's weight: `smoothquant.fold_scales`)."""
    alpha = smoothquant.check_alpha(alpha)

    def transform(layer, index: int, xs, valid, layer_inputs) -> None:
        refuse_scaling(layer, index, "SmoothQuant")
        sparse = _moe_block(layer) is not None if moe is None else moe
        if getattr(layer.self_attn, "mla", None) is not None:
            mappings = _mla_smoothquant_mappings(layer)
        else:
            mappings = MOE_SMOOTHQUANT_MAPPINGS if sparse else SMOOTHQUANT_MAPPINGS
        norms = {}
        for norm, _ in mappings:
            inner = getattr(layer, norm)
            norms[norm] = inner
            setattr(layer, norm, _RangeTap(inner, int(inner.weight.get_value().shape[0])))
        try:
            for j, (x, v) in enumerate(zip(xs, valid)):
                _range_pass(layer, x, v, *layer_inputs(j))
            ranges = {n: getattr(layer, n).hi.get_value() - getattr(layer, n).lo.get_value() for n in norms}
        finally:
            for n, inner in norms.items():
                setattr(layer, n, inner)
        for norm, projs in mappings:
            lins = [_get(layer, p) for p in projs]
            for p, lin in zip(projs, lins):
                if not isinstance(lin, nnx.Linear):
                    raise ModelError(f"model/layers/{index}/{p}: SmoothQuant folds scales into a float nnx.Linear, "
                                     f"found {type(lin).__name__}")
            kernels = [lin.kernel.get_value() for lin in lins]
            s = smoothquant.smoothing_scales(ranges[norm], kernels, alpha)
            nw = norms[norm].weight
            w, folded = smoothquant.fold_scales(nw.get_value(), kernels, s)
            nw.set_value(w)
            for lin, k in zip(lins, folded):
                lin.kernel.set_value(k)

    return transform
