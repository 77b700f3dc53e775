"""converters.formats.gptq_awq: AutoGPTQ / GPTQModel and AutoAWQ GEMM checkpoints, built by hand (random codes, zero
points and fp16 scales in a tiny llama), read bit for bit equal to the torch side's dequantization.

Oracles: AWQ -- compressed-tensors 0.20's AutoAWQConverter (entrypoints/convert/converters/autoawq.py) run on the
same tensors, its output decompressed by compressed-tensors (ct_oracle.decompress_dir). GPTQ -- no GPTQ library is
installed (transformers 5 delegates to gptqmodel / optimum), so the reference is AutoGPTQ's own torch dequantization
(`auto_gptq.nn_modules.qlinear.qlinear_cuda_old`, as its `qlinear_cuda_old_converter` / `gptq_unpack` copies read:
shift by wf, `(zeros + 1) & (2^b - 1)`, the 3-bit three-word layout, `scales[g_idx] * (weight - zeros[g_idx])`),
ported below; GPTQModel's v2 format is the same without the `+ 1`. The checkpoints are packed by a port of
AutoGPTQ's `QuantLinear.pack` loops (`qweight[row] |= intweight[j] << (bits * (j - i))`, the 3-bit branch) and
AutoAWQ's `WQLinear_GEMM.from_linear` (order_map [0, 2, 4, 6, 1, 3, 5, 7]).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import ct_oracle as O  # noqa: E402
from converters.formats.compressed_tensors.read import read_compressed  # noqa: E402
from converters.formats.gptq_awq import read_awq, read_gptq  # noqa: E402
from converters.formats.quantized import read_quantized  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.nn import QLinear  # noqa: E402
from qformats.qarray import QArray  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

# the model's forward as one jitted program (eagerly, each operation of each layer compiles on its own)
_logits_of = nnx.jit(lambda m, x: m(x)[0])

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=384, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
GS = 32
IDS = np.random.default_rng(0).integers(0, 384, size=(2, 9)).astype(np.int64)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", **TINY)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(out)
    return out


# ---- AutoGPTQ packing and dequantization (ported) --------------------------------------------------------------
def _pack_rows(intw: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ QuantLinear.pack: intweight [R, C] (unsigned codes) -> int32 [R * bits / 32, C], packed along R."""
    intw = intw.astype(np.uint32)
    q = np.zeros((intw.shape[0] * bits // 32, intw.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < q.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                q[row] |= intw[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        else:  # 3 bits: 32 values in three words
            for j in range(i, i + 10):
                q[row] |= intw[j] << (3 * (j - i))
            i += 10
            q[row] |= intw[i] << 30
            row += 1
            q[row] |= (intw[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                q[row] |= intw[j] << (3 * (j - i) + 1)
            i += 10
            q[row] |= intw[i] << 31
            row += 1
            q[row] |= (intw[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                q[row] |= intw[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    return q.view(np.int32)


_WF3 = [[0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0], [0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31],
        [0, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0]]


def _unpack3(words: "torch.Tensor") -> "torch.Tensor":
    """AutoGPTQ's 3-bit unpacking along dim 0: [R, C] words -> [R * 32 / 3, C]."""
    w = words.reshape(words.shape[0] // 3, 3, 1, words.shape[1]).expand(-1, -1, 12, -1)
    w = (w >> torch.tensor(_WF3, dtype=torch.int32).unsqueeze(-1)) & 0x7
    w[:, 0, 10] = (w[:, 0, 10] & 0x3) | ((w[:, 1, 0] << 2) & 0x4)
    w[:, 1, 11] = (w[:, 1, 11] & 0x1) | ((w[:, 2, 0] << 1) & 0x6)
    w = w & 0x7
    return torch.cat([w[:, 0, :11], w[:, 1, 1:12], w[:, 2, 1:11]], dim=1).reshape(-1, words.shape[1])


def gptq_reference(qweight, qzeros, scales, g_idx, bits: int, v2: bool) -> np.ndarray:
    """AutoGPTQ's torch dequantization (qlinear_cuda_old) of one layer: the Linear weight transposed, [K, N]."""
    qweight, qzeros, scales = (torch.from_numpy(np.asarray(a)) for a in (qweight, qzeros, scales))
    if bits in (2, 4, 8):
        wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
        zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)
                                          ).to(torch.int16 if bits == 8 else torch.int8)
        zeros = zeros + (0 if v2 else 1)
        zeros = torch.bitwise_and(zeros, (2 ** bits) - 1).reshape(zeros.shape[0], -1)
        weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)
                                           ).to(torch.int16 if bits == 8 else torch.int8)
        weight = torch.bitwise_and(weight, (2 ** bits) - 1).reshape(-1, weight.shape[2])
    else:
        zeros = _unpack3(qzeros.T.contiguous()).T + (0 if v2 else 1)
        weight = _unpack3(qweight)
    g = torch.from_numpy(np.asarray(g_idx)).long()
    return (scales[g] * (weight - zeros[g]).to(scales.dtype)).numpy()


def _write(path: Path, dense_dir: Path, qc: dict, layer_tensors) -> None:
    path.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(dense_dir / "model.safetensors"))
    for m, t in layer_tensors.items():
        del sd[m + ".weight"]
        sd.update({f"{m}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()})
    save_file(sd, str(path / "model.safetensors"))
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))


def _linears(dense_dir: Path):
    sd = load_file(str(dense_dir / "model.safetensors"))
    return {f"model.layers.{i}.{p}": tuple(sd[f"model.layers.{i}.{p}.weight"].shape)
            for i in range(TINY["num_hidden_layers"]) for p in PROJ}


def make_gptq(path: Path, dense_dir: Path, bits=4, v2=False, permute=False, seed=0, gs=GS):
    """A GPTQ checkpoint of random codes / zeros / scales; returns module -> reference weight [K, N]."""
    rng = np.random.default_rng(seed)
    tensors, ref = {}, {}
    for m, (n, k) in _linears(dense_dir).items():
        g = (k // gs) if gs != -1 else 1
        q = rng.integers(0, 2 ** bits, (k, n))
        z = rng.integers(1 if not v2 else 0, 2 ** bits, (g, n))  # v1 stores z - 1 (z = 0 is its wrap case)
        s = (rng.random((g, n)) * 0.02 + 0.001).astype(np.float16)
        g_idx = np.arange(k) // (gs if gs != -1 else k)
        if permute:
            g_idx = rng.permutation(g_idx)
        t = {"qweight": _pack_rows(q, bits), "qzeros": _pack_rows((z - (0 if v2 else 1)).T, bits).T,
             "scales": s, "g_idx": g_idx.astype(np.int32)}
        tensors[m] = t
        ref[m] = gptq_reference(t["qweight"], t["qzeros"], s, g_idx, bits, v2)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": gs, "desc_act": permute, "sym": False,
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    _write(path, dense_dir, qc, tensors)
    return ref, tensors


@pytest.mark.parametrize("bits,v2", [(4, False), (4, True), (2, False), (3, False), (8, False), (8, True)])
def test_gptq_identity_g_idx_reads_packed_bit_exact(tmp_path, dense_dir, bits, v2):
    ref, _ = make_gptq(tmp_path / "ck", dense_dir, bits, v2)
    cm = read_quantized(tmp_path / "ck")
    assert cm.quant.groups[0].weights.bits == bits and not cm.quant.groups[0].weights.symmetric
    assert sorted(cm.quant.groups[0].targets) == sorted(ref)
    for m, want in ref.items():
        q = cm.modules[m]["weight"]
        assert isinstance(q, QArray) and q.shape == want.shape and q.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(dequantize(q, q.dtype)).view(np.int16), want.view(np.int16))
    assert "model.embed_tokens" in cm.modules and cm.formats[m] == "pack-quantized"


def test_gptq_channel_group_size(tmp_path, dense_dir):
    ref, _ = make_gptq(tmp_path / "ck", dense_dir, 4, gs=-1)
    cm = read_gptq(tmp_path / "ck")
    assert cm.quant.groups[0].weights.strategy == "channel"
    for m, want in ref.items():
        q = cm.modules[m]["weight"]
        np.testing.assert_array_equal(np.asarray(dequantize(q, q.dtype)).view(np.int16), want.view(np.int16))


def test_gptq_v1_stored_all_ones_is_zero_point_zero(tmp_path, dense_dir):
    """AutoGPTQ's (stored + 1) & (2^b - 1): a stored 15 (the z - 1 of z = 0) reads as zero point 0."""
    ref, t = make_gptq(tmp_path / "ck", dense_dir, 4)
    m = next(iter(t))
    t[m]["qzeros"] = np.full_like(t[m]["qzeros"], -1)  # every nibble 15
    _write(tmp_path / "ck2", dense_dir, json.loads((tmp_path / "ck" / "config.json").read_text())
           ["quantization_config"], t)
    q = read_gptq(tmp_path / "ck2").modules[m]["weight"]
    want = gptq_reference(t[m]["qweight"], t[m]["qzeros"], t[m]["scales"], t[m]["g_idx"], 4, False)
    np.testing.assert_array_equal(np.asarray(q.zero_point), -8)
    np.testing.assert_array_equal(np.asarray(dequantize(q, q.dtype)).view(np.int16), want.view(np.int16))


def test_gptq_without_g_idx_reads_the_same(tmp_path, dense_dir):
    ref, _ = make_gptq(tmp_path / "ck", dense_dir, 4)
    _edit(tmp_path / "ck", tensor_edit=lambda sd: [sd.pop(k) for k in list(sd) if k.endswith(".g_idx")])
    cm = read_gptq(tmp_path / "ck")
    for m, want in ref.items():
        q = cm.modules[m]["weight"]
        np.testing.assert_array_equal(np.asarray(dequantize(q, q.dtype)).view(np.int16), want.view(np.int16))


@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_permuted_g_idx_reads_dense_by_the_formula(tmp_path, dense_dir, bits):
    ref, _ = make_gptq(tmp_path / "ck", dense_dir, bits, permute=True)
    with pytest.warns(UserWarning, match="activation-ordered groups"):
        cm = read_gptq(tmp_path / "ck")
    for m, want in ref.items():
        w = cm.modules[m]["weight"]
        assert not isinstance(w, QArray) and w.dtype == np.float16 and w.shape == want.T.shape
        np.testing.assert_array_equal(w.view(np.int16), want.T.view(np.int16))


# ---- AutoAWQ ----------------------------------------------------------------------------------------------------
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def _awq_pack(intw: np.ndarray) -> np.ndarray:
    """AutoAWQ WQLinear_GEMM.from_linear: [R, C] codes -> int32 [R, C / 8], packed along C in order_map order."""
    intw = intw.astype(np.uint32)
    q = np.zeros((intw.shape[0], intw.shape[1] // 8), dtype=np.uint32)
    for col in range(q.shape[1]):
        for i in range(8):
            q[:, col] |= intw[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
    return q.view(np.int32)


def make_awq(path: Path, dense_dir: Path, zero_point=True, seed=1):
    rng = np.random.default_rng(seed)
    tensors = {}
    for m, (n, k) in _linears(dense_dir).items():
        g = k // GS
        t = {"qweight": _awq_pack(rng.integers(0, 16, (k, n))),
             "scales": (rng.random((g, n)) * 0.02 + 0.001).astype(np.float16)}
        if zero_point:
            t["qzeros"] = _awq_pack(rng.integers(0, 16, (g, n)))
        tensors[m] = t
    qc = {"quant_method": "awq", "bits": 4, "group_size": GS, "zero_point": zero_point, "version": "gemm",
          "modules_to_not_convert": None}
    _write(path, dense_dir, qc, tensors)
    return qc, tensors


def _awq_oracle(tmp_path: Path, qc: dict, tensors) -> dict:
    """compressed-tensors' AutoAWQ converter on the tensors, decompressed by compressed-tensors: module -> [N, K]."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    conv = AutoAWQConverter.from_autoawq_config(qc)
    flat = {f"{m}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for m, t in tensors.items() for k, v in t.items()}
    conv.validate(dict(flat))
    out = tmp_path / "ct"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in conv.process(flat).items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"quantization_config": conv.update_config(None).model_dump()}))
    return O.decompress_dir(out)


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_reads_packed_equal_to_compressed_tensors_converter(tmp_path, dense_dir, zero_point):
    qc, tensors = make_awq(tmp_path / "ck", dense_dir, zero_point)
    want = _awq_oracle(tmp_path, qc, tensors)
    cm = read_quantized(tmp_path / "ck")
    assert cm.quant.groups[0].weights.symmetric == (not zero_point)
    assert set(want) == set(tensors)
    with warnings.catch_warnings():  # its ignore list names lm_head, which this checkpoint keeps dense
        warnings.filterwarnings("ignore", message=".*ignore entry 'lm_head' matches no module")
        ct = read_compressed(tmp_path / "ct")  # the converter's checkpoint, read by our compressed-tensors reader
    for m, w in want.items():
        q = cm.modules[m]["weight"]
        assert isinstance(q, QArray) and q.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(dequantize(q, q.dtype)).T.view(np.int16), O.bits_of(w))
        c = ct.modules[m]["weight"]  # the same QArray, leaf for leaf
        assert (q.shape, q.dtype, q.axis, q.scheme) == (c.shape, c.dtype, c.axis, c.scheme)
        for a, b in ((q.codes, c.codes), (q.scale, c.scale), (q.zero_point, c.zero_point)):
            assert (a is None) == (b is None)
            if a is not None:
                assert np.asarray(a).dtype == np.asarray(b).dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the model loads and runs ---------------------------------------------------------------------------------
def _reference_logits(dense_dir: Path, weights) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    sd = model.state_dict()
    with torch.no_grad():
        for m, w in weights.items():
            sd[m + ".weight"].copy_(torch.from_numpy(np.asarray(w, np.float32)))
        return model(torch.from_numpy(IDS)).logits.numpy()


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_load_causal_lm_runs_packed(tmp_path, dense_dir, kind):
    if kind == "gptq":
        ref, _ = make_gptq(tmp_path / "ck", dense_dir, 4)
        want = {m: w.T for m, w in ref.items()}
    else:
        qc, tensors = make_awq(tmp_path / "ck", dense_dir)
        want = {m: w.numpy() for m, w in _awq_oracle(tmp_path, qc, tensors).items()}
    model, _, _ = load_causal_lm(tmp_path / "ck", tokenizer=False)
    assert sum(isinstance(mod, QLinear) for _, mod in nnx.iter_graph(model)) == len(want) == 14
    logits = _logits_of(model, jnp.asarray(IDS, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), _reference_logits(dense_dir, want), atol=1e-4, rtol=1e-4)


# ---- malformed / unsupported ----------------------------------------------------------------------------------
def _edit(path: Path, qc_update=None, tensor_edit=None):
    if qc_update:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(qc_update)
        (path / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        sd = load_file(str(path / "model.safetensors"))
        tensor_edit(sd)
        save_file(sd, str(path / "model.safetensors"))


M0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("qc_update,tensor_edit,match", [
    ({"bits": 5}, None, r"bits 5 is not supported.*\[2, 3, 4, 8\]"),
    ({"checkpoint_format": "marlin"}, None, r"'marlin' is not supported.*gptq_v2"),
    ({"is_marlin_format": True}, None, r"marlin"),
    ({"group_size": 0}, None, r"group_size 0"),
    ({"group_size": 48}, None, r"not a multiple of group_size 48"),
    ({"dynamic": {"re:.*": {"bits": 8}}}, None, r"dynamic"),
    ({"pack_dtype": "int16"}, None, r"pack_dtype"),
    (None, lambda sd: sd.pop(M0 + ".qzeros"), r"q_proj\.qzeros.*found none"),
    (None, lambda sd: sd.pop(M0 + ".qweight"), r"q_proj.*holds.*qzeros.*but no.*qweight"),
    (None, lambda sd: sd.__setitem__(M0 + ".scales", sd[M0 + ".scales"][:1].contiguous()), r"q_proj\.scales.*shape"),
    (None, lambda sd: sd.__setitem__(M0 + ".qweight", sd[M0 + ".qweight"].float()), r"q_proj\.qweight.*int32"),
    (None, lambda sd: sd.__setitem__(M0 + ".g_idx", sd[M0 + ".g_idx"] + 7), r"q_proj\.g_idx.*values in \[0, 3\]"),
    (None, lambda sd: sd.__setitem__(M0 + ".weight", torch.zeros(4)), r"q_proj.*dense weight"),
    (None, lambda sd: sd.__setitem__(M0 + ".foo", torch.zeros(4)), r"q_proj.*\['foo'\]"),
])
def test_gptq_malformed_is_a_typed_error(tmp_path, dense_dir, qc_update, tensor_edit, match):
    make_gptq(tmp_path / "ck", dense_dir, 4)
    _edit(tmp_path / "ck", qc_update, tensor_edit)
    with pytest.raises(CheckpointError, match=match):
        read_quantized(tmp_path / "ck")


@pytest.mark.parametrize("qc_update,tensor_edit,match", [
    ({"version": "gemv"}, None, r"version 'gemv' is not supported; expected 'gemm'"),
    ({"version": "exllama"}, None, r"'exllama'"),
    ({"bits": 8}, None, r"bits 8 is not supported.*\[4\]"),
    ({"zero_point": False}, None, r"qzeros.*zero_point is false"),
    (None, lambda sd: sd.pop(M0 + ".scales"), r"q_proj\.scales.*found none"),
    (None, lambda sd: sd.__setitem__(M0 + ".qzeros", sd[M0 + ".qzeros"][:, :2].contiguous()), r"q_proj\.qzeros.*sh"),
])
def test_awq_malformed_is_a_typed_error(tmp_path, dense_dir, qc_update, tensor_edit, match):
    make_awq(tmp_path / "ck", dense_dir)
    _edit(tmp_path / "ck", qc_update, tensor_edit)
    with pytest.raises(CheckpointError, match=match):
        read_awq(tmp_path / "ck")


def test_no_qweight_is_an_error(tmp_path, dense_dir):
    (tmp_path / "ck").mkdir()
    _write(tmp_path / "ck", dense_dir, {"quant_method": "gptq", "bits": 4, "group_size": GS}, {})
    with pytest.raises(CheckpointError, match=r"no tensor named '\*\.qweight'"):
        read_quantized(tmp_path / "ck")
