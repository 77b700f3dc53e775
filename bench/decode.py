"""Greedy decode throughput (tokens/s) of the small LLaMA-style decoder (examples/llama.py), dense vs schemes.

Usage: python bench/decode.py [--batch 1] [--prompt 32] [--new 64] [--repeat 3] [--schemes ...] [--append]

Times the whole jit `generate` (prefill + scan of decode steps) after a warm-up call, best of N; tokens/s
counts generated tokens (batch x new). Parameter bytes are those of `nnx.state(model, nnx.Param)`.
Prints a markdown table; --append also appends it to BENCHMARKS.md.
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

from examples.llama import LlamaConfig, generate, small_llama  # noqa: E402
from qformats.nn import Rule, param_bytes, quantize_model  # noqa: E402

SCHEMES = ["W8A16", "FP8_DYNAMIC", "W4A16", "NVFP4A16", "MXFP4A16", "FP6_E3M2"]


def _bench(model, prompt, new, repeat):
    t = time.perf_counter()
    out = jax.block_until_ready(generate(model, prompt, new))
    compile_s = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(generate(model, prompt, new))
        best = min(best, time.perf_counter() - t)
    return best, compile_s, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--append", action="store_true")
    args = p.parse_args(argv)
    cfg = LlamaConfig()
    prompt = jax.random.randint(jax.random.key(0), (args.batch, args.prompt), 0, cfg.vocab_size)
    rows = []
    ref_tokens = None
    for name in ["dense"] + [s for s in args.schemes.split(",") if s]:
        model = small_llama(0, cfg)
        if name != "dense":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_model(model, [Rule(".*", name)])
        best, comp, toks = _bench(model, prompt, args.new, args.repeat)
        if ref_tokens is None:
            ref_tokens = toks
        agree = float((toks == ref_tokens).mean())
        rows.append((name, param_bytes(model), args.batch * args.new / best, comp, agree))
    dense_tps = rows[0][2]
    lines = [f"### Decode, LLaMA-style {cfg.n_layers}L d{cfg.dim} GQA {cfg.n_heads}/{cfg.n_kv_heads} "
             f"ffn{cfg.ffn_dim} vocab{cfg.vocab_size}, batch {args.batch}, prompt {args.prompt}, "
             f"{args.new} new tokens ({platform.machine()}, {jax.default_backend()}, jax {jax.__version__})",
             "",
             "| scheme | param MB | tokens/s | vs dense | compile s | greedy tokens = dense |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, nbytes, tps, comp, agree in rows:
        lines.append(f"| {name} | {nbytes / 1e6:.2f} | {tps:.0f} | {tps / dense_tps:.2f}x | {comp:.1f} | "
                     f"{agree:.0%} |")
    out = "\n".join(lines)
    print(out)
    if args.append:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "BENCHMARKS.md"), "a") as f:
            f.write("\n" + out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
