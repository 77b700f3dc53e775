"""SmolLM2-135M calibrated quantization: `quantize_calibrated_lm` beside llm-compressor's `oneshot`, same tokens.

Recipes (`--recipe`): "gptq" = W4A16:g64 with GPTQ (GPTQModifier, group 64, block 128, dampening 0.01, its default
actorder "static"); "awq" = W4A16:g64 AWQ then round-to-nearest, as llm-compressor's AWQ examples pair it
(AWQModifier(n_grid=20, duo_scaling=True) + QuantizationModifier; ours: `awq=True`, weight search "rtn", float
propagation); "smoothquant-gptq" = SmoothQuant (alpha 0.5) then GPTQ W8A8 (int8 per-channel weights, per-token
dynamic int8 activations: llm-compressor's W8A8 preset; SmoothQuantModifier + GPTQModifier).

Source: a dense float32 SmolLM2 HF directory (--src, or the embedded GGUF converted once). Data (`--data`): "numpy"
(below) or "prose": the paragraphs of scikit-learn's dataset descriptions as calibration (`prose_lines`: variable-
length documents, one per line, ~4k tokens) and IDLE's user guide as evaluation (`idle_guide_text`, ~9k tokens).
Calibration text ("numpy"): the docstrings of numpy's public functions (numpy ships them; BSD-3-Clause), one docstring per line (whitespace
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
otherwise spin while waiting, which on a shared, loaded machine multiplies its CPU seconds. Ours also reports the
wall and CPU seconds of each phase (`quantize_calibrated_lm(timings=...)`). `--side ours|theirs|both` runs one side
(its figures are kept in WORK/<data>-<recipe>-ours[-sSEED].json and -theirs-K.json, so the sides can be measured
in separate runs); `--runs K` runs llm-compressor K times (with `--shuffle`, its default unseeded sample order: the
result varies run to run) and `--seeds` ours over several sample orders; the table (perplexities, their median and
spread) is printed from whatever WORK holds. `--pairs N` times the two sides alternately, N runs each with a pause
before every run, and compares the medians of those runs alone: this machine's speed drifts by tens of percent
over an hour (their run 147-232 s on one day), so figures from different windows do not compare.

    python bench/calibrate_lm.py [--recipe gptq|awq|smoothquant-gptq] [--data numpy|prose] [--samples 64]
        [--seq-len 256] [--side both|ours|theirs|none] [--runs 1] [--first-run 0] [--shuffle] [--seeds 0,1,2]
        [--no-table] [--pairs N [--pause 20]]
        [--src DIR] [--work DIR] [--llmc-python /work/oneshot/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
src, dst, ids_file, seq_len, group, kind, shuffle = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                                    int(sys.argv[5]), sys.argv[6], sys.argv[7] == "1")
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
        shuffle_calibration_samples=shuffle)
t, c = time.perf_counter() - t0, cpu() - c0
mem = memory()
model.save_pretrained(dst, save_compressed=True)
print(json.dumps({"oneshot_s": t, "oneshot_cpu_s": c, "threads": torch.get_num_threads(), **mem}))
"""

OURS = r"""
from converters.process import reexec_with_hugepage_malloc
reexec_with_hugepage_malloc()  # as `qformats quantize --calibrate` restarts itself: huge-page malloc
""" + MEASURE + r"""
import json, resource, sys, time
_t0 = time.perf_counter()
from converters.pipelines.calibrate import quantize_calibrated_lm
from converters.process import lean_calibration
src, dst, text, seq_len, tokens, scheme, kind, seed, cache = sys.argv[1:10]
if cache:  # JAX's persistent compilation cache, as `qformats quantize --calibrate` turns it on, in WORK/jax-cache
    import os
    from converters.cli.common import enable_compile_cache
    os.environ["QFORMATS_COMPILE_CACHE"] = cache
    enable_compile_cache()
phases = {"imports": time.perf_counter() - _t0, "imports cpu": time.process_time()}
with lean_calibration() as between_phases:  # the rest of the process tuning `qformats quantize --calibrate` applies
    info = quantize_calibrated_lm(src, dst, scheme, text, seq_len=int(seq_len), calibration_tokens=int(tokens),
                                  seed=int(seed),
                                  awq=kind == "awq", smooth=0.5 if kind == "smoothquant-gptq" else None,
                                  between_phases=between_phases, timings=phases,
                                  log=lambda m: print(f"{time.perf_counter() - _t0:7.1f} s  {m}", file=sys.stderr))
print(json.dumps({"cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), **memory(),
                  "samples": info["samples"], "tokens": info["tokens"], "phases": phases}))
"""


def write_calibration(src: Path, work: Path, lines, seq_len: int, ids_name: str, data: str):
    """The calibration text (`lines`, one per line) as work/calib-<data>.txt and its token ids, each sample cut at
    seq_len, as work/<ids_name> (JSON) -- the same ids for both sides. Returns (text path, ids, tokens)."""
    from converters.pipelines.causal_lm import load_tokenizer

    tok = load_tokenizer(src)
    text = work / f"calib-{data}.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ids = [tok.encode(t).ids[:seq_len] for t in lines]
    total = sum(len(x) for x in ids)
    (work / ids_name).write_text(json.dumps(ids))
    print(f"calibration: {len(ids)} {data} samples, {total} tokens (seq_len {seq_len})", file=sys.stderr)
    return text, ids, total


def prose_lines(n: int = 0):
    """Variable-length prose documents, one per line: the paragraphs (>= 25 words, whitespace collapsed; no tables,
    directives, titles or list items) of scikit-learn's dataset descriptions (`sklearn/datasets/descr/*.rst`,
    BSD-3-Clause), files in name order; the first n (0: all)."""
    import glob

    import sklearn

    out = []
    for f in sorted(glob.glob(str(Path(sklearn.__file__).parent / "datasets" / "descr" / "*.rst"))):
        for para in re.split(r"\n\s*\n", Path(f).read_text(encoding="utf-8")):
            line = " ".join(para.split())
            if len(line.split()) >= 25 and not line.startswith(("..", ":", "=", "|", "*", "-", "+")) \
                    and "====" not in line and line not in out:
                out.append(line)
    return out[:n] if n else out


def idle_guide_text():
    """The text of IDLE's user guide (`idlelib/help.html`, CPython's; Python Software Foundation License 2): from its
    first sentence to the end of its last section (the sidebar's table of contents cut), tags stripped, entities unescaped, blank runs collapsed."""
    import html
    import idlelib

    h = (Path(idlelib.__file__).parent / "help.html").read_text(encoding="utf-8")
    h = re.sub(r"<(script|style).*?</\1>", "", h, flags=re.S)
    txt = html.unescape(re.sub(r"<[^>]+>", "", h))
    start = txt.index("IDLE is Python")
    end = txt.rfind("Table of Contents")  # the sidebar that follows the last section
    end = end if end > start else len(txt)
    return re.sub(r"\n\s*\n+", "\n\n", txt[start:end]).strip() + "\n"


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


def phase_table(ph: dict, cpu_s: float, wall_s: float, layers: int):
    """Markdown rows: each phase's wall and CPU seconds, and for the per-layer phases the first layer's excess CPU
    over the mean of the other layers (compilation: the first layer compiles the layer passes and the weight
    search), from `quantize_calibrated_lm(timings=...)`; the rest of the process (interpreter start, exit) last."""
    out = ["| phase | wall s | CPU s | of which compiling (layer 1's excess CPU s) |", "| --- | ---: | ---: | ---: |"]
    names = [k for k in ph if not k.endswith((" cpu", "(layer 1)"))]
    cw = cc = 0.0
    for k in names:
        w, c = ph[k], ph.get(k + " cpu", float("nan"))
        if k == "imports":
            c = ph["imports cpu"]  # process CPU time when the imports were done (the interpreter's start included)
        first = ph.get(f"{k} cpu (layer 1)") if k in ("transform", "calibration pass", "weight search",
                                                         "propagation") else None
        comp = "" if first is None else f"{first - (c - first) / (layers - 1):.1f}"
        out.append(f"| {k} | {w:.1f} | {c:.1f} | {comp} |")
        cw += w
        cc += 0.0 if c != c else c
    out.append(f"| rest (unaccounted: exit, untimed) | {wall_s - cw:.1f} | {cpu_s - cc:.1f} | |")
    out.append(f"| whole process | {wall_s:.1f} | {cpu_s:.1f} | |")
    return out


def _run(cmd, env, what):
    """Runs cmd, returns (its last stdout line as JSON, the wall seconds of the whole process)."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if what == "ours":
        print("\n".join(line for line in r.stderr.splitlines() if " s  " in line), file=sys.stderr)
    if r.returncode:
        raise SystemExit(f"{what} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="gptq")
    ap.add_argument("--data", choices=("numpy", "prose"), default="numpy",
                    help="numpy: numpy docstrings, eval pydoc_data.topics; prose: scikit-learn's dataset descriptions "
                         "(paragraphs), eval IDLE's user guide")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--side", choices=("ours", "theirs", "both", "none"), default="both",
                    help="which side to (re)measure; 'none': only print the table from WORK")
    ap.add_argument("--runs", type=int, default=1, help="llm-compressor runs (their result varies run to run)")
    ap.add_argument("--first-run", type=int, default=0,
                    help="number their runs from this one (keeps the earlier runs' figures in WORK)")
    ap.add_argument("--seeds", default="0", help="our runs: the calibration sample order's seeds, comma-separated")
    ap.add_argument("--shuffle", action="store_true",
                    help="their side with oneshot's default shuffle_calibration_samples=True (an unseeded "
                         "RandomSampler: the sample order changes from run to run)")
    ap.add_argument("--no-table", action="store_true",
                    help="measure only (e.g. under the bench lock); the perplexities and the table come from a later "
                         "--side none run")
    ap.add_argument("--compile-cache", action="store_true",
                    help="ours with JAX's persistent compilation cache in WORK/jax-cache (the qformats CLI's default; "
                         "programs compiling in over 1 s): a second run reads them instead of compiling")
    ap.add_argument("--pairs", type=int, default=0,
                    help="time both sides N times each, alternately (ours, theirs, ours, ...; ours as runs r1..rN "
                         "with the first --seeds seed, theirs numbered from --first-run), --pause seconds between "
                         "runs: this machine's speed drifts over minutes, so only runs in the same window compare")
    ap.add_argument("--pause", type=float, default=20.0, help="--pairs: idle seconds before each run")
    ap.add_argument("--src", default=None, help="a dense SmolLM2 HF directory (default: converted from the GGUF)")
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    if a.pairs and (a.side != "both" or a.runs != 1):
        raise SystemExit("--pairs times both sides itself: it takes neither --side nor --runs")
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
    lines = calibration_lines(a.samples) if a.data == "numpy" else prose_lines(a.samples if a.samples != 64 else 0)
    text, ids, total = write_calibration(src, work, lines, a.seq_len, f"ids-{a.data}.json", a.data)

    scheme, title = (x.format(group=a.group) for x in RECIPES[a.recipe])
    tag = f"{a.data}-{a.recipe}"
    seeds = [int(x) for x in a.seeds.split(",")]
    if a.pairs:  # (side, directory, seed), alternately
        todo = [x for k in range(a.pairs) for x in (("ours", work / f"{tag}-ours-r{k + 1}", seeds[0]),
                                                    ("theirs", work / f"{tag}-theirs-{a.first_run + k}", None))]
    else:
        todo = [("ours", work / (f"{tag}-ours" if k == 0 else f"{tag}-ours-s{k}"), k) for k in seeds
                if a.side in ("ours", "both")]
        todo += [("theirs", work / f"{tag}-theirs-{k}", None) for k in range(a.first_run, a.first_run + a.runs)
                 if a.side in ("theirs", "both")]
    for side, dst, seed in todo:
        if dst.exists():
            import shutil

            shutil.rmtree(dst)
        if a.pairs:
            time.sleep(a.pause)
        load = os.getloadavg()[0]
        if side == "ours":
            r, wall = _run([sys.executable, "-c", OURS, str(src), str(dst), str(text), str(a.seq_len),
                            str(total), scheme, a.recipe, str(seed),
                            str(work / "jax-cache") if a.compile_cache else ""], env, "ours")
            r["wall_s"] = wall
            if r["tokens"] != total:
                raise SystemExit(f"calibration tokens differ: ours {r['tokens']}, theirs {total}")
        else:
            r, wall = _run([a.llmc_python, "-c", THEIRS, str(src), str(dst), str(work / f"ids-{a.data}.json"),
                            str(a.seq_len), str(a.group), a.recipe, str(int(a.shuffle))],
                           dict(env, OMP_WAIT_POLICY="PASSIVE"), "llm-compressor")
            r["process_s"] = wall
        r["load_before"], r["load_after"] = load, os.getloadavg()[0]
        r["nice"] = os.nice(0)
        r["date"] = time.strftime("%Y-%m-%d %H:%M")
        Path(f"{dst}.json").write_text(json.dumps(r))
        print(side, dst.name, r, file=sys.stderr)
    if a.no_table:
        return
    got = {}
    for side in ("ours", "theirs"):
        pattern = f"{tag}-ours*.json" if side == "ours" else f"{tag}-theirs-*.json"
        got[side] = {Path(f).name[:-5]: json.loads(Path(f).read_text()) for f in sorted(work.glob(pattern))
                     if ".ppl-" not in Path(f).name}

    if a.data == "numpy":
        import pydoc_data.topics as topics

        eval_text, eval_name = "\n".join(topics.topics[k] for k in sorted(topics.topics)), "pydoc_data.topics"
    else:
        eval_text, eval_name = idle_guide_text(), "IDLE's user guide (idlelib/help.html)"
    import shutil

    ppl = {}
    for name in ["dense"] + sorted(got["ours"]) + sorted(got["theirs"]):
        path = src if name == "dense" else work / name
        if name != "dense" and "theirs" in name:  # save_pretrained writes no tokenizer: the source's
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (src / f).exists() and not (path / f).exists():
                    shutil.copy(src / f, path / f)
        cache = work / f"{name}.ppl-{a.eval_windows}.json" if name != "dense" else work / f"dense-{a.data}.ppl-{a.eval_windows}.json"
        if cache.exists() and cache.stat().st_mtime > path.stat().st_mtime:
            ppl[name] = json.loads(cache.read_text())["ppl"]
        else:
            ppl[name] = evaluate_text(path, eval_text, seq_len=512, max_windows=a.eval_windows)["stored"]["ppl"]
            cache.write_text(json.dumps({"ppl": ppl[name]}))
        print(name, ppl[name], file=sys.stderr)
    import statistics

    theirs = [ppl[n] for n in sorted(got["theirs"])]
    med = statistics.median(theirs) if theirs else None
    rows = [
        f"### SmolLM2-135M {title}, {a.data}: qformats vs llm-compressor 0.14 oneshot ({os.cpu_count()} CPUs)", "",
        f"Calibration: {len(ids)} {'numpy docstrings' if a.data == 'numpy' else 'scikit-learn dataset-description paragraphs'} "
        f"({total} tokens, samples cut at {a.seq_len}), the same token ids on both sides"
        f"{' (theirs shuffled by oneshot)' if a.shuffle else ''}. Perplexity: {eval_name}, up to {a.eval_windows} "
        f"windows of 512 tokens; dense float32 {ppl['dense']:.3f}.", "",
        "| run | perplexity | wall s | CPU s | VmHWM MiB | RssAnon peak MiB | load before / after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side, key in (("ours", "wall_s"), ("theirs", "oneshot_s")):
        for n, r in sorted(got[side].items()):
            cpu = r.get("cpu_s", r.get("oneshot_cpu_s", 0))
            rows.append(f"| {n} | {ppl[n]:.3f} | {r[key]:.1f} | {cpu:.1f} | {r['vmhwm_mib']:.0f} | "
                        f"{r['rss_anon_peak_mib']:.0f} | {r['load_before']:.1f} / {r['load_after']:.1f} |")
    if med is not None:
        rows += ["", f"llm-compressor: median {med:.3f}, min {min(theirs):.3f}, max {max(theirs):.3f} "
                     f"({len(theirs)} runs)."]
        ours = [ppl[n] for n in sorted(got["ours"])]
        if len(ours) > 1:
            rows.append(f"qformats: median {statistics.median(ours):.3f}, min {min(ours):.3f}, max {max(ours):.3f} "
                        f"({len(ours)} runs: sample orders, or repeats with --pairs); median / their median "
                        f"{statistics.median(ours) / med:.4f} (goal <= 1.005).")
        t_med = statistics.median(x["oneshot_s"] for x in got["theirs"].values())
        c_med = statistics.median(x["oneshot_cpu_s"] for x in got["theirs"].values())
        m_med = statistics.median(x["vmhwm_mib"] for x in got["theirs"].values())
        for n, r in sorted(got["ours"].items()):
            rows.append(f"{n}: perplexity / their median {ppl[n] / med:.4f} (goal <= 1.005); whole process / their "
                        f"median oneshot call: wall {r['wall_s'] / t_med:.3f}, CPU {r['cpu_s'] / c_med:.3f} "
                        f"(goal <= 0.5); VmHWM {r['vmhwm_mib'] / m_med:.2f} (goal <= 0.5)")
            if "phases" in r:
                rows += ["", *phase_table(r["phases"], r["cpu_s"], r["wall_s"], 30), ""]
    if a.pairs:  # this invocation's runs only: the same window on both sides
        mine = {side: [json.loads(Path(f"{d}.json").read_text()) for sd, d, _ in todo if sd == side]
                for side in ("ours", "theirs")}
        wo = [r["wall_s"] for r in mine["ours"]]
        wt = [r["oneshot_s"] for r in mine["theirs"]]
        rows += ["", f"Interleaved ({a.pairs} pairs, {a.pause:.0f} s pauses): ours wall {min(wo):.1f}–{max(wo):.1f} s, "
                     f"median {statistics.median(wo):.1f}; their oneshot {min(wt):.1f}–{max(wt):.1f} s, median "
                     f"{statistics.median(wt):.1f}; ratio of medians {statistics.median(wo) / statistics.median(wt):.3f}"
                     f" (goal <= 0.5); ours CPU s median {statistics.median(r['cpu_s'] for r in mine['ours']):.1f}, "
                     f"theirs {statistics.median(r['oneshot_cpu_s'] for r in mine['theirs']):.1f}; VmHWM "
                     f"{max(r['vmhwm_mib'] for r in mine['ours']):.0f} / "
                     f"{statistics.median(r['vmhwm_mib'] for r in mine['theirs']):.0f} MiB."]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
