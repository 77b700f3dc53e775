"""qformats.models.decoder.rules: the seven projections of every layer are quantized, lm_head only on request."""

from flax import nnx

from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
from qformats.nn import QLinear, quantize_model


def test_quantization_rules_leave_lm_head_dense():
    rules = quantization_rules("W8A16")
    assert [r.pattern for r in rules] == [r"model/layers/\d+/(self_attn/([qkvo]_proj|q_[ab]_proj|kv_a_proj_with_mqa|"
                                          r"kv_b_proj)|mlp/((experts|shared_experts)/)?(gate|up|down)_proj)"]
    assert [r.pattern for r in quantization_rules("W8A16", quantize_lm_head=True)][1] == "lm_head"
    model = CausalLM(DecoderConfig.from_hf(dict(
        model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2)), rngs=nnx.Rngs(0))
    quantize_model(model, quantization_rules("W8A16", quantize_lm_head=True))
    assert isinstance(model.lm_head, QLinear)
