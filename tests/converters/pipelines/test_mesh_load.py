"""load_causal_lm(mesh=...) in one process on one device (converters.pipelines.mesh_load): the sharded load equals the
one-device load, reads shard by shard, and refuses what it cannot read shard-wise with typed errors (8 devices:
tests/multidevice)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from converters.pipelines.causal_lm import load_causal_lm
from converters.pipelines.mesh_load import ReadStats, place, tensor_parallel_setup
from converters.pipelines.quantize_checkpoint import quantize_checkpoint
from converters.formats.safetensors_io import open_checkpoint, save_file
from qformats.errors import CheckpointError, ModelError
from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensors

HF = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mesh_load") / "dense"
    d.mkdir()
    cfg = DecoderConfig.from_hf(HF)
    save_file(hf_tensors(CausalLM(cfg, rngs=nnx.Rngs(3))), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(HF))
    return d


def _mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("tp",))


def _leaves(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("scheme", [None, "W4A16:g16", "NVFP4A16", "FP8_DYNAMIC"])
def test_sharded_load_equals_load_causal_lm(dense_dir, tmp_path, scheme):
    src = dense_dir
    if scheme:
        src = tmp_path / "q"
        quantize_checkpoint(dense_dir, src, scheme, progress=False)
    ref, _, _ = load_causal_lm(src, tokenizer=False)
    st = ReadStats()
    got, hf, tok = load_causal_lm(src, mesh=_mesh1(), tokenizer=False, stats=st)
    assert tok is None and hf["model_type"] == "llama"
    a, b = _leaves(ref), _leaves(got)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # one device holds every shard: exactly the stored bytes were read, each tensor once
    with open_checkpoint(src) as ck:
        stored = sum(ck.info(n).nbytes for n in ck.keys())
    assert st.bytes == stored


def test_place_reads_one_shard_per_device_and_only_its_index():
    mesh = _mesh1()
    seen = []
    src = np.arange(24, dtype=np.float32).reshape(4, 6)

    def read(ix):
        seen.append(ix)
        return src[ix]
    a = place((4, 6), np.float32, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp")), read)
    np.testing.assert_array_equal(np.asarray(a), src)
    assert seen == [(slice(None), slice(None))] or len(seen) == 1
    with pytest.raises(CheckpointError, match=r"came out as \(2, 6\), expected \(4, 6\)"):
        place((4, 6), np.float32, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), lambda ix: src[:2])


def test_asymmetric_packed_zero_points_are_refused_naming_the_module(dense_dir, tmp_path):
    src = tmp_path / "asym"
    quantize_checkpoint(dense_dir, src, "W4A16_ASYM:g16", progress=False)
    with pytest.raises(CheckpointError, match=r"module 'model.layers.0.mlp.down_proj' \(pack-quantized.*an "
                                              r"asymmetric pack-quantized zero point.*load_causal_lm"):
        load_causal_lm(src, mesh=_mesh1(), tokenizer=False)


def test_missing_and_unexpected_tensors_are_checkpoint_errors(dense_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with open_checkpoint(dense_dir) as ck:
        tensors = {n: np.array(ck.get(n)) for n in ck.keys() if n != "model.norm.weight"}
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(HF))
    with pytest.raises(CheckpointError, match=r"1 missing: model.norm.weight; 1 unexpected: model.extra.weight"):
        load_causal_lm(bad, mesh=_mesh1(), tokenizer=False)
    with pytest.raises(CheckpointError, match=r"expected a checkpoint directory"):
        load_causal_lm(bad / "model.safetensors", mesh=_mesh1())


def test_tensor_parallel_setup_after_jax_started_needs_the_devices():
    jax.devices()  # this process's JAX has started (one CPU device)
    mesh = tensor_parallel_setup(1)
    assert mesh.axis_names == ("tp",) and mesh.devices.size == 1
    n = len(jax.devices()) + 1
    with pytest.raises(ModelError, match=rf"tensor parallel {n}: expected at least {n} cpu devices, found "
                                         rf"{n - 1} \(JAX started before"):
        tensor_parallel_setup(n)
    with pytest.raises(ModelError, match="positive device count"):
        tensor_parallel_setup(0)


@pytest.mark.parametrize("kv", ["fp8", "fp8:head", "fp8:dynamic"])
def test_kv_cache_scheme_loads_onto_the_mesh(dense_dir, tmp_path, kv):
    """A checkpoint with kv_cache_scheme (static scales per tensor / per KV head, or dynamic): the sharded loader
    quantizes the cache as load_causal_lm does (same scheme, same scales, replicated), and decodes the same
    logits with its fp8 cache."""
    from converters.pipelines.causal_lm import save_causal_lm
    from qformats.kv_cache import parse_kv_cache
    from qformats.models.decoder import calibrate_kv_cache, enable_kv_cache_quantization, kv_cache_scheme, \
        kv_scale_tensors

    m, cfg, _ = load_causal_lm(dense_dir, tokenizer=False)
    scheme = parse_kv_cache(kv)
    ids = np.random.RandomState(0).randint(0, 128, (1, 10))
    if scheme.dynamic:
        enable_kv_cache_quantization(m, scheme)
    else:
        calibrate_kv_cache(m, [ids], scheme)
    src = save_causal_lm(m, tmp_path / "kv", cfg)
    ref, _, _ = load_causal_lm(src, tokenizer=False)
    got, _, _ = load_causal_lm(src, mesh=_mesh1(), tokenizer=False)
    assert kv_cache_scheme(got) == scheme
    a, b = kv_scale_tensors(ref), kv_scale_tensors(got)
    assert sorted(a) == sorted(b) and len(a) == (0 if scheme.dynamic else 2)
    for n in a:
        assert b[n].sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]))
    step = nnx.jit(lambda model, x: model(x, model.init_cache(1, 16)))
    (la, ca), (lb, cb) = step(ref, ids), step(got, ids)
    assert ca.keys[0].dtype == cb.keys[0].dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


def _splits(d, parts):
    edges = [round(i * d / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(edges, edges[1:]) if b > a]


@pytest.mark.parametrize("scheme", ["W4A16:g16", "W3A16:g16", "W8A16:g16", "W8A8", "NVFP4A16", "MXFP6A16",
                                    "FP8_DYNAMIC", "W4A16_ASYM:g16"])
def test_the_decoder_reads_any_slice_of_a_leaf_as_the_whole_leaf_holds_it(dense_dir, tmp_path, scheme):
    """converters.formats.compressed_tensors.read.decode_weight, the one decoder of both placements: its leaves read whole make the QArray
    read_compressed returns, and each leaf read by slices (rows and columns cut anywhere, as a device reads its
    part) equals that slice of the whole leaf; a layout whose values span slices says so (whole_only)."""
    from converters.formats.compressed_tensors.read import decode_weight, open_compressed, plan_modules, read_compressed

    src = tmp_path / "q"
    quantize_checkpoint(dense_dir, src, scheme, progress=False)
    ref = read_compressed(src).qarrays()
    ck, _, qc = open_compressed(src)
    decoded = 0
    with ck:
        for m in plan_modules(ck, qc):
            if m.group is None:
                continue
            w = decode_weight(ck, m, qc)
            q = w.whole()
            for part in ("codes", "scale", "zero_point", "global_scale"):
                a, b = getattr(q, part), getattr(ref[m.name], part)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.dtype == b.dtype and a.shape == b.shape
                    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            decoded += 1
            if w.whole_only is not None:
                assert scheme == "W4A16_ASYM:g16", w.whole_only
                continue
            for leaf in (w.codes, w.scale, w.zero_point, w.global_scale):
                if leaf is None:
                    continue
                whole = leaf.read(None)
                assert whole.shape == leaf.shape and whole.dtype == leaf.dtype
                for parts in (1, 2, 3, 8):
                    for rows in _splits(leaf.shape[0], parts):
                        for cols in (_splits(leaf.shape[1], 5 - parts % 4) if len(leaf.shape) > 1 else [None]):
                            ix = (rows,) if cols is None else (rows, cols)
                            np.testing.assert_array_equal(leaf.read(ix).view(np.uint8), whole[ix].view(np.uint8))
    assert decoded == 7
