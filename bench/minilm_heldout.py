"""MiniLM calibrated quantization judged on held-out text: mean / min cosine vs fp32 on the calibration set and on
a disjoint evaluation set, calibrated on text of the same kind and of another kind.

Usage: python bench/minilm_heldout.py [--schemes W4A16,NVFP4A16,MXFP4A16,FP6_E2M3] [--searches rtn,mse,gptq,mse+gptq]
         [--calibrations same,other] [--calib-count 64] [--batching exact|padded] [--json] [--make-sets]

Sets (package data, `converters.embedded.heldout_sentences` / `default_sentences`):
  held-out   converters/data/heldout_eval.txt: 256 sentences of the Python documentation's prose;
  same kind  converters/data/heldout_calib.txt: another 256 sentences of that prose (the first --calib-count used);
  other kind converters/data/sentences.txt: the 64 shipped everyday-English sentences.
The two prose sets come from `pydoc_data.topics` (the standard library's copy of the Python reference's topics,
PSF License): non-indented paragraphs split into sentences, kept when 8-40 words, capitalised, ending in ".",
with >= 93% letters/spaces and no code punctuation; deduplicated, shuffled with numpy seed 0; the first 256 are
the held-out set, the next 256 the calibration set. `--make-sets` rewrites the two files that way (the shipped
files are what the figures in BENCHMARKS.md used; a different Python's pydoc_data gives different sentences).

Every Linear (pooler included) is quantized as `converters.calibrate.quantize_calibrated` does
(`quantize_model(..., calibration_data=batches, weight_search=S)`, compare_rtn on); the reference is torch
sentence-transformers fp32. `--batching padded` calibrates on the old padded batches (32 a batch, lengths
rounded up to 16, padding rows entering H) instead of `embedded.calibration_batches` (no padding).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from converters import embedded  # noqa: E402
from converters.evaluate import cosines, resolve  # noqa: E402
from qformats.models import minilm  # noqa: E402
from qformats.nn import Rule, quantize_model  # noqa: E402

SCHEMES = "W4A16,NVFP4A16,MXFP4A16,FP6_E2M3"
SEARCHES = "rtn,mse,gptq,mse+gptq"


def make_sets(n_eval: int = 256, n_calib: int = 256, seed: int = 0):
    """(held-out, calibration) sentence lists from `pydoc_data.topics`, as the module docstring describes."""
    import pydoc_data.topics as topics

    out, seen = [], set()
    for key in sorted(topics.topics):
        for para in re.split(r"\n\s*\n", topics.topics[key]):
            lines = para.split("\n")
            if any(line.startswith(" ") for line in lines if line.strip()):
                continue  # code, grammar and tables are indented
            text = " ".join(line.strip() for line in lines)
            for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
                s = s.strip()
                words = s.split()
                if not (8 <= len(words) <= 40) or not s[0].isupper() or s[-1] != ".":
                    continue
                if re.search(r"[=\[\]{}<>*`|\\#@~^]|\.\.\.|__|::|\(\)", s):
                    continue
                if sum(c.isalpha() or c == " " for c in s) / len(s) < 0.93 or s in seen:
                    continue
                seen.add(s)
                out.append(s)
    idx = np.random.default_rng(seed).permutation(len(out))
    return [out[i] for i in idx[:n_eval]], [out[i] for i in idx[n_eval:n_eval + n_calib]]


def padded_batches(tok, sentences, batch_size=32):
    """The batches calibration used before `embedded.calibration_batches`: padded to the longest, rounded to 16."""
    return [tok(sentences[i:i + batch_size]) for i in range(0, len(sentences), batch_size)]


def run(scheme, search, batches, sets, refs, tok):
    """Quantize a fresh MiniLM with `scheme` / `search` on `batches` → {set: (mean, min)} cosines vs fp32."""
    model = embedded.load_minilm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, [Rule(".*", resolve(scheme))], calibration_data=None if search == "rtn" else batches,
                       weight_search=search)
    out = {}
    for name, sents in sets.items():
        c = cosines(minilm.encode_sentences(model, tok, sents, 32), refs[name])
        out[name] = (float(c.mean()), float(c.min()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default=SCHEMES)
    ap.add_argument("--searches", default=SEARCHES)
    ap.add_argument("--calibrations", default="same,other", help="same (prose) and/or other (the shipped set)")
    ap.add_argument("--calib-count", type=int, default=64, help="sentences of the same-kind set to calibrate on")
    ap.add_argument("--batching", choices=("exact", "padded"), default="exact")
    ap.add_argument("--bucket", type=int, default=8, help="embedded.calibration_batches' length bucket")
    ap.add_argument("--json", action="store_true", help="one JSON line per row, on stdout")
    ap.add_argument("--make-sets", action="store_true", help="rewrite converters/data/heldout_*.txt and exit")
    args = ap.parse_args(argv)
    if args.make_sets:
        ev, ca = make_sets()
        data = os.path.join(os.path.dirname(_HERE), "converters", "data")
        for name, sents in (("heldout_eval.txt", ev), ("heldout_calib.txt", ca)):
            with open(os.path.join(data, name), "w", encoding="utf-8") as f:
                f.write("\n".join(sents) + "\n")
        print(f"wrote {len(ev)} + {len(ca)} sentences to {data}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = embedded.Tokenizer()
    held = embedded.heldout_sentences("eval")
    calib_sets = {"same": embedded.heldout_sentences("calib")[:args.calib_count],
                  "other": embedded.default_sentences()}
    assert not set(held) & (set(calib_sets["same"]) | set(calib_sets["other"])), "held-out set not disjoint"
    kinds = [k.strip() for k in args.calibrations.split(",") if k.strip()]
    sets = {"held-out": held, **{f"calib:{k}": calib_sets[k] for k in kinds}}
    t0 = time.perf_counter()
    refs = {name: embedded.torch_reference_embeddings(s) for name, s in sets.items()}
    if any(r is None for r in refs.values()):
        print("torch / sentence-transformers are needed for the fp32 reference", file=sys.stderr)
        return 2
    print(f"references: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    batcher = (lambda s: embedded.calibration_batches(tok, s, bucket=args.bucket)) if args.batching == "exact" \
        else (lambda s: padded_batches(tok, s))
    rows = []
    for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        for search in [s.strip() for s in args.searches.split(",") if s.strip()]:
            for kind in (kinds if search != "rtn" else kinds[:1]):
                t = time.perf_counter()
                cal = "none" if search == "rtn" else kind
                scored = sets if search == "rtn" else {"held-out": held, f"calib:{kind}": calib_sets[kind]}
                r = run(scheme, search, None if search == "rtn" else batcher(calib_sets[kind]), scored, refs, tok)
                if search == "rtn":  # one uncalibrated model, scored on every set
                    for k in kinds:
                        print(f"{scheme:<10} rtn       on calib:{k} {r[f'calib:{k}'][0]:.5f} / "
                              f"{r[f'calib:{k}'][1]:.5f}", file=sys.stderr, flush=True)
                row = {"scheme": scheme, "search": search, "calibration": cal,
                       "calib_sentences": len(calib_sets[kind]), "batching": args.batching,
                       "heldout_mean": r["held-out"][0], "heldout_min": r["held-out"][1],
                       "calib_mean": r[f"calib:{kind}"][0], "calib_min": r[f"calib:{kind}"][1],
                       "seconds": round(time.perf_counter() - t, 1)}
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                print(f"{scheme:<10} {search:<9} {cal:<6} held-out {row['heldout_mean']:.5f} / "
                      f"{row['heldout_min']:.5f}   calib set {row['calib_mean']:.5f} / {row['calib_min']:.5f}"
                      f"   ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    if not args.json:
        print("| scheme | search | calibrated on | held-out mean / min | calibration set mean / min |")
        print("| --- | --- | --- | ---: | ---: |")
        for r in rows:
            print(f"| {r['scheme']} | {r['search']} | {r['calibration']} | {r['heldout_mean']:.5f} / "
                  f"{r['heldout_min']:.5f} | {r['calib_mean']:.5f} / {r['calib_min']:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
