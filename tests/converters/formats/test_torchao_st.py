"""torchao safetensors checkpoints (torchao.prototype.safetensors) read as QArrays equal to torchao's own dequantize."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
from safetensors.torch import save_file  # noqa: E402
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8WeightOnlyConfig, IntxWeightOnlyConfig, MappingType, PerAxis, PerGroup, quantize_)

from converters.formats.quantized import read_quantized  # noqa: E402
from qformats import dequantize  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402


def _save(tmp_path, config, dtype=torch.float32, shapes=((96, 64), (32, 96)), seed=0):
    """A two-Linear torch model quantized by torchao's `quantize_(config)`, saved as torchao's safetensors
    integration writes it (flatten_tensor_state_dict + its metadata) with a config.json of quant_method "torchao";
    returns (directory, {module: torchao weight}, {"0": the first Linear's bias})."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(k, n, bias=i == 0) for i, (k, n) in enumerate(shapes)]).to(dtype)
    quantize_(model, config)
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata=metadata)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "torchao"}}))
    return tmp_path, {str(i): model[i].weight for i in range(len(shapes))}, {"0": model[0].bias}


CASES = {
    "float8-row": (Float8WeightOnlyConfig(), torch.float32),
    "float8-row-bf16": (Float8WeightOnlyConfig(), torch.bfloat16),
    "int4-group32-sym": (IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)), torch.float32),
    "int4-group32-asym-bf16": (IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                                    mapping_type=MappingType.ASYMMETRIC), torch.bfloat16),
    "int8-row": (IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)), torch.float32),
    "int3-group32": (IntxWeightOnlyConfig(weight_dtype=torch.int3, granularity=PerGroup(32)), torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_torchao_dequantize_bit_for_bit(tmp_path, case):
    config, dtype = CASES[case]
    path, weights, biases = _save(tmp_path, config, dtype)
    cm = read_quantized(path)
    for m, w in weights.items():
        q = cm.modules[m]["weight"]
        assert q.shape == tuple(w.shape[::-1]) and q.dtype.name == str(dtype).split(".")[1]
        ref = w.dequantize()
        ours = np.asarray(dequantize(q)).T
        if dtype == torch.bfloat16:
            np.testing.assert_array_equal(ours.view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))
        else:
            np.testing.assert_array_equal(ours.view(np.uint32), ref.numpy().view(np.uint32))
    bias = np.asarray(cm.modules["0"]["bias"]).astype(np.float32)
    np.testing.assert_array_equal(bias, biases["0"].detach().float().numpy())
    assert set(cm.groups) == {"0", "1"} and cm.quant is not None


def _edit_metadata(path, name, old, new):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        md, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert old in md[name]
    md[name] = md[name].replace(old, new)
    save_file(tensors, str(path / "model.safetensors"), metadata=md)


def test_activation_quantization_refused(tmp_path):
    """torchao's Float8DynamicActivationFloat8WeightConfig needs a recent GPU to be made; its record differs from the
    weight-only one by act_quant_kwargs, set here by hand."""
    path, _, _ = _save(tmp_path, Float8WeightOnlyConfig())
    _edit_metadata(path, "0.weight", '"act_quant_kwargs": null',
                   '"act_quant_kwargs": {"_type": "QuantizeTensorToFloat8Kwargs", "_data": {}}')
    with pytest.raises(CheckpointError, match=r"tensor '0\.weight': Float8Tensor with activation quantization"):
        read_quantized(path)


def test_unread_type_refused_naming_tensor(tmp_path):
    path, _, _ = _save(tmp_path, Float8WeightOnlyConfig())
    _edit_metadata(path, "1.weight", '"Float8Tensor"', '"Int4Tensor"')
    with pytest.raises(CheckpointError, match=r"tensor '1\.weight': torchao tensor type 'Int4Tensor' is not read"):
        read_quantized(path)


@pytest.mark.slow
def test_torchao_llama_runs_packed_with_torchaos_logits(tmp_path):
    """A tiny llama whose projections torchao quantized (int4 groups of 32), saved with torchao's safetensors
    integration: load_causal_lm runs it with packed QLinears and gives the logits of the torchao model in torch
    (float32 on both sides: accumulation order only)."""
    transformers = pytest.importorskip("transformers")
    import jax.numpy as jnp
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.nn import QLinear

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
              filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "proj" in name)
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata=metadata)
    config = {**cfg.to_dict(), "quantization_config": {"quant_method": "torchao"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, _, _ = load_causal_lm(tmp_path, tokenizer=False)
    proj = [m for p, m in nnx.iter_modules(ours) if p and "proj" in str(p[-1])]
    assert len(proj) == 7 and all(isinstance(m, QLinear) for m in proj)
    ids = np.array([[3, 17, 99, 5, 42]])
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32))[0])
    assert np.abs(got - theirs).max() <= 2e-5 * np.abs(theirs).max()
