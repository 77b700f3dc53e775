"""qformats.models.decoder.rules: the seven projections of every layer are quantized (MoE expert stacks: tests/qformats/
models/decoder/test_moe_quantized.py), lm_head only on request."""

from flax import nnx

from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
from qformats.models.decoder.rules import PROJECTIONS
from qformats.nn import QLinear, quantize_model


def test_quantization_rules_leave_lm_head_dense():
    rules = quantization_rules("W8A16")
    assert [r.pattern for r in rules] == [PROJECTIONS]
    assert [r.pattern for r in quantization_rules("W8A16", quantize_lm_head=True)][1] == "lm_head"
    model = CausalLM(DecoderConfig.from_hf(dict(
        model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2)), rngs=nnx.Rngs(0))
    quantize_model(model, quantization_rules("W8A16", quantize_lm_head=True))
    assert isinstance(model.lm_head, QLinear)
