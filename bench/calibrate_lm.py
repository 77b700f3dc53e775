"""SmolLM2-135M calibrated quantization: `quantize_calibrated_lm` beside llm-compressor's `oneshot`, same tokens.

Recipes (`--recipe`): "gptq" = W4A16:g64 with GPTQ (GPTQModifier, group 64, block 128, dampening 0.01, its default
actorder "static"); "awq" = W4A16:g64 AWQ then round-to-nearest, as llm-compressor's AWQ examples pair it
(AWQModifier(n_grid=20, duo_scaling=True) + QuantizationModifier; ours: `awq=True`, weight search "rtn", float
propagation); "smoothquant-gptq" = SmoothQuant (alpha 0.5) then GPTQ W8A8 (int8 per-channel weights, per-token
dynamic int8 activations: llm-compressor's W8A8 preset; SmoothQuantModifier + GPTQModifier).

Source: a dense float32 SmolLM2 HF directory (--src, or the embedded GGUF converted once). Calibration text: the
docstrings of numpy's public functions (numpy ships them; BSD-3-Clause), one docstring per line (whitespace
collapsed), tokenized with the checkpoint's tokenizer.json, each sample cut to --seq-len tokens; the first
--samples lines are used whole by both sides: llm-compressor gets the token ids as a pre-tokenized dataset (in
order, unshuffled), ours the text file with a token budget equal to their count (checked: the run stops if our
token count differs). Evaluation: perplexity on CPython's `pydoc_data.topics` (the Python docs, a text of another
kind) with `converters.evaluation.perplexity`, the same loader and windows for both checkpoints (bench/llm_ppl.py's
protocol: windows of 512 tokens, the first --eval-windows of them: 32 by default; 4 proved too few to tell the two
sides apart, GPTQ's pair reading -1.2% at 4 windows and +0.23% at 32).

Measured, the same way on both sides (MEASURE runs in both processes): wall time of our whole quantize process
(load, calibrate, save; a fresh subprocess, timed from outside) and of llm-compressor's `oneshot` call alone (its
imports, model load and save excluded); CPU seconds (user + system, all threads) of the same spans; peak memory
of each whole process as VmHWM (the kernel's high-water mark of the resident set: anonymous and file-backed pages,
so memory-mapped checkpoint pages count while resident) and as the peak of RssAnon (anonymous pages only: heap,
torch / XLA buffers), sampled every 20 ms. Their process runs with OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads
otherwise spin while waiting, which on a shared, loaded machine multiplies its CPU seconds. `--side ours|theirs|both` runs one side (its figures are kept in
WORK/<recipe>-<side>.json, so the two sides can be measured in separate runs, ours under the bench lock with
--no-table); the table (and the perplexities) is printed from whatever WORK holds.

    python bench/calibrate_lm.py [--recipe gptq|awq|smoothquant-gptq] [--samples 64] [--seq-len 256]
        [--side both|ours|theirs|none] [--no-table] [--src DIR] [--work DIR] [--llmc-python /work/lcvenv/bin/python]
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

MEASURE = r"""
import threading, time
def _status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) / 1024
    return out
_PEAK = {"anon": 0.0}
def _sample():
    while True:
        _PEAK["anon"] = max(_PEAK["anon"], _status()["RssAnon"])
        time.sleep(0.02)
threading.Thread(target=_sample, daemon=True).start()
def memory():
    s = _status()
    return {"vmhwm_mib": s["VmHWM"], "rss_anon_peak_mib": max(_PEAK["anon"], s["RssAnon"])}
"""
# Both sides' memory figures, the same code in both processes: VmHWM (the kernel's peak resident set of the process,
# anonymous + file-backed pages: memory-mapped checkpoints count while resident) and the peak of RssAnon (heap, torch /
# XLA buffers, Python objects; no file pages), sampled every 20 ms by a thread.

THEIRS = MEASURE + r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
# AWQ pins its cached batches for faster host->GPU copies; a CPU-only torch cannot pin ("Cannot access accelerator
# device"): pinning moves no value, so it is skipped
IntermediatesCache.pin_memory = lambda self, batch_index: None
src, dst, ids_file, seq_len, group, kind = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
w4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                     strategy="group", group_size=group))
if kind == "gptq":
    recipe = GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head"], block_size=128, dampening_frac=0.01)
elif kind == "awq":
    recipe = [AWQModifier(n_grid=20, duo_scaling=True),
              QuantizationModifier(config_groups={"group_0": w4}, ignore=["lm_head"])]
else:
    recipe = [SmoothQuantModifier(smoothing_strength=0.5),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"], block_size=128, dampening_frac=0.01)]
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
t0, c0 = time.perf_counter(), cpu()
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seq_len, num_calibration_samples=len(ids),
        shuffle_calibration_samples=False)
t, c = time.perf_counter() - t0, cpu() - c0
mem = memory()
model.save_pretrained(dst, save_compressed=True)
print(json.dumps({"oneshot_s": t, "oneshot_cpu_s": c, "threads": torch.get_num_threads(), **mem}))
"""

OURS = MEASURE + r"""
import json, resource, sys, time
from converters.pipelines.calibrate import quantize_calibrated_lm
from converters.process import lean_calibration
src, dst, text, seq_len, tokens, scheme, kind = sys.argv[1:8]
with lean_calibration() as between_phases:  # the process tuning `qformats quantize --calibrate` applies
    info = quantize_calibrated_lm(src, dst, scheme, text, seq_len=int(seq_len), calibration_tokens=int(tokens),
                                  awq=kind == "awq", smooth=0.5 if kind == "smoothquant-gptq" else None,
                                  between_phases=between_phases)
print(json.dumps({"cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), **memory(),
                  "samples": info["samples"], "tokens": info["tokens"]}))
"""


def write_calibration(src: Path, work: Path, samples: int, seq_len: int, ids_name: str):
    """The calibration text (`calibration_lines(samples)`, one per line) as work/calib.txt and its token ids, each
    sample cut at seq_len, as work/<ids_name> (JSON) -- the same ids for both sides. Returns (text path, ids, tokens)."""
    from converters.pipelines.causal_lm import load_tokenizer

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


RECIPES = {"gptq": ("W4A16:g{group}", "W4A16:g{group} GPTQ (block 128, dampening 0.01, actorder static)"),
           "awq": ("W4A16:g{group}", "W4A16:g{group} AWQ (n_grid 20, duo scaling) + round-to-nearest"),
           "smoothquant-gptq": ("W8A8", "SmoothQuant 0.5 + GPTQ W8A8 (block 128, dampening 0.01, actorder static)")}


def _run(cmd, env, what):
    """Runs cmd, returns (its last stdout line as JSON, the wall seconds of the whole process)."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{what} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="gptq")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--side", choices=("ours", "theirs", "both", "none"), default="both",
                    help="which side to (re)measure; 'none': only print the table from WORK")
    ap.add_argument("--no-table", action="store_true",
                    help="measure only (e.g. under the bench lock); the perplexities and the table come from a later "
                         "--side none run")
    ap.add_argument("--src", default=None, help="a dense SmolLM2 HF directory (default: converted from the GGUF)")
    ap.add_argument("--llmc-python", default="/work/lcvenv/bin/python")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-calib-lm-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    from converters.evaluation.embedded import smollm2_gguf
    from converters.formats.gguf_convert import convert_gguf
    from converters.evaluation.perplexity import evaluate_text

    src = Path(a.src) if a.src else work / "smollm2-f32"
    if not src.exists():
        convert_gguf(smollm2_gguf(), src)
    text, ids, total = write_calibration(src, work, a.samples, a.seq_len, "ids.json")

    scheme, title = (x.format(group=a.group) for x in RECIPES[a.recipe])
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
            r, wall = _run([sys.executable, "-c", OURS, str(src), str(dst[side]), str(text), str(a.seq_len),
                            str(total), scheme, a.recipe], env, "ours")
            r["wall_s"] = wall
            if r["tokens"] != total:
                raise SystemExit(f"calibration tokens differ: ours {r['tokens']}, theirs {total}")
        else:
            r, wall = _run([a.llmc_python, "-c", THEIRS, str(src), str(dst[side]), str(work / "ids.json"),
                            str(a.seq_len), str(a.group), a.recipe], dict(env, OMP_WAIT_POLICY="PASSIVE"),
                           "llm-compressor")
            r["process_s"] = wall
        r["load_before"], r["load_after"] = load, os.getloadavg()[0]
        r["nice"] = os.nice(0)
        r["date"] = time.strftime("%Y-%m-%d %H:%M")
        res[side].write_text(json.dumps(r))
        print(side, r, file=sys.stderr)
    if a.no_table:
        return
    got = {side: json.loads(res[side].read_text()) for side in res if res[side].exists()}

    import pydoc_data.topics as topics

    eval_text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):  # save_pretrained writes no tokenizer: the source's
        if "theirs" in got and (src / f).exists() and not (dst["theirs"] / f).exists():
            shutil.copy(src / f, dst["theirs"] / f)
    ppl = {}
    for name, path in (("dense", src), ("ours", dst["ours"]), ("theirs", dst["theirs"])):
        if name == "dense" or name in got:
            ppl[name] = evaluate_text(path, eval_text, seq_len=512, max_windows=a.eval_windows)["stored"]["ppl"]
            print(name, ppl[name], file=sys.stderr)
    cell = lambda side, key, f: f.format(got[side][key]) if side in got and key in got[side] else "—"  # noqa: E731
    pp = lambda side: f"{ppl[side]:.3f}" if side in ppl else "—"  # noqa: E731
    rows = [
        f"### SmolLM2-135M {title}: qformats vs llm-compressor 0.14 oneshot ({os.cpu_count()} CPUs, CPU only)", "",
        f"Calibration: {len(ids)} numpy docstrings ({total} tokens, samples cut at {a.seq_len}), the same token ids "
        f"on both sides. Perplexity: pydoc_data.topics, {a.eval_windows} windows of 512 tokens; dense float32 "
        f"{ppl['dense']:.3f}. Peak RSS: VmHWM (anonymous + file-backed pages) and the peak of RssAnon (sampled "
        f"every 20 ms) of each process.", "",
        "| | perplexity | wall s | CPU s (all threads) | VmHWM MiB | RssAnon peak MiB | load avg (before / after) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| qformats `quantize_calibrated_lm` (whole process: imports, load, calibrate, save) | {pp('ours')} | "
        f"{cell('ours', 'wall_s', '{:.1f}')} | {cell('ours', 'cpu_s', '{:.1f}')} | "
        f"{cell('ours', 'vmhwm_mib', '{:.0f}')} | {cell('ours', 'rss_anon_peak_mib', '{:.0f}')} | "
        f"{cell('ours', 'load_before', '{:.1f}')} / {cell('ours', 'load_after', '{:.1f}')} |",
        f"| llm-compressor `oneshot` (time: the call alone; memory: its whole process) | {pp('theirs')} | "
        f"{cell('theirs', 'oneshot_s', '{:.1f}')} | {cell('theirs', 'oneshot_cpu_s', '{:.1f}')} | "
        f"{cell('theirs', 'vmhwm_mib', '{:.0f}')} | {cell('theirs', 'rss_anon_peak_mib', '{:.0f}')} | "
        f"{cell('theirs', 'load_before', '{:.1f}')} / {cell('theirs', 'load_after', '{:.1f}')} |", ""]
    if len(got) == 2:
        o, t = got["ours"], got["theirs"]
        rows += [f"ppl ratio {ppl['ours'] / ppl['theirs']:.4f} (goal <= 1.005); time ratio "
                 f"{o['wall_s'] / t['oneshot_s']:.3f} wall, {o['cpu_s'] / t['oneshot_cpu_s']:.3f} CPU (goal <= 0.2); "
                 f"memory ratio {o['vmhwm_mib'] / t['vmhwm_mib']:.2f} VmHWM, "
                 f"{o['rss_anon_peak_mib'] / t['rss_anon_peak_mib']:.2f} RssAnon (goal <= 0.5).", ""]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
