"""converters.formats.gguf_convert: GGUF -> dense HF checkpoint equal, bit for bit, to transformers' own GGUF loading
(`from_pretrained(dir, gguf_file=...)`): the embedded SmolLM2 (Q4_1 projections, Q8_0 tied embedding) and tiny
GGUF files written with gguf.GGUFWriter; tokenizer.json equal to the one transformers builds; typed errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF path needs it
tokenizers = pytest.importorskip("tokenizers")

from converters.evaluation.embedded import smollm2_gguf  # noqa: E402
from converters.formats.gguf_convert import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    check_gguf_header,
    convert_gguf,
    field_contents,
    gguf_tensors,
    open_gguf,
    supported_tensor_types,
)
from converters.formats.safetensors_io import open_checkpoint  # noqa: E402
from gguf_tiny import byte_alphabet, write_tensors  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402

Q = gguf.GGMLQuantizationType
TEXT = ("The quick brown fox jumps over the lazy dog. Numbers 1234567 and café, naïve résumé; "
        "<|im_start|>user\nHello there!<|im_end|>\n  two  spaces\tand\ttabs.")


def _transformers_gguf(path: Path):
    """transformers' GGUF loading of `path`: (state dict, config dict, tokenizer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config)
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.state_dict(), config, tok


def _assert_same_as_transformers(path: Path, dst: Path, reference, tmp_path: Path) -> None:
    sd, config, tok = reference
    with open_checkpoint(dst) as ck:
        names = set(ck.keys())
        expected = set(sd)
        if config.tie_word_embeddings:  # written once, as transformers saves a tied model
            expected.discard("lm_head.weight")
            assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
        assert names == expected
        for name in sorted(names):
            ours = np.asarray(ck.get(name))
            theirs = sd[name].numpy()
            assert ours.dtype == np.float32 and theirs.dtype == np.float32, name
            assert ours.shape == theirs.shape, name
            np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), err_msg=name)
    ours_cfg = transformers.AutoConfig.from_pretrained(dst).to_dict()
    theirs_cfg = config.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "dtype", "transformers_version"):
        ours_cfg.pop(key, None)
        theirs_cfg.pop(key, None)
    assert ours_cfg == theirs_cfg
    tok.save_pretrained(tmp_path / "transformers-tokenizer")
    theirs_json = json.loads((tmp_path / "transformers-tokenizer" / "tokenizer.json").read_text())
    assert json.loads((dst / "tokenizer.json").read_text()) == theirs_json
    ours_tok = tokenizers.Tokenizer.from_file(str(dst / "tokenizer.json"))
    assert ours_tok.encode(TEXT).ids == tok(TEXT)["input_ids"]
    ids = ours_tok.encode(TEXT).ids
    assert ours_tok.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------------------------------- embedded SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    return path, _transformers_gguf(path)


@pytest.mark.slow
def test_smollm2_equals_transformers_bit_for_bit(smollm2, smollm2_dense, tmp_path):
    path, reference = smollm2
    g = open_gguf(path)
    types = {g.tensor_type(n) for n in g.keys() if n.endswith("_proj.weight")}
    assert types == {"Q4_1"} and g.tensor_type("model.embed_tokens.weight") == "Q8_0"
    dst = smollm2_dense  # convert_gguf(path, ...) of the embedded file, shared with the other SmolLM2 tests
    assert sorted(p.name for p in dst.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    cfg = json.loads((dst / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    _assert_same_as_transformers(path, dst, reference, tmp_path)
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


# ------------------------------------------------------------------------------------- tiny GGUF files

def _vocab():
    specials = ["<|endoftext|>", "<|begin_of_text|>", "<|eot|>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ f", "o x", "Ġf ox"]
    merged = ["Ġt", "he", "Ġthe", "Ġa", "in", "Ġf", "ox", "Ġfox"]
    tokens = specials + byte_alphabet() + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def write_tiny_gguf(path: Path, arch: str = "llama", *, hidden=64, heads=4, kv_heads=2, inter=128, layers=2,
                    weight_type=Q.Q8_0, tied=False, pre="llama-bpe", add_bos=True, extra=None, drop=(),
                    metadata=(), tokenizer_model="gpt2", head_dim=None, seed=0) -> Path:
    """A small random GGUF causal LM written with gguf.GGUFWriter (projections in `weight_type`)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = _vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    hd = head_dim or hidden // heads
    if arch == "llama":
        w.add_rope_dimension_count(hd)
        w.add_vocab_size(vocab)
    if head_dim is not None:
        w.add_key_length(hd)
        w.add_value_length(hd)
    for add in metadata:  # extra metadata: callables on the writer
        add(w)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def mat(rows, cols):
        return (0.5 * rng.standard_normal((rows, cols))).astype(np.float32)

    tensors = {"token_embd.weight": (mat(vocab, hidden), Q.Q8_0), "output_norm.weight": (1 + mat(1, hidden)[0], Q.F32)}
    if not tied:
        tensors["output.weight"] = (mat(vocab, hidden), Q.F16)
    for i in range(layers):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": (1 + 0.1 * mat(1, hidden)[0], Q.F32),
            p + "ffn_norm.weight": (1 + 0.1 * mat(1, hidden)[0], Q.F32),
            p + "attn_q.weight": (mat(heads * hd, hidden), weight_type),
            p + "attn_k.weight": (mat(kv_heads * hd, hidden), weight_type),
            p + "attn_v.weight": (mat(kv_heads * hd, hidden), weight_type),
            p + "attn_output.weight": (mat(hidden, heads * hd), weight_type),
            p + "ffn_gate.weight": (mat(inter, hidden), weight_type),
            p + "ffn_up.weight": (mat(inter, hidden), weight_type),
            p + "ffn_down.weight": (mat(hidden, inter), weight_type),
        })
        if arch == "qwen2":
            for t, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"attn_{t}.bias"] = (mat(1, n * hd)[0], Q.F32)
        if arch == "qwen3":
            tensors[p + "attn_q_norm.weight"] = (1 + 0.1 * mat(1, hd)[0], Q.F32)
            tensors[p + "attn_k_norm.weight"] = (1 + 0.1 * mat(1, hd)[0], Q.F32)
    tensors.update(extra or {})
    for name in drop:
        tensors.pop(name)
    return write_tensors(w, tensors, path)


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_the_checked_header_reads_what_gguf_s_reader_reads(tmp_path, endian):
    """`open_gguf` reads the file through its checked header (`field_contents`, `gguf_tensors`), not gguf's
    GGUFReader: every metadata value of every type (scalars, strings, arrays of numbers, of strings, an empty one)
    equals `ReaderField.contents()` in value and Python type, and every tensor (plain and block types) has gguf's
    name, type, dimensions, data dtype, shape and bytes, in both byte orders."""
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "llama", endianess=gguf.GGUFEndian[endian])
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_float32("k.f32", 0.1)
    w.add_float64("k.f64", -1e300)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ✓")
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, -1.25])
    w.add_array("k.strs", ["a", "", "ünï", "Ġthe"])
    w.add_array("k.empty", [])
    rng = np.random.default_rng(0)
    q = gguf.GGMLQuantizationType
    write_tensors(w, {"a": (rng.standard_normal((4, 64)).astype(np.float32), q.F32),
                      "b": (rng.standard_normal((64,)).astype(np.float32), q.F16),
                      "c": (rng.standard_normal((3, 64)).astype(np.float32), q.Q8_0),
                      "d": (rng.standard_normal((2, 64)).astype(np.float32), q.Q4_0),
                      "e": (np.arange(6, dtype=np.int32).reshape(2, 3), q.I32)}, tmp_path / "f.gguf")
    path = tmp_path / "f.gguf"
    header = check_gguf_header(path)
    data = np.memmap(path, mode="r")
    reader = gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # the reader's own entries for the header
    assert keys == list(header.fields)
    for k in keys:
        want, got = reader.fields[k].contents(), field_contents(data, header, k)
        assert got == want and type(got) is type(want), (k, got, want)
        if isinstance(want, list):
            assert [type(x) for x in got] == [type(x) for x in want], k
    assert field_contents(data, header, "no.such.key") is None
    ours = gguf_tensors(data, header)
    assert [t.name for t in ours] == [t.name for t in reader.tensors] == list("abcde")
    for a, b in zip(reader.tensors, ours):
        assert b.tensor_type == a.tensor_type and b.shape.tolist() == a.shape.tolist(), a.name
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape, a.name
        assert b.data.tobytes() == a.data.tobytes(), a.name


@pytest.mark.parametrize("arch,weight_type,tied,pre,head_dim", [
    ("llama", Q.Q8_0, False, "llama-bpe", None),  # Q/K un-permuted, GQA (4 query / 2 KV heads), llama3 split
    ("llama", Q.Q4_1, True, "default", None),
    ("qwen2", Q.Q4_0, False, "qwen2", None),  # stored unpermuted; q/k/v biases
    ("qwen3", Q.Q5_1, True, "qwen2", 128),  # q/k norms; head_dim 128 (transformers assumes Qwen3's default)
])
def test_tiny_gguf_equals_transformers_bit_for_bit(tmp_path, arch, weight_type, tied, pre, head_dim):
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, weight_type=weight_type, tied=tied, pre=pre,
                           head_dim=head_dim)
    dst = convert_gguf(path, tmp_path / "out")
    _assert_same_as_transformers(path, dst, _transformers_gguf(path), tmp_path)


def test_llama_q_and_k_are_unpermuted(tmp_path):
    """llama.cpp interleaves each head's rotary halves; the HF weight has them contiguous again."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weight_type=Q.F32)
    with_raw = gguf.GGUFReader(path)
    raw = {t.name: np.asarray(t.data) for t in with_raw.tensors}
    g = open_gguf(path)
    for name, gguf_name, heads in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)):
        ours = g.get(f"model.layers.0.self_attn.{name}.weight")
        stored = raw[f"blk.0.{gguf_name}.weight"]
        hd = 16
        for h in range(heads):
            block = stored[h * hd:(h + 1) * hd]
            np.testing.assert_array_equal(ours[h * hd:h * hd + hd // 2], block[0::2])
            np.testing.assert_array_equal(ours[h * hd + hd // 2:(h + 1) * hd], block[1::2])
    np.testing.assert_array_equal(g.get("model.layers.0.self_attn.v_proj.weight"), raw["blk.0.attn_v.weight"])


def test_dtype_and_sharding(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    dst = convert_gguf(path, tmp_path / "bf16", dtype="bfloat16", max_shard_size="20KB")
    assert (dst / "model.safetensors.index.json").is_file()
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    g = open_gguf(path)
    with open_checkpoint(dst) as ck:
        for name in g.keys():
            want = torch.tensor(g.get(name)).to(torch.bfloat16).view(torch.int16).numpy()
            np.testing.assert_array_equal(np.asarray(ck.get(name)).view(np.int16), want, err_msg=name)


def test_existing_destination_is_refused_and_kept(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists"):
        convert_gguf(path, dst)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


# ------------------------------------------------------------------------------------- errors


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(CheckpointError, match=r"'phi3'.*llama, qwen2, qwen3"):
        open_gguf(path)
    assert sorted(SUPPORTED_ARCHITECTURES) == ["llama", "qwen2", "qwen3"]


def test_unsupported_tensor_type(tmp_path):
    path = write_tiny_gguf(tmp_path / "i32.gguf", extra={"blk.1.ffn_up.weight": (np.ones((128, 64)), Q.I32)})
    with pytest.raises(CheckpointError, match=r"'blk.1.ffn_up.weight'.*I32.*Q4_1"):
        open_gguf(path)
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= set(supported_tensor_types())
    assert "I32" not in supported_tensor_types()


def test_tensor_without_a_place_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "rope.gguf", extra={"rope_freqs.weight": (np.ones(8), Q.F32)})
    with pytest.raises(CheckpointError, match="'rope_freqs.weight'.*no place"):
        open_gguf(path)


def test_missing_tensor_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "missing.gguf", drop=["blk.1.ffn_down.weight"])
    with pytest.raises(CheckpointError, match=r"1 missing.*model.layers.1.mlp.down_proj.weight"):
        open_gguf(path)


def test_shape_that_does_not_fit_the_metadata(tmp_path):
    path = write_tiny_gguf(tmp_path / "shape.gguf",
                           extra={"blk.0.ffn_gate.weight": (np.ones((96, 64), np.float32), Q.F32)})
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_gate.weight'.*expected shape \[128, 64\].*\[96, 64\]"):
        open_gguf(path)


def test_rope_scaling_and_experts_are_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "yarn.gguf",
                           metadata=[lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)])
    with pytest.raises(CheckpointError, match="rope.scaling.type = 'yarn'"):
        open_gguf(path)
    path = write_tiny_gguf(tmp_path / "moe.gguf", metadata=[lambda w: w.add_expert_count(8)])
    with pytest.raises(CheckpointError, match="expert_count = 8: mixture-of-experts"):
        open_gguf(path)


def test_unsupported_tokenizer(tmp_path):
    path = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(CheckpointError, match="'llama'.*supported GGUF tokenizers: 'gpt2'"):
        open_gguf(path).tokenizer_files()
    convert_gguf(path, tmp_path / "ok", tokenizer=False)  # the model converts without it


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 3)
    with pytest.raises(CheckpointError, match="bad.gguf: expected a GGUF file"):
        open_gguf(bad)
    with pytest.raises(CheckpointError, match="no such file"):
        open_gguf(tmp_path / "none.gguf")
