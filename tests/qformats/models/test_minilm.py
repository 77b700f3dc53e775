"""qformats.models.minilm on small random BERTs: transformers' BertModel parity, name map, weight filling, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.errors import CheckpointError, ModelError
from qformats.models import minilm

SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=24, type_vocab_size=2, layer_norm_eps=1e-12)
CFG = minilm.MiniLMConfig(**SMALL)
LINEARS = [f"encoder/layers/{i}/{n}" for i in range(2)
           for n in ("attention/key", "attention/output", "attention/query", "attention/value", "intermediate",
                     "output")] + ["pooler"]


def random_tensors(cfg=CFG, seed=0, with_pooler=True):
    """HF-named float32 tensors of the right shapes (torch layout: Linear weights [out, in])."""
    rng = np.random.default_rng(seed)
    shapes = {}
    abstract = nnx.eval_shape(lambda: minilm.MiniLM(cfg, with_pooler=with_pooler, rngs=nnx.Rngs(0)))
    variables = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(abstract) if isinstance(v, nnx.Variable)}
    for name, (path, transpose) in minilm.torch_to_flax(cfg, with_pooler=with_pooler).items():
        shape = tuple(variables[path].get_value().shape)
        shapes[name] = shape[::-1] if transpose else shape
    return {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in shapes.items()}


@pytest.fixture(scope="module")
def tensors():
    return random_tensors()


@pytest.fixture(scope="module")
def model(tensors):
    return minilm.from_tensors(tensors, CFG)


@nnx.jit
def forward(model, ids, mask, types=None):
    """The model's hidden states and pooler output, jit-compiled (eager dispatch is slow on a loaded CPU)."""
    hidden = model(ids, mask, types)
    return hidden, model.pool(hidden)


def _abstract(with_pooler=True):
    return nnx.eval_shape(lambda: minilm.MiniLM(CFG, with_pooler=with_pooler, rngs=nnx.Rngs(0)))


def test_config_from_dict_reads_bert_keys_and_ignores_the_rest():
    cfg = minilm.MiniLMConfig.from_dict(dict(SMALL, model_type="bert", hidden_act="gelu", architectures=["B"],
                                             position_embedding_type="absolute"))
    assert cfg == CFG and cfg.head_dim == 8
    assert minilm.MiniLMConfig.from_dict({"position_embedding_type": None}) == minilm.MiniLMConfig()


@pytest.mark.parametrize("override, msg", [
    ({"model_type": "roberta"}, "model_type='bert'"),
    ({"hidden_act": "relu"}, "hidden_act='gelu'"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type='absolute'"),
    ({"num_attention_heads": 5}, "not a multiple of num_attention_heads 5"),
])
def test_config_refuses_what_this_bert_does_not_implement(override, msg):
    with pytest.raises(ModelError, match=f"cfg.json: expected|cfg.json: .*{msg}") as e:
        minilm.MiniLMConfig.from_dict(dict(SMALL, **override), source="cfg.json")
    assert msg in str(e.value)


def test_name_map_covers_every_parameter_once():
    table = minilm.torch_to_flax(CFG)
    assert len(table) == 5 + 16 * 2 + 2
    assert table["encoder.layer.1.attention.self.query.weight"] == ("encoder/layers/1/attention/query/kernel", True)
    assert table["encoder.layer.0.output.LayerNorm.bias"] == ("encoder/layers/0/LayerNorm/bias", False)
    assert table["pooler.dense.weight"] == ("pooler/kernel", True)
    params = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(_abstract(), nnx.Param))}
    assert sorted(path for path, _ in table.values()) == sorted(params)
    assert "pooler.dense.bias" not in minilm.torch_to_flax(CFG, with_pooler=False)


def test_linear_paths_are_plain_nnx_linear(model):
    assert minilm.linear_paths(model) == LINEARS
    assert all(type(m) is nnx.Linear for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear))


def test_from_tensors_sets_every_parameter_exactly(model, tensors):
    for name, (path, transpose) in minilm.torch_to_flax(CFG).items():
        node = model
        for part in path.split("/"):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        want = tensors[name].T if transpose else tensors[name]
        np.testing.assert_array_equal(np.asarray(node.get_value()), want, err_msg=name)


def test_from_tensors_casts_to_dtype(tensors):
    m = minilm.from_tensors(tensors, CFG, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(nnx.state(m, nnx.Param))
    assert {p.dtype for p in leaves} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(np.asarray(m.pooler.bias.get_value()),
                                  tensors["pooler.dense.bias"].astype(jnp.bfloat16))


def test_matches_transformers_bert(model, tensors):
    """The same random weights in transformers' BertModel (eval mode): last hidden state and pooler output agree
    to float32 accumulation order."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(transformers.BertConfig(**SMALL, hidden_act="gelu")).eval()
    missing, unexpected = bert.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"embeddings.position_ids"}
    rng = np.random.default_rng(1)
    ids = rng.integers(1, SMALL["vocab_size"], (3, 11)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    types = (np.arange(11)[None] >= 5).astype(np.int32).repeat(3, 0)
    with torch.no_grad():
        out = bert(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                   token_type_ids=torch.from_numpy(types).long())
    hidden, pooled = forward(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    keep = mask.astype(bool)  # padded positions are not defined by either model's output
    np.testing.assert_allclose(np.asarray(hidden)[keep], out.last_hidden_state.numpy()[keep], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), out.pooler_output.numpy(), atol=2e-5, rtol=0)


def test_embeddings_are_mean_pooled_unit_vectors(model):
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
    mask = (ids != 0).astype(np.int32)
    emb = np.asarray(minilm.embed(model, {"input_ids": ids, "attention_mask": mask}))
    hidden = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask))[0], np.float64)
    for row in range(2):
        mean = hidden[row, mask[row] == 1].mean(axis=0)
        np.testing.assert_allclose(emb[row], mean / np.linalg.norm(mean), atol=1e-6)


def test_encode_sentences_batches_through_the_tokenizer(model):
    vocab = {w: i + 1 for i, w in enumerate("a b c d e f g".split())}

    def tokenizer(sentences):
        ids = np.zeros((len(sentences), 6), np.int32)
        for r, s in enumerate(sentences):
            ids[r, :len(s.split())] = [vocab[w] for w in s.split()]
        return {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int32),
                "token_type_ids": np.zeros_like(ids)}

    sentences = ["a b c", "d e", "f g a b", "c"]
    got = minilm.encode_sentences(model, tokenizer, sentences, batch_size=3)
    assert got.shape == (4, 32) and got.dtype == np.float32
    np.testing.assert_array_equal(got[3:], np.asarray(minilm.embed(model, tokenizer(sentences[3:]))))
    assert minilm.encode_sentences(model, tokenizer, []).shape == (0, 32)


def test_pool_without_pooler_is_a_model_error(tensors):
    m = minilm.from_tensors(tensors, CFG, with_pooler=False)  # the pooler's tensors are ignored, by name
    assert m.pooler is None and minilm.linear_paths(m) == LINEARS[:-1]
    with pytest.raises(ModelError, match="with_pooler=False"):
        m.pool(jnp.zeros((1, 2, 32)))


def test_missing_tensor_is_named(tensors):
    partial = {k: v for k, v in tensors.items() if k != "encoder.layer.1.attention.self.value.weight"}
    with pytest.raises(CheckpointError, match=r"x.safetensors: .*missing \['encoder\.layer\.1\.attention\.self"
                                              r"\.value\.weight'\]; unexpected none"):
        minilm.assign_weights(_abstract(), partial, source="x.safetensors")


def test_unexpected_tensor_is_named_and_buffers_are_ignored(tensors):
    with_buffer = dict(tensors, **{"embeddings.position_ids": np.arange(24)[None]})
    minilm.assign_weights(_abstract(), with_buffer)
    extra = dict(tensors, **{"encoder.layer.2.output.dense.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected \['encoder\.layer\.2\.output\.dense\.weight'\]"):
        minilm.assign_weights(_abstract(), extra)


def test_wrong_shape_is_named_and_nothing_is_set(tensors):
    m = minilm.from_tensors(tensors, CFG)
    before = np.asarray(m.embeddings.word_embeddings.embedding.get_value())
    bad = dict(random_tensors(seed=3), **{"pooler.dense.weight": np.zeros((32, 31), np.float32)})
    with pytest.raises(CheckpointError, match=r"'pooler.dense.weight' → pooler/kernel: expected shape \(32, 32\)"):
        minilm.assign_weights(m, bad)
    np.testing.assert_array_equal(np.asarray(m.embeddings.word_embeddings.embedding.get_value()), before)
