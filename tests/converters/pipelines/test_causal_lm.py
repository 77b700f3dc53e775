"""converters.pipelines.causal_lm: dense / sharded / compressed-tensors / GGUF causal LMs load into the Flax decoder and
give transformers' logits (and greedy tokens) on the same checkpoint."""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from converters.formats.gguf_convert import convert_gguf, open_gguf  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from converters.formats.safetensors_io import open_checkpoint, save_file  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.nn import QLinear  # noqa: E402
from qformats.models.decoder.scan import scan_layers  # noqa: E402

# the model's forward as one jitted program (eagerly, each operation of each layer compiles on its own)
_logits_of = nnx.jit(lambda m, x: m(x)[0])

# float32 on both sides: the only difference is the order of accumulation in the matmuls and softmax.
DENSE_ATOL = 2e-5
# compressed-tensors checkpoints, against transformers + compressed-tensors on the same directory:
#   W4A16, FP8_DYNAMIC: transformers runs the compressed model (run_compressed, the default), with the same
#     dequantized float32 weights and, for FP8_DYNAMIC, the same dynamic per-token fp8 input quantization as
#     our packed layers: accumulation order only.
#   NVFP4A16: transformers' compressed forward fails on CPU in float32 (its decompressed weight is bfloat16),
#     so the reference dequantizes at load; compressed-tensors rounds each NVFP4 weight to bfloat16 once
#     (see test_nvfp4_parity) where we keep float32, a relative 2^-9 per weight.
PACKED = {"W4A16": (False, DENSE_ATOL), "FP8_DYNAMIC": (False, DENSE_ATOL), "NVFP4A16": (True, 1e-2)}

TINY = {
    "llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=384, max_position_embeddings=128, rms_norm_eps=1e-5,
                  tie_word_embeddings=False),
    "qwen3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=384, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=384, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
}
IDS = np.random.default_rng(0).integers(0, 384, size=(2, 11)).astype(np.int64)


def _save_tiny(kind: str, out: Path, **save_kwargs) -> Path:
    torch.manual_seed({"llama": 0, "qwen3": 1, "qwen2": 2}[kind])
    cfg = transformers.AutoConfig.for_model(kind, **TINY[kind])
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, **save_kwargs)
    return out


def _torch_logits(path, dequantize: bool = False) -> np.ndarray:
    kwargs = {}
    if dequantize:  # decompress at load into dense weights, then run a plain model
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


def _our_logits(model) -> np.ndarray:
    return np.asarray(_logits_of(model, jnp.asarray(IDS, jnp.int32)))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: _save_tiny(kind, root / kind) for kind in TINY}


@pytest.fixture(scope="module")
def dense_logits(tiny_dirs):
    """kind -> our logits of the dense tiny checkpoint (computed once, on first use)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model, hf_config, tok = load_causal_lm(tiny_dirs[kind])
            assert hf_config["model_type"] == kind and tok is None
            cache[kind] = _our_logits(model)
        return cache[kind]
    return get


@pytest.fixture(scope="module")
def qwen3_w4a16(tiny_dirs, tmp_path_factory):
    """The tied qwen3 checkpoint quantized W4A16 (read only)."""
    dst = tmp_path_factory.mktemp("ct") / "qwen3-W4A16"
    quantize_checkpoint(tiny_dirs["qwen3"], dst, "W4A16", progress=False)
    return dst


@pytest.mark.parametrize("kind", sorted(TINY))
def test_dense_logits_equal_transformers(tiny_dirs, dense_logits, kind):
    diff = np.abs(dense_logits(kind) - _torch_logits(tiny_dirs[kind])).max()
    assert diff <= DENSE_ATOL, diff


def test_sharded_checkpoint_loads_the_same(dense_logits, tmp_path):
    sharded = _save_tiny("llama", tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a, _, _ = load_causal_lm(sharded)
    np.testing.assert_array_equal(_our_logits(a), dense_logits("llama"))


# One case per scheme (each a different compressed-tensors format / activation path), the architectures shared out
# between them: what differs between llama and qwen3 (the tied embedding, q/k norms) does not depend on the scheme.
# The tied qwen3 W4A16 checkpoint is also the one transformers must load unchanged.
@pytest.mark.parametrize("kind,scheme", [("qwen3", "W4A16"), ("llama", "FP8_DYNAMIC"), ("llama", "NVFP4A16")])
def test_compressed_tensors_logits_equal_transformers(tiny_dirs, dense_logits, qwen3_w4a16, tmp_path, kind, scheme):
    dst = tmp_path / f"{kind}-{scheme}"
    if (kind, scheme) == ("qwen3", "W4A16"):
        dst = qwen3_w4a16
    else:
        quantize_checkpoint(tiny_dirs[kind], dst, scheme, progress=False)
    model, hf_config, _ = load_causal_lm(dst)
    assert hf_config["quantization_config"]["quant_method"] == "compressed-tensors"
    packed = [m for _, m in nnx.iter_modules(model) if isinstance(m, QLinear)]
    assert len(packed) == 7 * TINY[kind]["num_hidden_layers"]  # every projection packed, lm_head dense
    assert model.lm_head is None or not isinstance(model.lm_head, QLinear)
    ours = _our_logits(model)
    dequantize, atol = PACKED[scheme]
    diff = np.abs(ours - _torch_logits(dst, dequantize)).max()
    assert diff <= atol, diff
    # the quantization is visible: the dense model's logits are far outside that tolerance
    assert np.abs(ours - dense_logits(kind)).max() > 5 * atol


def test_tied_compressed_checkpoint_with_a_different_lm_head_is_an_error(qwen3_w4a16, tmp_path):
    """A tied model's compressed checkpoint may carry lm_head.weight only as a copy of the embedding. (That
    transformers loads the tied checkpoint unchanged: test_compressed_tensors_logits_equal_transformers[qwen3-W4A16].)"""
    dst = qwen3_w4a16
    with open_checkpoint(dst) as ck:
        emb = np.array(ck.get("model.embed_tokens.weight"))
    same = _rewrite(dst, tmp_path / "same", lambda t: t.__setitem__("lm_head.weight", emb.copy()))
    load_causal_lm(same, tokenizer=False)  # an equal copy is accepted
    bad = _rewrite(dst, tmp_path / "bad", lambda t: t.__setitem__("lm_head.weight", emb + 1))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_causal_lm(bad, tokenizer=False)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    with open_checkpoint(src) as ck:
        tensors = {n: np.array(ck.get(n)) for n in ck.keys()}
    edit(tensors)
    (dst / "model.safetensors").unlink()
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_an_error(tiny_dirs, tmp_path):
    bad = _rewrite(tiny_dirs["llama"], tmp_path / "bad", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_causal_lm(bad)


def test_unexpected_tensor_is_an_error(tiny_dirs, tmp_path):
    bad = _rewrite(tiny_dirs["llama"], tmp_path / "bad",
                   lambda t: t.__setitem__("model.layers.0.extra.weight", np.zeros((2, 2), np.float32)))
    with pytest.raises(CheckpointError, match="model.layers.0.extra.weight"):
        load_causal_lm(bad)


def test_misshapen_tensor_is_an_error(tiny_dirs, tmp_path):
    bad = _rewrite(tiny_dirs["llama"], tmp_path / "bad",
                   lambda t: t.__setitem__("model.norm.weight", np.ones((127,), np.float32)))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_causal_lm(bad)


def test_unsupported_model_type_is_an_error(tiny_dirs, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_dirs["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gpt2"):
        load_causal_lm(bad)


def test_not_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such path"):
        load_causal_lm(tmp_path / "nothing")


# ------------------------------------------------------------------------------------- GGUF files


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_tiny_gguf_logits_equal_transformers(tmp_path, arch):
    """A .gguf loads in memory as its converted checkpoint loads in transformers (qwen3 with head_dim =
    hidden / heads, which transformers' own GGUF path would take as 128)."""
    gguf = pytest.importorskip("gguf")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # test_gguf_convert's helper
    from test_gguf_convert import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, hidden=128, heads=4, kv_heads=2, inter=256, layers=1,
                           weight_type=gguf.GGMLQuantizationType.Q8_0)
    model, hf_config, tok = load_causal_lm(path)
    assert hf_config == open_gguf(path).config and tok is not None
    ids = np.array([tok.encode("the fox and the fox").ids] * 2)
    dense = convert_gguf(path, tmp_path / "dense")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.from_numpy(ids)).logits.numpy()
    ours = _logits_of(model, jnp.asarray(ids, jnp.int32))
    assert np.abs(np.asarray(ours) - theirs).max() <= DENSE_ATOL * np.abs(theirs).max()


def _tiny_gguf_writer():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # test_gguf_convert's helper
    from test_gguf_convert import write_tiny_gguf

    return write_tiny_gguf


def _projections(model):
    return {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model)
            if isinstance(m, (QLinear, nnx.Linear)) and "proj" in str(p[-1])}


@pytest.mark.parametrize("arch,type_name", [pytest.param("llama", "Q4_1", marks=pytest.mark.slow),  # two compiles
                                            ("qwen2", "Q5_0"), ("qwen3", "Q8_0")])
def test_tiny_gguf_loads_packed(tmp_path, arch, type_name):
    """By default every block-quantized projection is a packed QLinear whose dequantized kernel equals the dense
    load's kernel bit for bit (llama's Q/K rows un-permuted, qwen2's biases kept); logits agree with the dense
    model to float32 accumulation order on one token (the fused packed GEMV; a prompt dequantizes each layer and is
    the dense computation: test_smollm2_gguf_runs_packed_and_logits_equal_transformers)."""
    from qformats import dequantize

    gguf = pytest.importorskip("gguf")
    path = _tiny_gguf_writer()(tmp_path / "tiny.gguf", arch, hidden=128, heads=4, kv_heads=2, inter=256, layers=1,
                               weight_type=gguf.GGMLQuantizationType[type_name])
    packed, _, tok = load_causal_lm(path)
    dense, _, _ = load_causal_lm(path, packed=False)
    pp, dp = _projections(packed), _projections(dense)
    assert len(pp) == 7 and set(pp) == set(dp)
    for name, m in pp.items():
        assert isinstance(m, QLinear) and isinstance(dp[name], nnx.Linear), name
        assert (m.kernel.get_value().offset is not None) == (type_name == "Q4_1")
        w = np.asarray(dequantize(m.kernel.get_value()))
        np.testing.assert_array_equal(w.view(np.uint32), np.asarray(dp[name].kernel.get_value()).view(np.uint32))
        if arch == "qwen2" and "_proj" in name and name.rsplit("/", 1)[1] in ("q_proj", "k_proj", "v_proj"):
            np.testing.assert_array_equal(np.asarray(m.bias.get_value()), np.asarray(dp[name].bias.get_value()))
    if arch != "llama":
        return  # the forward pass is the same code for every architecture: run once
    x = jnp.asarray([tok.encode("the fox").ids[:1]], jnp.int32)  # one token: the fused packed GEMV path
    ours, theirs = (np.asarray(_logits_of(m, x)) for m in (packed, dense))
    assert np.abs(ours - theirs).max() <= DENSE_ATOL * np.abs(theirs).max()


def test_tiny_gguf_unpacked_type_is_refused_naming_the_tensor(tmp_path):
    """A projection in a quantized GGML type that is not packed exactly (here TQ2_0) is refused when packing,
    naming the tensor and its type; packed=False dequantizes it."""
    gguf = pytest.importorskip("gguf")
    path = _tiny_gguf_writer()(tmp_path / "tq.gguf", hidden=256, heads=4, kv_heads=2, inter=256, layers=1,
                               weight_type=gguf.GGMLQuantizationType.TQ2_0)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_q\.weight': GGML type TQ2_0 is not packed"):
        load_causal_lm(path)
    model, _, _ = load_causal_lm(path, packed=False, tokenizer=False)
    assert not any(isinstance(m, QLinear) for _, m in nnx.iter_modules(model))


def test_tiny_gguf_schemes_start_from_the_right_weights(tmp_path):
    """`eval` / `generate` schemes on a .gguf file: "stored" runs it packed, "dense" dequantized, a preset quantizes
    the dequantized weights (`converters.evaluation.perplexity.load_for_scheme`)."""
    from converters.evaluation.perplexity import load_for_scheme

    gguf = pytest.importorskip("gguf")
    path = _tiny_gguf_writer()(tmp_path / "tiny.gguf", hidden=128, heads=4, kv_heads=2, inter=256, layers=1,
                               weight_type=gguf.GGMLQuantizationType.Q4_1)
    for scheme, kind, desc in (("stored", QLinear, "uint4 group32"), ("dense", nnx.Linear, None),
                               ("W8A16:g64", QLinear, "int8 group64")):
        model = load_for_scheme(path, scheme, tokenizer=False)[0]
        proj = _projections(model)
        assert len(proj) == 7 and all(type(m) is kind for m in proj.values()), scheme
        if desc:
            assert all(m.kernel.get_value().scheme.describe().startswith(desc) for m in proj.values())


# ------------------------------------------------------------------------------------- SmolLM2 (GGUF)

PROMPT = "The capital of France is"
# 30 layers in float32 against torch's float32: accumulation order only (measured 1.7e-4; logits reach |x| ~ 30).
SMOLLM2_ATOL = 1e-3
# greedy tokens compared (one compiled generate program whatever the count: a while_loop over the steps)
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2(smollm2_dense):
    pytest.importorskip("gguf")
    from converters.evaluation.embedded import smollm2_gguf

    path = smollm2_gguf()
    model, hf_config, tok = load_causal_lm(path)  # ours: straight from the .gguf file
    # The torch reference: transformers' LlamaForCausalLM on the GGUF tensors as convert_gguf writes them
    # (the session's converted SmolLM2: equal, bit for bit, to transformers' own GGUF loading, test_gguf_convert).
    assert json.loads((smollm2_dense / "config.json").read_text()) == hf_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dense, dtype=torch.float32).eval()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()  # tied
    return model, tok, ref


@pytest.mark.slow
def test_smollm2_gguf_greedy_tokens_equal_transformers(smollm2):
    from qformats.models.generate import generate

    model, tok, ref = smollm2
    ids = tok.encode(PROMPT).ids
    # the layers scanned, as `qformats generate` runs them (the same values: test_decoder_scan), on a copy (the
    # fixture's model keeps its 30 layers): one traced layer instead of 30, -18 CPU s of compiling here
    ours = np.asarray(generate(scan_layers(nnx.clone(model)), jnp.asarray([ids], jnp.int32), GREEDY_TOKENS))
    ours = ours[0].tolist()
    theirs, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):  # greedy with the KV cache, no end-of-sequence stop
            out = ref(step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            step = out.logits[:, -1].argmax(-1, keepdim=True)
            theirs.append(int(step))
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))


@pytest.mark.slow
def test_smollm2_gguf_runs_packed_and_logits_equal_transformers(smollm2):
    """The SmolLM2 GGUF (Q4_1 projections, Q8_0 tied embedding) loads packed by default: all 210 projections are
    uint4 group-32 QLinears with the file's minima as offsets, the embedding a PackedEmbed of int8 codes, at the
    file's bits per weight (Q4_1 5.0, Q8_0 8.5); its logits
    equal transformers' float32 model on the same dequantized weights to float32 accumulation order, for a prompt
    (dequantize-then-dot) and for one token (the fused packed GEMV). (Greedy generation of the packed model:
    test_smollm2_gguf_greedy_tokens_equal_transformers; `packed=False` GGUF loading, dequantized at load:
    test_tiny_gguf_loads_packed and test_gguf_packed_embedding on small files.)"""
    model, tok, ref = smollm2
    proj = _projections(model)
    assert len(proj) == 210 and all(isinstance(m, QLinear) for m in proj.values())
    q = next(iter(proj.values())).kernel.get_value()
    assert q.scheme.describe().startswith("uint4 group32") and q.offset is not None
    from qformats.models.decoder import PackedEmbed  # the Q8_0 tied embedding: rows gathered, lm_head a packed GEMV

    assert isinstance(model.model.embed_tokens, PackedEmbed)
    assert model.model.embed_tokens.kernel.get_value().codes.dtype == jnp.int8
    # the file's bits per weight: float16 d (and m) kept as stored, computed in float32; bits of the loaded leaves
    # (codes + scales + offsets) / weights = the block sizes, Q4_1 20 bytes and Q8_0 34 bytes per 32 weights
    import math

    import jax

    from qformats.qarray import QArray

    by_bits = {}
    for leaf in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, QArray)):
        if isinstance(leaf, QArray):
            assert leaf.scale.dtype == jnp.float16 and leaf.compute_dtype == jnp.float32
            assert leaf.offset is None or leaf.offset.dtype == jnp.float16
            b, n = by_bits.get(leaf.scheme.bits, (0, 0))
            by_bits[leaf.scheme.bits] = (b + leaf.nbytes, n + math.prod(leaf.shape))
    assert {k: 8 * b / n for k, (b, n) in by_bits.items()} == {4: 20 * 8 / 32, 8: 34 * 8 / 32}
    ids = np.array([tok.encode(PROMPT).ids])
    # the forward jitted, on a scanned copy (the same values as the 30 layers: test_decoder_scan): one traced layer,
    # where the eager forward dispatched and compiled each operation of each layer
    scanned = scan_layers(nnx.clone(model))
    forward = nnx.jit(lambda m, x: m(x)[0])
    for x in (ids, ids[:, :1]):
        with torch.no_grad():
            theirs = ref(torch.from_numpy(x)).logits.numpy()
        ours = np.asarray(forward(scanned, jnp.asarray(x, jnp.int32)))
        diff = np.abs(ours - theirs).max()
        assert diff <= SMOLLM2_ATOL, (x.shape, diff)
