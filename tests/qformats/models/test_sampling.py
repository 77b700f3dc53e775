"""Token choice: top-k / top-p masks equal transformers' logits warpers; sampling is deterministic per key and
draws from the masked softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qformats.errors import ModelError
from qformats.models.sampling import next_token, top_k_mask, top_p_mask

LOGITS = np.random.RandomState(0).standard_normal((6, 200)).astype(np.float32) * 3


@pytest.mark.parametrize("k", [1, 7, 200, 500])
def test_top_k_mask_equals_transformers(k):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.TopKLogitsWarper(top_k=k)(None, torch.tensor(LOGITS)).numpy()
    got = np.asarray(top_k_mask(jnp.asarray(LOGITS), k))
    np.testing.assert_array_equal(got, ref)  # the kept logits unchanged, the rest -inf


@pytest.mark.parametrize("p", [0.05, 0.3, 0.8, 0.95, 1.0])
def test_top_p_mask_equals_transformers(p):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.TopPLogitsWarper(top_p=p)(None, torch.tensor(LOGITS)).numpy()
    got = np.asarray(top_p_mask(jnp.asarray(LOGITS), p))
    np.testing.assert_array_equal(got, ref)
    assert np.isfinite(got).sum(-1).min() >= 1


def test_greedy_and_deterministic_sampling():
    x = jnp.asarray(LOGITS)
    np.testing.assert_array_equal(np.asarray(next_token(x)), LOGITS.argmax(-1))
    key = jax.random.key(3)
    a = next_token(x, key, temperature=1.5, top_k=50, top_p=0.9)
    b = next_token(x, key, temperature=1.5, top_k=50, top_p=0.9)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    draws = jax.vmap(lambda k: next_token(x, k, temperature=2.0))(jax.random.split(key, 8))
    assert len({tuple(np.asarray(d)) for d in draws}) > 1  # another key, other tokens
    # top_k = 1 is greedy whatever the key
    np.testing.assert_array_equal(np.asarray(next_token(x, key, temperature=5.0, top_k=1)), LOGITS.argmax(-1))


def test_sampling_draws_from_the_masked_softmax():
    logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temp, k, n = 0.7, 4, 20000
    draws = np.asarray(jax.vmap(lambda key: next_token(logits, key, temperature=temp, top_k=k))(
        jax.random.split(jax.random.key(0), n)))
    assert set(np.unique(draws)) <= set(range(k))  # masked tokens never drawn
    p = np.asarray(jax.nn.softmax(logits[:k] / temp))
    freq = np.bincount(draws, minlength=6)[:k] / n
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n))


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=3), "give a temperature > 0"),
    (dict(temperature=1.0, top_k=0), "top_k must be a positive integer"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0), "needs a key"),
])
def test_bad_sampling_arguments(kw, message):
    with pytest.raises(ModelError, match=message):
        next_token(jnp.asarray(LOGITS), **kw)
