"""Third-party-style Flax models (Gemma-style linen, EasyDeL-style NNX): quantize time, peak memory, error vs qwix.

Usage: python bench/flax_any.py [--embed 512] [--hidden 2048] [--layers 4] [--vocab 8192] [--schemes ...] [--no-qwix]

The models are the test suite's re-implementations of Google DeepMind's `gemma` layer style (`Gemma`: its own
Einsum modules calling `jnp.einsum` on their params, a tied embedding, blocks under `nn.scan`) and of EasyDeL's
(`NnxCustom`: `ParallelLinear` modules with `lax.dot_general`, an `nnx.scan` stack), sized by the flags, with
random weights (tests/qformats/nn/gemma_style.py). For each scheme: `quantize_linen` / `quantize_model` time
(including the one abstract trace that finds the matmul weights), peak RSS growth while quantizing (sampled
every 2 ms), relative L2 error of the logits against the float model (same tokens), and the packed param bytes.
The same models are quantized by qwix 0.1.8 (`qwix.quantize_model` + `qwix.quantize_params` for linen,
`qwix.quantize_model` for NNX, PtqProvider, the closest weight qtype: int8 / int4 with tile 128 / float8_e4m3fn /
nvfp4) in the same run; the tied embedding is left float on both sides (qwix cannot take a table used in a
gather and a dot). Prints the markdown table of BENCHMARKS.md's section "Any Flax model: custom layers vs qwix".
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
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

SCHEMES = ["W8A16", "W4A16", "FP8_DYNAMIC", "NVFP4A16"]
QWIX = {"W8A16": ("int8", None), "W4A16": ("int4", 128), "FP8_DYNAMIC": ("float8_e4m3fn", None),
        "NVFP4A16": ("nvfp4", None)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRSS:
    """Peak resident memory growth (MB) over a block, sampled every 2 ms by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss_mb()
        self._stop = threading.Event()

        def watch():
            while not self._stop.is_set():
                self.peak = max(self.peak, _rss_mb())
                time.sleep(0.002)
        self._t = threading.Thread(target=watch, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_mb())
        self.growth = self.peak - self.base


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))


def _bytes(tree) -> float:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")) / 2**20


def _ready(tree):
    jax.block_until_ready([x for x in jax.tree.leaves(tree) if hasattr(x, "block_until_ready")])


def gemma_rows(args, tokens, schemes, use_qwix, scan):
    model = Gemma(vocab_size=args.vocab, embed_dim=args.embed, num_layers=args.layers, num_heads=args.heads,
                  num_kv_heads=1, head_dim=args.embed // args.heads, hidden_dim=args.hidden, scan=scan)
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    ref = jax.jit(model.apply)(params, tokens)
    rows = [("float", "-", 0.0, 0.0, _bytes(params), 0.0)]
    for name in schemes:
        with _PeakRSS() as mem, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            qmod, qparams = quantize_linen(model, params, [Rule("embedder/.*", None), Rule(".*", name)], tokens)
            _ready(qparams)
            dt = time.perf_counter() - t
        err = _rel(jax.jit(qmod.apply)(qparams, tokens), ref)
        rows.append((f"qformats {name}", name, dt, mem.growth, _bytes(qparams), err))
        del qparams
        if use_qwix:
            rows.append(_qwix_linen(model, params, tokens, name, ref))
    return rows


def _qwix_rules(name):
    import qwix

    qt, tile = QWIX[name]
    kw = {"tile_size": tile} if tile else {}
    return [qwix.QtRule(module_path="layer.*", weight_qtype=qt, **kw)]


def _qwix_linen(model, params, tokens, name, ref):
    import qwix

    try:
        with _PeakRSS() as mem:
            t = time.perf_counter()
            qm = qwix.quantize_model(model, qwix.PtqProvider(_qwix_rules(name)))
            abstract = jax.eval_shape(qm.init, jax.random.key(0), tokens)["params"]
            qparams = qwix.quantize_params(params["params"], abstract)
            _ready(qparams)
            dt = time.perf_counter() - t
        err = _rel(jax.jit(qm.apply)({"params": qparams}, tokens), ref)
        return (f"qwix {QWIX[name][0]}", name, dt, mem.growth, _bytes(qparams), err)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return (f"qwix {QWIX[name][0]} failed: {type(e).__name__}: {str(e)[:80]}", name, None, None, None, None)


def nnx_rows(args, tokens, schemes, use_qwix):
    rows = []
    fwd = nnx.jit(lambda m, t: m(t))
    for name in schemes:
        model = NnxCustom(vocab=args.vocab, d=args.embed, hidden=args.hidden, layers=args.layers)
        ref = fwd(model, tokens)
        if not rows:
            rows.append(("float", "-", 0.0, 0.0, _bytes(nnx.state(model, nnx.Param)), 0.0))
        _ready(nnx.state(model))
        with _PeakRSS() as mem, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            quantize_model(model, [Rule("embed", None), Rule(".*", name)], example=tokens)
            _ready(nnx.state(model))
            dt = time.perf_counter() - t
        err = _rel(fwd(model, tokens), ref)
        rows.append((f"qformats {name}", name, dt, mem.growth, _bytes(nnx.state(model, nnx.Param)), err))
        del model
        if use_qwix:
            rows.append(_qwix_nnx(args, tokens, name, ref, fwd))
    return rows


def _qwix_nnx(args, tokens, name, ref, fwd):
    import qwix

    model = NnxCustom(vocab=args.vocab, d=args.embed, hidden=args.hidden, layers=args.layers)
    _ready(nnx.state(model))
    try:
        rules = [qwix.QtRule(module_path="blocks.*|proj", weight_qtype=QWIX[name][0],
                             **({"tile_size": QWIX[name][1]} if QWIX[name][1] else {}))]
        with _PeakRSS() as mem:
            t = time.perf_counter()
            qm = qwix.quantize_model(model, qwix.PtqProvider(rules), tokens)
            _ready(nnx.state(qm))
            dt = time.perf_counter() - t
        err = _rel(fwd(qm, tokens), ref)
        return (f"qwix {QWIX[name][0]}", name, dt, mem.growth, _bytes(nnx.state(qm, nnx.Param)), err)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return (f"qwix {QWIX[name][0]} failed: {type(e).__name__}: {str(e)[:80]}", name, None, None, None, None)


def table(title, rows) -> str:
    ours = {r[1]: r for r in rows if r[0].startswith("qformats")}
    lines = [f"**{title}**", "",
             "| model | quantize s | vs qwix | peak RSS growth MB | vs qwix | params MB | rel-L2 logits |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    qw = {r[1]: r for r in rows if r[0].startswith("qwix") and r[2] is not None}
    for r in rows:
        label, scheme, dt, mem, mb, err = r
        if dt is None:
            lines.append(f"| {label} | - | - | - | - | - | - |")
            continue
        ratio_t = ratio_m = ""
        if r[0].startswith("qformats") and scheme in qw:
            ratio_t = f"{dt / qw[scheme][2]:.2f}x"
            ratio_m = f"{mem / max(qw[scheme][3], 1e-9):.2f}x"
        lines.append(f"| {label} | {dt:.2f} | {ratio_t} | {mem:.0f} | {ratio_m} | {mb:.1f} | {err:.4f} |")
    del ours
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
    p.add_argument("--only", choices=["linen", "nnx"], default=None)
    p.add_argument("--no-scan", action="store_true", help="skip the nn.scan variant")
    args = p.parse_args(argv)
    use_qwix = not args.no_qwix
    if use_qwix:
        try:
            import qwix  # noqa: F401
        except ImportError:
            use_qwix = False
    tokens = (jnp.arange(2 * args.tokens).reshape(2, args.tokens) * 7919) % args.vocab
    schemes = [s for s in args.schemes.split(",") if s]
    print(f"{platform.node()} {platform.processor() or platform.machine()}, jax {jax.__version__}, "
          f"{jax.devices()[0].platform}; embed {args.embed}, hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, {args.tokens} tokens x 2" + ("" if use_qwix else "; qwix not run"))
    if args.only in (None, "linen"):
        print(table("Gemma-style linen (own Einsum modules, blocks in a list as gemma has them)",
                    gemma_rows(args, tokens, schemes, use_qwix, scan=False)))
        print()
        if not args.no_scan:
            print(table("Gemma-style linen under nn.scan", gemma_rows(args, tokens, schemes, use_qwix, scan=True)))
            print()
    if args.only in (None, "nnx"):
        print(table("EasyDeL-style NNX (ParallelLinear, nnx.scan)", nnx_rows(args, tokens, schemes, use_qwix)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
