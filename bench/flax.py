"""MiniLM (Flax NNX, real weights) jit forward latency and parameter bytes, dense vs qformats schemes (and qwix).

Usage: python bench/flax.py [--batch 32] [--seq 128] [--repeat 5] [--schemes ...] [--no-qwix] [--append]

For each scheme: `quantize_model` time and peak RSS growth while quantizing, parameter bytes
(`nnx.state(model, nnx.Param)`), and the best-of-N latency of a jit forward pass on a [batch, seq] batch.
When qwix is installed the same model is quantized with `qwix.quantize_model(model, PtqProvider(...))`
(int8 and float8_e4m3fn weights, per-channel) in the same run, side by side. Prints a markdown table;
--append also appends it to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
import warnings

# This file is named flax.py: drop its own folder from sys.path so `import flax` finds the library.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from examples import minilm  # noqa: E402
from qformats.nn import Rule, param_bytes, quantize_model  # noqa: E402

SCHEMES = ["W8A16", "FP8_E4M3", "FP8_DYNAMIC", "W4A16", "NVFP4A16", "MXFP4A16", "FP6_E3M2"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _latency(model, batch, repeat):
    fwd = nnx.jit(lambda m, ids, mask: m(ids, mask))
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    t = time.perf_counter()
    jax.block_until_ready(fwd(model, ids, mask))
    compile_s = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fwd(model, ids, mask))
        best = min(best, time.perf_counter() - t)
    return best, compile_s


def _row(name, model, batch, repeat, q_s, rss):
    lat, comp = _latency(model, batch, repeat)
    return {"scheme": name, "bytes": param_bytes(model), "latency_ms": lat * 1e3, "compile_s": comp,
            "quantize_s": q_s, "rss_mb": rss}


def _qwix(qtype, batch):
    import qwix

    model = minilm.load_minilm()
    rules = [qwix.QtRule(module_path=".*", weight_qtype=qtype)]
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    r0, t = _rss_mb(), time.perf_counter()
    qmodel = qwix.quantize_model(model, qwix.PtqProvider(rules), ids, mask)
    jax.block_until_ready(jax.tree.leaves(nnx.state(qmodel)))
    return qmodel, time.perf_counter() - t, _rss_mb() - r0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--no-qwix", action="store_true")
    p.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    args = p.parse_args(argv)

    tok = minilm.Tokenizer(max_length=args.seq)
    sents = (minilm.default_sentences() * (args.batch // 8 + 1))[: args.batch]
    batch = tok(sents, length=args.seq)
    rows = []
    model = minilm.load_minilm()
    rows.append(_row("dense f32", model, batch, args.repeat, 0.0, 0.0))
    for name in [s for s in args.schemes.split(",") if s]:
        model = minilm.load_minilm()
        r0, t = _rss_mb(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_model(model, [Rule(".*", name)])
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        rows.append(_row(f"qformats {name}", model, batch, args.repeat, time.perf_counter() - t, _rss_mb() - r0))
    qwix_note = ""
    if not args.no_qwix:
        try:
            import qwix  # noqa: F401
        except ImportError:
            qwix_note = "qwix not installed: no qwix rows"
        else:
            for qt in ("int8", "float8_e4m3fn"):
                try:
                    qm, q_s, rss = _qwix(qt, batch)
                    rows.append(_row(f"qwix PTQ {qt}", qm, batch, args.repeat, q_s, rss))
                except Exception as e:  # report, never hide
                    qwix_note += f"qwix {qt} failed: {type(e).__name__}: {e}\n"
    dense = rows[0]["bytes"]
    head = (f"### MiniLM jit forward, batch {args.batch} x {args.seq} tokens ({platform.machine()}, "
            f"{jax.default_backend()}, jax {jax.__version__})\n\n"
            "| model | param MB | vs dense | forward ms | compile s | quantize_model s | peak RSS +MB |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head] + [f"| {r['scheme']} | {r['bytes'] / 1e6:.2f} | {dense / r['bytes']:.2f}x | "
                      f"{r['latency_ms']:.1f} | {r['compile_s']:.1f} | {r['quantize_s']:.2f} | {r['rss_mb']:.0f} |"
                      for r in rows]
    out = "\n".join(lines) + ("\n\n" + qwix_note.strip() if qwix_note else "")
    print(out)
    if args.append:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "BENCHMARKS.md"), "a") as f:
            f.write("\n" + out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
