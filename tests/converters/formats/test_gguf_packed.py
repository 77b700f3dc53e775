"""GGUF block types as packed QArrays: dequantize equals gguf's own numpy dequantization bit for bit, every type."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

gguf = pytest.importorskip("gguf")

from converters.formats.gguf_convert import unpermute_rope_rows  # noqa: E402
from converters.formats.gguf_packed import PACKED_TYPES, decode_blocks, gguf_qarray  # noqa: E402
from qformats import dequantize  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.packed_dot import packed_dot, packed_dot_supported  # noqa: E402

# the model's forward as one jitted program (eagerly, each operation of each layer compiles on its own)
_logits_of = nnx.jit(lambda m, x: m(x)[0])

EPS = float(np.finfo(np.float32).eps)

# byte ranges of each block's float16 fields (d, and dmin / m where the type has one), from gguf's readers
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "MXFP4": ()}


def _blocks(type_name, n, k, seed=0, finite=True):
    """Random bytes of a [n, k] tensor of `type_name`, built by hand after gguf's reader: every bit pattern of the
    packed codes and sub-block scales, and the float16 super-scales random finite values of both signs over the
    whole exponent range, subnormals included (`finite=False`: any bit pattern, inf and NaN included)."""
    qt = gguf.GGMLQuantizationType[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // block, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":  # the E8M0 exponent byte: codes 2 .. 254 (module docstring of gguf_packed)
        raw[:, 0] = rng.integers(2, 255, raw.shape[0], dtype=np.uint8)
    if finite:
        for at in F16_FIELDS[type_name]:
            bits = rng.integers(0, 1 << 16, raw.shape[0], dtype=np.uint16)
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)  # no inf / NaN
            raw[:, at:at + 2] = bits.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def _quantized(type_name, n, k, seed=0):
    """gguf's own quantize of random rows where gguf has one (else None)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(1e-3, 4, (n, 1))).astype(np.float32)
    try:
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        return None


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_every_packed_type_is_in_gguf():
    for t in PACKED_TYPES:
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] == PACKED_TYPES[t][0]


@pytest.mark.parametrize("type_name", list(PACKED_TYPES))
def test_dequantize_equals_gguf_bit_for_bit(type_name):
    block = PACKED_TYPES[type_name][0]
    n, k = 5, 3 * block
    cases = [_blocks(type_name, n, k, seed=1)]
    written = _quantized(type_name, n, k, seed=2)
    if written is not None:
        cases.append(written)
    for raw in cases:
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, k)
        q = gguf_qarray(raw, type_name, (n, k), f"t.{type_name}")
        assert q.shape == (k, n) and q.axis == 0 and q.scheme.group_size == PACKED_TYPES[type_name][2]
        assert q.scheme.format.name == PACKED_TYPES[type_name][1]
        assert (q.offset is not None) == (type_name in ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"))
        ours = np.asarray(dequantize(q)).T
        assert np.isfinite(ref).all()
        np.testing.assert_array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_non_finite_scales_propagate_as_gguf(type_name):
    block = PACKED_TYPES[type_name][0]
    raw = _blocks(type_name, 7, 2 * block, seed=3, finite=False)
    for at in F16_FIELDS[type_name]:  # some inf and NaN super-scales
        raw.reshape(-1, raw.shape[1] // 2)[:3, at:at + 2] = np.array([0x7C00, 0xFC00, 0x7E00], np.uint16).view(
            np.uint8).reshape(3, 2)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(7, -1)
    ours = np.asarray(dequantize(gguf_qarray(raw, type_name, (7, 2 * block), "t"))).T
    np.testing.assert_array_equal(ours, ref)  # NaN where gguf has NaN, every other value equal


def test_scale_products_are_exact_in_float32():
    """d * sc and dmin * m (float16 times an integer of <= 8 bits) are exact in float32: the float64 product
    rounds to the same value, for every float16 d and every 6-bit / int8 sub-scale."""
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    d = d[np.isfinite(d)].astype(np.float32)
    for sc in (np.arange(64), np.arange(-128, 128)):
        prod32 = d[:, None] * sc[None, :].astype(np.float32)
        prod64 = d[:, None].astype(np.float64) * sc[None, :]
        assert np.array_equal(prod32.astype(np.float64), prod64)


def test_q4_0_codes_are_the_files_nibbles():
    """Q4_0's int4 code u = q + 8 is the stored nibble; only their order changes (element j of a block and
    element 16 + j share a byte in GGUF, elements 2i and 2i + 1 in qformats)."""
    raw = _blocks("Q4_0", 2, 64)
    u, s, o = decode_blocks(raw, "Q4_0", (2, 64), "t")
    blocks = raw.reshape(-1, 18)[:, 2:]
    np.testing.assert_array_equal(u.reshape(-1, 32)[:, :16], blocks & 15)
    np.testing.assert_array_equal(u.reshape(-1, 32)[:, 16:], blocks >> 4)
    assert o is None and s.shape == (2, 2)


def test_rows_permutation_commutes_with_dequantize():
    raw = _blocks("Q4_K", 8, 256, seed=4)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(8, 256)
    q = gguf_qarray(raw, "Q4_K", (8, 256), "t", rows=lambda a: unpermute_rope_rows(a, 2))
    np.testing.assert_array_equal(_bits(np.asarray(dequantize(q)).T), _bits(unpermute_rope_rows(ref, 2)))


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "TQ1_0", "NVFP4", "F32"])
def test_other_types_refused_naming_tensor_and_type(type_name):
    qt = gguf.GGMLQuantizationType[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((2, 2 * nbytes), np.uint8)
    with pytest.raises(CheckpointError, match=rf"blk\.0\.attn_q\.weight: GGML type {type_name} is not packed.*Q4_K"):
        gguf_qarray(raw, type_name, (2, 2 * block), "blk.0.attn_q.weight")


@pytest.mark.parametrize("e", [255, 0, 1])
def test_mxfp4_exponents_outside_ocp_refused(e):
    raw = _blocks("MXFP4", 2, 64)
    raw.reshape(-1, 17)[1, 0] = e
    with pytest.raises(CheckpointError, match=rf"w: MXFP4: 1 block scale\(s\) with exponent code {e}"):
        gguf_qarray(raw, "MXFP4", (2, 64), "w")


def test_wrong_byte_count_refused():
    with pytest.raises(CheckpointError, match=r"w: Q8_0 \[2, 64\]: expected 4 blocks of 34 bytes"):
        gguf_qarray(np.zeros(100, np.uint8), "Q8_0", (2, 64), "w")


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q8_0", "Q2_K", "MXFP4", "IQ4_NL", "IQ4_XS"])
def test_packed_dot_with_offset(type_name):
    """The fused GEMV honours the offset: one-hot activations read back each weight row bit for bit; random ones
    equal dequantize-then-dot within float32 accumulation order."""
    block = PACKED_TYPES[type_name][0]
    k, n = 2 * block if block == 256 else 8 * block, 48
    raw = _blocks(type_name, n, k, seed=5)
    if type_name == "MXFP4":  # exponents whose weights stay finite (0 * inf in a one-hot sum would be NaN)
        raw.reshape(-1, 17)[:, 0] = np.random.default_rng(7).integers(110, 140, raw.size // 17, dtype=np.uint8)
    q = gguf_qarray(raw, type_name, (n, k), "t")
    supported = packed_dot_supported((1, k), q)
    assert supported == (q.scheme.bits in (4, 8))
    if not supported:
        return
    w = np.asarray(dequantize(q))
    f = jax.jit(packed_dot)
    for i in (0, 1, k // 2 + 3, k - 1):
        x = jnp.zeros((1, k), jnp.float32).at[0, i].set(1.0)
        np.testing.assert_array_equal(f(x, q)[0], w[i])  # values (a sum of zeros makes -0 +0)
    x = np.random.default_rng(6).standard_normal((1, k)).astype(np.float32)
    y = np.asarray(f(jnp.asarray(x), q), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = 2 * k * EPS * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)))
    assert np.all(np.abs(y - exact) <= bound)


# bits per weight: (the file's, the packed QArray's). The block's float16 d (and m) are kept as stored; the
# super-block types hold float32 per-group products d * sc, -(dmin * m) (gguf_packed's module docstring: "Storage")
BITS_PER_WEIGHT = {"Q4_0": (4.5, 4.5), "Q5_0": (5.5, 5.5), "Q8_0": (8.5, 8.5), "Q4_1": (5.0, 5.0), "Q5_1": (6.0, 6.0),
                   "IQ4_NL": (4.5, 4.5), "MXFP4": (4.25, 4.25), "IQ4_XS": (4.25, 5.0), "Q2_K": (2.625, 6.0),
                   "Q3_K": (3.4375, 5.0), "Q4_K": (4.5, 6.0), "Q5_K": (5.5, 7.0), "Q6_K": (6.5625, 8.0)}


def test_bits_per_weight_every_type():
    assert set(BITS_PER_WEIGHT) == set(PACKED_TYPES)
    for type_name, (file_bits, ours) in BITS_PER_WEIGHT.items():
        n, k = 4, 2 * 256
        raw = _blocks(type_name, n, k, seed=8)
        q = gguf_qarray(raw, type_name, (n, k), "t")
        assert (8 * raw.size / (n * k), 8 * q.nbytes / (n * k)) == (file_bits, ours), type_name


def test_iq4_codes_are_the_files_indices():
    """IQ4_NL keeps the file's 4-bit table indices (as Q4_0 its nibbles, reordered within a byte pair) under the table
    format IQ4_NL, two codes per byte."""
    from qformats.formats import IQ4_NL

    raw = _blocks("IQ4_NL", 2, 64)
    q = gguf_qarray(raw, "IQ4_NL", (2, 64), "t")
    assert q.scheme.format is IQ4_NL and q.codes.dtype == jnp.uint8 and q.codes.shape == (2, 32)
    blocks = raw.reshape(-1, 18)[:, 2:]
    u = np.asarray(q.element_codes()).reshape(-1, 32)
    np.testing.assert_array_equal(u[:, :16], blocks & 15)
    np.testing.assert_array_equal(u[:, 16:], blocks >> 4)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "IQ4_NL"])
def test_stored_bits_per_weight(type_name):
    """The block's float16 d (and m) are kept float16, computed in float32: the QArray holds exactly the file's
    bytes per block (Q4_1: 20 bytes per 32 weights, 5 bits; Q8_0: 8.5), and still decodes as gguf does."""
    block = PACKED_TYPES[type_name][0]
    n, k = 3, 4 * block
    raw = _blocks(type_name, n, k, seed=4)
    q = gguf_qarray(raw, type_name, (n, k), "t")
    assert q.scale.dtype == jnp.float16 and q.compute_dtype == jnp.float32 and q.work_dtype == jnp.float32
    assert q.offset is None or q.offset.dtype == jnp.float16
    assert q.nbytes == raw.size
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, k)
    np.testing.assert_array_equal(_bits(np.asarray(dequantize(q)).T), _bits(ref))
    back = jax.tree.unflatten(*reversed(jax.tree.flatten(q)))  # compute_dtype travels as static aux data
    assert back.compute_dtype == jnp.float32 and back.replace(offset=q.offset).work_dtype == jnp.float32


def test_compressed_tensors_writer_refuses_a_compute_dtype_apart_from_the_scale():
    """A Q8_0 QArray (float16 d, float32 compute) written as is would decompress in float16 in compressed-tensors:
    refused, naming the tensor; the convert path (gguf_ct_qarray) widens the scale to float32 and is exact."""
    from converters.formats.compressed_tensors.write import qarray_to_tensors
    from converters.pipelines.convert_quantized import gguf_ct_qarray

    q = gguf_qarray(_blocks("Q8_0", 2, 64, seed=5), "Q8_0", (2, 64), "t")
    with pytest.raises(CheckpointError, match="blk.0.weight: .*computes in float32"):
        qarray_to_tensors(q, "pack-quantized", "blk.0.weight")
    ct = gguf_ct_qarray(q)
    assert ct.scale.dtype == jnp.float32 and ct.compute_dtype is None
    np.testing.assert_array_equal(_bits(dequantize(ct)), _bits(dequantize(q)))
    assert "weight_packed" in qarray_to_tensors(ct, "pack-quantized", "blk.0.weight")


def test_compressed_tensors_writer_refuses_a_table_and_convert_writes_its_values_as_int8():
    """compressed-tensors has no table format: an IQ4_NL QArray written as is is refused, naming the tensor; the
    convert path writes the table's values as int8 codes under the same scales, equal bit for bit."""
    from converters.formats.compressed_tensors.write import qarray_to_tensors
    from converters.pipelines.convert_quantized import gguf_ct_qarray

    q = gguf_qarray(_blocks("IQ4_XS", 2, 256, seed=5), "IQ4_XS", (2, 256), "t")
    with pytest.raises(CheckpointError, match="blk.0.weight: .*iq4_nl table indices"):
        qarray_to_tensors(q, "pack-quantized", "blk.0.weight")
    ct = gguf_ct_qarray(q)
    assert ct.scheme.format.name == "int8" and ct.codes.dtype == jnp.int8
    np.testing.assert_array_equal(_bits(dequantize(ct)), _bits(dequantize(q)))
    assert "weight_packed" in qarray_to_tensors(ct, "pack-quantized", "blk.0.weight")


@pytest.mark.slow  # two model compiles
def test_iq4_model_runs_packed_with_logits_of_the_dequantized_run(tmp_path):
    """A tiny llama GGUF whose projections are IQ4_NL / IQ4_XS (gguf.GGUFWriter, random blocks: gguf has no IQ4
    quantizer) loads with 4-bit table QLinears whose kernels equal the dense load's bit for bit, and its logits for one
    token (the fused packed GEMV) equal the dense model's up to float32 accumulation order."""
    import sys
    from pathlib import Path

    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.formats import IQ4_NL
    from qformats.nn import QLinear

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    from gguf_mixed import mixed_gguf

    types = {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS",
             "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_NL"}
    src = mixed_gguf(tmp_path / "iq4.gguf", types, hidden=256, heads=4, kv_heads=2, inter=256, layers=1)
    packed, _, _ = load_causal_lm(src, tokenizer=False)
    dense, _, _ = load_causal_lm(src, tokenizer=False, packed=False)
    mods = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(packed) if isinstance(m, QLinear)}
    dmods = dict((("/".join(map(str, p))), m) for p, m in nnx.iter_modules(dense))
    assert len(mods) >= 6
    for name, m in mods.items():
        q = m.kernel.get_value()
        assert q.scheme.format is IQ4_NL and q.scheme.bits == 4
        np.testing.assert_array_equal(_bits(dequantize(q)), _bits(dmods[name].kernel.get_value()))
    x = jnp.asarray([[5]], jnp.int32)
    ours, theirs = (np.asarray(_logits_of(model, x)) for model in (packed, dense))
    assert np.abs(ours - theirs).max() <= 2e-5 * np.abs(theirs).max()
