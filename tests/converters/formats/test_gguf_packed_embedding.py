"""A GGUF block-quantized token embedding kept packed (decoder.PackedEmbed): gathered rows equal gguf's dequantization
bit for bit, the tied lm_head (the packed GEMV over the codes) equals the dequantized model's logits to float32
accumulation order, greedy tokens equal."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).parent))

from gguf_tiny import tiny_gguf  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats import dequantize  # noqa: E402
from qformats.errors import ModelError  # noqa: E402
from qformats.models.decoder import PackedEmbed  # noqa: E402
from qformats.models.generate import generate  # noqa: E402

# the model's forward as one jitted program (eagerly, each operation of each layer compiles on its own)
_logits_of = nnx.jit(lambda m, x: m(x)[0])

EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    t = gguf.GGMLQuantizationType
    path = tiny_gguf(tmp_path_factory.mktemp("emb") / "q8.gguf", hidden=64, heads=2, kv_heads=1, inter=64,
                     weight_type=t.Q8_0, embed_type=t.Q8_0, seed=3)
    packed, cfg, _ = load_causal_lm(path, tokenizer=False)
    dense, _, _ = load_causal_lm(path, packed=False, tokenizer=False)
    return path, packed, dense, cfg


def test_embedding_stays_packed_and_rows_equal_gguf(models):
    path, packed, dense, cfg = models
    emb = packed.model.embed_tokens
    assert isinstance(emb, PackedEmbed) and cfg["tie_word_embeddings"]
    q = emb.kernel.get_value()
    assert q.codes.dtype == jnp.int8 and q.shape == (64, cfg["vocab_size"])
    reader = gguf.GGUFReader(str(path))
    t = next(x for x in reader.tensors if x.name == "token_embd.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(cfg["vocab_size"], 64)
    np.testing.assert_array_equal(np.asarray(dequantize(q)).T.view(np.uint32), ref.view(np.uint32))
    ids = jnp.asarray([[0, 5, cfg["vocab_size"] - 1], [7, 7, 2]], jnp.int32)
    rows = np.asarray(jax.jit(emb)(ids))
    assert rows.shape == (2, 3, 64)
    np.testing.assert_array_equal(rows.view(np.uint32), ref[np.asarray(ids)].view(np.uint32))
    np.testing.assert_array_equal(rows, np.asarray(dense.model.embed_tokens(ids)))


def test_tied_lm_head_equals_dense_to_accumulation_order(models):
    _, packed, dense, _ = models
    emb = packed.model.embed_tokens
    w = np.asarray(dequantize(emb.kernel.get_value()), np.float64)  # [hidden, vocab]
    h = np.random.default_rng(0).standard_normal((1, 1, 64)).astype(np.float32)
    ours = np.asarray(jax.jit(emb.attend)(jnp.asarray(h)), np.float64)[0, 0]  # one row: the packed GEMV
    exact = h[0, 0].astype(np.float64) @ w
    bound = 2 * 64 * EPS * (np.abs(h[0, 0].astype(np.float64)) @ np.abs(w))
    assert np.all(np.abs(ours - exact) <= bound)
    hh = np.random.default_rng(1).standard_normal((1, 4, 64)).astype(np.float32)  # several rows: dequantize-then-dot
    np.testing.assert_allclose(np.asarray(emb.attend(jnp.asarray(hh))), np.asarray(dense.model.embed_tokens.attend(
        jnp.asarray(hh))), rtol=0, atol=float(2 * 64 * EPS * (np.abs(hh).max(-1, keepdims=True) * np.abs(w).sum(0)).max()))


def test_logits_equal_dense(models):
    _, packed, dense, _ = models
    ids = jnp.asarray([[3, 40, 41, 100, 7, 9]], jnp.int32)
    for x in (ids, ids[:, :1]):
        a, b = (np.asarray(_logits_of(m, x)) for m in (packed, dense))
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())


@pytest.mark.slow
def test_greedy_tokens_equal_dense(models):
    _, packed, dense, _ = models
    ids = jnp.asarray([[3, 40, 41, 100, 7, 9]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(generate(packed, ids, 8)), np.asarray(generate(dense, ids, 8)))


def test_refuses_a_tensor_scale():
    from qformats import quantize
    from qformats.schemes import QuantScheme

    q = quantize(jnp.ones((32, 4)), QuantScheme("int8", "tensor"), axis=0)
    with pytest.raises(ModelError, match="PackedEmbed: expected a \\[hidden, vocab\\] QArray"):
        PackedEmbed(q, dtype=jnp.float32)
