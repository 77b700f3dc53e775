"""NVFP4 parity. Read: `dense_weight` gives, bit for bit, the weights `from_pretrained(...,
quantization_config=CompressedTensorsConfig(dequantize=True))` loads, for every dtype the model is loaded in.
Write: the in-memory path (`quantize_model`, as `qformats eval --schemes NVFP4A16` runs it) packs exactly what the
checkpoint path (`quantize_checkpoint`, reloaded) stores, fused siblings sharing one global scale as
compressed-tensors / llm-compressor compute it.

compressed-tensors' NVFP4 decompression computes `code * (scale / global_scale)` in float32 and rounds it to
bfloat16 once, whatever the model's dtype; transformers then casts to the model's dtype. The other formats
decompress in the scale's dtype (bfloat16 for MX), which the same rule covers.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import qformats as qf  # noqa: E402
from converters.formats.compressed_tensors.read import dense_weight, read_compressed  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402

PRESETS = ["NVFP4A16", "W4A16", "W8A16", "MXFP4A16", "FP8_DYNAMIC"]
LOAD = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _torch_bits(t) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy().view(np.uint32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny BERT saved in bf16 and in f32, each quantized with every preset by our writer."""
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=256, max_position_embeddings=32)
    out = {}
    for src_dtype in ("bfloat16", "float32"):
        torch.manual_seed(0)
        model = transformers.BertModel(cfg)
        with torch.no_grad():  # a spread of magnitudes, so that the bf16 rounding shows
            for p in model.parameters():
                p.mul_(torch.exp(torch.randn_like(p)))
        src = tmp_path_factory.mktemp(f"src_{src_dtype}")
        model.to(LOAD[src_dtype]).save_pretrained(src)
        for preset in PRESETS:
            dst = src.parent / f"{src.name}_{preset}"
            quantize_checkpoint(src, dst, preset, progress=False)
            out[preset, src_dtype] = dst
    return out


def _load(path, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModel.from_pretrained(
            path, quantization_config=CompressedTensorsConfig(dequantize=True), torch_dtype=LOAD[dtype]).state_dict()


@pytest.mark.parametrize("src_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("preset", PRESETS)
def test_dense_weight_equals_transformers(checkpoints, preset, src_dtype):
    qs = read_compressed(checkpoints[preset, src_dtype]).qarrays()
    assert len(qs) == 7  # q, k, v, attention.output, intermediate, output, pooler
    for load in LOAD:
        sd = _load(checkpoints[preset, src_dtype], load)
        for mod, q in qs.items():
            ours = np.asarray(dense_weight(q, jnp.dtype(load))).T
            assert ours.dtype == jnp.dtype(load)
            np.testing.assert_array_equal(_bits(ours), _torch_bits(sd[mod + ".weight"]),
                                          err_msg=f"{preset} {src_dtype} checkpoint loaded as {load}: {mod}")


def test_nvfp4_exact_option_is_the_unrounded_product(checkpoints):
    """exact=True keeps the float32 product; for NVFP4 it differs from what transformers loads in float32 on
    most weights, by at most half a bfloat16 ulp."""
    qs = read_compressed(checkpoints["NVFP4A16", "float32"]).qarrays()
    sd = _load(checkpoints["NVFP4A16", "float32"], "float32")
    differ = 0
    for mod, q in qs.items():
        exact = np.asarray(dense_weight(q, jnp.float32, exact=True))
        np.testing.assert_array_equal(exact, np.asarray(qf.dequantize(q, jnp.float32)))
        theirs = sd[mod + ".weight"].numpy().T
        differ += int((exact != theirs).sum())
        # theirs is exact rounded to bfloat16 (8 significant bits): |exact - theirs| <= 2^-8 |exact|
        assert (np.abs(exact - theirs) <= np.abs(exact) * 2.0 ** -8).all(), mod
    assert differ > 0


# ---- write parity: in-memory quantize_model == checkpoint path, fused global scales ------------------------------
# SmolLM2-135M's shapes (d=576, 9 query / 3 KV heads of 64, ffn 1536, tied embedding), two layers, small vocabulary.
SMOL_SHAPED = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                   num_key_value_heads=3, head_dim=64, vocab_size=256, max_position_embeddings=64,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)


def _packed_layers(model):
    from qformats.nn import QLinear

    return {"/".join(map(str, p)): m.kernel.get_value() for p, m in nnx.iter_modules(model) if isinstance(m, QLinear)}


@pytest.mark.slow
def test_in_memory_nvfp4_equals_the_checkpoint_path_bit_for_bit(tmp_path):
    from converters.pipelines.causal_lm import load_causal_lm
    from converters.evaluation.perplexity import load_for_scheme

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOL_SHAPED)).eval()
    with torch.no_grad():  # a different amax for every member of each fused group
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn.v_proj.weight.mul_(5.0 + i)
            layer.mlp.up_proj.weight.mul_(0.3)
            layer.mlp.gate_proj.weight.mul_(2.0)
    hf.save_pretrained(tmp_path / "dense")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "nvfp4", "NVFP4A16", progress=False)
    stored, _, _ = load_causal_lm(tmp_path / "nvfp4", tokenizer=False)
    in_memory, _, _, skipped = load_for_scheme(tmp_path / "dense", "NVFP4A16", tokenizer=False)
    assert skipped == []
    a, b = _packed_layers(stored), _packed_layers(in_memory)
    assert sorted(a) == sorted(b) and len(a) == 14
    for path in a:
        for part in ("codes", "scale", "zero_point", "global_scale"):
            x, y = getattr(a[path], part), getattr(b[path], part)
            assert (x is None) == (y is None), (path, part)
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape, (path, part)
                np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8),
                                              err_msg=f"{path} {part}")
    g = {p: float(q.global_scale[0]) for p, q in b.items()}
    for i in range(2):
        attn = {g[f"model/layers/{i}/self_attn/{n}_proj"] for n in "qkv"}
        mlp = {g[f"model/layers/{i}/mlp/{n}_proj"] for n in ("gate", "up")}
        assert len(attn) == 1 and len(mlp) == 1, (i, attn, mlp)
        assert g[f"model/layers/{i}/self_attn/o_proj"] not in attn  # o_proj is not fused: its own scale
    # the rest of the model (embedding, norms) is the same too
    for x, y in zip(jax.tree.leaves(nnx.state(stored, nnx.Param)), jax.tree.leaves(nnx.state(in_memory, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    ids = jnp.asarray([[1, 5, 9, 200, 3, 7]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(stored(ids)[0]), np.asarray(in_memory(ids)[0]))


def test_in_memory_attention_block_equals_compressed_tensors_fused_global_scale():
    """One SmolLM2-shaped attention block: compressed-tensors' generate_gparam over q/k/v (the minimum of the
    three, as llm-compressor's fused observers give), calculate_qparams under it, and its NVFP4 compressor, vs
    `quantize_model` on the same weights in Flax, tensor for tensor (the compressed-tensors names and bytes)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import ct_oracle as O

    from converters.formats.compressed_tensors.config import format_for
    from converters.formats.compressed_tensors.write import qarray_to_tensors
    from qformats.nn import Rule, quantize_model

    attn = "model.layers.0.self_attn"
    shapes = {f"{attn}.q_proj": (576, 576), f"{attn}.k_proj": (192, 576), f"{attn}.v_proj": (192, 576),
              f"{attn}.o_proj": (576, 576)}
    m = O.make_model(shapes, torch.float32, seed=3)
    with torch.no_grad():
        m.get_submodule(f"{attn}.k_proj").weight.mul_(4.0)
    weights = {n: m.get_submodule(n).weight.detach().clone().numpy() for n in shapes}
    O.quantize_model(m, "NVFP4A16")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ref = O.save_compressed(m, Path(d))

    class Node(nnx.Module):
        pass

    root = Node()
    node = root
    for part in attn.split("."):
        setattr(node, part, Node())
        node = getattr(node, part)
    for name, w in weights.items():
        lin = nnx.Linear(w.shape[1], w.shape[0], use_bias=False, rngs=nnx.Rngs(0))
        lin.kernel.set_value(jnp.asarray(w.T))
        setattr(node, name.rpartition(".")[2], lin)
    quantize_model(root, [Rule(".*", "NVFP4A16")])
    ss = qf.presets["NVFP4A16"]
    gs = set()
    for name in shapes:
        q = getattr(node, name.rpartition(".")[2]).kernel.get_value()
        ours = qarray_to_tensors(q, format_for(ss.weights), name)
        for local, arr in ours.items():
            theirs = ref[f"{name}.{local}"]
            np.testing.assert_array_equal(np.ascontiguousarray(arr).view(np.uint8).ravel(),
                                          theirs.contiguous().flatten().view(torch.uint8).numpy(),
                                          err_msg=f"{name}.{local}")
        if not name.endswith("o_proj"):
            gs.add(float(ours["weight_global_scale"][0]))
    assert len(gs) == 1  # q, k, v share the scale compressed-tensors computed for the group


def test_checkpoint_path_warns_for_a_partly_quantized_group(tmp_path):
    from converters.formats.compressed_tensors.read import read_compressed
    from converters.formats.safetensors_io import save_file

    rng = np.random.default_rng(5)
    attn = "model.layers.0.self_attn"
    w = {f"{attn}.{n}.weight": (rng.standard_normal((32, 64)) * s).astype(np.float32)
         for n, s in (("q_proj", 1.0), ("k_proj", 3.0), ("v_proj", 9.0))}
    (tmp_path / "src").mkdir()
    save_file(w, tmp_path / "src/model.safetensors")
    with pytest.warns(UserWarning, match=r"q_proj, k_proj, v_proj are fused siblings .* only "
                                         r"model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj take"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "q", "NVFP4A16", ignore=["v_proj"], progress=False)
    qs = read_compressed(tmp_path / "q").qarrays()
    ws = qf.presets["NVFP4A16"].weights
    for n in ("q_proj", "k_proj"):  # each its own global scale
        own = qf.quantize(w[f"{attn}.{n}.weight"], ws).global_scale
        assert float(qs[f"{attn}.{n}"].global_scale[0]) == float(own[0])
    quantize_checkpoint(tmp_path / "src", tmp_path / "all", "NVFP4A16", progress=False)
    qs = read_compressed(tmp_path / "all").qarrays()
    assert len({float(qs[f"{attn}.{n}"].global_scale[0]) for n in ("q_proj", "k_proj", "v_proj")}) == 1
