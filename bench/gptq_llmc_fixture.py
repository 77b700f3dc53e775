"""Generates tests/qformats/models/decoder/data/gptq_llmc_tiny.npz: llm-compressor's GPTQ codes for a tiny decoder.

The tiny llama decoder (`tiny_llama` below: 2 layers, hidden 64, weights from numpy's default_rng(0)) is written as a
dense HF checkpoint; `--samples` variable-length token sequences (default_rng(1)) are its calibration set.
llm-compressor 0.14's `oneshot` (its venv, `--llmc-python`) runs GPTQModifier on it: W4A16 int4 symmetric groups of
32, block 128, dampening 0.01, actorder static (its defaults), lm_head ignored, `batch_size=1`, samples unshuffled
(its LengthAwareSampler: longest first). The fixture keeps, per projection, its int4 codes (two per byte) and
its group scales, plus the samples and a digest of the weights, so the test
(tests/qformats/models/decoder/test_decoder_gptq_llmc.py) runs our calibration on the same model and inputs
without llm-compressor and checks the codes agree.

    python bench/gptq_llmc_fixture.py [--llmc-python /work/oneshot/bin/python] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
          "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
GROUP = 32


def tiny_llama(seed: int = 0) -> dict:
    """HF tensor name -> float32 array of the tiny decoder: N(0, 1) rows scaled per input channel for the
    embedding (well-separated diag(H), so activation order is not decided by rounding), norms exp(N(0, 0.3)),
    projections N(0, 1) / sqrt(fan-in)."""
    c = CONFIG
    rng = np.random.default_rng(seed)
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd, nh, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    t = {"model.embed_tokens.weight": rng.standard_normal((v, d)) * np.exp(rng.standard_normal(d)),
         "model.norm.weight": np.exp(0.3 * rng.standard_normal(d)),
         "lm_head.weight": rng.standard_normal((v, d)) / np.sqrt(d)}
    shapes = {"self_attn.q_proj": (nh * hd, d), "self_attn.k_proj": (kv * hd, d), "self_attn.v_proj": (kv * hd, d),
              "self_attn.o_proj": (d, nh * hd), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
              "mlp.down_proj": (d, f)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.exp(0.3 * rng.standard_normal(d))
        t[p + "post_attention_layernorm.weight"] = np.exp(0.3 * rng.standard_normal(d))
        for name, shape in shapes.items():
            t[p + name + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return {k: np.asarray(a, np.float32) for k, a in t.items()}


def tiny_samples(n: int = 12, seed: int = 1) -> list:
    """n token sequences of lengths drawn from [3, 48), ids from [3, vocab)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, CONFIG["vocab_size"], int(rng.integers(3, 48))).astype(np.int32) for _ in range(n)]


def digest(tensors: dict) -> str:
    """sha256 over the tensors' names and float32 bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(np.ascontiguousarray(tensors[k], np.float32).tobytes())
    return h.hexdigest()


def write_checkpoint(dst: Path, tensors: dict) -> Path:
    """The tiny decoder as a dense HF directory (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


ONESHOT_PREAMBLE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from llmcompressor import oneshot
src, ids_file, out, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
# the ids are given; oneshot only asks for a processor to exist (a word-level one over the vocabulary)
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(
    model.config.vocab_size)}, unk_token="t0")), pad_token="t0")
"""
"""The start of every llm-compressor script of the fixture generators (run as text in llm-compressor's venv, whose
torch / transformers / llmcompressor this project does not import): argv is (checkpoint dir, ids json, output npz,
*args); it defines `args`, `out`, the calibration dataset `ds` (the given token ids, unpadded), the float32 `model`
and a word-level `tok` (oneshot needs a processor to exist; the ids are given)."""

W4_GROUP = r"""
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
group = int(args[0])
w4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                     strategy="group", group_size=group))
"""
"""After ONESHOT_PREAMBLE: `w4`, int4 symmetric groups of `group` (args[0]) for every Linear."""

GROUP_CODES = r"""
res = {}
for name, m in model.named_modules():
    if hasattr(m, "weight_scale"):
        w, s = m.weight.detach().float(), m.weight_scale.detach().float()
        codes = torch.round(w / s.repeat_interleave(group, dim=1)).to(torch.int8)
        assert torch.equal(codes.float() * s.repeat_interleave(group, dim=1), w), name  # on the grid
        res[name + ".codes"] = codes.numpy()
        res[name + ".scale"] = s.numpy()
print(sorted(res)[:6], len(res), file=sys.stderr)
np.savez(out, **res)
"""
"""After a GPTQ oneshot with W4_GROUP: every quantized module's codes = round(W / s) (asserted to reconstruct W
exactly: GPTQ leaves W on the grid) and group scales, saved to `out`."""

THEIRS = ONESHOT_PREAMBLE + W4_GROUP + r"""
from llmcompressor.modifiers.quantization import GPTQModifier
oneshot(model=model, processor=tok, dataset=ds, recipe=GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head"]),
        max_seq_length=512, num_calibration_samples=len(ids), shuffle_calibration_samples=False)
""" + GROUP_CODES


def run_oneshot(llmc_python: str, script: str, src: Path, samples: list, out: Path, *args) -> dict:
    """Run `script` (ONESHOT_PREAMBLE + ...) in llm-compressor's venv on checkpoint `src` with `samples` (token id
    arrays, written beside `out` as json) and the extra argv `args`; returns the arrays it saved to `out`."""
    ids = out.with_suffix(".ids.json")
    ids.write_text(json.dumps([s.tolist() for s in samples]))
    env = {**os.environ, "LOGURU_LEVEL": "WARNING",
           "PYTHONPATH": ""}  # bench/kernels.py must not shadow the `kernels` package transformers probes for
    subprocess.run([llmc_python, "-c", script, str(src), str(ids), str(out), *map(str, args)], check=True, env=env,
                   cwd=out.parent)
    return dict(np.load(out))


def pack(codes: np.ndarray) -> np.ndarray:
    """int4 codes in [-8, 7] -> uint8, two per byte (element 2i in the low nibble)."""
    u = (codes.astype(np.int16) & 0xF).astype(np.uint8).reshape(codes.shape[0], -1, 2)
    return u[..., 0] | (u[..., 1] << 4)


def unpack(packed: np.ndarray) -> np.ndarray:
    """The inverse of `pack`."""
    lo, hi = packed & 0xF, packed >> 4
    u = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1).astype(np.int8)
    return np.where(u >= 8, u - 16, u).astype(np.int8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "qformats" / "models" /
                                         "decoder" / "data" / "gptq_llmc_tiny.npz"))
    a = ap.parse_args()
    tensors = tiny_llama()
    samples = tiny_samples()
    with tempfile.TemporaryDirectory() as d:
        src = write_checkpoint(Path(d) / "tiny", tensors)
        theirs = run_oneshot(a.llmc_python, THEIRS, src, samples, Path(d) / "theirs.npz", GROUP)
    fixture = {"digest": np.array(digest(tensors)), "lengths": np.array([len(s) for s in samples]),
               "ids": np.concatenate(samples)}
    for name in (f"model.layers.{i}.{p}" for i in range(CONFIG["num_hidden_layers"]) for p in PROJ):
        fixture[name + ".codes"] = pack(theirs[name + ".codes"])
        fixture[name + ".scale"] = theirs[name + ".scale"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **fixture)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
