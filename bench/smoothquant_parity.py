"""SmoothQuant parity: `qformats.algorithms.smoothquant` against llm-compressor 0.14's SmoothQuantModifier on the same model and tokens.

A small random llama (transformers, float32, a few outlier channels in its norms) is saved once; llm-compressor
runs `oneshot` with `SmoothQuantModifier(smoothing_strength=alpha)` alone (no quantization) and saves the smoothed
dense model; here the same tokens go through `qformats.models.decoder.calibration.smoothquant_transform` layer by layer on the
float model. Reported per smoothed tensor (norm weights, q/k/v/gate/up kernels): the largest relative difference.

    python bench/smoothquant_parity.py [--alpha 0.5] [--llmc-python /work/lcvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

THEIRS = r'''
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
src, dst, ids_file, alpha = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
oneshot(model=model, dataset=ds, recipe=SmoothQuantModifier(smoothing_strength=alpha), num_calibration_samples=len(ids),
        max_seq_length=max(len(x) for x in ids))
model.save_pretrained(dst)
'''


def save_outlier_llama(dst: Path, kv_heads: int) -> None:
    """A small random llama (2 layers, hidden 128, vocab 512, seed 0) whose norm weights are 1 + 0.1 N(0, 1) with
    3 outlier channels x15 each, saved by transformers to `dst` with SmolLM2's tokenizer files beside it (from the
    embedded GGUF): llm-compressor wants a tokenizer beside a model it is given a dataset for (ids are given here)."""
    import torch
    import transformers

    from converters.evaluation.embedded import smollm2_gguf
    from converters.formats.gguf_convert import open_gguf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, vocab_size=512, max_position_embeddings=128)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
                p[torch.randperm(p.numel())[:3]] *= 15.0
    hf.save_pretrained(dst)
    for name, content in open_gguf(smollm2_gguf()).tokenizer_files().items():
        (dst / name).write_text(content if isinstance(content, str) else json.dumps(content))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--llmc-python", default="/work/lcvenv/bin/python")
    a = ap.parse_args()
    import jax.numpy as jnp

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.formats.safetensors_io import open_checkpoint
    from qformats.models.decoder import attention_mask, inv_freq, rope_tables
    from qformats.models.decoder.calibration import smoothquant_transform

    work = Path(tempfile.mkdtemp(prefix="qformats-sq-"))
    save_outlier_llama(work / "src", kv_heads=2)
    ids = np.random.default_rng(0).integers(0, 512, (8, 64)).tolist()
    (work / "ids.json").write_text(json.dumps(ids))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([a.llmc_python, "-c", THEIRS, str(work / "src"), str(work / "theirs"), str(work / "ids.json"),
                        str(a.alpha)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])

    model, _, _ = load_causal_lm(work / "src", tokenizer=False)
    x = model.model.embed_tokens(jnp.asarray(ids))
    t = x.shape[1]
    pos = jnp.arange(t)
    cos, sin = rope_tables(pos, inv_freq(model.config))
    mask = attention_mask(pos, t, None)
    tf = smoothquant_transform(a.alpha)
    for i, layer in enumerate(model.model.layers):
        tf(layer, i, [x], [jnp.ones((x.shape[0], t), bool)], lambda _: (cos, sin, mask))
        x = layer(x, cos, sin, mask)[0]
    rows = []
    with open_checkpoint(work / "theirs") as ck:
        for i in range(len(model.model.layers)):
            lp = model.model.layers[i]
            pairs = {f"model.layers.{i}.input_layernorm.weight": lp.input_layernorm.weight.get_value(),
                     f"model.layers.{i}.post_attention_layernorm.weight": lp.post_attention_layernorm.weight.get_value()}
            for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                a_, b_ = p.split(".")
                pairs[f"model.layers.{i}.{p}.weight"] = getattr(getattr(lp, a_), b_).kernel.get_value().T
            for name, ours in pairs.items():
                theirs = np.asarray(ck.get(name), np.float32)
                rel = float(np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs)))
                rows.append((name, rel))
    print(f"## bench/smoothquant_parity.py — SmoothQuant alpha {a.alpha}, qformats vs llm-compressor 0.14 "
          "(small random llama, 8x64 tokens)\n")
    print("| tensor | max relative difference |\n| --- | --- |")
    for name, rel in rows:
        print(f"| {name} | {rel:.2e} |")


if __name__ == "__main__":
    sys.exit(main())
