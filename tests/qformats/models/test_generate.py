"""generate(): one jit of prefill + lax loop; greedy equals the teacher-forced argmax of the full forward pass,
eos handling, seeded sampling, packed models, argument errors, no recompilation for new prompts."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qformats.errors import ModelError
from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensor_names, load_hf_tensors, quantization_rules
from qformats.models.decoder.params import resolve_path
from qformats.models.generate import generate
from qformats.nn import quantize_model

# one layer: what generate does (prefill, the cache, the loop, sampling, batching) does not depend on the depth;
# a scanned stack (the last test) takes 2
CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)
PROMPT = np.random.RandomState(1).randint(0, 128, (2, 6))
forward = nnx.jit(lambda m, ids: m(ids)[0])


def random_model(cfg_dict=CONFIG, seed=0):
    """A CausalLM filled through load_hf_tensors with random HF-layout tensors (std 0.1 Linear weights)."""
    cfg = DecoderConfig.from_hf(cfg_dict)
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(seed)
    tensors = {}
    for name, slot in hf_tensor_names(cfg).items():
        node = resolve_path(model, slot.path)
        shape = node.get_value().shape[::-1] if slot.transpose else node.get_value().shape
        tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                         else 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return load_hf_tensors(model, tensors)


@pytest.fixture(scope="module")
def model():
    return random_model()


def teacher_forced(model, prompt, toks):
    """argmax of the full forward pass over prompt + generated tokens at the places that predicted them."""
    t = prompt.shape[1]
    logits = forward(model, jnp.concatenate([jnp.asarray(prompt), jnp.asarray(toks)[:, :-1]], axis=1))
    return np.asarray(jnp.argmax(logits[:, t - 1:], axis=-1))


def test_greedy_is_the_argmax_of_the_full_forward(model):
    toks = generate(model, PROMPT, 12)
    assert toks.shape == (2, 12) and toks.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(toks), teacher_forced(model, PROMPT, toks))
    single = generate(model, PROMPT[0], 12)  # a 1-D prompt gives a 1-D result
    np.testing.assert_array_equal(np.asarray(single), np.asarray(toks[0]))


def test_new_prompt_of_the_same_shape_does_not_recompile(model, caplog):
    generate(model, PROMPT, 12)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG, logger="jax"):
        generate(model, PROMPT[::-1] + 1, 12)
    traced = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("Compiling", "Finished tracing"))]
    assert not traced, traced


def test_eos_finishes_a_row(model):
    greedy = np.asarray(generate(model, PROMPT, 12))
    eos = int(greedy[0, 3])
    first = int(np.argmax(greedy[0] == eos))
    toks = np.asarray(generate(model, PROMPT, 12, eos_id=eos))
    np.testing.assert_array_equal(toks[0, :first + 1], greedy[0, :first + 1])
    assert (toks[0, first:] == eos).all()  # finished: padded with the eos id
    hits = np.flatnonzero(greedy[1] == eos)
    end = hits[0] + 1 if hits.size else 12
    np.testing.assert_array_equal(toks[1, :end], greedy[1, :end])  # the other row runs on until its own eos
    assert (toks[1, end:] == eos).all()
    # several eos ids: each row finishes at its first one; finished places hold the first eos id
    both = np.asarray(generate(model, PROMPT, 12, eos_id=[int(greedy[0, 0]), int(greedy[1, 0])]))
    np.testing.assert_array_equal(both[:, 0], greedy[:, 0])
    assert (both[:, 1:] == greedy[0, 0]).all()


def test_sampling_is_deterministic_per_key(model):
    kw = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = generate(model, PROMPT, 12, key=jax.random.key(0), **kw)
    b = generate(model, PROMPT, 12, key=jax.random.key(0), **kw)
    c = generate(model, PROMPT, 12, key=jax.random.key(1), **kw)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # top_k = 1 samples the argmax: the greedy tokens, for any key
    np.testing.assert_array_equal(np.asarray(generate(model, PROMPT, 12, key=jax.random.key(5), temperature=2.0,
                                                      top_k=1)), np.asarray(generate(model, PROMPT, 12)))


def test_packed_model_generates_its_own_greedy_tokens():
    packed = random_model()
    quantize_model(packed, quantization_rules("W4A16"))
    toks = generate(packed, PROMPT, 8)
    np.testing.assert_array_equal(np.asarray(toks), teacher_forced(packed, PROMPT, toks))


@pytest.mark.parametrize("args, kw, message", [
    ((np.zeros((2, 3), np.float32), 4), {}, "integer dtype"),
    ((np.zeros((2, 0), np.int32), 4), {}, "time >= 1"),
    ((PROMPT, 0), {}, "max_new_tokens must be a positive integer"),
    ((PROMPT, 4), dict(temperature=0.5), "needs a key"),
    ((PROMPT, 4), dict(top_p=0.5), "give a temperature > 0"),
])
def test_bad_arguments(model, args, kw, message):
    with pytest.raises(ModelError, match=message):
        generate(model, *args, **kw)


def test_bfloat16_model_runs_in_bfloat16(model):
    m16 = nnx.eval_shape(lambda: CausalLM(model.config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                          rngs=nnx.Rngs(0)))
    nnx.update(m16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    assert m16.init_cache(1, 4).keys[0].dtype == jnp.bfloat16
    got, want = forward(m16, jnp.asarray(PROMPT)), forward(model, jnp.asarray(PROMPT))
    assert got.dtype == jnp.float32
    # bfloat16 rounding (8-bit significand) of weights and activations through the layer; logits up to ~4
    assert float(jnp.abs(got - want).max()) < 0.15


# ---- TokenStream: the same steps one at a time ---------------------------------------------------------------
from qformats.models.generate import TokenStream, check_context  # noqa: E402


def _streamed(model, prompt, n, **kw):
    return np.stack(list(TokenStream(model, prompt, n, **kw)), axis=-1)


def test_stream_yields_generates_tokens(model):
    np.testing.assert_array_equal(_streamed(model, PROMPT, 12), np.asarray(generate(model, PROMPT, 12)))
    np.testing.assert_array_equal(_streamed(model, PROMPT[0], 5), np.asarray(generate(model, PROMPT[0], 5)))
    kw = dict(temperature=1.0, top_k=20, top_p=0.95, key=jax.random.key(3))
    np.testing.assert_array_equal(_streamed(model, PROMPT, 12, **kw), np.asarray(generate(model, PROMPT, 12, **kw)))


def test_stream_stops_when_every_row_is_finished(model):
    greedy = np.asarray(generate(model, PROMPT, 12))
    eos = [int(greedy[0, 2]), int(greedy[1, 4])]
    want = np.asarray(generate(model, PROMPT, 12, eos_id=eos))
    got = _streamed(model, PROMPT, 12, eos_id=eos)
    last = max(int(np.argmax(np.isin(want[r], eos))) for r in range(2))
    assert got.shape == (2, last + 1)  # no step after the last row's eos
    np.testing.assert_array_equal(got, want[:, :last + 1])


def test_stream_compiles_ahead_and_times_each_phase(model):
    s = TokenStream(model, PROMPT, 4).compile()
    assert s.compile_seconds > 0 and s.prefill_seconds == s.decode_seconds == 0
    assert len(list(s)) == 4 and s.prefill_seconds > 0 and s.decode_seconds > 0


def test_context_is_checked_before_compute(model):
    check_context(model, 2040, 8)
    with pytest.raises(ModelError, match=r"a prompt of 2041 tokens with max_new_tokens=8 needs 2049 positions, over "
                                         r"the model's context of 2048 \(max_position_embeddings\)"):
        check_context(model, 2041, 8)
    with pytest.raises(ModelError, match="max_position_embeddings"):
        TokenStream(model, np.zeros((1, 2047), np.int32), 2)


# ---- ragged batches and shape buckets ------------------------------------------------------------------------
from qformats.models.generate import bucket_length, plan_shapes  # noqa: E402

RAGGED = [np.random.RandomState(3).randint(0, 128, n) for n in (3, 21, 9, 14)]
COUNTS = [6, 4, 9, 7]


def test_ragged_batch_rows_equal_each_prompt_alone(model):
    batch = np.asarray(generate(model, RAGGED, COUNTS))
    assert batch.shape == (4, 9)
    for row, p, n in zip(batch, RAGGED, COUNTS):
        alone = np.asarray(generate(model, p, n))
        np.testing.assert_array_equal(row[:n], alone)
        assert (row[n:] == 0).all()  # past its own max_new_tokens: the pad
        np.testing.assert_array_equal(alone, np.asarray(generate(model, p, n, buckets=False)))
    np.testing.assert_array_equal(_streamed(model, RAGGED, COUNTS), batch)


def test_ragged_prefill_logits_equal_each_prompt_alone(model):
    """The right-padded batch's logits at each row's last token are the row's own: bit for bit against the row
    alone in a batch of the same shape (the other rows and the padding do not leak), and within accumulation order
    against the row run at its own shape [1, len] (XLA:CPU picks its matmul blocking by shape)."""
    def padded(rows):
        ids = np.zeros((4, 32), np.int32)
        for i, p in enumerate(rows):
            ids[i, :len(p)] = p
        return jnp.asarray(ids)

    lens = jnp.asarray([len(p) for p in RAGGED])
    step = nnx.jit(lambda m, ids, idx: m(ids, m.init_cache(ids.shape[0], 64), logit_index=idx)[0])
    got = np.asarray(step(model, padded(RAGGED), lens - 1))
    for i, p in enumerate(RAGGED):
        same_shape = np.asarray(step(model, padded([np.zeros(1, np.int32)] * i + [p]), lens - 1))
        np.testing.assert_array_equal(got[i], same_shape[i])
        own = np.asarray(step(model, jnp.asarray(p)[None], jnp.asarray([len(p) - 1])))
        np.testing.assert_allclose(got[i], own[0], rtol=0, atol=1e-5)


def test_buckets():
    assert [bucket_length(n) for n in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]
    assert bucket_length(3000, limit=2048) == 3000 and bucket_length(1500, limit=2048) == 2048
    assert plan_shapes([3, 21], [6, 4]) == (32, 32) and plan_shapes([3, 30], [6, 4]) == (32, 64)
    assert plan_shapes([3, 21], [6, 4], buckets=False) == (21, 25)


def test_prompt_lengths_and_counts_in_one_bucket_do_not_recompile(model, caplog):
    generate(model, RAGGED[0], 5)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG, logger="jax"):
        generate(model, RAGGED[2], 3)  # 9 tokens, 3 new: still prompt bucket 16, cache bucket 16
    traced = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("Compiling", "Finished tracing"))]
    assert not traced, traced


# ---- ContinuousBatch: finished rows take the pending requests ------------------------------------------------
from qformats.models.generate import ContinuousBatch  # noqa: E402

REQUESTS = RAGGED + [np.random.RandomState(4).randint(0, 128, n) for n in (1, 6)]
REQUEST_COUNTS = [6, 1, 9, 3, 5, 2]


def test_continuous_batch_rows_equal_each_request_alone(model):
    """2 rows for 6 requests: each finished row is refilled (one prefill per request, 1 + 5 + ... decode steps for
    the rows in use only), every request's tokens equal `generate` of it alone; an eos ends a request early."""
    alone = [np.asarray(generate(model, p, n)) for p, n in zip(REQUESTS, REQUEST_COUNTS)]
    batch = ContinuousBatch(model, REQUESTS, REQUEST_COUNTS, batch_size=2)
    got = dict(batch)
    assert sorted(got) == list(range(6)) and batch.shapes == (2, 32)
    for r in range(6):
        np.testing.assert_array_equal(got[r], alone[r])
    assert batch.decode_tokens == sum(REQUEST_COUNTS) - 6  # no step is counted for an empty or finished row
    assert batch.prefill_tokens == sum(len(p) for p in REQUESTS)
    eos = int(alone[2][3])
    got = dict(ContinuousBatch(model, REQUESTS, REQUEST_COUNTS, batch_size=3, eos_id=eos))
    want = np.asarray(generate(model, REQUESTS[2], REQUEST_COUNTS[2], eos_id=eos))
    stop = int(np.argmax(want == eos))
    np.testing.assert_array_equal(got[2], want[:stop + 1])


def test_continuous_batch_batched_refills_and_shrinking_keep_each_request_alone(model):
    """4 rows for 6 requests: the first fill prefills 4 requests in one [4, W] call, the rest refill one at a time;
    once nothing is pending the live rows move into a batch of 2, then 1 (fewer row-steps than a fixed batch of
    4); every request's tokens equal `generate` of it alone, with and without shrinking (off by default)."""
    alone = [np.asarray(generate(model, p, n)) for p, n in zip(REQUESTS, REQUEST_COUNTS)]
    batch = ContinuousBatch(model, REQUESTS, REQUEST_COUNTS, batch_size=4, shrink=True)
    got = dict(batch)
    width = max(batch.widths[:4])
    assert (4, width) in batch._prefills and sorted(batch._decodes)[0] < 4
    fixed = ContinuousBatch(model, REQUESTS, REQUEST_COUNTS, batch_size=4)
    got_fixed = dict(fixed)
    assert sorted(fixed._decodes) == [4] and batch.decode_row_steps < fixed.decode_row_steps
    assert batch.decode_tokens == fixed.decode_tokens == sum(REQUEST_COUNTS) - 6
    for r in range(6):
        np.testing.assert_array_equal(got[r], alone[r])
        np.testing.assert_array_equal(got_fixed[r], alone[r])


def test_continuous_batch_batched_prefill_samples_each_first_token_with_its_request_key(model):
    """Sampling: request r's first token is chosen with fold_in(fold_in(key, r), 0), whether its prefill ran alone
    (batch of 1) or with others (batch of 4): the first tokens of both runs agree."""
    kw = dict(key=jax.random.key(7), temperature=1.5)
    together = dict(ContinuousBatch(model, REQUESTS[:4], 1, batch_size=4, **kw))
    one_by_one = dict(ContinuousBatch(model, REQUESTS[:4], 1, batch_size=1, **kw))
    assert {r: list(t) for r, t in together.items()} == {r: list(t) for r, t in one_by_one.items()}


def test_continuous_batch_on_scanned_layers_and_its_errors():
    from qformats.models.decoder.scan import scan_layers
    m = scan_layers(random_model(dict(CONFIG, num_hidden_layers=2)))
    got = dict(ContinuousBatch(m, REQUESTS[:3], 4, batch_size=2))
    for r, p in enumerate(REQUESTS[:3]):
        np.testing.assert_array_equal(got[r], np.asarray(generate(m, p, 4)))
    with pytest.raises(ModelError, match="batch_size must be a positive integer, got 0"):
        ContinuousBatch(m, REQUESTS, 4, batch_size=0)
    with pytest.raises(ModelError, match="max_position_embeddings"):
        ContinuousBatch(m, [np.zeros(2047, np.int32)], 2, batch_size=1)
