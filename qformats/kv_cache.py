"""FP8 key/value-cache quantization as compressed-tensors' `kv_cache_scheme` defines it (per tensor or per head).

compressed-tensors quantizes the post-RoPE key states and the value states of each attention module before
they enter the cache (`QuantizedKVCache.forward` -> `forward_quantize(module, key_states, "k", args)`), with
the states laid out [batch, kv_heads, seq, head_dim] -- the layout of `qformats.models.decoder`'s cache:

    codes  = fp8_e4m3fn(clamp(x / scale, -448, 448))        (round to nearest, ties to even)
    x_hat  = codes.astype(scale.dtype) * scale

    strategy "tensor":    one scale, shape [1]
    strategy "attn_head": one scale per KV head, shape [kv_heads, 1, 1]

Static scales (`dynamic: false`) live on the attention module as `k_scale` / `v_scale` and are calibrated
from data: scale = amax / 448 over every calibration batch (min-max: compressed-tensors' `calculate_qparams`
for symmetric FP8, `max(|min(x, 0)|, max(x, 0)) / ((448 - (-448)) / 2)`, a zero scale replaced by the
scale dtype's eps). That is llm-compressor 0.14's `static_minmax` observer; its default for a kv_cache_scheme
without an `observer` is the moving-average `minmax` (m <- 0.99 m + 0.01 batch min/max, over its shuffled
calibration batches), which depends on the sample order and is not reproduced here: give llm-compressor
`observer: "static_minmax"` in the kv_cache_scheme to get these scales. Dynamic scales (`dynamic: true`, "tensor" only: compressed-tensors refuses dynamic
`attn_head`) are computed the same way from each block of states written at once (a prefill, a decode step),
over the whole block, batch included. A cache keeps uint8 codes: 1 byte per element against 2 (bfloat16)
or 4 (float32); a dynamic cache adds one float32 scale per position.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Tuple

import jax
import jax.numpy as jnp

from qformats.codec import decode, encode
from qformats.errors import SchemeError

__all__ = ["FP8_MAX", "KV_CACHE_CHOICES", "KV_FORMAT", "KVCacheScheme", "amax_of", "calibrate_kv_scales",
           "dequantize_kv", "dynamic_scale", "fake_quantize_kv", "kv_cache_name", "parse_kv_cache", "quantize_kv",
           "scale_from_amax"]

KV_FORMAT = "fp8_e4m3fn"
FP8_MAX = 448.0
STRATEGIES = ("tensor", "attn_head")


@dataclasses.dataclass(frozen=True)
class KVCacheScheme:
    """An FP8 (e4m3fn) KV-cache scheme: `strategy` "tensor" (scale [1]) or "attn_head" (scale [kv_heads, 1, 1]);
    `dynamic`: scales from each written block (tensor only) instead of static calibrated ones."""

    strategy: str = "tensor"
    dynamic: bool = False

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise SchemeError(f"KVCacheScheme: strategy must be one of {STRATEGIES}, found {self.strategy!r}")
        if not isinstance(self.dynamic, bool):
            raise SchemeError(f"KVCacheScheme: dynamic must be a bool, found {self.dynamic!r}")
        if self.dynamic and self.strategy != "tensor":
            raise SchemeError("KVCacheScheme: dynamic scales exist for strategy 'tensor' only (compressed-tensors "
                              f"computes no dynamic {self.strategy!r} scales)")

    def scale_shape(self, num_kv_heads: int) -> Tuple[int, ...]:
        """The shape compressed-tensors gives `k_scale` / `v_scale`: [1] or [kv_heads, 1, 1]."""
        return (1,) if self.strategy == "tensor" else (num_kv_heads, 1, 1)


#: The KV-cache scheme strings of `parse_kv_cache` (the CLI's --kv-cache): per tensor, per KV head, dynamic.
KV_CACHE_CHOICES = {"fp8": KVCacheScheme("tensor"), "fp8:head": KVCacheScheme("attn_head"),
                    "fp8:dynamic": KVCacheScheme("tensor", dynamic=True)}


def parse_kv_cache(text: str) -> KVCacheScheme:
    """"fp8" (static, one scale per tensor), "fp8:head" (static, one per KV head) or "fp8:dynamic" (a scale per
    written block) -> the KVCacheScheme."""
    if text not in KV_CACHE_CHOICES:
        raise SchemeError(f"KV-cache scheme: expected one of {sorted(KV_CACHE_CHOICES)}, found {text!r}")
    return KV_CACHE_CHOICES[text]


def kv_cache_name(scheme: KVCacheScheme) -> str:
    """The `parse_kv_cache` string of a scheme ("fp8", "fp8:head", "fp8:dynamic")."""
    return next(k for k, v in KV_CACHE_CHOICES.items() if v == scheme)


def amax_of(x: jax.Array, scheme: KVCacheScheme) -> jax.Array:
    """max |x| of states x [batch, kv_heads, seq, head_dim]: shape [1] ("tensor") or [kv_heads, 1, 1]."""
    a = jnp.abs(x)
    if scheme.strategy == "tensor":
        return jnp.max(a).reshape(1)
    return jnp.max(a, axis=(0, 2, 3)).reshape(-1, 1, 1)


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """scale = amax / 448 in amax's dtype; 0 -> eps of that dtype (compressed-tensors' calculate_qparams)."""
    s = amax / jnp.asarray(FP8_MAX, amax.dtype)
    return jnp.where(s == 0, jnp.asarray(jnp.finfo(amax.dtype).eps, amax.dtype), s)


def dynamic_scale(x: jax.Array) -> jax.Array:
    """The dynamic "tensor" scale of one written block x: [1] = max|x| / 448 (eps when x is all zeros)."""
    return scale_from_amax(jnp.max(jnp.abs(x)).reshape(1))


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """uint8 fp8_e4m3fn codes of fp8(clamp(x / scale, -448, 448)); scale broadcasts against x [B, G, S, D]
    ([1], [G, 1, 1], or per position [S, 1]). The division happens in x's dtype, as torch's does."""
    return encode(x / scale.astype(x.dtype), KV_FORMAT, overflow="saturate")


def dequantize_kv(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """codes.astype(scale.dtype) * scale (exact decode of the fp8 codes, one rounding of the product)."""
    return decode(codes, KV_FORMAT, dtype=scale.dtype) * scale


def fake_quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """dequantize_kv(quantize_kv(x, scale), scale): what attention sees of states x."""
    return dequantize_kv(quantize_kv(x, scale), scale)


def calibrate_kv_scales(states: Iterable[List[Tuple[jax.Array, jax.Array]]], scheme: KVCacheScheme
                        ) -> List[Tuple[jax.Array, jax.Array]]:
    """Static (k_scale, v_scale) per layer from calibration batches: scale = amax / 448 over all batches.

    Args:
      states: one item per calibration batch: the list over layers of (keys, values) [B, G, S, D] as they
        would enter the cache (post-RoPE keys; `qformats.models.decoder.kv_states` yields them for a model).
      scheme: a static KVCacheScheme.
    Returns:
      per layer (k_scale, v_scale), shapes `scheme.scale_shape(G)`, in the states' dtype.
    """
    if scheme.dynamic:
        raise SchemeError("calibrate_kv_scales: a dynamic KVCacheScheme has no static scales to calibrate")
    amax = None
    for layers in states:
        cur = [(amax_of(k, scheme), amax_of(v, scheme)) for k, v in layers]
        amax = cur if amax is None else [(jnp.maximum(a, c), jnp.maximum(b, d))
                                         for (a, b), (c, d) in zip(amax, cur)]
    if amax is None:
        raise SchemeError("calibrate_kv_scales: expected at least one calibration batch, found none")
    return [(scale_from_amax(a), scale_from_amax(b)) for a, b in amax]
