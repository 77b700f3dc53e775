"""qformats.nn: quantized Flax layers and in-place model quantization by path rules (NNX and linen)."""

from qformats.nn.modules import CalibStat, QEinsum, QLinear, QLinearGeneral, QuantStat, quantize_weight
from qformats.nn.rules import Rule, resolve_scheme
from qformats.nn.transform import convert, quantize_model, quantized_layers
from qformats.nn.stats import param_bytes
from qformats.nn.linen import QDense, QuantizedLinen, quantize_linen, quantize_params

__all__ = ["QLinear", "QLinearGeneral", "QEinsum", "QuantStat", "CalibStat", "Rule", "quantize_model", "convert", "quantized_layers",
           "quantize_weight", "resolve_scheme", "param_bytes",
           "QDense", "QuantizedLinen", "quantize_linen", "quantize_params"]
