"""converters.formats.hf_fp8: HF fine-grained FP8 checkpoints (quant_method "fp8") read exactly as FP8-block QArrays,
run packed by the causal-LM loader, and refused by name where malformed or unsupported."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from converters.formats.hf_fp8 import not_converted, read_hf_fp8  # noqa: E402
from converters.formats.quantized import read_quantized  # noqa: E402
from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.nn import QLinear  # noqa: E402
from qformats.presets import presets  # noqa: E402
from qformats.qarray import QArray  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402
from qformats.schemes import SchemeSet  # noqa: E402

# hidden 256: q/k/v/gate/up have in = 2 whole blocks (their activations take the per-token-group-128 FP8 scheme);
# intermediate 80: gate/up have out = 80 (one partial block of rows), down_proj in = 80 (one partial block of
# columns: a weight-only group), o_proj / q_proj are 2 x 2 whole blocks, k / v 1 x 2.
TINY = dict(hidden_size=256, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
SKIP = ["lm_head", "model.layers.1.mlp.up_proj"]  # modules_to_not_convert: dense float32 weights
IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9)).astype(np.int64)


def _fp8_codes(rng, shape) -> np.ndarray:
    """Random e4m3fn codes (uint8, no NaN): normal values across the range, subnormals, and a few -0 / +0."""
    x = (rng.standard_normal(shape) * 40).astype(np.float32)
    x.flat[:3] = [0.0, -0.0, 2.0 ** -9]
    codes = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert not np.any((codes & 0x7F) == 0x7F)
    return codes


def write_fp8_llama(out: Path, *, block=(128, 128), seed=0, skip=SKIP, edit=None, qc_edit=None) -> Path:
    """A tiny llama in the HF fine-grained FP8 layout, written by hand as transformers reads it: every Linear of
    the decoder layers not in `skip` stores weight float8_e4m3fn [out, in] and weight_scale_inv float32
    [ceil(out / bm), ceil(in / bn)]; the rest float32. `edit(tensors)` / `qc_edit(qc)` corrupt it for tests."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = transformers.AutoConfig.for_model("llama", **TINY)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    tensors = {}
    bm, bn = block
    for name, p in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith("norm.weight"):
            p = 1 + 0.1 * torch.randn_like(p)
        if name.endswith(".weight") and p.ndim == 2 and ".layers." in name and not not_converted(mod, skip):
            n, k = p.shape
            tensors[name] = torch.from_numpy(_fp8_codes(rng, (n, k))).view(torch.float8_e4m3fn)
            s = rng.uniform(0.5, 1.5, size=(-(-n // bm), -(-k // bn))) * 2.0 ** -9
            tensors[f"{mod}.weight_scale_inv"] = torch.from_numpy(s.astype(np.float32))
        else:
            tensors[name] = p.detach().clone().contiguous()
    if edit is not None:
        edit(tensors)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    conf["dtype"] = "float32"
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
          "modules_to_not_convert": list(skip)}
    if qc_edit is not None:
        qc_edit(qc)
    conf["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_fp8_llama(tmp_path_factory.mktemp("fp8") / "llama")
