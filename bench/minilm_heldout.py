"""MiniLM calibrated quantization judged on held-out text: mean / min cosine vs fp32 on the calibration set, on a
validation set and on a disjoint evaluation set, calibrated on text of the same kind and of another kind.

Usage:
  python bench/minilm_heldout.py [--schemes W4A16,NVFP4A16,MXFP4A16,FP6_E2M3] [--searches rtn,mse,gptq,mse+gptq]
         [--calibrations same,other] [--calib-count 64] [--dampening 0.01] [--actorder static|none]
         [--batching exact|padded] [--json] [--make-sets]
  python bench/minilm_heldout.py --sweep OUT.jsonl [--plan w4a16,beyond,rtn,schemes,budget,order,mse] [--shard I/N]
  python bench/minilm_heldout.py --final OUT.jsonl --configs SCHEME:SEARCH:DAMP:ACTORDER:KIND:COUNT,...
  python bench/minilm_heldout.py --diagnose   (per layer kind: validation energy outside H_C's span)
  python bench/minilm_heldout.py --report SWEEP.jsonl [FINAL.jsonl]   (markdown tables, "**": min below RTN's)

Sets (package data, `converters.evaluation.embedded.heldout_sentences` / `default_sentences`):
  held-out   converters/evaluation/data/heldout_eval.txt: 256 sentences of the Python documentation's prose;
  same kind  converters/evaluation/data/heldout_calib.txt: another 256 sentences of that prose; the first 64 are the
             calibration pool (the first 16 / 32 / 64 used), sentences 128-255 the validation set;
  other kind converters/evaluation/data/sentences.txt: the 64 shipped everyday-English sentences (the first 16 / 32 /
  64).
The two prose sets come from `pydoc_data.topics` (the standard library's copy of the Python reference's topics,
PSF License): non-indented paragraphs split into sentences, kept when 8-40 words, capitalised, ending in ".",
with >= 93% letters/spaces and no code punctuation; deduplicated, shuffled with numpy seed 0; the first 256 are
the held-out set, the next 256 the calibration set. `--make-sets` rewrites the two files that way (the shipped
files are what the figures in BENCHMARKS.md used; a different Python's pydoc_data gives different sentences).

Every Linear (pooler included) is quantized as `converters.pipelines.calibrate.quantize_calibrated` does
(`quantize_model(..., calibration_data=batches, weight_search=S)`); the reference is torch sentence-transformers
fp32. `--batching padded` calibrates on the old padded batches (32 a batch, lengths rounded up to 16, padding
rows entering H) instead of `embedded.calibration_batches` (no padding).

`--sweep` chooses defaults without touching the held-out set: every configuration (weight search x GPTQ
dampening x activation order x token budget x kind of calibration text) is scored on the validation set
(128 prose sentences, in no calibration set) and on its own calibration sentences (the gap between the two
is the overfit); rows are appended to OUT.jsonl as they finish and rows already there or claimed by a running
process (OUT.jsonl.claims) are skipped, so several processes share one plan and a run can be resumed (delete
the claims file of a killed run first). The sweep runs `quantize_model` with
compare_rtn=False (the model-level guard's two extra passes; the per-layer tr(dW^T H dW) check stays on).
`--final` scores the chosen configurations once on the 256 held-out sentences with the library's full path
(compare_rtn on); the GPTQ dampening goes to `quantize_model(dampening_frac=...)`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from converters.evaluation import embedded  # noqa: E402
from converters.evaluation.embedding_fidelity import cosines, resolve  # noqa: E402
from qformats.models import minilm  # noqa: E402
from qformats.nn import QLinear, Rule, quantize_model  # noqa: E402
from qformats.nn.graph import module_references, replace_child  # noqa: E402
from qformats.observers import get_observer  # noqa: E402

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


def run(scheme, search, batches, sets, refs, tok, *, dampening=0.01, actorder="static", compare_rtn=True):
    """Quantize a fresh MiniLM with `scheme` / `search` on `batches` → {set: (mean, min)} cosines vs fp32."""
    model = embedded.load_minilm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, [Rule(".*", resolve(scheme))], calibration_data=None if search == "rtn" else batches,
                       weight_search=search, actorder=actorder, compare_rtn=compare_rtn, dampening_frac=dampening)
    out = {}
    for name, sents in sets.items():
        c = cosines(minilm.encode_sentences(model, tok, sents, 32), refs[name])
        out[name] = (float(c.mean()), float(c.min()))
    return out


DAMPENINGS = (0.001, 0.01, 0.03, 0.1)
COUNTS = (16, 32, 64)
KINDS = ("same", "other")


def sweep_plan(parts):
    """The sweep's configurations (scheme, search, dampening, actorder, kind, sentences) by named parts, in the
    order given (a part "NAME@D" keeps only its rows at dampening D):
      w4a16:   W4A16: rtn; mse; mse+gptq x every dampening (static order) — 64 sentences of each kind;
      beyond:  W4A16 mse+gptq at 0.3 and 1.0 (past the grid) — 64 sentences of each kind;
      rtn:     NVFP4A16, MXFP4A16, FP6_E2M3 round-to-nearest;
      schemes: NVFP4A16, MXFP4A16, FP6_E2M3 mse+gptq at 0.01 and 0.1 — 64 sentences of each kind;
      budget:  W4A16 mse+gptq at 0.01 and 0.1 on 16 and 32 sentences of each kind;
      order:   W4A16 mse+gptq at 0.01 in column order (no act order); gptq at 0.1 — 64 sentences of each kind;
      mse:     NVFP4A16, MXFP4A16, FP6_E2M3 mse — 64 sentences of each kind.
    """
    others = ("NVFP4A16", "MXFP4A16", "FP6_E2M3")
    plan = []
    for part in parts:
        part, _, only = part.partition("@")
        rows = []
        if part == "w4a16":
            rows.append(("W4A16", "rtn", None, None, "none", 0))
            rows += [("W4A16", "mse", None, None, k, 64) for k in KINDS]
            rows += [("W4A16", "mse+gptq", d, "static", k, 64) for d in DAMPENINGS for k in KINDS]
        elif part == "beyond":
            rows += [("W4A16", "mse+gptq", d, "static", k, 64) for d in (0.3, 1.0) for k in KINDS]
        elif part == "rtn":
            rows += [(s, "rtn", None, None, "none", 0) for s in others]
        elif part == "schemes":
            rows += [(s, "mse+gptq", d, "static", k, 64) for d in (0.1, 0.01) for s in others for k in KINDS]
        elif part == "budget":
            rows += [("W4A16", "mse+gptq", d, "static", k, n) for d in (0.1, 0.01) for n in (32, 16) for k in KINDS]
        elif part == "order":
            rows += [("W4A16", "mse+gptq", 0.01, "none", k, 64) for k in KINDS]
            rows += [("W4A16", "gptq", 0.1, "static", k, 64) for k in KINDS]
        elif part == "mse":
            rows += [(s, "mse", None, None, k, 64) for s in others for k in KINDS]
        else:
            raise SystemExit(f"--plan: unknown part {part!r} (w4a16, beyond, rtn, schemes, budget, order, mse)")
        plan += [r for r in rows if not only or r[2] == float(only)]
    return plan


def config_key(c):
    return "{}:{}:{}:{}:{}:{}".format(*c)


def parse_config(text):
    """SCHEME:SEARCH:DAMP:ACTORDER:KIND:COUNT → a plan tuple (DAMP/ACTORDER 'None' for rtn and mse)."""
    s, search, d, a, k, n = text.split(":")
    return (s, search, None if d == "None" else float(d), None if a == "None" else a, k, int(n))


def reference(sentences, cache=None):
    """torch sentence-transformers fp32 embeddings of `sentences`, kept in the directory `cache` (a .npy file
    named by a hash of the sentences) when given, so resumed and parallel sweeps compute them once."""
    if cache is None:
        return embedded.torch_reference_embeddings(sentences)
    name = os.path.join(cache, hashlib.sha256("\n".join(sentences).encode()).hexdigest()[:16] + ".npy")
    if os.path.exists(name):
        return np.load(name, allow_pickle=False)
    emb = embedded.torch_reference_embeddings(sentences)
    os.makedirs(cache, exist_ok=True)
    np.save(name + ".tmp.npy", emb)
    os.replace(name + ".tmp.npy", name)
    return emb


def _taken(out_path, claims=True):
    """Keys of the rows in `out_path` (and, with claims, of those claimed in `out_path`.claims)."""
    keys = set()
    for path in (out_path, out_path + ".claims") if claims else (out_path,):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                keys |= {json.loads(line)["key"] if line.startswith("{") else line.strip() for line in f if line.strip()}
    return keys


def _claim(out_path, key):
    """Claim `key` for this process (False when done or claimed already): a line in `out_path`.claims, under an
    exclusive lock, so several sweep processes share one plan as a work queue."""
    with open(out_path + ".claims", "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if key in _taken(out_path):
            return False
        f.write(key + "\n")
        f.flush()
    return True


def sweep(out_path, plan, score_on, *, compare_rtn, shard=(0, 1), cache=None):
    """Run the `plan` rows not yet in `out_path` (JSON lines), scoring each on `score_on` ("validation" or
    "held-out") and on its own calibration sentences; append each row as it finishes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    todo = [c for i, c in enumerate(plan) if i % shard[1] == shard[0]]
    if not [c for c in todo if config_key(c) not in _taken(out_path, claims=False)]:
        print("nothing to do", file=sys.stderr)
        return 0
    tok = embedded.Tokenizer()
    prose = embedded.heldout_sentences("calib")
    pools = {"same": prose[:64], "other": embedded.default_sentences()}
    score = embedded.heldout_sentences("eval") if score_on == "held-out" else prose[128:]
    assert not set(score) & (set(pools["same"]) | set(pools["other"])), "scored set not disjoint"
    t0 = time.perf_counter()
    sets = {score_on: score, **{f"calib:{k}": v for k, v in pools.items()}}
    refs = {name: reference(s, cache) for name, s in sets.items()}
    print(f"references: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for c in todo:
        if not _claim(out_path, config_key(c)):
            continue  # done, or being run by another process
        scheme, search, damp, act, kind, n = c
        t = time.perf_counter()
        calib = pools[kind][:n] if search != "rtn" else pools["same"]
        batches = None if search == "rtn" else embedded.calibration_batches(tok, calib)
        scored = {score_on: score, "calib": calib}
        r_refs = {score_on: refs[score_on], "calib": refs[f"calib:{kind if search != 'rtn' else 'same'}"][:len(calib)]}
        r = run(scheme, search, batches, scored, r_refs, tok, dampening=0.01 if damp is None else damp,
                actorder=None if act in (None, "none") else act, compare_rtn=compare_rtn)
        row = {"key": config_key(c), "scheme": scheme, "search": search, "dampening": damp, "actorder": act,
               "calibration": kind, "calib_sentences": n,
               "calib_tokens": 0 if batches is None else int(sum(b["input_ids"].size for b in batches)),
               "scored_on": score_on, "mean": r[score_on][0], "min": r[score_on][1],
               "calib_mean": r["calib"][0], "calib_min": r["calib"][1], "compare_rtn": compare_rtn,
               "seconds": round(time.perf_counter() - t, 1), "load": round(os.getloadavg()[0], 1)}
        with open(out_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['key']:<36} {score_on} {row['mean']:.5f} / {row['min']:.5f}   calib set "
              f"{row['calib_mean']:.5f} / {row['calib_min']:.5f}   ({row['seconds']:.0f} s, load {row['load']})",
              file=sys.stderr, flush=True)
    return 0


def input_moments(tok, sentences):
    """Every Linear's input second moment over `sentences` (calibration batches, no padding rows): path ->
    (H = (1/n) sum_t x_t x_t^T as float64 [K, K], n tokens), read from calibrating `QLinear`s (full moments)
    swapped in for the float layers — the H that `quantize_model` gives GPTQ. Layers that see no input are left
    out."""
    model = embedded.load_minilm()
    ss = resolve("W4A16")
    layers = {}
    for path, lin, parents in module_references(model, nnx.Linear).values():
        q = QLinear.from_module(lin, ss, mode="calibrate", path=path, observer=get_observer("minmax", ss.weights),
                                full_moments=True)
        for parent, key in parents:
            replace_child(parent, key, q)
        layers[path] = q
    step = nnx.jit(lambda m, b: m(**b))
    for b in embedded.calibration_batches(tok, sentences):
        step(model, b)
    out = {}
    for path, q in layers.items():
        total, n = q.calib_sq.get_value()
        if float(n) > 0:  # the pooler: mean-pooled embeddings never run it (quantize_model keeps it RTN)
            out[path] = (np.asarray(total, np.float64) / float(n), int(n))
    return out


def diagnose(dampenings=(0.01, 0.1)):
    """Why GPTQ calibrated on few tokens or other text loses held-out fidelity, per layer: for H_C (calibration)
    with eigenpairs (e_i, u_i) and the dampening level lam = d * mean(diag H_C), the share of the validation
    inputs' energy that H_C barely sees,
        low(d) = sum_{i: e_i < lam} u_i^T H_V u_i / tr(H_V)       (H_V: validation moments),
    i.e. the directions where GPTQ's objective tr(dW^T (H_C + lam I) dW) is held only by the dampening, so
    the error GPTQ pushes out of H_C's span lands where the validation text has this much energy."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = embedded.Tokenizer()
    prose = embedded.heldout_sentences("calib")
    sets = {"same 64": prose[:64], "same 32": prose[:32], "other 64": embedded.default_sentences(),
            "other 16": embedded.default_sentences()[:16]}
    hv = input_moments(tok, prose[128:])
    kinds = {}
    for path in hv:
        leaf = path.rsplit("/", 2)
        role = "/".join(leaf[-2:]) if "attention" in path else leaf[-1]
        if role in ("attention/key", "attention/value"):
            continue  # the query's input: one H for q/k/v
        kinds.setdefault("attention/qkv" if role == "attention/query" else role, []).append(path)
    print("| calibration | tokens | " + " | ".join(f"{k} (K={hv[v[0]][0].shape[0]}) low@{d}"
                                                  for k, v in kinds.items() for d in dampenings) + " |")
    print("| --- | ---: |" + " ---: |" * (len(kinds) * len(dampenings)))
    for name, sents in sets.items():
        hc = input_moments(tok, sents)
        cells = []
        for k, paths in kinds.items():
            eig = {p: np.linalg.eigh(hc[p][0]) for p in paths}
            for d in dampenings:
                vals = []
                for p in paths:
                    e, u = eig[p]
                    low = u[:, e < d * np.mean(np.diag(hc[p][0]))]
                    vals.append(np.trace(low.T @ hv[p][0] @ low) / np.trace(hv[p][0]))
                cells.append(f"{np.mean(vals):.3f}")
        print(f"| {name} | {next(iter(hc.values()))[1]} | " + " | ".join(cells) + " |", flush=True)
    return 0


def report(paths):
    """Markdown tables of the rows in the JSON-lines files `paths` (sweep and final), best validation mean first
    within each scheme; gap = calibration-set mean - scored-set mean (the overfit)."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    for scored in ("validation", "held-out"):
        sel = [r for r in rows if r["scored_on"] == scored]
        if not sel:
            continue
        print(f"\n| scheme | search | dampening | act order | calibrated on | tokens | {scored} mean / min | "
              "calibration set mean / min | gap |")
        print("| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
        rtn = {r["scheme"]: r for r in sel if r["search"] == "rtn"}
        for r in sorted(sel, key=lambda r: (SCHEMES.split(",").index(r["scheme"]), r["search"] != "rtn",
                                            r["calibration"], -r["calib_sentences"], -r["mean"])):
            on = "—" if r["search"] == "rtn" else f"{r['calib_sentences']} {r['calibration']} kind"
            below = r["scheme"] in rtn and r["search"] != "rtn" and r["min"] < rtn[r["scheme"]]["min"]
            print(f"| {r['scheme']} | {r['search']} | {r['dampening'] if r['dampening'] is not None else ''} | "
                  f"{r['actorder'] or ''} | {on} | {r['calib_tokens'] or ''} | {r['mean']:.5f} / "
                  f"{'**' if below else ''}{r['min']:.5f}{'**' if below else ''} | "
                  f"{r['calib_mean']:.5f} / {r['calib_min']:.5f} | {r['calib_mean'] - r['mean']:+.4f} |")
    return 0


def grid(args) -> int:
    """The plain grid: schemes x searches x kinds of calibration text, scored on the held-out set."""
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
    actorder = None if args.actorder == "none" else args.actorder
    rows = []
    for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        for search in [s.strip() for s in args.searches.split(",") if s.strip()]:
            for kind in (kinds if search != "rtn" else kinds[:1]):
                t = time.perf_counter()
                cal = "none" if search == "rtn" else kind
                scored = sets if search == "rtn" else {"held-out": held, f"calib:{kind}": calib_sets[kind]}
                r = run(scheme, search, None if search == "rtn" else batcher(calib_sets[kind]), scored, refs, tok,
                        dampening=args.dampening, actorder=actorder)
                if search == "rtn":  # one uncalibrated model, scored on every set
                    for k in kinds:
                        print(f"{scheme:<10} rtn       on calib:{k} {r[f'calib:{k}'][0]:.5f} / "
                              f"{r[f'calib:{k}'][1]:.5f}", file=sys.stderr, flush=True)
                row = {"scheme": scheme, "search": search, "calibration": cal,
                       "calib_sentences": len(calib_sets[kind]), "batching": args.batching,
                       "dampening": args.dampening, "actorder": args.actorder,
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default=SCHEMES)
    ap.add_argument("--searches", default=SEARCHES)
    ap.add_argument("--calibrations", default="same,other", help="same (prose) and/or other (the shipped set)")
    ap.add_argument("--calib-count", type=int, default=64, help="sentences of the same-kind set to calibrate on")
    ap.add_argument("--dampening", type=float, default=0.01, help="GPTQ's dampening_frac")
    ap.add_argument("--actorder", choices=("static", "none"), default="static", help="GPTQ's column order")
    ap.add_argument("--batching", choices=("exact", "padded"), default="exact")
    ap.add_argument("--bucket", type=int, default=8, help="embedded.calibration_batches' length bucket")
    ap.add_argument("--json", action="store_true", help="one JSON line per row, on stdout")
    ap.add_argument("--make-sets", action="store_true",
                    help="rewrite converters/evaluation/data/heldout_*.txt and exit")
    ap.add_argument("--sweep", metavar="OUT.jsonl", help="run the sweep plan, scored on the validation set")
    ap.add_argument("--plan", default="w4a16,beyond,rtn,schemes,budget,order,mse", help="the sweep's parts, in order")
    ap.add_argument("--shard", default="0/1", help="I/N: run every N-th row of the plan starting at I")
    ap.add_argument("--final", metavar="OUT.jsonl", help="score --configs on the held-out set (compare_rtn on)")
    ap.add_argument("--configs", default="", help="SCHEME:SEARCH:DAMP:ACTORDER:KIND:COUNT,... for --final")
    ap.add_argument("--diagnose", action="store_true", help="per-layer share of validation energy H_C misses")
    ap.add_argument("--refs-cache", metavar="DIR", help="keep the fp32 reference embeddings in DIR (.npy)")
    ap.add_argument("--report", nargs="+", metavar="ROWS.jsonl", help="print the tables of sweep / final rows")
    args = ap.parse_args(argv)
    if args.make_sets:
        ev, ca = make_sets()
        data = os.path.join(os.path.dirname(_HERE), "converters", "evaluation", "data")
        for name, sents in (("heldout_eval.txt", ev), ("heldout_calib.txt", ca)):
            with open(os.path.join(data, name), "w", encoding="utf-8") as f:
                f.write("\n".join(sents) + "\n")
        print(f"wrote {len(ev)} + {len(ca)} sentences to {data}")
        return 0
    if args.report:
        return report(args.report)
    if args.diagnose:
        return diagnose()
    shard = tuple(int(x) for x in args.shard.split("/"))
    if args.sweep:
        return sweep(args.sweep, sweep_plan([p.strip() for p in args.plan.split(",") if p.strip()]), "validation",
                     compare_rtn=False, shard=shard, cache=args.refs_cache)
    if args.final:
        plan = [parse_config(c) for c in args.configs.split(",") if c.strip()]
        return sweep(args.final, plan, "held-out", compare_rtn=True, shard=shard, cache=args.refs_cache)
    return grid(args)


if __name__ == "__main__":
    sys.exit(main())
