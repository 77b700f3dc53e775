"""Byte-for-byte comparison of `qformats quantize` with llm-compressor's real `oneshot` on the same weights.

  python bench/oneshot_parity.py --oneshot-python VENV/bin/python [--models llama,qwen3_moe,mixtral,qwen2_moe,gpt_oss]
                                 [--layers 1] [--schemes ...] [--moe-size tiny|bench]

llm-compressor pins compressed-tensors 0.19, so it lives in a separate venv (`pip install torch==2.13.0
llmcompressor`); this script runs it there in a subprocess (`QuantizationModifier(targets="Linear", scheme=S,
ignore=["lm_head"])`, its default data-free plan) and `qformats quantize SRC DST --scheme S` here, each in a fresh
process measured with os.wait4 (wall time, peak RSS), and compares every tensor of the two outputs (names,
dtypes, shapes, bytes) and the config's `ignore` list. Models:
  - llama: a TinyLlama-shaped random bf16 checkpoint (bench/checkpoint.py's builder, --layers layers);
  - qwen3_moe, mixtral, qwen2_moe, gpt_oss: random bf16 models built by transformers (`from_config`, weights
    N(0, 0.05)) and written with `save_pretrained` (per-expert on-disk names; gpt-oss's fused 3-D experts), 8
    experts, top-2, GQA; `--moe-size bench` makes them 4 layers, hidden 512, 32 experts of 256 for the timing.
llm-compressor 0.14 renames Mixtral's experts w1 / w3 / w2 to gate_proj / up_proj / down_proj (it linearizes
them into its own ExpertMLP modules and saves those names); qformats keeps the checkpoint's (and vLLM's) w1/w2/w3,
so Mixtral is compared under that renaming, which the table says.
Prints one line per (model, scheme); exit status 1 when any tensor differs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DATA_FREE = "FP8_DYNAMIC,FP8_BLOCK,W8A8,W8A16,W4A16,W4A16_ASYM,W3A16,NVFP4A16,MXFP4A16,MXFP8A16"
MOE = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")
MIXTRAL_RENAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}

BUILD = r'''
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
arch, dst, size = sys.argv[1], sys.argv[2], sys.argv[3]
h, inter, e, layers = (128, 128, 8, 2) if size == "tiny" else (512, 256, 32, 4)
common = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              head_dim=h // 4, max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=2)
if arch == "qwen3_moe":
    cfg = AutoConfig.for_model(arch, **common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                               num_experts=e, norm_topk_prob=True)
elif arch == "qwen2_moe":
    cfg = AutoConfig.for_model(arch, **common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                               shared_expert_intermediate_size=inter, num_experts=e)
else:  # mixtral, gpt_oss
    cfg = AutoConfig.for_model(arch, **common, intermediate_size=inter, num_local_experts=e)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.05)
m.save_pretrained(dst)
'''


def _tensors(d: Path):
    from converters.formats.safetensors_io import open_checkpoint
    with open_checkpoint(d) as ck:
        return {k: np.array(ck.get(k)) for k in ck.keys()}


def _ignore(d: Path):
    return sorted(json.loads((d / "config.json").read_text())["quantization_config"].get("ignore", []))


def _rename(names, model):
    """llm-compressor's names mapped to the checkpoint's (Mixtral's experts: gate/up/down_proj -> w1/w3/w2)."""
    if model != "mixtral":
        return names
    sub = lambda k: re.sub(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)(\.|$)",  # noqa: E731
                           lambda m: m[1] + MIXTRAL_RENAMES[m[2]] + m[3], k)
    return {sub(k): v for k, v in names.items()} if isinstance(names, dict) else sorted(sub(k) for k in names)


def build(model: str, dst: Path, layers: int, size: str) -> None:
    if model == "llama":
        import checkpoint as bc  # bench/checkpoint.py
        bc.build(dst, layers)
    else:
        subprocess.run([sys.executable, "-c", BUILD, model, str(dst), size], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oneshot-python", required=True)
    ap.add_argument("--models", default="llama," + ",".join(MOE))
    ap.add_argument("--layers", type=int, default=1, help="layers of the llama model")
    ap.add_argument("--schemes", default=DATA_FREE)
    ap.add_argument("--moe-size", choices=("tiny", "bench"), default="tiny")
    a = ap.parse_args(argv)
    import checkpoint as bc  # bench/checkpoint.py: ONESHOT, measure
    work = Path(tempfile.mkdtemp(prefix="qformats-oneshot-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    failed = 0
    print("| model | scheme | result | tensors | qformats s | qformats peak RSS MiB | oneshot s | "
          "oneshot peak RSS MiB | speedup | oneshot RSS / ours |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for model in a.models.split(","):
        src = work / model / "src"
        src.parent.mkdir(parents=True)
        build(model, src, a.layers, a.moe_size)
        for s in a.schemes.split(","):
            ours, theirs = work / model / f"q-{s}", work / model / f"os-{s}"
            qs, qrss = bc.measure([sys.executable, "-m", "converters.cli", "quantize", str(src), str(ours),
                                   "--scheme", s, "--quiet"], dict(env, PYTHONPATH=str(ROOT)))
            os_s, os_rss = bc.measure([a.oneshot_python, "-c", bc.ONESHOT, str(src), str(theirs), s], env)
            x, y = _tensors(ours), _rename(_tensors(theirs), model)
            diff = sorted(set(x) ^ set(y))
            bad = [k for k in sorted(set(x) & set(y))
                   if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes()]
            ign_x, ign_y = _ignore(ours), _rename(_ignore(theirs), model)
            ok = not diff and not bad and ign_x == ign_y
            failed += not ok
            what = ("byte-identical" + (" (w1/w2/w3 names)" if model == "mixtral" else "") if ok else "DIFFERS"
                    + (f"; names only on one side: {diff[:4]}" if diff else "")
                    + (f"; differing: {bad[:4]}" if bad else "")
                    + (f"; ignore {ign_x} vs {ign_y}" if ign_x != ign_y else ""))
            print(f"| {model} | {s} | {what} | {len(x)} | {qs:.1f} | {qrss:.0f} | {os_s:.1f} | {os_rss:.0f} | "
                  f"x{os_s / qs:.2f} | x{os_rss / qrss:.2f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
