"""Stacked expert projections: one [E, in, out] parameter per projection (float `Experts`, packed `QExperts`).

A mixture-of-experts layer holds E linear maps of the same shape. They are stored as one stacked kernel
W [E, K, N] (the Flax kernel layout per expert, the expert axis first) and an optional bias b [E, N]:

    y_m = x_m @ W[e_m] + b[e_m]          (row m of the input goes through expert e_m)

`QExperts` holds the packed counterpart: a `QArray` whose static shape is one expert's [K, N] and whose leaves
(codes, scales, zero points, global scales) carry the expert axis in front, i.e. expert e's codes and scales are
exactly those `quantize_weight(W[e])` gives for its own [K, N] Linear kernel (`quantize_weight` vmaps over the
expert axis). `qformats.nn.quantize_model` swaps `Experts` for `QExperts` by the same rules as Linear layers.

Two ways to run the rows through their experts, chosen by the caller (the MoE block) by the number of rows:

* `gathered(x, e)`: each row is one matrix-vector product with its expert's weight read in place (`W[e_m]`; for
  packed weights only that expert's codes and scales, through the packed GEMV of `qformats.packed_dot` where the
  format has one) — the decode path, where the rows (tokens x top_k) are fewer than the experts.
* `grouped(x, group_sizes)`: the rows are sorted by expert (group_sizes[e] consecutive rows for expert e) and one
  grouped matmul runs per projection: `jax.lax.ragged_dot` on the stack ("ragged"; a packed stack dequantized
  `RAGGED_CHUNK` experts at a time, chunks without rows skipped), or a loop over row tiles of one expert each
  ("tiled": each tile reads and decodes only its expert's weight, 4- and 8-bit packed weights through
  `qformats.packed_dot.packed_matmul`; empty experts cost nothing; one expert's dense weight alive at a time).
  XLA:CPU lowers ragged_dot to one dense product per group over all rows, so "auto" picks "tiled" on the CPU and
  "ragged" elsewhere. "tiled" runs a loop of data-dependent length (forward only: reverse-mode gradients, e.g.
  QAT, need "ragged").
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qformats.dispatch import kernels_enabled, xla_qdot
from qformats.errors import ModelError
from qformats.nn.nnx_layers import QuantizedMatmul, QuantStat, _pack
from qformats.nn.projection import fake_quantize_weight, quantize_acts
from qformats.observers import Observer
from qformats.packed_dot import packed_matmul, packed_matmul_supported
from qformats.qarray import QArray
from qformats.quantize import dequantize
from qformats.schemes import SchemeSet

GROUPED_METHODS = ("auto", "ragged", "tiled")
_OTHER = {"input_scale": "input_global_scale", "input_global_scale": "input_scale"}

RAGGED_CHUNK = 8
"""Most experts of a packed stack the "ragged" grouped matmul dequantizes at once (`chunked_ragged_grouped_matmul`)."""

GATHER_UNROLL = 16
"""Most rows `QExperts.gathered` runs as an unrolled loop of packed GEMVs (more: `jax.lax.map`, one compiled body)."""


def _dot(x, w):
    """x [M, K] @ w [K, N] accumulated in float32 (the dense layers' `projection.dot`), as float32."""
    return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def tile_rows(rows: int, experts: int) -> int:
    """The row tile of the "tiled" grouped matmul: the power of two nearest above rows / experts, within [8, 128]
    (about one tile per active expert when the rows spread evenly; tiles are never shared between experts)."""
    per = max(1, -(-rows // max(experts, 1)))
    return int(min(128, max(8, 1 << (per - 1).bit_length())))


def tiled_grouped_matmul(x, group_sizes, product_of: Callable, bias_of: Optional[Callable], n: int,
                         tile: Optional[int] = None):
    """y [M, N] float32 with y_m = x_m @ W_e (+ b_e) for rows sorted by expert (group_sizes [E] consecutive rows
    per expert, sum = M), computed tile by tile: every tile is `tile` rows of one expert, so the loop runs
    sum_e ceil(group_sizes_e / tile) <= M / tile + E times, and `product_of(x_tile, e)` (x_tile [tile, K] @ W_e,
    [tile, N] float32) reads expert e's weight only for experts that have rows, one expert's weight at a time.
    Rows of a tile past its expert's group are masked (they belong to the next tile)."""
    m, k = x.shape
    e_count = group_sizes.shape[0]
    tile = tile or tile_rows(m, e_count)
    gs = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs
    tiles = (gs + tile - 1) // tile
    ends = jnp.cumsum(tiles)
    xp = jnp.pad(x, ((0, tile), (0, 0)))
    out = jnp.zeros((m + tile, n), jnp.float32)

    def body(i, out):
        e = jnp.minimum(jnp.searchsorted(ends, i, side="right"), e_count - 1)
        j = i - (ends[e] - tiles[e])
        r0 = starts[e] + j * tile
        y = product_of(jax.lax.dynamic_slice(xp, (r0, 0), (tile, k)), e)
        if bias_of is not None:
            y = y + bias_of(e).astype(jnp.float32)
        valid = (j * tile + jnp.arange(tile)) < gs[e]
        cur = jax.lax.dynamic_slice(out, (r0, 0), (tile, n))
        return jax.lax.dynamic_update_slice(out, cur + jnp.where(valid[:, None], y, 0.0), (r0, 0))

    return jax.lax.fori_loop(0, ends[-1], body, out)[:m]


def ragged_grouped_matmul(x, group_sizes, stack, bias):
    """y [M, N] float32 = `jax.lax.ragged_dot(x, stack, group_sizes)` (+ bias of each row's expert) for rows
    sorted by expert; stack [E, K, N] dense."""
    y = jax.lax.ragged_dot(x, stack.astype(x.dtype), group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    if bias is not None:
        row_expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=x.shape[0])
        y = y + bias.astype(jnp.float32)[row_expert]
    return y


def chunk_experts(num_experts: int, most: int) -> int:
    """The experts per chunk of `chunked_ragged_grouped_matmul`: the largest divisor of num_experts <= most."""
    return max(d for d in range(1, max(1, min(most, num_experts)) + 1) if num_experts % d == 0)


def chunked_ragged_grouped_matmul(x, group_sizes, stack_of: Callable, bias, n: int, chunk: int):
    """`ragged_grouped_matmul` with the dense stack made `chunk` experts at a time (E / chunk chunks, chunk | E):

        for each chunk c of experts [lo, lo + C) that has rows (a chunk without rows is skipped, `jax.lax.cond`):
            s_c = sum_{e < lo} group_sizes_e                     (its rows are [s_c, s_c + sum of its sizes))
            y  += roll(ragged_dot(roll(x, -s_c), stack_of(lo), group_sizes[lo:lo + C]), s_c)

    y [M, N] float32 (+ each row's expert's bias). ragged_dot gives 0 for the rows past its groups, so each row is
    written by its own chunk only. `stack_of(lo)` [C, K, N]: the dense weights of experts lo .. lo + C - 1 (lo
    traced); at most C experts' dense weights exist at once, not the whole stack's."""
    m = x.shape[0]
    e_count = group_sizes.shape[0]
    if e_count % chunk:
        raise ModelError(f"experts: a chunk of {chunk} experts does not divide {e_count} experts")
    gs = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs

    def body(c, out):
        lo = c * chunk
        sub = jax.lax.dynamic_slice_in_dim(gs, lo, chunk)
        first = starts[lo]

        def run(out):
            y = jax.lax.ragged_dot(jnp.roll(x, -first, axis=0), stack_of(lo).astype(x.dtype), sub,
                                   preferred_element_type=jnp.float32)
            return out + jnp.roll(y, first, axis=0)

        return jax.lax.cond(jnp.sum(sub) > 0, run, lambda out: out, out)

    y = jax.lax.fori_loop(0, e_count // chunk, body, jnp.zeros((m, n), jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)[_row_experts(group_sizes, m)]
    return y


def _row_experts(group_sizes, m: int):
    """Each row's expert [M] for rows sorted by expert (group_sizes [E] consecutive rows per expert)."""
    return jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=m)


def _method(method: str) -> str:
    if method not in GROUPED_METHODS:
        raise ModelError(f"experts: grouped matmul method must be one of {GROUPED_METHODS}, got {method!r}")
    if method == "auto":
        return "tiled" if jax.default_backend() == "cpu" else "ragged"
    return method


class _ExpertOps:
    """The expert products of a stacked projection, given how to read its weights (`_stack`, `_one`) and one row's
    product (`_row`)."""

    num_experts: int

    def _input(self, x, rows):
        """The activations row m's product sees (rows() [M]: each row's expert); the identity for float experts."""
        return x

    def _bias(self):
        return None if self.bias is None else self.bias.get_value()

    def grouped(self, x, group_sizes, method: str = "auto", tile: Optional[int] = None):
        """y [M, N] (in x's dtype) for rows x [M, K] sorted by expert, group_sizes [E] (int, summing to M):
        y_m = x_m @ W[e_m] + b[e_m], one grouped matmul ("ragged": `jax.lax.ragged_dot`, "tiled":
        `tiled_grouped_matmul`; "auto": tiled on the CPU, ragged elsewhere)."""
        dt = self.dtype or x.dtype
        x = self._input(x.astype(dt), lambda: _row_experts(group_sizes, x.shape[0]))
        b = self._bias()
        if _method(method) == "ragged":
            y = self._ragged(x, group_sizes, b, dt)
        else:
            y = tiled_grouped_matmul(x, group_sizes, lambda xt, e: self._tile(xt, e, dt),
                                     None if b is None else (lambda e: b[e]), self.out_features, tile)
        return y.astype(dt)

    def _ragged(self, x, group_sizes, b, dtype):
        """The "ragged" grouped matmul: `jax.lax.ragged_dot` on the whole (float) stack."""
        return ragged_grouped_matmul(x, group_sizes, self._stack(dtype), b)

    def gathered(self, x, experts, valid=None):
        """y [M, N] (in x's dtype) for rows x [M, K] and their experts [M] (int): y_m = x_m @ W[e_m] + b[e_m],
        reading only the weights of the experts named (each as often as it is named). With `valid` [M] (bool),
        a row whose flag is False is not computed (`jax.lax.cond`): its y_m is b[e_m] (0 without bias).

        Each row is its own matrix-vector product with its expert's weight (`_row`): a product batched over rows
        of the gathered weights [M, K, N] first copies them (float) or dequantizes them (packed) into a dense
        buffer, and XLA:CPU runs a batched dot as a library call that fuses no weight decode. Packed rows are
        a Python loop up to `GATHER_UNROLL` rows (each a fused packed GEMV reading its expert's codes in place);
        float rows, and packed rows beyond that, run in `jax.lax.map` (one compiled body: unrolled, XLA:CPU
        copied every row's float expert slice up front, in slow elemental loops)."""
        dt = self.dtype or x.dtype
        x = self._input(x.astype(dt), lambda: experts)
        n = self.out_features

        def row(xm, em, vm):
            if vm is None:
                return self._row(xm, em, dt)
            return jax.lax.cond(vm, lambda: self._row(xm, em, dt), lambda: jnp.zeros((n,), jnp.float32))

        if x.shape[0] <= self._unroll_rows():
            y = jnp.stack([row(x[m], experts[m], None if valid is None else valid[m]) for m in range(x.shape[0])])
        elif valid is None:
            y = jax.lax.map(lambda a: row(a[0], a[1], None), (x, experts))
        else:
            y = jax.lax.map(lambda a: row(*a), (x, experts, valid))
        b = self._bias()
        if b is not None:
            y = y + b.astype(jnp.float32)[experts]
        return y.astype(dt)

    def _unroll_rows(self) -> int:
        return 0

    def _row(self, xm, e, dtype):
        """x_m @ W[e] [N] float32 for one row x_m [K] (in the compute dtype) and its expert e (a traced int)."""
        return _dot(xm[None], self._one(e, dtype))[0]

    def _tile(self, xt, e, dtype):
        """x_t @ W[e] [T, N] float32 for the rows x_t [T, K] (in the compute dtype) of one tile of expert e (a
        traced int): the "tiled" grouped matmul's product."""
        return _dot(xt, self._one(e, dtype))

    def dense(self, x, expert: int):
        """x [..., K] @ W[expert] + b[expert] for one expert (a reference path; in x's dtype)."""
        dt = self.dtype or x.dtype
        xs = x.astype(dt)
        xs = self._input(xs.reshape(-1, xs.shape[-1]),
                         lambda: jnp.full((xs.size // max(xs.shape[-1], 1),), expert, jnp.int32)).reshape(xs.shape)
        y = jax.lax.dot_general(xs, self._one(expert, dt), (((xs.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        b = self._bias()
        if b is not None:
            y = y + b[expert].astype(jnp.float32)
        return y.astype(dt)


class Experts(_ExpertOps, nnx.Module):
    """E float linear maps stacked: kernel [E, in, out] (each expert's Flax kernel), optional bias [E, out].

    y_m = x_m @ kernel[e_m] + bias[e_m]; see `grouped` (rows sorted by expert) and `gathered` (rows with their
    experts). `dtype`: the compute dtype (None: the input's)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,)),
                 rngs: nnx.Rngs):
        self.num_experts, self.in_features, self.out_features = int(num_experts), int(in_features), int(out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), (self.num_experts, self.in_features, self.out_features),
                                            param_dtype))
        self.bias = nnx.Param(jnp.zeros((self.num_experts, self.out_features), param_dtype)) if use_bias else None
        self.dtype = dtype

    def _stack(self, dtype):
        return self.kernel.get_value().astype(dtype)

    def _one(self, e, dtype):
        return self.kernel.get_value()[e].astype(dtype)



def _select(q: QArray, idx) -> QArray:
    """The QArray of the experts `idx` (an int or an index array): every leaf indexed along its expert axis."""
    return jax.tree.map(lambda leaf: leaf[idx], q)


def _dequantize_stacked(q: QArray, dtype):
    """dequantize over the leading axes of q's leaves: [*lead, K, N]."""
    fn = lambda qq: dequantize(qq, dtype)  # noqa: E731
    for _ in range(q.codes.ndim - len(q.tshape)):
        fn = jax.vmap(fn)
    return fn(q)


class QExperts(_ExpertOps, QuantizedMatmul):
    """The quantized `Experts`: a packed QArray of per-expert shape [in, out] whose leaves carry the expert axis
    first (expert e's codes and scales = those of its own [in, out] kernel quantized along `in`), or, in QAT mode,
    the float stack fake-quantized per expert.

    Activation schemes (`schemes.input_activations`, optional): each row is quantized along `in` before its
    expert's product, Qa_e(x_m) @ dequantize(W[e_m]) with e = e_m: dynamically (per token / group at run time), or,
    for a static scheme (FP8's per-tensor input scale, NVFP4's input global scale), with expert e's own static
    scale, `input_scale` [E, 1] / `input_global_scale` [E, 1] (one per expert, as compressed-tensors stores an MoE
    checkpoint: `mlp.experts.{e}.gate_proj.input_scale`), given at construction (e.g. by
    `qformats.models.decoder.calibration`, which observes them, or from a checkpoint). A static scheme without them,
    and calibration mode, are refused (ModelError): the decoder calibration observes stacked experts itself."""

    def __init__(self, kernel, bias, schemes: SchemeSet, *, mode: str = "ptq", dtype=None, path: str = "",
                 observer: Optional[Observer] = None, full_moments: bool = False, input_scale=None,
                 input_global_scale=None):
        a = schemes.input_activations
        where = f"QExperts {path or '<module>'}"
        if mode == "calibrate":
            raise ModelError(f"{where}: calibration mode is not supported on stacked experts; calibrate a decoder's "
                             "experts with qformats.models.decoder.calibration.calibrate_decoder (it observes every "
                             "expert), quantize them without calibration_data, or leave them out with a rule")
        static = a is not None and a.dynamic is not True
        given = {"input_scale": input_scale, "input_global_scale": input_global_scale}
        want = {"tensor": "input_scale", "tensor_group": "input_global_scale"}.get(a.strategy) if static else None
        if not static and any(v is not None for v in given.values()):
            raise ModelError(f"{where}: static input scales given, but scheme {schemes.name!r} has "
                             f"{'no' if a is None else 'dynamic'} activation quantization")
        if static and (want is None or mode != "ptq" or given[want] is None or given[_OTHER[want]] is not None):
            raise ModelError(f"{where}: scheme {schemes.name!r} has static activation scales ({a.describe()}); "
                             f"stacked experts take them per expert, {want or 'a per-tensor scale'} [E, 1], in PTQ "
                             f"mode (mode {mode!r}, given "
                             f"{', '.join(k for k, v in given.items() if v is not None) or 'none'})")
        super().__init__(kernel, bias, schemes, mode=mode, dtype=dtype, path=path)
        if len(self.stacked) != 1:
            raise ModelError(f"{where}: expected a kernel [E, in, out], found stacking axes "
                             f"{self.stacked} before [{self.k_dim}, {self.n_dim}]")
        self.num_experts = n = self.stacked[0]
        if static:
            v = jnp.asarray(given[want])
            if v.size != n:
                raise ModelError(f"{where}: {want} must hold one scale per expert ([{n}, 1]), got shape "
                                 f"{tuple(v.shape)}")
            dt = jnp.float32 if want == "input_global_scale" else v.dtype
            setattr(self, want, QuantStat(v.reshape(n, 1).astype(dt)))

    @property
    def in_features(self) -> int:
        return self.k_dim

    @property
    def out_features(self) -> int:
        return self.n_dim

    @classmethod
    def from_module(cls, experts: Experts, schemes: SchemeSet, *, mode: str = "ptq", path: str = "",
                    pack: Optional[Callable] = None, observer: Optional[Observer] = None,
                    full_moments: bool = False) -> "QExperts":
        """The quantized counterpart of `experts` (left untouched): in "ptq" mode the [E, K, N] kernel is packed
        per expert by `pack(kernel)` (default round-to-nearest along K, `quantize_weight`, vmapped over E)."""
        if mode == "calibrate":
            raise ModelError(f"QExperts {path or '<module>'}: calibration of stacked experts is not supported; "
                             "quantize the experts without calibration_data, or leave them out with a rule")
        kernel = experts.kernel.get_value()
        bias = None if experts.bias is None else experts.bias.get_value()
        if mode == "ptq":
            kernel = _pack(kernel, schemes, pack)
        return cls(kernel, bias, schemes, mode=mode, dtype=experts.dtype, path=path)

    @classmethod
    def from_packed(cls, q: QArray, bias, schemes: SchemeSet, *, dtype=None, path: str = "", input_scale=None,
                    input_global_scale=None) -> "QExperts":
        """A PTQ QExperts holding `q` (per-expert shape [in, out], expert axis first on its leaves) as it is, with
        the experts' static input scales ([E, 1] each) when the scheme's activations are static."""
        return cls(q, bias, schemes, mode="ptq", dtype=dtype, path=path, input_scale=input_scale,
                   input_global_scale=input_global_scale)

    def _input(self, x, rows):
        """Qa(x) along `in`: dynamic per row, or row m with expert rows()[m]'s static scale (an elementwise
        quantization with a given per-tensor / global scale, so row by row equals the whole expert's tensor)."""
        a = self.schemes.input_activations
        if a is None:
            return x
        if a.dynamic is True:
            y = quantize_acts(x, a)
            return x + jax.lax.stop_gradient(y - x) if self.mode == "qat" else y
        s, g = (None if v is None else v.get_value() for v in (self.input_scale, self.input_global_scale))
        e = rows()
        per_row = lambda xm, sm, gm: quantize_acts(xm[None], a, sm, gm)[0]  # noqa: E731
        return jax.vmap(per_row)(x, None if s is None else s[e], None if g is None else g[e])

    def _float(self, dtype):
        return fake_quantize_weight(self.kernel.get_value(), self.schemes).astype(dtype)

    def _stack(self, dtype):
        k = self.kernel.get_value()
        return _dequantize_stacked(k, dtype) if self.mode == "ptq" else self._float(dtype)

    def _one(self, e, dtype):
        k = self.kernel.get_value()
        if self.mode == "ptq":
            return dequantize(_select(k, e), dtype)
        return fake_quantize_weight(k[e], self.schemes).astype(dtype)

    def _ragged(self, x, group_sizes, b, dtype):
        """The "ragged" grouped matmul with the stack dequantized (PTQ) or fake-quantized (QAT, the same values)
        `RAGGED_CHUNK` experts at a time (`chunked_ragged_grouped_matmul`; the largest divisor of E up to it), never
        the whole stack at once; QAT and PTQ run the same chunks, so their products are equal bit for bit."""
        k = self.kernel.get_value()
        chunk = chunk_experts(group_sizes.shape[0], RAGGED_CHUNK)  # the experts this device holds (shard_map)

        def stack_of(lo):
            part = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, lo, chunk), k)
            if self.mode == "ptq":
                return _dequantize_stacked(part, dtype)
            return fake_quantize_weight(part, self.schemes).astype(dtype)

        return chunked_ragged_grouped_matmul(x, group_sizes, stack_of, b, self.out_features, chunk)

    def _unroll_rows(self) -> int:
        return GATHER_UNROLL if self.mode == "ptq" else 0

    def _row(self, xm, e, dtype):
        """x_m @ dequantize(W[e]) [N] float32: PTQ through the XLA packed path (`qformats.dispatch.xla_qdot`: the
        fused packed GEMV of `qformats.packed_dot` where the format has one, reading expert e's codes and scales in
        place; else dequantize-then-dot of that one expert)."""
        if self.mode != "ptq":
            return super()._row(xm, e, dtype)
        return xla_qdot(xm[None], _select(self.kernel.get_value(), e))[0].astype(jnp.float32)

    def _tile(self, xt, e, dtype):
        """x_t @ dequantize(W[e]) [T, N] float32 for one tile: PTQ 4- and 8-bit weights through
        `qformats.packed_dot.packed_matmul` (expert e's codes decoded once, in their own [N, K] layout, then one
        dot: the same weight elements as `dequantize`, without its nibble interleave and transpose); other formats,
        QAT, and kernels turned off (`qformats.dispatch.set_kernels_enabled(False)`) dequantize expert e (`_one`)
        and dot."""
        if self.mode == "ptq" and kernels_enabled():
            q = _select(self.kernel.get_value(), e)
            if packed_matmul_supported(q):
                return packed_matmul(xt, q)
        return super()._tile(xt, e, dtype)

    def __call__(self, x):
        raise ModelError(f"QExperts {self.path or '<module>'}: call `grouped` or `gathered` (rows and their experts)")

    def expert_weight(self, e: int) -> QArray:
        """Expert e's packed [in, out] QArray (its leaves indexed along the expert axis)."""
        k = self.kernel.get_value()
        if not isinstance(k, QArray):
            raise ModelError(f"{self.path}: expert_weight needs a packed (PTQ) layer, mode is {self.mode!r}")
        return _select(k, e)


__all__ = ["Experts", "QExperts", "GROUPED_METHODS", "tiled_grouped_matmul", "ragged_grouped_matmul",
           "chunked_ragged_grouped_matmul", "chunk_experts", "tile_rows", "RAGGED_CHUNK"]
