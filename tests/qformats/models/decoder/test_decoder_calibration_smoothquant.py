"""qformats.models.decoder.calibration's SmoothQuant adapter: llm-compressor's SmoothQuant scales folded into the
decoder's norms leave the float model's outputs unchanged (float rounding only) and flatten the activation ranges
the projections see."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder import CausalLM, DecoderConfig
from qformats.models.decoder.calibration import calibrate_decoder, smoothquant_transform

CFG = DecoderConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)


def _outlier_model():
    m = CausalLM(CFG, rngs=nnx.Rngs(0))
    for layer in m.model.layers:  # a few outlier channels in the norms, as in real LMs
        w = np.ones(64, np.float32)
        w[[3, 17]] = 20.0
        layer.input_layernorm.weight.set_value(jnp.asarray(w))
        layer.post_attention_layernorm.weight.set_value(jnp.asarray(w[::-1].copy()))
    return m


def test_float_outputs_unchanged_and_w8a8_error_lower():
    samples = list(np.random.default_rng(0).integers(0, 128, (8, 16)).astype(np.int32))
    ids = jnp.stack(samples)
    ref = _outlier_model()(ids)[0]
    errs = {}
    for alpha in (None, 0.5):
        m = _outlier_model()
        tf = None if alpha is None else smoothquant_transform(alpha)
        if tf is not None:  # float pass only: transform each layer, no quantization
            calibrate_decoder(m, samples, "W8A8", weight_search="rtn", transform=tf)
        else:
            calibrate_decoder(m, samples, "W8A8", weight_search="rtn")
        errs[alpha] = float(jnp.mean((m(ids)[0] - ref) ** 2))
    assert errs[0.5] < 0.5 * errs[None], errs


def test_transform_is_exact_in_float():
    samples = list(np.random.default_rng(1).integers(0, 128, (4, 16)).astype(np.int32))
    ids = jnp.stack(samples)
    m = _outlier_model()
    ref = m(ids)[0]
    xs = [m.model.embed_tokens(ids)]
    valid = [jnp.ones(ids.shape, bool)]
    from qformats.models.decoder import attention_mask, inv_freq, rope_tables
    pos = jnp.arange(16)
    cos, sin = rope_tables(pos, inv_freq(CFG))
    tf = smoothquant_transform(0.8)
    tf(m.model.layers[0], 0, xs, valid, lambda j: (cos, sin, attention_mask(pos, 16, None)))  # batch j's
    assert float(jnp.max(jnp.abs(m.model.layers[0].input_layernorm.weight.get_value() - 1))) > 0.1
    np.testing.assert_allclose(np.asarray(m(ids)[0]), np.asarray(ref), atol=1e-4)  # float rounding only


def test_bad_alpha():
    with pytest.raises(ModelError, match="alpha"):
        smoothquant_transform(1.5)
