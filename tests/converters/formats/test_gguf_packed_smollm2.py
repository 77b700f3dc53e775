"""The real SmolLM2 GGUF (Q4_1 projections, tied Q8_0 embedding) loaded packed runs at the file's bits per weight (the
float16 d and m kept as stored, computed in float32) and gives the logits of the same file loaded dequantized."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("gguf")

from converters.evaluation.embedded import smollm2_gguf  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.models.decoder import PackedEmbed  # noqa: E402
from qformats.qarray import QArray  # noqa: E402

pytestmark = pytest.mark.slow  # SmolLM2-135M loaded twice (packed and dequantized float32)


def _qarrays(model):
    return [x for x in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, QArray))
            if isinstance(x, QArray)]


def test_smollm2_runs_at_its_stored_bits_with_the_dequantized_logits():
    path = smollm2_gguf()
    packed, cfg, _ = load_causal_lm(path, tokenizer=False)
    qs = _qarrays(packed)
    assert isinstance(packed.model.embed_tokens, PackedEmbed)
    by_bits = {}
    for q in qs:
        assert q.scale.dtype == jnp.float16 and q.compute_dtype == jnp.float32
        assert q.offset is None or q.offset.dtype == jnp.float16
        b, n = by_bits.get(q.scheme.bits, (0, 0))
        by_bits[q.scheme.bits] = (b + q.nbytes, n + math.prod(q.shape))
    # bits per weight of the loaded leaves (codes + scales + offsets) / weights: the file's block sizes
    assert {k: 8 * b / n for k, (b, n) in by_bits.items()} == {4: 20 * 8 / 32, 8: 34 * 8 / 32}  # Q4_1 5.0, Q8_0 8.5
    dense, _, _ = load_causal_lm(path, packed=False, tokenizer=False)
    assert not _qarrays(dense)
    ids = jnp.asarray([[1, 504, 3458, 282, 4649, 314]], jnp.int32)
    for x in (ids, ids[:, :1]):  # prefill (dequantize-then-dot) and one row (the packed GEMV: summation order)
        a, b = (np.asarray(nnx.jit(lambda m, t: m(t)[0])(m, x)) for m in (packed, dense))
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max()), np.abs(a - b).max()
        assert (a.argmax(-1) == b.argmax(-1)).all()
