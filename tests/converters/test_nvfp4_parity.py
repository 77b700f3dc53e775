"""Read parity with transformers: `dense_weight` gives, bit for bit, the weights `from_pretrained(...,
quantization_config=CompressedTensorsConfig(dequantize=True))` loads, for every dtype the model is loaded in.

compressed-tensors' NVFP4 decompression computes `code * (scale / global_scale)` in float32 and rounds it to
bfloat16 once, whatever the model's dtype; transformers then casts to the model's dtype. The other formats
decompress in the scale's dtype (bfloat16 for MX), which the same rule covers.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import qformats as qf  # noqa: E402
from converters.ct_read import dense_weight, read_compressed  # noqa: E402
from converters.quantize_checkpoint import quantize_checkpoint  # noqa: E402

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
