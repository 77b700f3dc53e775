"""Expert-parallel decode step of a random Qwen3-MoE-shaped model on 8 forced CPU devices: step ms per mesh (expert
parallel 2 / 4 / 8, expert x tensor parallel) against one device in the same process, the greedy token against one
device's, and the collectives of the compiled decode step (what crosses devices: activations, not expert weights).

Usage: python bench/moe_ep_decode.py [--layers 8] [--hidden 1024] [--experts 64] [--moe-inter 512] [--top-k 8]
                                     [--schemes float,W4A16] [--meshes ep2,ep4,ep8,ep2xtp2,ep4xtp2] [--steps 10]

The script re-runs itself in a fresh interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=8 (and
--xla_cpu_multi_thread_eigen=false). The forced host devices are threads of one process on the same CPU cores: on a
2-core machine the 8 "devices" share 2 cores, so these figures show the overhead of the expert-parallel program
(shard_map, the psum of the routed rows, the work split), not a speed-up.

Timing: the fastest of --steps jit calls of one decode step (batch 1, one token, an empty KV cache of 64 positions),
parameters placed by `shard_model(model, parallel_setup(tp, ep), decoder_parallel_rules(...))` as `generate
--expert-parallel` places them. Collectives: every all-reduce / all-gather / all-to-all / reduce-scatter /
collective-permute of the compiled step with its bytes, against the bytes of one layer's expert stacks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
DEVICES = 8
OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(OPS) + r")(-start)?\(", re.M)
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_ITEM = dict(pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8,
             f8e4m3fn=1, f8e5m2=1)


def collectives(hlo: str):
    """[(op, bytes, shapes)] of every collective of a compiled HLO module's text (a tuple-typed one with all its
    elements; an async "-start" op by its result type)."""
    out = []
    for m in _INSTR.finditer(hlo):
        parts = [(d, [int(x) for x in s.split(",") if x]) for d, s in _SHAPE.findall(m.group(1))]
        nbytes = 0
        for d, s in parts:
            n = _ITEM.get(d, 4)
            for x in s:
                n *= x
            nbytes += n
        out.append((m.group(2), nbytes, ";".join(f"{d}{s}" for d, s in parts)))
    return out


def _mesh_sizes(name):
    """(tensor, expert) device counts of a mesh name "ep4" / "ep4xtp2"."""
    m = re.fullmatch(r"ep(\d+)(?:xtp(\d+))?", name)
    if not m:
        raise SystemExit(f"moe_ep_decode: a mesh is epN or epNxtpM, got {name!r}")
    return int(m.group(2) or 1), int(m.group(1))


def worker(a):
    """The measurements, in the 8-device interpreter: a JSON line 'RESULT {...}'."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from converters.pipelines.mesh_load import parallel_setup
    from qformats.errors import ModelError
    from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
    from qformats.models.decoder.sharding import decoder_parallel_rules
    from qformats.nn import quantize_model
    from qformats.nn.experts import Experts, QExperts
    from qformats.nn.sharding import shard_model

    cfg = DecoderConfig.from_hf(dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=4096, hidden_size=a.hidden,
        intermediate_size=a.top_k * a.moe_inter, moe_intermediate_size=a.moe_inter, num_experts=a.experts,
        num_experts_per_tok=a.top_k, norm_topk_prob=True, num_hidden_layers=a.layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=a.hidden // 8, max_position_embeddings=1024, tie_word_embeddings=False,
        rms_norm_eps=1e-6))
    meshes = {name: parallel_setup(*_mesh_sizes(name)) for name in a.meshes.split(",") if name}
    tok = jnp.asarray([[17]], jnp.int32)
    res = dict(devices=len(jax.devices()), rows=[], refused=[])

    def best(fn, n):
        jax.block_until_ready(fn())
        times = []
        for _ in range(n):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return 1e3 * min(times)

    for scheme in a.schemes.split(","):
        model = CausalLM(cfg, rngs=nnx.Rngs(0))
        if scheme != "float":
            quantize_model(model, quantization_rules(scheme))
        layer0 = model.model.layers[0].mlp.experts
        stack_bytes = sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize
                          for m in (getattr(layer0, p) for p in cfg.moe.projections if p)
                          if isinstance(m, (Experts, QExperts)) for leaf in jax.tree.leaves(m.kernel.get_value()))
        ref = None
        for name in ["one"] + list(meshes):
            if name != "one":
                mesh = meshes[name]
                try:  # layouts are checked before anything moves: a refused mesh leaves the model as it was
                    shard_model(model, mesh, decoder_parallel_rules(cfg, mesh))
                except ModelError as e:
                    res["refused"].append(dict(scheme=scheme, mesh=name, error=str(e).splitlines()[0]))
                    print(json.dumps(res["refused"][-1]), file=sys.stderr, flush=True)
                    continue
            gd, st = nnx.split(model)
            step = jax.jit(lambda s, t, c: nnx.merge(gd, s)(t, c, last_only=True)[0])
            cache = model.init_cache(1, 64)
            t0 = time.perf_counter()
            compiled = step.lower(st, tok, cache).compile()
            compile_s = time.perf_counter() - t0
            logits = np.asarray(compiled(st, tok, cache), np.float32)
            ms = best(lambda: compiled(st, tok, cache), a.steps)
            coll = collectives(compiled.as_text())
            if ref is None:
                ref = (ms, logits)
            ops = {}
            for op, nbytes, _ in coll:
                c = ops.setdefault(op, [0, 0])
                c[0] += 1
                c[1] += nbytes
            res["rows"].append(dict(
                scheme=scheme, mesh=name, ms=ms, vs_one=ms / ref[0], compile_s=compile_s,
                same_token=bool(np.argmax(logits[0, -1]) == np.argmax(ref[1][0, -1])),
                max_logit_diff=float(np.max(np.abs(logits - ref[1]))), ops=ops,
                largest=max(coll, key=lambda c: c[1])[1:] if coll else None, stack_bytes=stack_bytes))
            print(json.dumps(res["rows"][-1]), file=sys.stderr, flush=True)
        del model
    print("RESULT " + json.dumps(res), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--schemes", default="float,W4A16")
    ap.add_argument("--meshes", default="ep2,ep4,ep8,ep2xtp2,ep4xtp2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        sys.path.insert(0, _ROOT)
        return worker(a)
    t0 = time.perf_counter()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} "
                                     "--xla_cpu_multi_thread_eigen=false")
    args = [sys.executable, os.path.abspath(__file__), "--worker"] + (sys.argv[1:] if argv is None else list(argv))
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=_ROOT)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"moe_ep_decode: the {DEVICES}-device worker failed (exit {p.returncode}):\n"
                         f"{p.stderr[-4000:]}")
    res = json.loads(line[len("RESULT "):])
    load = os.getloadavg()
    print(f"\n{a.layers} layers, hidden {a.hidden}, {a.experts} experts x {a.moe_inter}, top-{a.top_k}; batch 1, one "
          f"token; {res['devices']} forced host devices on {os.cpu_count()} CPUs; load average {load[0]:.1f} / "
          f"{load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end; {time.perf_counter() - t0:.0f} s\n")
    print("| weights | mesh (expert x tensor) | decode step ms | vs one device | same token, max logit diff | "
          "collectives of the step (count, KiB) | largest (KiB) | one layer's expert stacks (MiB) | compile s |")
    print("|---|---|---:|---:|---|---|---:|---:|---:|")
    for r in res["rows"]:
        ops = ", ".join(f"{op} {c} ({b / 1024:.1f})" for op, (c, b) in sorted(r["ops"].items())) or "none"
        big = f"{r['largest'][0] / 1024:.1f}" if r["largest"] else "-"
        print(f"| {r['scheme']} | {r['mesh']} | {r['ms']:.1f} | {r['vs_one']:.2f}x | "
              f"{'yes' if r['same_token'] else 'NO'}, {r['max_logit_diff']:.1e} | {ops} | {big} | "
              f"{r['stack_bytes'] / 2**20:.1f} | {r['compile_s']:.1f} |")
    for r in res["refused"]:
        print(f"\n{r['scheme']} on {r['mesh']}: refused: {r['error']}")


if __name__ == "__main__":
    main()
