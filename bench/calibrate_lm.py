"""SmolLM2-135M W4A16:g64 GPTQ: `quantize_calibrated_lm` beside llm-compressor's `oneshot` (GPTQModifier), same tokens.

Source: the embedded SmolLM2-135M-Instruct GGUF, converted once to a dense float32 HF directory (both sides read
it). Calibration text: the docstrings of numpy's public functions (numpy ships them; BSD-3-Clause), one
docstring per line (whitespace collapsed), tokenized with the checkpoint's tokenizer.json, each sample cut to
--seq-len tokens; the first --samples lines are used whole by both sides (same token ids: llm-compressor gets
them as a pre-tokenized dataset). Evaluation: perplexity on CPython's `pydoc_data.topics` (the Python docs, a
text of another kind) with `converters.perplexity`, the same loader and windows for both checkpoints.

Measured: wall time and peak RSS of our whole quantize process (load, calibrate, save; a fresh subprocess) and
of llm-compressor's `oneshot` call alone (its model load excluded; peak RSS of its whole process), perplexity
of both checkpoints and of the dense model.

    python bench/calibrate_lm.py [--samples 64] [--seq-len 256] [--llmc-python /work/lcvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THEIRS = r'''
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
src, dst, ids_file, seq_len, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                          strategy="group", group_size=group))
recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=128, dampening_frac=0.01)
t0 = time.perf_counter()
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seq_len, num_calibration_samples=len(ids))
t = time.perf_counter() - t0
model.save_pretrained(dst, save_compressed=True)
print(json.dumps({"oneshot_s": t, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''

OURS = r'''
import json, resource, sys, time
t0 = time.perf_counter()
from converters.calibrate import quantize_calibrated_lm
src, dst, text, seq_len, tokens, scheme = sys.argv[1:7]
info = quantize_calibrated_lm(src, dst, scheme, text, seq_len=int(seq_len), calibration_tokens=int(tokens))
print(json.dumps({"wall_s": time.perf_counter() - t0, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "samples": info["samples"], "tokens": info["tokens"]}))
'''


def calibration_lines(n: int):
    """The first n non-empty docstrings of numpy's public callables (sorted by name), whitespace collapsed."""
    import numpy as np

    out = []
    for name in sorted(dir(np)):
        doc = getattr(getattr(np, name, None), "__doc__", None)
        if name.startswith("_") or not isinstance(doc, str):
            continue
        line = " ".join(doc.split())
        if len(line) > 200 and line not in out:
            out.append(line)
        if len(out) == n:
            break
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--llmc-python", default="/work/lcvenv/bin/python")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-calib-lm-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    from converters.causal_lm import load_tokenizer
    from converters.embedded import smollm2_gguf
    from converters.gguf_convert import convert_gguf
    from converters.perplexity import evaluate_text

    src = work / "smollm2-f32"
    if not src.exists():
        convert_gguf(smollm2_gguf(), src)
    tok = load_tokenizer(src)
    lines = calibration_lines(a.samples)
    text = work / "calib.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ids = [tok.encode(t).ids[:a.seq_len] for t in lines]
    total = sum(len(x) for x in ids)
    (work / "ids.json").write_text(json.dumps(ids))
    print(f"calibration: {len(ids)} numpy docstrings, {total} tokens (seq_len {a.seq_len})", file=sys.stderr)

    scheme = f"W4A16:g{a.group}"
    ours_dst, theirs_dst = work / "ours", work / "theirs"
    for d in (ours_dst, theirs_dst):
        if d.exists():
            import shutil
            shutil.rmtree(d)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", OURS, str(src), str(ours_dst), str(text), str(a.seq_len), str(total),
                        scheme], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"ours failed: {r.stderr[-3000:]}")
    ours = json.loads(r.stdout.strip().splitlines()[-1])
    print("ours", ours, f"(process {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    r = subprocess.run([a.llmc_python, "-c", THEIRS, str(src), str(theirs_dst), str(work / "ids.json"),
                        str(a.seq_len), str(a.group)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"llm-compressor failed: {r.stderr[-3000:]}")
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    print("theirs", theirs, file=sys.stderr)

    import pydoc_data.topics as topics

    eval_text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    ppl = {}
    for name, path in (("dense", src), ("qformats", ours_dst), ("llm-compressor", theirs_dst)):
        ppl[name] = evaluate_text(path, eval_text, seq_len=512, max_windows=a.eval_windows)["stored"]["ppl"]
        print(name, ppl[name], file=sys.stderr)
    rows = [
        f"## bench/calibrate_lm.py — SmolLM2-135M {scheme} GPTQ, qformats vs llm-compressor 0.14 oneshot "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, CPU only)", "",
        f"Calibration: {len(ids)} numpy docstrings ({total} tokens, samples cut at {a.seq_len}), the same token ids "
        f"on both sides; GPTQ block 128, dampening 0.01, actorder static. Perplexity: pydoc_data.topics, "
        f"{a.eval_windows} windows of 512 tokens; dense float32 {ppl['dense']:.3f}.", "",
        "| | perplexity | wall s | peak RSS MiB |", "| --- | --- | --- | --- |",
        f"| qformats `quantize_calibrated_lm` (whole process: load, calibrate, save) | {ppl['qformats']:.3f} | "
        f"{ours['wall_s']:.1f} | {ours['rss_mib']:.0f} |",
        f"| llm-compressor `oneshot` (the call alone; RSS: its process) | {ppl['llm-compressor']:.3f} | "
        f"{theirs['oneshot_s']:.1f} | {theirs['rss_mib']:.0f} |",
        "", f"ppl ratio {ppl['qformats'] / ppl['llm-compressor']:.4f}, time ratio "
        f"{ours['wall_s'] / theirs['oneshot_s']:.2f}, RSS ratio {ours['rss_mib'] / theirs['rss_mib']:.2f}.", ""]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
