"""QArray: the quantized array pytree (packed codes, contracted scales, static scheme and logical shape)."""

from __future__ import annotations

import math
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats.codec import decode, encode
from qformats.errors import SchemeError
from qformats.formats import FloatFormat, IntFormat, TableFormat
from qformats.grouping import expand, expected_shapes, transposed_shape
from qformats.packing import unpack
from qformats.rounding import FLOAT_DTYPES as _FLOAT_DTYPES
from qformats.schemes import QuantScheme


def round_elements(scaled: jax.Array, fmt: "FloatFormat | IntFormat") -> jax.Array:
    """The element codes a QArray stores for already-scaled values y = x / s + z (before packing).

    Integers: q = round_half_even(clamp(y, qmin, qmax)) (NaN -> 0), stored offset as uint8 u = q - qmin,
    except signed int8, stored as int8 q. Floats: `encode(y, fmt, overflow="saturate")` (nearest code, ties
    to even, +-max on overflow), with an exact -0 input giving the +0 code, as llm-compressor's oneshot
    writes it (compressed-tensors adds a zero point of 0 to symmetric weights: -0 + 0 = +0); tiny negatives
    that round to zero keep their sign (-0 code). Table formats are refused: their codes and scales are chosen
    together by the codebook's own quantizer (they are read from files, `qformats.formats.TableFormat`).

    Raises:
      SchemeError: a table format.
    """
    if isinstance(fmt, TableFormat):
        raise SchemeError(f"quantize: table format {fmt.name} is read from files (GGUF IQ4_NL / IQ4_XS), not made by "
                          f"quantize (its codes and scales are chosen together by the codebook's own search); "
                          f"expected a float or integer element format")
    if isinstance(fmt, IntFormat):
        q = jnp.round(jnp.clip(scaled, fmt.qmin, fmt.qmax))
        q = jnp.where(jnp.isnan(q), 0, q).astype(jnp.int32)
        if fmt.bits == 8 and fmt.signed:
            return q.astype(jnp.int8)
        return (q - fmt.qmin).astype(jnp.uint8)
    scaled = jnp.where(scaled == 0, jnp.float32(0), scaled)
    return encode(scaled, fmt, overflow="saturate")


def element_values(codes: jax.Array, fmt: "FloatFormat | IntFormat | TableFormat", dtype=jnp.float32) -> jax.Array:
    """Inverse of `round_elements` on the codes it returns: the element values before scaling.

    Integers: q = u + qmin (int8: q itself), the zero point not yet subtracted; floats: `decode(codes, fmt)`;
    tables: `fmt.values[c]` (a gather from the 2^b-entry table, exact in float32 / bf16 / f16).
    Exact in float32; a narrower `dtype` rounds as `astype` does.
    """
    if isinstance(fmt, TableFormat):
        return jnp.asarray(np.asarray(fmt.values, np.float32), dtype)[codes]  # uint8 index: no negative wrap
    if isinstance(fmt, IntFormat):
        if codes.dtype == jnp.int8:
            return codes.astype(dtype)
        return (codes.astype(jnp.int32) + fmt.qmin).astype(dtype)
    return decode(codes, fmt, dtype=dtype)


@jax.tree_util.register_pytree_node_class
class QArray:
    """A quantized array.

    Layout (the interchange layout, identical to compressed-tensors' `[out, in]` storage for a Flax kernel
    quantized along axis 0): the reduction axis `axis` is moved last, giving the transposed logical shape
    `tshape = shape[:axis] + shape[axis+1:] + (K,)`, K = shape[axis]. Then

      codes:        uint8 `tshape[:-1] + (ceil(K * bits / 8),)`, codes packed little-endian along the last
                    axis (`qformats.packing.pack`); 8-bit formats unpacked (int8 for int8, else uint8 bit
                    patterns). Integer codes are stored offset: u = q - qmin (q + 2^(bits-1) when signed); table
                    formats (`TableFormat`, e.g. GGUF's IQ4_NL grid) store the table index c, value(c) = values[c].
      scale:        contracted, never expanded: tensor `[1]`; channel/token `tshape[:-1] + (1,)`; group and
                    tensor_group `tshape[:-1] + (K / g,)`; block (2-D) `[ceil(O/bh), ceil(K/bw)]`. Its dtype
                    is the scheme's scale format (float32/bf16/f16, float8_e4m3fn, or uint8 E8M0 codes).
      zero_point:   int8, shaped like scale (asymmetric integer schemes only).
      global_scale: float32 `[1]` (tensor_group / NVFP4 only).
      offset:       optional, a float additive offset shaped like scale, in the scale's (float) dtype: the
                    minimum of formats that store one per group beside the scale (GGUF Q4_1 / Q5_1 / Q2_K /
                    Q4_K / Q5_K: w = d q + m), which an integer zero point cannot hold. None for every array
                    `quantize` makes (and for every compressed-tensors format).
      compute_dtype: optional (static), the float dtype the reconstruction rounds in when it is not the scale's:
                    a GGUF block's float16 d and m are stored as float16 (the file's bytes) while gguf computes
                    d q + m in float32. None: the scale's dtype when it is a float (float32 / bf16 / f16), else
                    float32 (fp8 and E8M0 scales), as compressed-tensors computes (`work_dtype`).

    Reconstruction: x = (value(code) - zero_point) * scale / global_scale + offset, each op rounded in
    `work_dtype` (scale and offset converted to it first, exactly when it is wider), scale and offset expanded
    over their group, then the reduction axis moved back. `scheme`, `shape`, `dtype`, `axis` and
    `compute_dtype` are static (pytree aux data). The offset is a pytree child only when present, so an array
    without one flattens exactly as before it existed.
    """

    def __init__(self, codes, scale, zero_point, global_scale, *, scheme: QuantScheme,
                 shape: Tuple[int, ...], dtype, axis: int, offset=None, compute_dtype=None):
        self.codes = codes
        self.scale = scale
        self.zero_point = zero_point
        self.global_scale = global_scale
        self.offset = offset
        self.scheme = scheme
        self.shape = tuple(int(s) for s in shape)
        self.dtype = jnp.dtype(dtype)
        self.axis = int(axis)
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)

    # ---- pytree ----------------------------------------------------------------------------------------
    def tree_flatten(self):
        children = (self.codes, self.scale, self.zero_point, self.global_scale)
        if self.offset is not None:
            children += (self.offset,)
        compute = None if self.compute_dtype is None else self.compute_dtype.name
        return children, (self.scheme, self.shape, self.dtype.name, self.axis, compute)

    @classmethod
    def tree_unflatten(cls, aux, children):
        scheme, shape, dtype, axis, compute = aux
        offset = children[4] if len(children) > 4 else None
        return cls(*children[:4], scheme=scheme, shape=shape, dtype=dtype, axis=axis, offset=offset,
                   compute_dtype=compute)

    def replace(self, **parts) -> "QArray":
        """This QArray with the given leaves (`codes`, `scale`, `zero_point`, `global_scale`, `offset`) or static
        fields (`shape`, `dtype`, `axis`, `scheme`, `compute_dtype`) replaced; every other one kept."""
        kw = dict(codes=self.codes, scale=self.scale, zero_point=self.zero_point, global_scale=self.global_scale,
                  offset=self.offset, scheme=self.scheme, shape=self.shape, dtype=self.dtype, axis=self.axis,
                  compute_dtype=self.compute_dtype)
        unknown = set(parts) - set(kw)
        if unknown:
            raise SchemeError(f"QArray.replace: unknown field(s) {sorted(unknown)}; expected some of {sorted(kw)}")
        kw.update(parts)
        return QArray(kw.pop("codes"), kw.pop("scale"), kw.pop("zero_point"), kw.pop("global_scale"), **kw)

    # ---- facts -----------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def tshape(self) -> Tuple[int, ...]:
        """The logical shape with the reduction axis moved last."""
        return transposed_shape(self.shape, self.axis)

    @property
    def format(self):
        return self.scheme.format

    @property
    def work_dtype(self):
        """The float dtype the reconstruction rounds each op in: `compute_dtype` when set, else the scale's dtype
        when it is float32 / bf16 / f16, else float32."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        sd = jnp.dtype(self.scale.dtype)
        return sd if sd in _FLOAT_DTYPES else jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes + scale + zero point + global scale + offset."""
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (self.codes, self.scale, self.zero_point, self.global_scale, self.offset)
                   if a is not None)

    @property
    def dense_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __repr__(self) -> str:
        extra = "" if self.offset is None else ", offset"
        if self.compute_dtype is not None:
            extra += f", compute_dtype={self.compute_dtype.name}"
        return (f"QArray(shape={self.shape}, dtype={self.dtype.name}, axis={self.axis}, "
                f"scheme={self.scheme.describe()!r}{extra}, nbytes={self.nbytes})")

    # ---- views -----------------------------------------------------------------------------------------
    def element_codes(self) -> jax.Array:
        """Unpacked codes, uint8 (int8 for int8), shape `tshape`."""
        bits = self.scheme.bits
        if bits == 8:
            return self.codes
        return unpack(self.codes, bits, self.tshape[-1])

    def element_values(self, dtype=jnp.float32) -> jax.Array:
        """Element values before scaling (integers for int formats, with zero point not yet applied)."""
        return element_values(self.element_codes(), self.scheme.format, dtype)

    def scale_values(self, dtype=jnp.float32) -> jax.Array:
        """The contracted scale as floats (E8M0 codes decoded to 2^(e-127)), global scale not applied."""
        if self.scheme.scale_format == "e8m0":
            return decode(self.scale, "e8m0", dtype=dtype)
        return self.scale.astype(dtype)

    def expanded_scale(self, dtype=jnp.float32) -> jax.Array:
        """The effective scale broadcast to `tshape` (a derived view; never stored)."""
        s = self.scale_values(jnp.float32)
        if self.global_scale is not None:
            s = s / self.global_scale.astype(jnp.float32)
        return expand(s, self.scheme, self.tshape).astype(dtype)

    def check(self) -> None:
        """Validate shapes of all parts against the scheme (non-jit; raises SchemeError)."""
        want = expected_shapes(self.scheme, self.shape, self.axis)
        for part in ("codes", "scale", "zero_point", "global_scale"):
            arr, exp = getattr(self, part), want.get(part)
            if (arr is None) != (exp is None) or (arr is not None and tuple(arr.shape) != exp):
                raise SchemeError(f"QArray {self.scheme.describe()} shape {self.shape}: {part} expected "
                                  f"shape {exp}, found {None if arr is None else tuple(arr.shape)}")
        if self.offset is not None:
            o, s = self.offset, self.scale
            if tuple(o.shape) != tuple(s.shape) or jnp.dtype(o.dtype) != jnp.dtype(s.dtype) \
                    or jnp.dtype(s.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                                  jnp.dtype(jnp.float16)):
                raise SchemeError(f"QArray {self.scheme.describe()} shape {self.shape}: offset expected the "
                                  f"scale's shape {tuple(s.shape)} and float dtype {jnp.dtype(s.dtype).name}, found "
                                  f"{tuple(o.shape)} {jnp.dtype(o.dtype).name}")
        if self.compute_dtype is not None and self.compute_dtype not in _FLOAT_DTYPES:
            raise SchemeError(f"QArray {self.scheme.describe()} shape {self.shape}: compute_dtype expected one of "
                              f"float32, bfloat16, float16, found {self.compute_dtype.name}")
