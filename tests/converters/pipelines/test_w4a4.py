"""NVFP4 W4A4 (llm-compressor's NVFP4 preset: TENSOR_GROUP weights, activations with a static per-tensor input global
scale and dynamic local fp8 group scales): the calibrated input global scale against compressed-tensors'
generate_gparam and llm-compressor 0.14's calibration order on a transformers llama, fused weight global scales,
and the checkpoint as compressed-tensors names it (`input_global_scale`)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import generate_gparam  # noqa: E402
from flax import nnx  # noqa: E402

from converters.pipelines.calibrate import quantize_calibrated_lm  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from converters.formats.safetensors_io import open_checkpoint  # noqa: E402
from qformats.models.decoder.calibration import PROJECTIONS, calibrate_decoder  # noqa: E402
from qformats.observers import static_scale  # noqa: E402
from qformats.presets import parse_scheme  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-5,
            tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
SAMPLES = [np.random.RandomState(i).randint(0, 96, n).astype(np.int32) for i, n in enumerate((7, 12, 20))]
# The Flax decoder and transformers sum in different orders: activations (and so their ranges) agree to a few
# float32 ulps, not bit for bit; 2e-6 relative is that accumulation-order allowance, nothing more.
ACC_RTOL = 2e-6


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.float32).eval()
    d = tmp_path_factory.mktemp("w4a4") / "dense"
    hf.save_pretrained(d)
    return d, hf


def _proj(layer, rel):
    a, b = rel.split("/")
    return getattr(getattr(layer, a), b)


def _hf_input_amax(hf):
    """max |x| over every calibration token of each decoder projection's input, from forward pre-hooks on
    transformers' model (what llm-compressor's static_minmax input observer accumulates), one sample at a time."""
    amax, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        for rel in PROJECTIONS:
            mod = _proj(layer, rel)
            key = (i, rel)

            def pre(m, args, key=key):
                a = args[0].detach().abs().max()
                amax[key] = a if key not in amax else torch.maximum(amax[key], a)
            hooks.append(mod.register_forward_pre_hook(pre))
    with torch.no_grad():
        for s in SAMPLES:
            hf(torch.tensor(s[None], dtype=torch.long))
    for h in hooks:
        h.remove()
    return amax


def _gparam(a):
    a = a.detach()
    return generate_gparam(-a.reshape(1), a.reshape(1)).numpy()


def test_input_global_scale_is_compressed_tensors_generate_gparam():
    """static_scale(amax) of NVFP4's input scheme == generate_gparam(-amax, amax), bit for bit, over magnitudes
    from 2^-20 to 2^20 (random mantissas) and powers of two."""
    a = parse_scheme("NVFP4").input_activations
    rng = np.random.default_rng(0)
    vals = np.concatenate([np.exp2(rng.uniform(-20, 20, 2000)), np.exp2(np.arange(-20, 21)), [1.0, 448.0, 6.0]])
    for v in vals.astype(np.float32):
        _, g = static_scale(jnp.float32(v), a, jnp.float32)
        ref = _gparam(torch.tensor(v, dtype=torch.float32))
        assert np.asarray(g).dtype == np.float32 and np.asarray(g).shape == (1,)
        np.testing.assert_array_equal(np.asarray(g), ref, err_msg=str(v))


def test_rtn_float_propagation_is_the_float_models_ranges(dense):
    """weight_search rtn, propagate float (llm-compressor's QuantizationModifier: every pass under
    DisableQuantization, weights float until saved): each projection's input_global_scale is generate_gparam of
    the float model's input range; q/k/v (one input) and gate/up share it exactly."""
    src, hf = dense
    model, _, _ = load_causal_lm(src, tokenizer=False)
    calibrate_decoder(model, SAMPLES, "NVFP4", weight_search="rtn", propagate="float")
    ref = _hf_input_amax(hf)
    for i, layer in enumerate(model.model.layers):
        got = {rel: np.asarray(_proj(layer, rel).input_global_scale.get_value()) for rel in PROJECTIONS}
        for rel in PROJECTIONS:
            np.testing.assert_allclose(got[rel], _gparam(ref[(i, rel)]), rtol=ACC_RTOL, err_msg=f"{i} {rel}")
        np.testing.assert_array_equal(got["self_attn/q_proj"], got["self_attn/k_proj"])
        np.testing.assert_array_equal(got["self_attn/q_proj"], got["self_attn/v_proj"])
        np.testing.assert_array_equal(got["mlp/gate_proj"], got["mlp/up_proj"])


def test_gptq_propagates_quantized_weights_with_float_activations(dense):
    """weight_search gptq, propagate quantized (llm-compressor's GPTQModifier: layer 1 calibrates on layer 0's
    GPTQ weights, activations unquantized): layer 1's input global scales equal those of transformers' model
    with layer 0's weights replaced by ours, dequantized. Quantized NVFP4 activations in the propagation would
    move these ranges by far more than the accumulation-order allowance."""
    src, hf = dense
    model, _, _ = load_causal_lm(src, tokenizer=False)
    calibrate_decoder(model, SAMPLES, "NVFP4", weight_search="gptq", propagate="quantized")
    ref_model = transformers.LlamaForCausalLM(hf.config).to(torch.float32).eval()
    ref_model.load_state_dict(hf.state_dict())
    layer0 = model.model.layers[0]
    with torch.no_grad():
        for rel in PROJECTIONS:
            w = np.asarray(dequantize(_proj(layer0, rel).kernel.get_value(), jnp.float32)).T
            _proj(ref_model.model.layers[0], rel).weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))
    ref = _hf_input_amax(ref_model)
    for rel in PROJECTIONS:
        got = np.asarray(_proj(model.model.layers[1], rel).input_global_scale.get_value())
        np.testing.assert_allclose(got, _gparam(ref[(1, rel)]), rtol=ACC_RTOL, err_msg=rel)
    # fused siblings share the weight global scale: generate_gparam of max |W| over the group (exact)
    for i, layer in enumerate(model.model.layers):
        hl = hf.model.layers[i]
        for group in (("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj"), ("mlp/gate_proj", "mlp/up_proj")):
            amax = torch.stack([_proj(hl, r).weight.abs().max() for r in group]).max()
            for r in group:
                np.testing.assert_array_equal(np.asarray(_proj(layer, r).kernel.get_value().global_scale).reshape(1),
                                              _gparam(amax), err_msg=f"{i} {r}")


def test_w4a4_checkpoint_as_compressed_tensors_names_it(dense, tmp_path):
    src, _ = dense
    np.save(tmp_path / "calib.npy", np.concatenate(SAMPLES))
    out = tmp_path / "nvfp4"
    quantize_calibrated_lm(src, out, "NVFP4", tmp_path / "calib.npy", weight_search="rtn", propagate="float",
                           seq_len=16)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ref = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])}).to_dict()
    assert qc["format"] == "nvfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"] == ref["config_groups"]["group_0"]["input_activations"]
    assert qc["config_groups"]["group_0"]["weights"] == ref["config_groups"]["group_0"]["weights"]
    model, _, _ = load_causal_lm(out, tokenizer=False)
    n = 0
    with open_checkpoint(out) as ck:
        for i, layer in enumerate(model.model.layers):
            for rel in PROJECTIONS:
                name = f"model.layers.{i}.{rel.replace('/', '.')}.input_global_scale"
                assert ck.info(name).dtype == "F32" and tuple(ck.info(name).shape) == (1,), name
                np.testing.assert_array_equal(np.asarray(_proj(layer, rel).input_global_scale.get_value()).reshape(1),
                                              np.asarray(ck.get(name)))
                n += 1
        assert n == 14 and not any(k.endswith("input_scale") for k in ck.keys())
    # the reloaded model computes what the calibrated one does
    again, _, _ = load_causal_lm(src, tokenizer=False)
    from converters.evaluation.calibration_data import load_calibration
    calibrate_decoder(again, load_calibration(tmp_path / "calib.npy", None, seq_len=16, max_tokens=65536, seed=0,
                                              vocab_size=96), "NVFP4", weight_search="rtn", propagate="float")
    fwd = nnx.jit(lambda m, ids: m(ids)[0])
    ids = jnp.asarray(SAMPLES[2][None])
    np.testing.assert_array_equal(np.asarray(fwd(model, ids)), np.asarray(fwd(again, ids)))
