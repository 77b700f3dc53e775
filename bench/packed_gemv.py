"""One-row GEMV (decode) on XLA:CPU, ms per call: dense f32 vs dequantize-then-dot vs qformats.packed_dot.

  python bench/packed_gemv.py [--shapes 576x1536,1536x576,4096x4096] [--schemes W4A16:g64,...] [--rounds 30]

x [1, K] float32 times a [K, N] weight quantized along K (random normal * 0.05, seed 0): "dense" is x @ W with
W = dequantize(q) precomputed (f32, 4 bytes per weight); "dequantize+dot" is `dequantize(q)` then dot_general
inside one jit (the generic XLA path); "packed_dot" is `qformats.packed_dot.packed_dot` (what `qdot` runs for up to
8 rows of a 4- or 8-bit weight). The three run round-robin, --rounds times each; the table shows the best time of
each: the one-row GEMV table of BENCHMARKS.md's section "CPU decode (SmolLM2)"; update that table with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qformats import dequantize, quantize  # noqa: E402
from qformats.packed_dot import packed_dot  # noqa: E402
from qformats.presets import parse_scheme  # noqa: E402


def _dequantize_then_dot(x, q):
    return jax.lax.dot_general(x, dequantize(q, dtype=x.dtype), (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="576x1536,1536x576,4096x4096")
    ap.add_argument("--schemes", default="W4A16:g64,W4A16_ASYM:g64,NVFP4A16,MXFP4A16,W8A16:g64")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args(argv)
    lines = [f"### One-row GEMV, ms per call (bench/packed_gemv.py; {platform.machine()}, {os.cpu_count()} CPUs, "
             f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')})", "",
             "| K x N | scheme | dense f32 | dequantize+dot | packed_dot | packed_dot vs dequantize+dot | "
             "packed_dot vs dense | max abs diff |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    dense_f = jax.jit(lambda x, w: x @ w)
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w = jnp.asarray(np.random.RandomState(0).standard_normal((k, n)).astype(np.float32) * 0.05)
        x = jnp.asarray(np.random.RandomState(1).standard_normal((1, k)).astype(np.float32))
        for name in a.schemes.split(","):
            q = quantize(w, parse_scheme(name).weights, axis=0)
            wd = dequantize(q)
            fns = {"dense": (dense_f, (x, wd)), "deq": (jax.jit(_dequantize_then_dot), (x, q)),
                   "packed": (jax.jit(packed_dot), (x, q))}
            outs = {key: jax.block_until_ready(f(*args)) for key, (f, args) in fns.items()}
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(a.rounds):
                for key, (f, args) in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    best[key] = min(best[key], time.perf_counter() - t)
            diff = float(jnp.abs(outs["packed"] - outs["deq"]).max())
            lines.append(f"| {k}x{n} | {name} | {best['dense'] * 1e3:.3f} | {best['deq'] * 1e3:.3f} | "
                         f"{best['packed'] * 1e3:.3f} | {best['deq'] / best['packed']:.2f}x faster | "
                         f"{best['dense'] / best['packed']:.2f}x | {diff:.1e} |")
            print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
