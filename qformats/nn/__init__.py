"""qformats.nn: quantized Flax layers and in-place model quantization by path rules (NNX and linen).

NNX::

    from qformats.nn import Rule, quantize_model, convert

    quantize_model(model, [Rule("pooler", None), Rule(r".*/attention/.*", "FP8_DYNAMIC"), Rule(".*", "W4A16")])
    # calibrated: static activation scales + MSE clipping search / GPTQ of the weights
    quantize_model(model, [Rule(".*", "NVFP4")], calibration_data=batches, weight_search="mse")
    quantize_model(model, [Rule(".*", "W4A16")], calibration_data=batches, weight_search="gptq")
    # any layer class (custom modules, jnp.einsum on params, scan stacks): trace once on an example batch
    model, plan = quantize_model(model, [Rule(".*", "W4A16")], example=batch, return_summary=True)
    # QAT: float weights, fake-quantized forward; then pack
    quantize_model(model, [Rule(".*", "W4A16")], mode="qat"); ...train...; convert(model)

Linen::

    qmodule, qparams = quantize_linen(module, params, [Rule(".*", "W8A16")], x)  # x: example inputs
    y = qmodule.apply(qparams, x)

Modules: `projection` (the layer math as pure functions of arrays, shared by NNX and linen), `nnx_layers`
(QLinear, QLinearGeneral, QEinsum and their variable types: they hold statistics and packed weights), `experts`
(Experts / QExperts: stacked [E, in, out] expert projections, float and packed), `graph` (find / replace modules
in an NNX graph), `nnx_transform` (quantize_model, convert, prepare_kernels), `linen` (QDense, QDenseGeneral,
linen.QEinsum), `linen_transform` (quantize_linen),
`traced` (matmul weights of any layer class: found by one abstract trace of the model, held as packed
`MatmulWeight`s, run by a jaxpr interpreter; `quantize_model(..., example=)` and `quantize_linen` with example
inputs use it), `nnx_traced` (its NNX glue: packing params in place, running their modules),
`checkpoint` (load_quantized / export_quantized: pure glue for checkpoint readers and writers), `sizes`
(param_bytes). Observers and the MSE search are pure functions in `qformats.observers`; the weight searches
(WEIGHT_SEARCHES, quantize_weight), GPTQ and the shared NVFP4 global scales are in `qformats.algorithms`.
"""

from qformats.nn.experts import Experts, QExperts
from qformats.nn.nnx_layers import (CalibStat, KernelCache, PackedParam, QEinsum, QLinear, QLinearGeneral,
                                    QuantizedMatmul, QuantStat)
from qformats.matching import Rule, resolve_scheme
from qformats.nn.nnx_transform import convert, prepare_kernels, quantize_model, quantized_layers
from qformats.nn.sizes import param_bytes
from qformats.nn.linen import QDense, QDenseGeneral
from qformats.nn.linen_transform import QuantizedLinen, WeightLayout, quantize_linen, quantize_params, record_layouts
from qformats.nn.checkpoint import export_quantized, load_quantized
from qformats.nn.traced import MatmulWeight

__all__ = ["Experts", "QExperts", "QLinear", "QLinearGeneral", "QEinsum", "QuantizedMatmul", "QuantStat", "CalibStat", "KernelCache",
           "PackedParam", "Rule",
           "quantize_model", "convert", "prepare_kernels", "quantized_layers", "resolve_scheme",
           "param_bytes",
           "QDense", "QDenseGeneral", "QuantizedLinen", "WeightLayout", "quantize_linen", "quantize_params",
           "record_layouts", "load_quantized", "export_quantized", "MatmulWeight"]
