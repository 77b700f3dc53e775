"""SmolLM2-135M calibrated quantization: `quantize_calibrated_lm` beside llm-compressor's `oneshot`, same tokens.

Recipes (`--recipe`): "gptq" = W4A16:g64 with GPTQ (GPTQModifier, group 64); "smoothquant-gptq" = SmoothQuant
(alpha 0.5) then GPTQ W8A8 (int8 per-channel weights, per-token dynamic int8 activations: llm-compressor's W8A8
preset; SmoothQuantModifier + GPTQModifier).

Source: the embedded SmolLM2-135M-Instruct GGUF, converted once to a dense float32 HF directory (both sides read
it). Calibration text: the docstrings of numpy's public functions (numpy ships them; BSD-3-Clause), one
docstring per line (whitespace collapsed), tokenized with the checkpoint's tokenizer.json, each sample cut to
--seq-len tokens; the first --samples lines are used whole by both sides (same token ids: llm-compressor gets
them as a pre-tokenized dataset). Evaluation: perplexity on CPython's `pydoc_data.topics` (the Python docs, a
text of another kind) with `converters.perplexity`, the same loader and windows for both checkpoints.

Measured: wall time and peak RSS of our whole quantize process (load, calibrate, save; a fresh subprocess) and
of llm-compressor's `oneshot` call alone (its model load excluded; peak RSS of its whole process), perplexity
of both checkpoints and of the dense model (the protocol of bench/llm_ppl.py: pydoc_data.topics, windows of
512 tokens, the first --eval-windows of them). `--side ours|theirs|both` runs one side (its figures are kept
in WORK/<recipe>-<side>.json, so the two sides can be measured in separate runs, each under the bench lock);
the table is printed from whatever WORK holds.

    python bench/calibrate_lm.py [--recipe gptq] [--samples 64] [--seq-len 256] [--side both] [--work DIR]
        [--llmc-python /work/lcvenv/bin/python]
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
from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
src, dst, ids_file, seq_len, group, kind = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
if kind == "gptq":
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                              strategy="group", group_size=group))
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=128, dampening_frac=0.01)
else:
    recipe = [SmoothQuantModifier(smoothing_strength=0.5),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"], block_size=128, dampening_frac=0.01)]
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
t0, c0 = time.perf_counter(), cpu()
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seq_len, num_calibration_samples=len(ids))
t, c = time.perf_counter() - t0, cpu() - c0
model.save_pretrained(dst, save_compressed=True)
print(json.dumps({"oneshot_s": t, "oneshot_cpu_s": c, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''

OURS = r'''
import json, resource, sys, time
t0 = time.perf_counter()
from converters.calibrate import quantize_calibrated_lm
src, dst, text, seq_len, tokens, scheme, smooth = sys.argv[1:8]
info = quantize_calibrated_lm(src, dst, scheme, text, seq_len=int(seq_len), calibration_tokens=int(tokens),
                              smooth=None if smooth == "none" else float(smooth))
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "samples": info["samples"], "tokens": info["tokens"]}))
'''


def write_calibration(src: Path, work: Path, samples: int, seq_len: int, ids_name: str):
    """The calibration text (`calibration_lines(samples)`, one per line) as work/calib.txt and its token ids, each
    sample cut at seq_len, as work/<ids_name> (JSON) -- the same ids for both sides. Returns (text path, ids, tokens)."""
    from converters.causal_lm import load_tokenizer

    tok = load_tokenizer(src)
    lines = calibration_lines(samples)
    text = work / "calib.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ids = [tok.encode(t).ids[:seq_len] for t in lines]
    total = sum(len(x) for x in ids)
    (work / ids_name).write_text(json.dumps(ids))
    print(f"calibration: {len(ids)} numpy docstrings, {total} tokens (seq_len {seq_len})", file=sys.stderr)
    return text, ids, total


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


RECIPES = {"gptq": ("W4A16:g{group}", "none", "W4A16:g{group} GPTQ"),
           "smoothquant-gptq": ("W8A8", "0.5", "SmoothQuant 0.5 + GPTQ W8A8")}


def _run(cmd, env, what):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{what} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="gptq")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--side", choices=("ours", "theirs", "both", "none"), default="both",
                    help="which side to (re)measure; 'none': only print the table from WORK")
    ap.add_argument("--src", default=None, help="a dense SmolLM2 HF directory (default: converted from the GGUF)")
    ap.add_argument("--llmc-python", default="/work/lcvenv/bin/python")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-calib-lm-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    from converters.embedded import smollm2_gguf
    from converters.gguf_convert import convert_gguf
    from converters.perplexity import evaluate_text

    src = Path(a.src) if a.src else work / "smollm2-f32"
    if not src.exists():
        convert_gguf(smollm2_gguf(), src)
    text, ids, total = write_calibration(src, work, a.samples, a.seq_len, "ids.json")

    scheme, smooth, title = (x.format(group=a.group) for x in RECIPES[a.recipe])
    dst = {side: work / f"{a.recipe}-{side}" for side in ("ours", "theirs")}
    res = {side: work / f"{a.recipe}-{side}.json" for side in ("ours", "theirs")}
    for side in ("ours", "theirs"):
        if a.side not in (side, "both"):
            continue
        if dst[side].exists():
            import shutil
            shutil.rmtree(dst[side])
        load = os.getloadavg()[0]
        if side == "ours":
            r = _run([sys.executable, "-c", OURS, str(src), str(dst[side]), str(text), str(a.seq_len), str(total),
                      scheme, smooth], env, "ours")
        else:
            r = _run([a.llmc_python, "-c", THEIRS, str(src), str(dst[side]), str(work / "ids.json"), str(a.seq_len),
                      str(a.group), a.recipe], env, "llm-compressor")
        r["load_before"], r["load_after"] = load, os.getloadavg()[0]
        r["date"] = time.strftime("%Y-%m-%d %H:%M")
        res[side].write_text(json.dumps(r))
        print(side, r, file=sys.stderr)
    got = {side: json.loads(res[side].read_text()) for side in res if res[side].exists()}

    import pydoc_data.topics as topics

    eval_text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    ppl = {}
    for name, path in (("dense", src), ("ours", dst["ours"]), ("theirs", dst["theirs"])):
        if name == "dense" or name in got:
            ppl[name] = evaluate_text(path, eval_text, seq_len=512, max_windows=a.eval_windows)["stored"]["ppl"]
            print(name, ppl[name], file=sys.stderr)
    cell = lambda side, key, f: f.format(got[side][key]) if side in got else "—"  # noqa: E731
    pp = lambda side: f"{ppl[side]:.3f}" if side in ppl else "—"  # noqa: E731
    rows = [
        f"### SmolLM2-135M {title}: qformats vs llm-compressor 0.14 oneshot ({os.cpu_count()} CPUs, CPU only)", "",
        f"Calibration: {len(ids)} numpy docstrings ({total} tokens, samples cut at {a.seq_len}), the same token ids "
        f"on both sides; GPTQ block 128, dampening 0.01, actorder static. Perplexity: pydoc_data.topics, "
        f"{a.eval_windows} windows of 512 tokens; dense float32 {ppl['dense']:.3f}.", "",
        "| | perplexity | wall s | CPU s (all threads) | peak RSS MiB | load avg (before / after) |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| qformats `quantize_calibrated_lm` (whole process: load, calibrate, save) | {pp('ours')} | "
        f"{cell('ours', 'wall_s', '{:.1f}')} | {cell('ours', 'cpu_s', '{:.1f}')} | {cell('ours', 'rss_mib', '{:.0f}')} | "
        f"{cell('ours', 'load_before', '{:.1f}')} / {cell('ours', 'load_after', '{:.1f}')} |",
        f"| llm-compressor `oneshot` (the call alone; RSS: its process) | {pp('theirs')} | "
        f"{cell('theirs', 'oneshot_s', '{:.1f}')} | {cell('theirs', 'oneshot_cpu_s', '{:.1f}')} | "
        f"{cell('theirs', 'rss_mib', '{:.0f}')} | "
        f"{cell('theirs', 'load_before', '{:.1f}')} / {cell('theirs', 'load_after', '{:.1f}')} |", ""]
    if len(got) == 2:
        rows += [f"ppl ratio {ppl['ours'] / ppl['theirs']:.4f} (goal <= 1.005), time ratio "
                 f"{got['ours']['wall_s'] / got['theirs']['oneshot_s']:.3f} (goal <= 0.2; CPU time ratio "
                 f"{got['ours']['cpu_s'] / got['theirs']['oneshot_cpu_s']:.3f}), RSS ratio "
                 f"{got['ours']['rss_mib'] / got['theirs']['rss_mib']:.2f} (goal <= 0.5).", ""]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
