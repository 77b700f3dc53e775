"""MiniLM (Flax NNX, real weights) jit forward latency and parameter bytes, dense vs qformats schemes (and qwix).

Usage: python bench/flax_minilm.py [--batch 32] [--seq 128] [--repeat 5] [--schemes ...] [--no-qwix]

For each scheme: `quantize_model` time, peak RSS growth while quantizing (`bench/peak_rss.py`), growth
of live JAX arrays after it (for qwix counting the original model the caller still holds: qwix returns
a new model, ours swaps in place), parameter bytes (`nnx.state(model, nnx.Param)`), and the best-of-N
latency of a jit forward pass on a [batch, seq] batch (all models timed round-robin).
When qwix is installed the same model is quantized with `qwix.quantize_model(model, PtqProvider(...))`
(int8 and float8_e4m3fn weights, per-channel) in the same run, side by side. Prints the markdown table of
BENCHMARKS.md's section "Flax MiniLM forward and quantize_model vs qwix"; update that section with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

# Run from anywhere: put the repo root on sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from converters.evaluation import embedded  # noqa: E402
from qformats.nn import Rule, param_bytes, quantize_model  # noqa: E402
from peak_rss import PeakRSS  # noqa: E402

SCHEMES = ["W8A16", "FP8_E4M3", "FP8_DYNAMIC", "W4A16", "NVFP4A16", "MXFP4A16", "FP6_E3M2"]


def _live_mb() -> float:
    return sum(a.nbytes for a in jax.live_arrays()) / 2**20


def _compile(model, batch):
    fwd = nnx.jit(lambda m, ids, mask: m(ids, mask))
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    t = time.perf_counter()
    jax.block_until_ready(fwd(model, ids, mask))
    return (lambda: jax.block_until_ready(fwd(model, ids, mask))), time.perf_counter() - t


def _ours(name):
    model = embedded.load_minilm()
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    live0 = _live_mb()
    t = time.perf_counter()
    with PeakRSS() as mem, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, [Rule(".*", name)])
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    return model, time.perf_counter() - t, mem.growth, _live_mb() - live0


def _qwix(qtype, batch):
    import qwix

    model = embedded.load_minilm()
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    live0 = _live_mb()
    rules = [qwix.QtRule(module_path=".*", weight_qtype=qtype)]
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    t = time.perf_counter()
    with PeakRSS() as mem:
        qmodel = qwix.quantize_model(model, qwix.PtqProvider(rules), ids, mask)
        jax.block_until_ready(jax.tree.leaves(nnx.state(qmodel)))
    # the caller still holds `model` (qwix returns a new one); count what is alive with both
    return (qmodel, model), time.perf_counter() - t, mem.growth, _live_mb() - live0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--no-qwix", action="store_true")
    args = p.parse_args(argv)

    tok = embedded.Tokenizer(max_length=args.seq)
    sents = (embedded.default_sentences() * (args.batch // 8 + 1))[: args.batch]
    batch = tok(sents, length=args.seq)
    entries = []  # (name, model, quantize_s, peak MB, live MB)
    entries.append(("dense f32", embedded.load_minilm(), 0.0, 0.0, 0.0))
    for name in [s for s in args.schemes.split(",") if s]:
        model, q_s, peak, live = _ours(name)
        entries.append((f"qformats {name}", model, q_s, peak, live))
    qwix_note = ""
    if not args.no_qwix:
        try:
            import qwix  # noqa: F401
        except ImportError:
            qwix_note = "qwix not installed: no qwix rows"
        else:
            for qt in ("int8", "float8_e4m3fn"):
                try:
                    (qm, _orig), q_s, peak, live = _qwix(qt, batch)
                    entries.append((f"qwix PTQ {qt}", qm, q_s, peak, live))
                except Exception as e:  # report, never hide
                    qwix_note += f"qwix {qt} failed: {type(e).__name__}: {e}\n"
    runs, comps = [], []
    for _, model, *_ in entries:
        run, comp = _compile(model, batch)
        runs.append(run)
        comps.append(comp)
    best = [float("inf")] * len(entries)
    for _ in range(args.repeat):  # round-robin, best of N: fair under a noisy shared CPU
        for i, run in enumerate(runs):
            t = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - t)
    rows = [{"scheme": n, "bytes": param_bytes(m), "latency_ms": b * 1e3, "compile_s": c, "quantize_s": q,
             "rss_mb": p, "live_mb": lv} for (n, m, q, p, lv), b, c in zip(entries, best, comps)]
    dense = rows[0]["bytes"]
    head = (f"### MiniLM jit forward, batch {args.batch} x {args.seq} tokens ({platform.machine()}, "
            f"{jax.default_backend()}, jax {jax.__version__})\n\n"
            "| model | param MB | vs dense | forward ms | compile s | quantize_model s | peak RSS +MB "
            "| live arrays +MB |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head] + [f"| {r['scheme']} | {r['bytes'] / 1e6:.2f} | {dense / r['bytes']:.2f}x | "
                      f"{r['latency_ms']:.1f} | {r['compile_s']:.1f} | {r['quantize_s']:.2f} | {r['rss_mb']:.0f} | "
                      f"{r['live_mb']:.0f} |"
                      for r in rows]
    out = "\n".join(lines) + ("\n\n" + qwix_note.strip() if qwix_note else "")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
