"""all-MiniLM-L6-v2 (a 6-layer BERT) as a Flax NNX model: config, modules, HF name map, weight filling."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qformats.errors import CheckpointError, ModelError
from qformats.models.abstract import abstract_module

__all__ = [
    "MiniLMConfig", "MiniLM", "IGNORED_TENSORS", "linear_paths", "torch_to_flax", "assign_weights",
    "from_tensors", "mean_pool_normalize", "embed", "encode_sentences",
]

# The model mirrors Hugging Face's `BertModel` for inference (no dropout) and the sentence embedding
# mirrors sentence-transformers' pipeline for all-MiniLM-L6-v2: Transformer → mean pooling over the
# attention mask → L2 normalisation. Pure: reading config.json, model.safetensors and the tokenizer is
# `converters.evaluation.embedded`'s job.
#
# Every dense layer is a plain `nnx.Linear` (kernel `[in, out]`) held directly as an attribute, so
# `qformats.nn.quantize_model` can swap it by a regex on its module path. The paths read like the HF
# tensor names (`torch_to_flax`):
#
#     encoder/layers/{i}/attention/query     ← encoder.layer.{i}.attention.self.query
#     encoder/layers/{i}/attention/key       ← encoder.layer.{i}.attention.self.key
#     encoder/layers/{i}/attention/value     ← encoder.layer.{i}.attention.self.value
#     encoder/layers/{i}/attention/output    ← encoder.layer.{i}.attention.output.dense
#     encoder/layers/{i}/intermediate        ← encoder.layer.{i}.intermediate.dense
#     encoder/layers/{i}/output              ← encoder.layer.{i}.output.dense
#     pooler                                 ← pooler.dense

# Checkpoint tensors that are buffers, not parameters: ignored on purpose (named, never silently).
IGNORED_TENSORS = frozenset({"embeddings.position_ids"})


@dataclasses.dataclass(frozen=True)
class MiniLMConfig:
    """The subset of a BERT `config.json` this model reads (defaults: all-MiniLM-L6-v2)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        """hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, cfg: Mapping, *, source: str = "config") -> "MiniLMConfig":
        """A parsed HF BERT `config.json` → MiniLMConfig; unknown keys are ignored.

        Raises:
          ModelError: naming `source`, when the config asks for what this BERT does not implement
            (model_type other than "bert", hidden_act other than "gelu", non-absolute position
            embeddings; an absent or null key is the default) or hidden_size is not a multiple of num_attention_heads.
        """
        expect = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
        for key, want in expect.items():
            got = cfg.get(key)
            if got is not None and got != want:  # absent / null: the default (transformers 5 drops the key)
                raise ModelError(f"{source}: expected {key}={want!r} for this BERT, found {got!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        out = cls(**{k: v for k, v in cfg.items() if k in fields})
        if out.hidden_size % out.num_attention_heads:
            raise ModelError(
                f"{source}: hidden_size {out.hidden_size} is not a multiple of "
                f"num_attention_heads {out.num_attention_heads}"
            )
        return out


# --------------------------------------------------------------------------------------------------
# Model


class Embeddings(nnx.Module):
    """word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, cfg: MiniLMConfig, *, dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.word_embeddings = nnx.Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.position_embeddings = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, **kw)
        self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, cfg.hidden_size, **kw)
        self.LayerNorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, **kw)

    def __call__(self, input_ids, token_type_ids):
        """LayerNorm(W_word[ids] + W_pos[0..T-1] + W_type[type_ids]) → `[B, T, hidden]`."""
        positions = jnp.arange(input_ids.shape[-1])[None, :]
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(x)


class Attention(nnx.Module):
    """Multi-head self-attention with BERT's post-LayerNorm residual (HF `BertAttention`)."""

    def __init__(self, cfg: MiniLMConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.num_heads = cfg.num_attention_heads
        self.query = nnx.Linear(h, h, **kw)
        self.key = nnx.Linear(h, h, **kw)
        self.value = nnx.Linear(h, h, **kw)
        self.output = nnx.Linear(h, h, **kw)
        self.LayerNorm = nnx.LayerNorm(h, epsilon=cfg.layer_norm_eps, **kw)

    def __call__(self, x, mask):
        """LayerNorm(x + output(softmax(q k^T / sqrt(d), masked) v)), heads split along hidden."""
        b, t, h = x.shape
        split = lambda y: y.reshape(b, t, self.num_heads, h // self.num_heads)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(h // self.num_heads)
        # Masking with `where` (not an additive bias) keeps an all-padding row finite: it gets a
        # uniform softmax instead of NaN, and mean pooling then gives it a zero vector.
        scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h)
        return self.LayerNorm(self.output(ctx) + x)


class Layer(nnx.Module):
    """One encoder layer: attention, then intermediate (exact erf GELU) → output → LayerNorm."""

    def __init__(self, cfg: MiniLMConfig, *, dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.attention = Attention(cfg, dtype=dtype, rngs=rngs)
        self.intermediate = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.output = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.LayerNorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, **kw)

    def __call__(self, x, mask):
        """a = attention(x); LayerNorm(a + output(gelu_erf(intermediate(a))))."""
        x = self.attention(x, mask)
        y = jax.nn.gelu(self.intermediate(x), approximate=False)  # BERT's "gelu" is the erf form
        return self.LayerNorm(self.output(y) + x)


class Encoder(nnx.Module):
    """`num_hidden_layers` encoder layers applied in order."""

    def __init__(self, cfg: MiniLMConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([Layer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, x, mask):
        """x_{i+1} = layer_i(x_i, mask)."""
        for layer in self.layers:
            x = layer(x, mask)
        return x


class MiniLM(nnx.Module):
    """BERT encoder (HF `BertModel`, inference mode) with the all-MiniLM-L6-v2 shapes by default.

    `__call__` returns the last hidden state `[B, T, hidden]`; `pool` applies the optional pooler
    (dense + tanh on the first token), which sentence embeddings do not use.
    """

    def __init__(self, cfg: MiniLMConfig | None = None, *, with_pooler: bool = True, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.config = cfg if cfg is not None else MiniLMConfig()
        self.embeddings = Embeddings(self.config, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(self.config, dtype=dtype, rngs=rngs)
        h = self.config.hidden_size
        self.pooler = nnx.Linear(h, h, dtype=dtype, param_dtype=dtype, rngs=rngs) if with_pooler else None

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None):
        """input_ids, attention_mask, token_type_ids: int `[B, T]` → hidden states `[B, T, hidden]`."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        return self.encoder(x, attention_mask.astype(bool))

    def pool(self, hidden):
        """HF `BertPooler`: tanh(dense(hidden[:, 0])) → `[B, hidden]`."""
        if self.pooler is None:
            raise ModelError("this MiniLM was built with with_pooler=False; it has no 'pooler'")
        return jnp.tanh(self.pooler(hidden[:, 0]))


def linear_paths(model: nnx.Module) -> list[str]:
    """Module paths (`a/b/0/c`) of every `nnx.Linear` in `model`, in traversal order."""
    return ["/".join(map(str, path)) for path, module in nnx.iter_modules(model) if isinstance(module, nnx.Linear)]


# --------------------------------------------------------------------------------------------------
# HF tensor names ↔ Flax variable paths

# HF tensor name → (Flax variable path, transpose). `{i}` is the layer index.
_LAYER_MAP = {
    "attention.self.query.weight": ("attention/query/kernel", True),
    "attention.self.query.bias": ("attention/query/bias", False),
    "attention.self.key.weight": ("attention/key/kernel", True),
    "attention.self.key.bias": ("attention/key/bias", False),
    "attention.self.value.weight": ("attention/value/kernel", True),
    "attention.self.value.bias": ("attention/value/bias", False),
    "attention.output.dense.weight": ("attention/output/kernel", True),
    "attention.output.dense.bias": ("attention/output/bias", False),
    "attention.output.LayerNorm.weight": ("attention/LayerNorm/scale", False),
    "attention.output.LayerNorm.bias": ("attention/LayerNorm/bias", False),
    "intermediate.dense.weight": ("intermediate/kernel", True),
    "intermediate.dense.bias": ("intermediate/bias", False),
    "output.dense.weight": ("output/kernel", True),
    "output.dense.bias": ("output/bias", False),
    "output.LayerNorm.weight": ("LayerNorm/scale", False),
    "output.LayerNorm.bias": ("LayerNorm/bias", False),
}
_TOP_MAP = {
    "embeddings.word_embeddings.weight": ("embeddings/word_embeddings/embedding", False),
    "embeddings.position_embeddings.weight": ("embeddings/position_embeddings/embedding", False),
    "embeddings.token_type_embeddings.weight": ("embeddings/token_type_embeddings/embedding", False),
    "embeddings.LayerNorm.weight": ("embeddings/LayerNorm/scale", False),
    "embeddings.LayerNorm.bias": ("embeddings/LayerNorm/bias", False),
}
_POOLER_MAP = {
    "pooler.dense.weight": ("pooler/kernel", True),
    "pooler.dense.bias": ("pooler/bias", False),
}


def torch_to_flax(cfg: MiniLMConfig, *, with_pooler: bool = True) -> dict[str, tuple[str, bool]]:
    """HF tensor name → (Flax variable path, transposed): torch Linear weights are `[out, in]`, Flax
    kernels `[in, out]`, so kernel = weightᵀ; every other tensor maps unchanged."""
    table = dict(_TOP_MAP)
    for i in range(cfg.num_hidden_layers):
        for name, (path, transpose) in _LAYER_MAP.items():
            table[f"encoder.layer.{i}.{name}"] = (f"encoder/layers/{i}/{path}", transpose)
    if with_pooler:
        table.update(_POOLER_MAP)
    return table


def assign_weights(model: MiniLM, tensors: Mapping[str, np.ndarray], *, source: str = "<tensors>") -> MiniLM:
    """Sets every parameter of `model` from HF-named tensors; in place, returns `model`.

    kernel = weightᵀ for Linear weights (torch `[out, in]` → Flax `[in, out]`), every value cast to the
    dtype of the model's parameter. The tensors must match the model exactly: every expected tensor
    present with its shape, nothing unexpected besides `IGNORED_TENSORS` (and the pooler's tensors when
    the model was built without it). Nothing is set unless everything fits.

    Raises:
      CheckpointError: naming `source` and the missing, unexpected or mis-shaped tensors (all of them).
    """
    with_pooler = model.pooler is not None
    table = torch_to_flax(model.config, with_pooler=with_pooler)
    ignored = set(IGNORED_TENSORS) | (set() if with_pooler else set(_POOLER_MAP))
    missing = sorted(set(table) - set(tensors))
    unexpected = sorted(set(tensors) - set(table) - ignored)
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: tensors do not match the MiniLM model "
            f"({model.config.num_hidden_layers} layers, pooler={with_pooler}); "
            f"missing {missing or 'none'}; unexpected {unexpected or 'none'}"
        )
    variables = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model)
                 if isinstance(node, nnx.Variable)}
    updates = []
    for name, (path, transpose) in table.items():
        var = variables[path]
        want = var.get_value()
        arr = np.asarray(tensors[name])
        if transpose:
            arr = arr.T
        if arr.shape != tuple(want.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} → {path}: expected shape {tuple(want.shape)} "
                f"(after transpose: {transpose}), found {arr.shape}"
            )
        updates.append((var, jnp.asarray(arr, dtype=want.dtype)))
    for var, value in updates:
        var.set_value(value)
    return model


def from_tensors(tensors: Mapping[str, np.ndarray], cfg: MiniLMConfig | None = None, *, dtype=jnp.float32,
                 with_pooler: bool = True, source: str = "<tensors>") -> MiniLM:
    """A MiniLM built from `cfg` (default all-MiniLM-L6-v2's) with every parameter taken from `tensors`
    (HF names, see `assign_weights`), parameters in `dtype`.

    The model is built abstractly (`abstract_module`: no random initialisation, no memory for it), then
    filled. Raises CheckpointError as `assign_weights`.
    """
    cfg = cfg if cfg is not None else MiniLMConfig()
    model = abstract_module(lambda rngs: MiniLM(cfg, with_pooler=with_pooler, dtype=dtype, rngs=rngs))
    return assign_weights(model, tensors, source=source)


# --------------------------------------------------------------------------------------------------
# Sentence embeddings


def mean_pool_normalize(hidden, attention_mask):
    """sentence-transformers' mean pooling + Normalize, in float32.

    e = Σ_t m_t h_t / max(Σ_t m_t, 1e-9);  out = e / max(‖e‖₂, 1e-12).
    """
    m = attention_mask.astype(jnp.float32)[..., None]
    summed = jnp.sum(hidden.astype(jnp.float32) * m, axis=1)
    mean = summed / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
    norm = jnp.linalg.norm(mean, axis=-1, keepdims=True)
    return mean / jnp.maximum(norm, 1e-12)


@nnx.jit
def _embed(model, input_ids, attention_mask, token_type_ids):
    hidden = model(input_ids, attention_mask, token_type_ids)
    return mean_pool_normalize(hidden, attention_mask)


def embed(model: nnx.Module, batch: Mapping[str, np.ndarray]) -> jax.Array:
    """Jit-compiled unit-norm sentence embeddings `[B, hidden]` (float32) of a tokenized batch:
    `mean_pool_normalize(model(input_ids, attention_mask, token_type_ids), attention_mask)`."""
    ids = jnp.asarray(batch["input_ids"])
    mask = jnp.asarray(batch.get("attention_mask", np.ones_like(batch["input_ids"])))
    types = jnp.asarray(batch.get("token_type_ids", np.zeros_like(batch["input_ids"])))
    return _embed(model, ids, mask, types)


def encode_sentences(model: nnx.Module, tokenizer: Callable[[Sequence[str]], Mapping[str, np.ndarray]],
                     sentences: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """`embed` over `sentences` in batches of `batch_size` → float32 numpy `[n, hidden]`, rows of unit L2 norm.

    `tokenizer` maps a list of sentences to a batch {"input_ids", "attention_mask", "token_type_ids"}
    (e.g. `converters.evaluation.embedded.Tokenizer`).
    """
    out = []
    for start in range(0, len(sentences), batch_size):
        out.append(np.asarray(embed(model, tokenizer(sentences[start : start + batch_size]))))
    if not out:
        return np.zeros((0, model.config.hidden_size), np.float32)
    return np.concatenate(out, axis=0)
