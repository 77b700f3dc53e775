"""qformats.models.decoder.rotate: SpinQuant rotations of an in-memory decoder (then quantize_model) against the
checkpoint path (converters.pipelines.rotate.rotate_checkpoint -> quantize_checkpoint -> load_causal_lm) and the unrotated model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from converters.pipelines.rotate import rotate_checkpoint  # noqa: E402
from converters.formats.compressed_tensors.transforms import ct_hadamard_bases  # noqa: E402
from qformats.errors import ModelError  # noqa: E402
from qformats.models import decoder  # noqa: E402
from qformats.models.decoder import rotate_decoder  # noqa: E402
from qformats.models.minilm import MiniLM, MiniLMConfig  # noqa: E402
from qformats.nn import quantize_model  # noqa: E402

# power-of-two sizes, so that "hadamard" (Sylvester) exists too: hidden 64, head_dim 16, intermediate 128
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, eos_token_id=None,
             bos_token_id=None, pad_token_id=None, tie_word_embeddings=True, attention_bias=True)
IDS = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 9)), jnp.int32)
# float32 logits of magnitude ~5: the rotated weights are rounded to float32 once per fused step and the rotated
# activations are summed in another order; orthogonal rotations do not amplify that (the checkpoint tests measure
# <= 4e-6, the same bound as tests/converters/pipelines/test_rotate.py)
ATOL = 2e-5


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tied llama with q/k/v/o biases, norm gains and biases away from 1 / 0 (so that folding them matters)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.rand_like(p))
            elif n.endswith("bias"):
                p.normal_()
    d = tmp_path_factory.mktemp("rot") / "src"
    hf.save_pretrained(d)
    return d


_forward = nnx.jit(lambda m, x: m(x)[0])  # one jitted function: a model structure seen before is not traced again


def logits(model):
    return np.asarray(_forward(model, IDS))


def flat_state(model):
    """path -> array of every leaf of the model's state (packed codes, scales, kernels, norms, rotation signs)."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


@pytest.mark.parametrize("kind,rotations", [("hadamard", ("R1", "R2")), ("random-hadamard", ("R1", "R2")),
                                            ("random-hadamard", ("R1", "R2", "R3", "R4"))])
def test_rotated_dense_model_keeps_its_logits(src, kind, rotations):
    model, _, _ = load_causal_lm(src, tokenizer=False)
    ref = logits(model)
    rec = rotate_decoder(model, kind, rotations=rotations, center_embeddings=False)
    assert list(rec.transform_config["config_groups"]) == list(rotations)
    assert model.config.tie_word_embeddings is False and model.lm_head is not None
    assert np.all(np.asarray(model.model.layers[0].input_layernorm.weight.get_value()) == 1)
    got = logits(model)
    print(f"\n{kind} {'+'.join(rotations)}: max |logits rotated - original| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)
    assert np.abs(got - ref).max() > 0  # the weights did change


@pytest.mark.parametrize("scheme,kind,rotations", [
    ("W4A16:g16", "random-hadamard", ("R1", "R2")),
    ("NVFP4A16", "hadamard", ("R1", "R2")),
    ("W4A16:g16", "random-hadamard", ("R1", "R2", "R3", "R4")),
])
def test_in_memory_rotation_and_quantization_equal_the_checkpoint_path(src, tmp_path, scheme, kind, rotations):
    """rotate_decoder then quantize_model on the loaded dense model == rotate_checkpoint -> quantize_checkpoint ->
    load_causal_lm, leaf for leaf (packed codes, scales, global scales, dense tensors, online rotation signs) and
    logit for logit, bit for bit: the same per-tensor function with the same float64 products and casts."""
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, scheme, rotate=kind, rotations=rotations, progress=False)
    want_model, _, _ = load_causal_lm(dst, tokenizer=False)
    model, _, _ = load_causal_lm(src, tokenizer=False)
    rotate_decoder(model, kind, rotations=rotations)
    quantize_model(model, decoder.quantization_rules(scheme))
    got, want = flat_state(model), flat_state(want_model)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_array_equal(logits(model), logits(want_model))


def test_seed_and_signs_select_the_draw(src, tmp_path):
    """rotate_decoder(seed=s) rotates as rotate_checkpoint(seed=s); another seed gives other weights."""
    rotate_checkpoint(src, tmp_path / "rot", "random-hadamard", seed=3)
    want, _, _ = load_causal_lm(tmp_path / "rot", tokenizer=False)
    model, _, _ = load_causal_lm(src, tokenizer=False)
    rotate_decoder(model, "random-hadamard", seed=3)
    for k, v in flat_state(want).items():
        np.testing.assert_array_equal(flat_state(model)[k], v, err_msg=k)
    other, _, _ = load_causal_lm(src, tokenizer=False)
    rotate_decoder(other, "random-hadamard", seed=4)
    k = "['model']['layers'][0]['self_attn']['q_proj']['kernel'].value"
    assert not np.array_equal(flat_state(other)[k], flat_state(model)[k])


def test_unsupported_models_and_requests_are_typed_errors(src):
    with pytest.raises(ModelError, match="decoder family"):
        rotate_decoder(MiniLM(MiniLMConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32, max_position_embeddings=16), rngs=nnx.Rngs(0)))
    model, _, _ = load_causal_lm(src, tokenizer=False)
    before = flat_state(model)
    with pytest.raises(ModelError, match="decoder family"):
        rotate_decoder(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "random-hadamard")
    with pytest.raises(ModelError, match="kind"):
        rotate_decoder(model, "random-matrix")
    with pytest.raises(ModelError, match="rotations"):
        rotate_decoder(model, rotations=("R1", "R5"))
    with pytest.raises(ModelError, match="signs"):
        rotate_decoder(model, signs={"R1": np.ones(8)})
    for k, v in before.items():  # refused before any change
        np.testing.assert_array_equal(flat_state(model)[k], v)
    assert model.lm_head is None
    quantize_model(model, decoder.quantization_rules("W4A16:g16"))
    with pytest.raises(ModelError, match="already quantized"):
        rotate_decoder(model)


def test_sizes_without_a_rotation_are_refused():
    """hidden 48 = 16 * 3: no Sylvester matrix; a random Hadamard one needs compressed-tensors' stored base."""
    cfg = decoder.DecoderConfig(model_type="llama", vocab_size=32, hidden_size=48, intermediate_size=64,
                                num_layers=1, num_heads=3, num_kv_heads=3, head_dim=16)
    model = decoder.CausalLM(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ModelError, match="deterministic Hadamard"):
        rotate_decoder(model, "hadamard")
    with pytest.raises(ModelError, match="ct_hadamard_bases"):
        rotate_decoder(model, "random-hadamard")
    bases = ct_hadamard_bases()
    if 48 not in bases:
        pytest.skip("compressed-tensors' stored Hadamard matrices are not installed")
    ref = logits(model)
    rotate_decoder(model, "random-hadamard", hadamard_bases=bases, center_embeddings=False)
    np.testing.assert_allclose(logits(model), ref, rtol=0, atol=ATOL)


def test_saved_in_memory_rotation_reloads_with_its_online_rotations(src, tmp_path):
    """rotate_decoder(R1..R4) + quantize_model, written by save_causal_lm(rotated=record): config.json says lm_head is
    untied and records the transform_config, the online R3/R4 matrices are written, and the reloaded checkpoint
    gives the in-memory model's logits bit for bit. Without the record, saving is refused (it would drop R3/R4)."""
    import json

    from converters.pipelines.causal_lm import save_causal_lm

    hf = json.loads((src / "config.json").read_text())
    model, _, _ = load_causal_lm(src, tokenizer=False)
    rec = rotate_decoder(model, "random-hadamard", rotations=("R1", "R2", "R3", "R4"))
    quantize_model(model, decoder.quantization_rules("W4A16:g16"))
    with pytest.raises(ModelError, match="online rotations"):
        save_causal_lm(model, tmp_path / "lost", hf)
    assert not (tmp_path / "lost").exists()
    out = save_causal_lm(model, tmp_path / "q", hf, rotated=rec)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and hf["tie_word_embeddings"] is True
    assert cfg["quantization_config"]["transform_config"] == rec.transform_config
    back, _, _ = load_causal_lm(out, tokenizer=False)
    np.testing.assert_array_equal(logits(back), logits(model))
