"""converters.pipelines.mesh_load's native-format placement on one process: `gguf_sliced` reads any device slice of a
GGUF block-type QArray (rows across llama's Q/K un-permutation, K ranges inside super-blocks) equal to the same slice
of `GGUFModel.get_packed`, and load_causal_lm(mesh=...) of a GGUF file equals the one-device load (8 devices:
tests/multidevice/test_native_mesh_load.py)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

gguf = pytest.importorskip("gguf")

from gguf_mixed import mixed_gguf  # noqa: E402

from converters.formats.gguf_convert import open_gguf  # noqa: E402
from converters.formats.gguf_packed import PACKED_TYPES  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from converters.pipelines.mesh_load import gguf_dense_reader, gguf_sliced  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """One GGUF per packed type (q_proj: rope-permuted rows; down_proj: K = 512, two super-blocks)."""
    root = tmp_path_factory.mktemp("gguf_sliced")
    return {t: open_gguf(mixed_gguf(root / f"{t}.gguf", {"attn_q": t, "ffn_down": t}, hidden=256, heads=4,
                                    kv_heads=2, inter=512, layers=1, embed="Q8_0" if t != "MXFP4" else "F32"))
            for t in PACKED_TYPES}


@pytest.mark.parametrize("type_name", list(PACKED_TYPES))
def test_every_slice_equals_the_slice_of_get_packed(every_type, type_name):
    g = every_type[type_name]
    # q_proj: rows across the rope un-permutation, K whole; down_proj: K = 512 split 2 ways (a super-block each)
    # and 8 ways (ranges inside a super-block)
    for name, splits in (("model.layers.0.self_attn.q_proj.weight", (1,)), ("model.layers.0.mlp.down_proj.weight",
                                                                           (2, 8))):
        q = g.get_packed(name)
        w = gguf_sliced(g, name)
        for leaf in ("codes", "scale", "zero_point", "global_scale", "offset"):
            a, b = getattr(q, leaf), getattr(w.abstract, leaf)
            assert (a is None) == (b is None) and (a is None or (a.shape, a.dtype) == (b.shape, b.dtype)), leaf
        assert (w.abstract.scheme, w.abstract.shape, w.abstract.axis) == (q.scheme, q.shape, q.axis)
        n, k = g.shape(name)
        bits, group = q.scheme.bits, q.scheme.group_size
        rows = [slice(0, n), slice(64, 128)]  # whole heads of 64 rows, as a split takes them
        for parts in splits:  # K split into `parts` device ranges
            per = k // parts
            if per % group:
                continue
            for p in range(parts):
                k0, k1 = p * per, (p + 1) * per
                cb = slice(k0 * bits // 8, k1 * bits // 8) if bits < 8 else slice(k0, k1)
                gs = slice(k0 // group, k1 // group)
                for r in rows:
                    np.testing.assert_array_equal(w.reads["codes"]((r, cb)), np.asarray(q.codes)[r, cb])
                    np.testing.assert_array_equal(w.reads["scale"]((r, gs)), np.asarray(q.scale)[r, gs])
                    if q.offset is not None:
                        np.testing.assert_array_equal(w.reads["offset"]((r, gs)), np.asarray(q.offset)[r, gs])


def test_dense_reader_slices_equal_get(every_type):
    g = every_type["Q4_K"]
    emb = g.get("model.embed_tokens.weight")  # Q8_0, dequantized by gguf
    read = gguf_dense_reader(g, "model.embed_tokens.weight", False)
    np.testing.assert_array_equal(read((slice(8, 40), slice(32, 96))), emb[8:40, 32:96])
    norm = g.get("model.norm.weight")
    np.testing.assert_array_equal(gguf_dense_reader(g, "model.norm.weight", False)((slice(16, 48),)), norm[16:48])


@pytest.mark.parametrize("packed", [True, False])
def test_gguf_on_a_one_device_mesh_equals_load_causal_lm(tmp_path, packed):
    src = mixed_gguf(tmp_path / "m.gguf", {"attn_q": "Q4_K", "attn_k": "Q8_0", "attn_v": "MXFP4", "attn_output": "Q4_1",
                                           "ffn_gate": "Q6_K", "ffn_up": "IQ4_XS", "ffn_down": "Q2_K"},
                     hidden=256, heads=4, kv_heads=2, inter=512, layers=1, embed="Q8_0")
    ref, hf_ref, _ = load_causal_lm(src, tokenizer=False, packed=packed)
    got, hf, _ = load_causal_lm(src, mesh=Mesh(np.array(jax.devices()[:1]), ("tp",)), tokenizer=False, packed=packed)
    assert hf == hf_ref
    from qformats.models.decoder import PackedEmbed

    # the Q8_0 embedding packed (a PackedEmbed) on the mesh as on one device: the same leaves, bit for bit
    assert isinstance(got.model.embed_tokens, PackedEmbed) == isinstance(ref.model.embed_tokens, PackedEmbed) == packed
    a, b = jax.tree.leaves(nnx.state(ref, nnx.Param)), jax.tree.leaves(nnx.state(got, nnx.Param))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_gguf_type_not_packed_on_a_mesh_is_refused_naming_it(tmp_path):
    src = mixed_gguf(tmp_path / "m.gguf", {"attn_q": "Q4_1"}, hidden=256, heads=4, kv_heads=2, inter=512, layers=1)
    g = open_gguf(src)
    name = "model.layers.0.self_attn.q_proj.weight"  # a type gguf reads but qformats does not pack
    g._tensors[name] = g._tensors[name]._replace(tensor_type=gguf.GGMLQuantizationType.IQ2_XXS)
    from converters.pipelines.mesh_load import load_gguf_on_mesh
    from converters.pipelines.causal_lm import _abstract_model, _mesh_rules

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    model, cfg = _abstract_model(g.config, jax.numpy.float32, jax.numpy.float32, str(src))
    with pytest.raises(CheckpointError, match=r"q_proj.weight'.*IQ2_XXS is not packed"):
        load_gguf_on_mesh(g, model, cfg, mesh, _mesh_rules(cfg, mesh, None))


@pytest.mark.parametrize("fmt", [pytest.param("fp8", marks=pytest.mark.slow), "awq", "gptq_act_order", "modelopt"])
def test_native_formats_on_a_one_device_mesh_equal_load_causal_lm(tmp_path, fmt):
    """HF FP8, AWQ, ModelOpt NVFP4 and GPTQ with activation-ordered groups (a dense weight, as its reader gives it) go through
    load_native_on_mesh: the same parameters as the one-device load (8 devices: tests/multidevice)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    import test_gptq_awq as GA
    from test_hf_fp8 import write_fp8_llama

    if fmt == "fp8":
        src = write_fp8_llama(tmp_path / "fp8")
    elif fmt == "modelopt":  # NVFP4 with static input scales (their input_scale / input_global_scale tensors)
        from test_modelopt import _write_modelopt

        src = _write_modelopt(tmp_path / "modelopt")
    else:
        dense = tmp_path / "dense"
        torch.manual_seed(0)
        cfg = transformers.AutoConfig.for_model("llama", **GA.TINY)
        transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(dense)
        src = tmp_path / fmt
        if fmt == "awq":
            GA.make_awq(src, dense)
        else:
            GA.make_gptq(src, dense, permute=True)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, _, _ = load_causal_lm(src, tokenizer=False)
        got, _, _ = load_causal_lm(src, mesh=Mesh(np.array(jax.devices()[:1]), ("tp",)), tokenizer=False)
    if fmt == "gptq_act_order":  # loaded dense on both paths, said so
        assert any("activation-ordered" in str(w.message) for w in caught)
    a, b = jax.tree.leaves(nnx.state(ref, nnx.Param)), jax.tree.leaves(nnx.state(got, nnx.Param))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
