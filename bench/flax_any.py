"""Third-party-style Flax models (Gemma-style linen, EasyDeL-style NNX): quantize time, peak memory, error vs qwix.

Usage: python bench/flax_any.py [--embed 512] [--hidden 2048] [--layers 4] [--vocab 8192] [--schemes ...] [--no-qwix]
       [--repeat 3] [--models gemma,gemma-scan,nnx] [--baseline] [--log RUNS.jsonl | --report RUNS.jsonl [--compact]]

The models are the test suite's re-implementations of Google DeepMind's `gemma` layer style (`Gemma`: its own
Einsum modules calling `jnp.einsum` on their params, a tied embedding, blocks under `nn.scan`) and of EasyDeL's
(`NnxCustom`: `ParallelLinear` modules with `lax.dot_general`, an `nnx.scan` stack), sized by the flags, with
random weights (tests/qformats/nn/gemma_style.py). For each scheme: `quantize_linen` / `quantize_model` time
(including the one abstract trace that finds the matmul weights, and compilation) in wall seconds and in this
process's CPU seconds (all threads; steadier than wall time on a shared machine), peak RSS growth while
quantizing (`bench/peak_rss.py`: the kernel's high-water mark VmHWM, however short the peak, over a baseline
taken after `malloc_trim`), each (model, tool, scheme) in a fresh process, `--repeat` times (medians and
min–max; ratios taken per repeat against the qwix run beside it), relative L2 error of the logits against the
float model (same tokens), and the packed param bytes.
The same models are quantized by qwix 0.1.8 (`qwix.quantize_model` + `qwix.quantize_params` for linen,
`qwix.quantize_model` for NNX, PtqProvider, the closest weight qtype: int8 and int4 with tile 128 (qformats' W8A16 / W4A16 groups), float8_e4m3fn,
nvfp4 / float6_e3m2fn) in the same run; the tied embedding is left float on both sides (qwix cannot take a table used in a
gather and a dot). Prints the markdown table of BENCHMARKS.md's section "Any Flax model: custom layers vs qwix".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests", "qformats", "nn"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gemma_style import Gemma, NnxCustom  # noqa: E402
from qformats.nn import Rule, quantize_linen, quantize_model  # noqa: E402
from peak_rss import PeakRSS  # noqa: E402

SCHEMES = ["W8A16", "W4A16", "FP8_E4M3", "NVFP4A16", "FP6_E3M2"]
QWIX = {"W8A16": ("int8", 128), "W4A16": ("int4", 128), "FP8_E4M3": ("float8_e4m3fn", None),
        "NVFP4A16": ("nvfp4", 16), "FP6_E3M2": ("float6_e3m2fn", None)}


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))


def _bytes(tree) -> float:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")) / 2**20


def _ready(tree):
    jax.block_until_ready([x for x in jax.tree.leaves(tree) if hasattr(x, "block_until_ready")])


def _gemma(args, scan):
    return Gemma(vocab_size=args.vocab, embed_dim=args.embed, num_layers=args.layers, num_heads=args.heads,
                 num_kv_heads=1, head_dim=args.embed // args.heads, hidden_dim=args.hidden, scan=scan)


def _qwix_rules(name, path):
    import qwix

    qt, tile = QWIX[name]
    return [qwix.QtRule(module_path=path, weight_qtype=qt, **({"tile_size": tile} if tile else {}))]


def child(args) -> dict:
    """One (model, tool, scheme) measured in this fresh process: quantize seconds, peak RSS growth, error."""
    tokens = (jnp.arange(2 * args.tokens).reshape(2, args.tokens) * 7919) % args.vocab
    name, tool = args.scheme, args.tool
    warnings.simplefilter("ignore")
    if args.model.startswith("gemma"):
        model = _gemma(args, scan=args.model == "gemma-scan")
        params = jax.jit(model.init)(jax.random.key(0), tokens)
        ref = jax.jit(model.apply)(params, tokens)
        _ready(params)
        with PeakRSS() as mem:
            t, c = time.perf_counter(), time.process_time()
            if tool == "float":  # the baseline: the float model's first jitted forward (compilation included)
                qparams = params
                out = jax.jit(model.apply)(params, tokens)
                run = lambda: out  # noqa: E731
                _ready(out)
            elif tool == "qformats":
                qmod, qparams = quantize_linen(model, params, [Rule("embedder/.*", None), Rule(".*", name)], tokens)
                run = lambda: qmod.apply(qparams, tokens)  # noqa: E731
            else:
                import qwix

                qm = qwix.quantize_model(model, qwix.PtqProvider(_qwix_rules(name, "layer.*")))
                abstract = jax.eval_shape(qm.init, jax.random.key(0), tokens)["params"]
                qparams = qwix.quantize_params(params["params"], abstract)
                qparams = {"params": qparams}
                run = lambda: qm.apply(qparams, tokens)  # noqa: E731
            _ready(qparams)
            dt, dc = time.perf_counter() - t, time.process_time() - c
        mb = _bytes(qparams)
    else:
        fwd = nnx.jit(lambda m, t: m(t))
        model = NnxCustom(vocab=args.vocab, d=args.embed, hidden=args.hidden, layers=args.layers)
        ref = fwd(model, tokens)
        _ready(nnx.state(model))
        with PeakRSS() as mem:
            t, c = time.perf_counter(), time.process_time()
            if tool == "float":
                qm = model
                out = nnx.jit(lambda m, t: m(t))(model, tokens)
                _ready(out)
            elif tool == "qformats":
                quantize_model(model, [Rule("embed", None), Rule(".*", name)], example=tokens)
                qm = model
            else:
                import qwix

                qm = qwix.quantize_model(model, qwix.PtqProvider(_qwix_rules(name, "blocks.*|proj")), tokens)
            _ready(nnx.state(qm))
            dt, dc = time.perf_counter() - t, time.process_time() - c
        run = lambda: fwd(qm, tokens)  # noqa: E731
        mb = _bytes(nnx.state(qm, nnx.Param))
    return {"s": dt, "cpu_s": dc, "mb_peak": mem.growth, "mb_sampled": mem.sampled, "params_mb": mb,
            "err": _rel(run(), ref)}


_LOGGED: dict = {}


def _run_child(args, model, tool, name):
    """(result, None) or (None, why it failed) of one fresh-process run, appended to `--log` as a JSON line; with
    `--report`, the next logged run of (model, tool, scheme) instead ((None, None) when none is left)."""
    if args.report:
        left = _LOGGED.get((model, tool, name), [])
        return (left.pop(0) if left else (None, None))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--tool", tool,
           "--scheme", name] + [f"--{k}={getattr(args, k)}" for k in ("embed", "hidden", "heads", "layers",
                                                                     "vocab", "tokens")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode == 0 and line:
        out = json.loads(line[-1]), None
    else:
        errs = [ln for ln in res.stderr.splitlines() if re.match(r"^[\w.]*(Error|Exception): ", ln)]
        why = (errs or res.stderr.strip().splitlines() or ["?"])[-1]
        if "Check failed" in res.stderr:
            why = "XLA check failure: " + [ln for ln in res.stderr.splitlines() if "Check failed" in ln][0][-70:]
        out = None, why
    if args.log:
        with open(args.log, "a") as f:
            f.write(json.dumps({"model": model, "tool": tool, "scheme": name, "result": out[0], "why": out[1],
                                "at": time.strftime("%H:%M:%S", time.gmtime()), "load": os.getloadavg()[0]}) + "\n")
    return out


def _read_log(path):
    for ln in open(path):
        r = json.loads(ln)
        _LOGGED.setdefault((r["model"], r["tool"], r["scheme"]), []).append((r["result"], r["why"]))


def rows(args, model, schemes, use_qwix) -> list:
    """[(label, scheme, [results of each repeat] or None, why failed)]: each (tool, scheme) run `args.repeat`
    times, each run a fresh process; the repeats are the outer loop (every scheme once, then again: a cut-short
    `--log` holds every scheme), qformats and qwix alternating."""
    tools = {name: ("float",) if name == "float" else ("qformats", "qwix") if use_qwix else ("qformats",)
             for name in schemes}
    runs = {(name, t): [] for name in schemes for t in tools[name]}
    why = {}
    for _ in range(args.repeat):
        for name in schemes:
            for tool in tools[name]:
                if (name, tool) in why:
                    continue
                r, err = _run_child(args, model, tool, name)
                if r is not None:
                    runs[name, tool].append(r)
                elif err is not None:
                    why[name, tool] = err
    out = []
    for name in schemes:
        for tool in tools[name]:
            if not runs[name, tool] and (name, tool) not in why:
                continue  # --report: not run yet
            label = "float: first jitted forward" if tool == "float" else (
                f"{tool} {name if tool == 'qformats' else QWIX[name][0]}")
            out.append((label, name, runs[name, tool] if (name, tool) not in why else None, why.get((name, tool))))
    return out


def _median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _spread(v, fmt):
    m = _median(v)
    return fmt.format(m) + (f" ({fmt.format(min(v))}–{fmt.format(max(v))})" if len(v) > 1 else "")


def table(title, rows) -> str:
    """Medians over the repeats (min–max in brackets); ratios are per repeat (qformats / the qwix run beside
    it), then their median and range."""
    lines = [f"**{title}**", "",
             "| model | quantize s | vs qwix | CPU s | vs qwix | peak RSS +MB | vs qwix | params MB | rel-L2 logits |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    qw = {r[1]: r[2] for r in rows if r[0].startswith("qwix") and r[2]}
    for label, scheme, runs, why in rows:
        if runs is None:
            lines.append(f"| {label} failed: {str(why)[:110]} | - | - | - | - | - | - | - | - |")
            continue
        cells = []
        for key, fmt in (("s", "{:.2f}"), ("cpu_s", "{:.2f}"), ("mb_peak", "{:.0f}")):
            cells.append(_spread([r[key] for r in runs], fmt))
            ratio = ""
            if label.startswith("qformats") and scheme in qw:
                pairs = list(zip(runs, qw[scheme]))
                ratio = _spread([a[key] / max(b[key], 1e-9) for a, b in pairs], "{:.2f}") + "x"
            cells.append(ratio)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {runs[0]['params_mb']:.1f} | {runs[0]['err']:.4f} |")
    return "\n".join(lines)


def compact(found) -> str:
    """One table of every model: per scheme, qformats / qwix medians side by side, the per-repeat ratios' median
    (min–max); where qwix failed, why (and the float model's first jitted forward, if run)."""
    short = {"gemma": "linen", "gemma-scan": "linen nn.scan", "nnx": "NNX"}
    lines = ["| model scheme / qwix qtype (runs) | quantize s | vs qwix | CPU s | vs qwix | peak RSS +MB | vs qwix | "
             "rel-L2 logits |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, rs in found.items():
        by = {(label.split()[0], scheme): (runs, why) for label, scheme, runs, why in rs}
        flt = by.get(("float:", "float"), (None, None))[0]
        for scheme in [s for s in QWIX if ("qformats", s) in by]:
            ours, _ = by[("qformats", scheme)]
            theirs, why = by.get(("qwix", scheme), (None, "not run"))
            if not ours:
                continue
            qt, tile = QWIX[scheme]
            name = f"{short[model]} {scheme} / {qt}" + (f" (tile {tile})" if tile else "")
            cells = []
            for key, fmt in (("s", "{:.2f}"), ("cpu_s", "{:.2f}"), ("mb_peak", "{:.0f}")):
                a = fmt.format(_median([r[key] for r in ours]))
                if theirs:
                    cells += [f"{a} / {fmt.format(_median([r[key] for r in theirs]))}", _spread(
                        [x[key] / max(y[key], 1e-9) for x, y in zip(ours, theirs)], "{:.2f}") + "x"]
                else:
                    f = f"; float fwd {fmt.format(_median([r[key] for r in flt]))}" if flt else ""
                    cells += [a + f, ""]
            err = f"{ours[0]['err']:.4f}" + (f" / {theirs[0]['err']:.4f}" if theirs else "")
            runs = f"{len(ours)}" + (f" / {len(theirs)}" if theirs else "")
            if not theirs:
                name += f": qwix fails ({str(why)[:90]})"
            lines.append(f"| {name} ({runs}) | " + " | ".join(cells) + f" | {err} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--no-qwix", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per (tool, scheme); medians reported")
    p.add_argument("--models", default="gemma,gemma-scan,nnx")
    p.add_argument("--baseline", action="store_true", help="also a row of the float model's first jitted forward "
                   "(compilation included), the reference where qwix fails")
    p.add_argument("--log", help="append each run's result to this file (JSON lines) as it ends")
    p.add_argument("--report", help="print the tables from a --log file instead of running (runs not logged yet "
                   "are left out)")
    p.add_argument("--compact", action="store_true", help="one table, qformats and qwix side by side in each row "
                   "(medians; BENCHMARKS.md's form)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gemma")
    p.add_argument("--tool", default="qformats")
    p.add_argument("--scheme", default="W8A16")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    use_qwix = not args.no_qwix
    if args.report:
        _read_log(args.report)
    elif use_qwix:
        try:
            import qwix  # noqa: F401
        except ImportError:
            use_qwix = False
    schemes = [s for s in args.schemes.split(",") if s]
    models = [m for m in args.models.split(",") if m]
    print(f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax "
          f"{jax.__version__}, {jax.devices()[0].platform}; embed {args.embed}, hidden {args.hidden}, {args.layers} "
          f"layers, vocab {args.vocab}, {args.tokens} tokens x 2; each run a fresh process, {args.repeat} runs per "
          "row: median (min–max)" + ("" if use_qwix else "; qwix not run"))
    titles = {"gemma": "Gemma-style linen (own Einsum modules, blocks in a list as gemma has them)",
              "gemma-scan": "Gemma-style linen under nn.scan", "nnx": "EasyDeL-style NNX (ParallelLinear, "
                                                                   "HeadsEinsum, nnx.scan)"}
    picked = {"gemma": schemes, "gemma-scan": [s for s in schemes if s == "W4A16"] or schemes[:1],
              "nnx": [s for s in schemes if s in ("W8A16", "W4A16", "FP8_E4M3", "NVFP4A16")]}
    found = {}
    for m in ("gemma", "gemma-scan", "nnx"):
        if m in models:
            base = rows(args, m, ["float"], False) if args.baseline and m != "nnx" else []
            found[m] = base + rows(args, m, picked[m], use_qwix)
            if not args.compact:
                print(table(titles[m], found[m]) + "\n")
    if args.compact:
        print(compact(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
