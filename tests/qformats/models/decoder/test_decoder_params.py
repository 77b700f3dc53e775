"""qformats.models.decoder.params: loading HF state-dict tensors refuses missing, unexpected and misshapen ones and
checks the two it has no place for (a tied lm_head, rotary buffers)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder import CausalLM, DecoderConfig, load_hf_tensors  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, eos_token_id=None,
             bos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def tied_tensors():
    """config.json and state dict of a tied qwen2 (transformers, random weights, norms and biases not 1 / 0)."""
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return hf.config.to_dict(), {k: v.numpy() for k, v in hf.state_dict().items()}


def abstract_model(cfg_dict):
    """A CausalLM without initialised weights (what a loader builds before filling it)."""
    return nnx.eval_shape(lambda: CausalLM(DecoderConfig.from_hf(cfg_dict), rngs=nnx.Rngs(0)))


def test_load_refuses_missing_unexpected_and_misshapen_tensors(tied_tensors):
    cfg, tensors = tied_tensors
    model = load_hf_tensors(abstract_model(cfg), tensors)
    before = np.asarray(model.model.norm.weight.get_value())
    t = dict(tensors)
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.0.self_attn.q_proj.weight_scale"] = np.ones(1, np.float32)
    t["model.norm.weight"] = np.ones(65, np.float32)
    with pytest.raises(ModelError) as e:
        load_hf_tensors(model, t)
    msg = str(e.value)
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in msg
    assert "1 unexpected: model.layers.0.self_attn.q_proj.weight_scale" in msg
    assert "model.norm.weight (65,) (expected (64,))" in msg
    np.testing.assert_array_equal(np.asarray(model.model.norm.weight.get_value()), before)  # unchanged


def test_load_checks_tied_lm_head_and_rotary_buffers(tied_tensors):
    cfg, tensors = tied_tensors
    tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    emb = tensors["model.embed_tokens.weight"]
    inv = DecoderConfig.from_hf(cfg).rope.inv_freq(16)
    ok = {**tensors, "lm_head.weight": emb.copy(), "model.layers.0.self_attn.rotary_emb.inv_freq": inv}
    model = load_hf_tensors(abstract_model(cfg), ok)
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens.embedding.get_value()), emb)
    with pytest.raises(ModelError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_hf_tensors(abstract_model(cfg), {**tensors, "lm_head.weight": emb + 1})
    with pytest.raises(ModelError, match="rotary_emb.inv_freq does not equal"):
        load_hf_tensors(abstract_model(cfg), {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": inv * 2})
    untied = {**cfg, "tie_word_embeddings": False}
    with pytest.raises(ModelError, match="1 missing: lm_head.weight"):
        load_hf_tensors(abstract_model(untied), tensors)
