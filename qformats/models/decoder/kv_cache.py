"""KV-cache quantization of the decoder: static / dynamic fp8 schemes (`qformats.kv_cache`) set on its attention."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import ModelError
from qformats.kv_cache import KVCacheScheme, calibrate_kv_scales
from qformats.models.decoder.model import Attention, CausalLM


class KVScale(nnx.Variable):
    """A static KV-cache scale (`k_scale` / `v_scale` of an attention module), shape [1] or [kv_heads, 1, 1]."""


def _attentions(model: CausalLM) -> List[Attention]:
    return [layer.self_attn for layer in model.model.layers]


def kv_cache_scheme(model: CausalLM) -> Optional[KVCacheScheme]:
    """The model's KV-cache scheme (the same on every layer), or None when its cache is not quantized."""
    return _attentions(model)[0].kv_scheme


def enable_kv_cache_quantization(model: CausalLM, scheme: KVCacheScheme,
                                 scales: Optional[Sequence[Tuple[Any, Any]]] = None) -> CausalLM:
    """Quantize the KV cache of `model` (in place; returns it) with `scheme` (`qformats.kv_cache`).

    scales: per layer (k_scale, v_scale), each of shape `scheme.scale_shape(num_kv_heads)` (static schemes:
    required, e.g. from `calibrate_kv_cache`; dynamic: must be None). They are stored as `KVScale` variables
    in the compute dtype, as compressed-tensors keeps them in the model's dtype. From then on attention reads
    fake-quantized keys / values, and `init_cache` gives fp8-code caches. ModelError for a missing scale,
    a wrong count or shape, or a scale that is not finite and positive.
    """
    attns = _attentions(model)
    c = model.config
    if c.mla is not None:
        raise ModelError(f"enable_kv_cache_quantization: the {c.model_type} model's multi-head latent attention caches "
                         "a latent and a rope key (decoder/mla.py), which KV-cache quantization does not cover")
    want = scheme.scale_shape(c.num_kv_heads)
    if scheme.dynamic:
        if scales is not None:
            raise ModelError("enable_kv_cache_quantization: a dynamic KV-cache scheme takes no static scales")
        for a in attns:
            a.kv_scheme, a.k_scale, a.v_scale = scheme, None, None
        return model
    if scales is None or len(scales) != len(attns):
        raise ModelError(f"enable_kv_cache_quantization: a static KV-cache scheme needs (k_scale, v_scale) for each "
                         f"of the {len(attns)} layers, found {'none' if scales is None else len(scales)}")
    checked = []
    for i, pair in enumerate(scales):
        row = []
        for name, sc in zip(("k_scale", "v_scale"), pair):
            a = np.asarray(sc, np.float32)
            if a.shape != want or not np.all(np.isfinite(a)) or not np.all(a > 0):
                raise ModelError(f"enable_kv_cache_quantization: model/layers/{i}/self_attn/{name}: expected finite "
                                 f"positive scales of shape {want} ({scheme.strategy}), found shape {a.shape}"
                                 + ("" if a.shape != want else f", values {a.ravel()[:4]}"))
            row.append(jnp.asarray(sc, model.dtype))
        checked.append(row)
    for a, (ks, vs) in zip(attns, checked):
        a.kv_scheme, a.k_scale, a.v_scale = scheme, KVScale(ks), KVScale(vs)
    return model


def kv_states(model: CausalLM, ids: jax.Array) -> List[Tuple[jax.Array, jax.Array]]:
    """Per layer the (keys, values) [B, G, T, D] that tokens `ids` [B, T] put into the cache, unquantized
    (post-RoPE keys; the states `calibrate_kv_cache` observes)."""
    b, t = ids.shape
    _, cache = model(ids, model.init_cache(b, t, dtype=model.dtype))
    return list(zip(cache.keys, cache.values))


def calibrate_kv_cache(model: CausalLM, batches: Iterable[Any], scheme: KVCacheScheme) -> CausalLM:
    """Static KV-cache scales from calibration token batches ([B, T] ids each), then
    `enable_kv_cache_quantization(model, scheme, scales)`: scale = max |state| / 448 over all batches (per
    tensor or per KV head), `qformats.kv_cache.calibrate_kv_scales`. Returns the model."""
    step = nnx.jit(kv_states)
    scales = calibrate_kv_scales((step(model, jnp.asarray(ids)) for ids in batches), scheme)
    return enable_kv_cache_quantization(model, scheme, scales)


def kv_scale_tensors(model: CausalLM) -> Dict[str, jax.Array]:
    """compressed-tensors names -> static KV-cache scales: "model.layers.{i}.self_attn.k_scale" / "v_scale"
    ({} without static KV-cache quantization)."""
    out: Dict[str, jax.Array] = {}
    for i, a in enumerate(_attentions(model)):
        if a.k_scale is not None:
            out[f"model.layers.{i}.self_attn.k_scale"] = a.k_scale.get_value()
            out[f"model.layers.{i}.self_attn.v_scale"] = a.v_scale.get_value()
    return out
