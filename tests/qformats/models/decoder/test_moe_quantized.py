"""Packed mixture-of-experts decoders: quantization_rules quantize every expert stack (and the shared expert), not the
routers; the packed model equals the float model on the dequantized weights, through prefill and cached decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from moe_tiny import ids, read_checkpoint, write_checkpoint  # noqa: E402
from qformats.models.decoder import CausalLM, DecoderConfig, load_hf_tensors, quantization_rules  # noqa: E402
from qformats.models.generate import generate  # noqa: E402
from qformats.nn import Experts, QExperts, QLinear, quantize_model, quantized_layers  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

IDS = ids()


@pytest.mark.parametrize("arch, scheme", [pytest.param("qwen2_moe", "NVFP4A16", marks=pytest.mark.slow),
                                          pytest.param("mixtral", "W4A16:g16", marks=pytest.mark.slow)])
def test_packed_moe_equals_float_model_on_dequantized_weights(arch, scheme, tmp_path):
    # 2 layers: qwen2_moe's sparse layer (shared expert) then a dense one (mlp_only_layers)
    write_checkpoint(arch, tmp_path, num_hidden_layers=2, **({"mlp_only_layers": [1]} if arch == "qwen2_moe" else {}))
    cfg, tensors = read_checkpoint(tmp_path)

    def fresh():
        m = nnx.eval_shape(lambda: CausalLM(DecoderConfig.from_hf(cfg), rngs=nnx.Rngs(0)))
        return load_hf_tensors(m, tensors)

    packed, ref = fresh(), fresh()
    quantize_model(packed, quantization_rules(scheme))
    layers = quantized_layers(packed)
    stacks = {p for p, m in layers.items() if isinstance(m, QExperts)}
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w2", "w3") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    sparse = [i for i, s in enumerate(packed.config.moe_layers) if s]
    assert stacks == {f"model/layers/{i}/{block}/experts/{n}" for i in sparse for n in names}
    # routers and the shared expert's gate stay dense; the shared expert is quantized
    assert not any(p.endswith(("/gate", "shared_expert_gate")) for p in layers)
    if arch == "qwen2_moe":
        assert isinstance(packed.model.layers[0].mlp.shared_expert.up_proj, QLinear)
    for path, q in layers.items():
        node = ref
        for p in path.split("/"):
            node = node[int(p)] if p.isdigit() else getattr(node, p)
        w = q.kernel.get_value()
        if isinstance(q, QExperts):
            assert isinstance(node, Experts)
            w = jnp.stack([dequantize(q.expert_weight(e), jnp.float32) for e in range(q.num_experts)])
        else:
            w = dequantize(w, jnp.float32)
        node.kernel.set_value(w)
    fwd = nnx.jit(lambda m, x: m(x)[0])
    got, want = np.asarray(fwd(packed, jnp.asarray(IDS))), np.asarray(fwd(ref, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # accumulation order only
    # greedy decoding (gathered experts) of the packed model equals the float model's on the same weights
    np.testing.assert_array_equal(np.asarray(generate(packed, IDS[:, :8], 12)),
                                  np.asarray(generate(ref, IDS[:, :8], 12)))
    # the stacked packed weights are in the model's params, with the expert axis on every leaf
    q = layers[f"model/layers/{sparse[0]}/{block}/experts/{names[0]}"]
    assert all(leaf.shape[0] == q.num_experts for leaf in jax.tree.leaves(q.kernel.get_value()))
