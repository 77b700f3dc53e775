"""Integer weight error of qformats vs qwix on the third-party-style Flax models, over many seeds.

Usage: python bench/flax_any_error.py [--seeds 16] [--first-seed 0] [--models gemma,nnx] [--schemes W8A16,W4A16]
       [--embed 512] [--hidden 2048] [--layers 4] [--vocab 8192]

For each seed (the models' random weights; the same tokens), each model of bench/flax_any.py and each scheme
(W8A16 / W4A16 against qwix 0.1.8 int8 / int4, tile 128, PtqProvider; the tied embedding float on both sides):
- rel-L2 error of the logits against the float model, of qformats' packed model and of qwix's quantized model
  (each tool's own forward);
- the same float model run on dequantized weights ("fake quant", one forward for each set), so that the code
  difference is seen without the two tools' matmul paths: `ours` (our codes and scales), `qwix` (qwix's codes and
  scales), `sym` (our codes clipped to the symmetric range +-qmax: the group's negative extreme, at -(qmax +
  0.5) steps, rounded to -qmax instead of qmin);
- bit for bit: the scales (each tool's per-element scale, in the param's layout) and the codes, where both
  tools group the same elements (qwix groups Gemma's attn_vec einsum over both contracted axes: counted apart),
  and the (ours, qwix) code pairs where they differ.
Prints per-seed rows, then mean, standard deviation, standard error and range of the relative difference
err_ours / err_qwix - 1 (and of the fake-quant variants against qwix's, and of `sym` against ours) over the seeds.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time
import types
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests", "qformats", "nn"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gemma_style import Gemma, NnxCustom  # noqa: E402
from qformats.nn import Rule, quantize_linen, quantize_model  # noqa: E402
from qformats.nn import nnx_traced  # noqa: E402
from qformats.nn.traced import MatmulWeight  # noqa: E402
from qformats.qarray import QArray  # noqa: E402

QWIX = {"W8A16": ("int8", 127), "W4A16": ("int4", 7)}


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))


def _ours_elems(mw):
    """(codes, per-element scale) of a MatmulWeight (or a flax layer's QArray in its place) as float32 numpy
    arrays in the param's layout."""
    def one(q):
        return q.element_values(jnp.float32).T, q.expanded_scale(jnp.float32).T  # [K, N]

    fn = one
    for _ in mw.stacked:
        fn = jax.vmap(fn)
    c, s = fn(mw.q)
    out = []
    ns = len(mw.stacked)
    inv = sorted(range(len(mw.perm)), key=lambda i: mw.perm[i])
    for a in (c, s):
        a = np.asarray(a).reshape(mw.stacked + tuple(mw.shape[p] for p in mw.perm))
        out.append(np.transpose(a, tuple(range(ns)) + tuple(ns + i for i in inv)))
    return out[0], out[1]


def _qwix_elems(aux):
    """(codes, per-element scale) float32 numpy arrays of a qwix WithAux / QArray, in the param's layout."""
    arr = aux.array if hasattr(aux, "array") else aux
    qv = np.asarray(arr.qvalue.astype(jnp.int8)).astype(np.float32)
    s = np.asarray(arr.scale, np.float32)
    for ax, (n, m) in enumerate(zip(qv.shape, s.shape)):
        if n != m:
            s = np.repeat(s, n // m, axis=ax)
    return qv, s


def _groups_equal(mw, aux) -> bool:
    """Whether qwix's scale has one entry per our group (same number of scales)."""
    arr = aux.array if hasattr(aux, "array") else aux
    return math.prod(arr.scale.shape) == math.prod(mw.q.scale.shape)


def _compare(pairs, stats):
    """Accumulate bit-for-bit comparisons of [(ours MatmulWeight, qwix aux)] into `stats`."""
    for mw, aux in pairs:
        oc, os_ = _ours_elems(mw)
        qc, qs = _qwix_elems(aux)
        if not _groups_equal(mw, aux):
            stats["weights other grouping"] += 1
            continue
        stats["weights"] += 1
        stats["elements"] += oc.size
        stats["scale diff"] += int(np.sum(os_.view(np.uint32) != qs.view(np.uint32)))
        d = oc != qc
        stats["code diff"] += int(d.sum())
        for a, b in zip(oc[d].astype(int).tolist(), qc[d].astype(int).tolist()):
            stats[f"code ours {a} qwix {b}"] += 1


def _fake(codes, scale, lo=None):
    c = codes if lo is None else np.maximum(codes, lo)
    return jnp.asarray((c * scale).astype(np.float32))


def run_gemma(args, seed, scheme, stats):
    import qwix

    tokens = (jnp.arange(2 * args.tokens).reshape(2, args.tokens) * 7919) % args.vocab
    model = Gemma(vocab_size=args.vocab, embed_dim=args.embed, num_layers=args.layers, num_heads=args.heads,
                  num_kv_heads=1, head_dim=args.embed // args.heads, hidden_dim=args.hidden)
    params = jax.jit(model.init)(jax.random.key(seed), tokens)
    apply = jax.jit(model.apply)
    ref = apply(params, tokens)
    qmod, qp = quantize_linen(model, params, [Rule("embedder/.*", None), Rule(".*", scheme)], tokens)
    e_ours = _rel(qmod.apply(qp, tokens), ref)
    qt, qmax = QWIX[scheme]
    qm = qwix.quantize_model(model, qwix.PtqProvider([qwix.QtRule(module_path="layer.*", weight_qtype=qt,
                                                                  tile_size=128)]))
    abstract = jax.eval_shape(qm.init, jax.random.key(0), tokens)["params"]
    qq = qwix.quantize_params(params["params"], abstract)
    e_qwix = _rel(qm.apply({"params": qq}, tokens), ref)
    is_mw = lambda v: isinstance(v, MatmulWeight)  # noqa: E731
    flat_o = dict(jax.tree_util.tree_leaves_with_path(qp["params"], is_leaf=is_mw))
    is_q = lambda v: hasattr(v, "array")  # noqa: E731
    flat_q = dict(jax.tree_util.tree_leaves_with_path(qq, is_leaf=is_q))
    pairs = [(flat_o[k], flat_q[k]) for k in flat_o if is_mw(flat_o[k])]
    _compare(pairs, stats)
    fq = {}
    for name, pick in (("ours", lambda o, q: _fake(*_ours_elems(o))),
                       ("qwix", lambda o, q: _fake(*_qwix_elems(q))),
                       ("sym", lambda o, q: _fake(*_ours_elems(o), lo=-qmax))):
        tree = {k: (pick(v, flat_q[k]) if is_mw(v) else v) for k, v in flat_o.items()}
        fparams = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params["params"]),
                                               [tree[k] for k, _ in jax.tree_util.tree_leaves_with_path(
                                                   params["params"])])
        fq[name] = _rel(apply({"params": fparams}, tokens), ref)
    return e_ours, e_qwix, fq


def run_nnx(args, seed, scheme, stats):
    import qwix

    tokens = (jnp.arange(2 * args.tokens).reshape(2, args.tokens) * 7919) % args.vocab
    fwd = nnx.jit(lambda m, t: m(t))
    make = lambda: NnxCustom(vocab=args.vocab, d=args.embed, hidden=args.hidden, layers=args.layers,  # noqa: E731
                             seed=seed)
    model = make()
    ref = fwd(model, tokens)
    qt, qmax = QWIX[scheme]
    qm = qwix.quantize_model(model, qwix.PtqProvider([qwix.QtRule(module_path="blocks.*|proj", weight_qtype=qt,
                                                                  tile_size=128)]), tokens)
    e_qwix = _rel(fwd(qm, tokens), ref)
    qaux = {}
    for path, node in nnx.iter_graph(qm):
        if hasattr(node, "array") and hasattr(node.array, "qvalue"):
            qaux["/".join(str(p) for p in path)] = node
    if not qaux:  # Variables holding a WithAux value
        for path, node in nnx.iter_graph(qm):
            if isinstance(node, nnx.Variable):
                v = node.get_value()
                if hasattr(v, "array") and hasattr(v.array, "qvalue"):
                    qaux["/".join(str(p) for p in path)] = v
    quantize_model(model, [Rule("embed", None), Rule(".*", scheme)], example=tokens)
    e_ours = _rel(fwd(model, tokens), ref)
    mws = dict(nnx_traced.packed_weights(model))
    for path, node in nnx.iter_graph(model):  # flax layers quantized by their own class (QLinear): QArray [K, N]
        v = node.get_value() if isinstance(node, nnx.Variable) else None
        if isinstance(v, QArray):
            assert v.axis == 0 and len(v.shape) == 2, (path, v)
            mws["/".join(str(p) for p in path)] = types.SimpleNamespace(
                q=v, stacked=tuple(v.codes.shape[:-2]), shape=tuple(v.shape), perm=(0, 1))
    pairs = [(mw, qaux[p]) for p, mw in mws.items()]
    _compare(pairs, stats)
    fq = {}
    for name, pick in (("ours", lambda o, q: _fake(*_ours_elems(o))),
                       ("qwix", lambda o, q: _fake(*_qwix_elems(q))),
                       ("sym", lambda o, q: _fake(*_ours_elems(o), lo=-qmax))):
        fm = make()
        for p, mw in mws.items():
            nnx_traced.variable_at(fm, p).set_value(pick(mw, qaux[p]))
        fq[name] = _rel(fwd(fm, tokens), ref)
    return e_ours, e_qwix, fq


def _summary(v):
    v = np.asarray(v)
    sd = float(v.std(ddof=1)) if len(v) > 1 else float("nan")
    return f"{100 * v.mean():+.2f}% ± {100 * sd:.2f}% (s.e. {100 * sd / math.sqrt(len(v)):.2f}%; " \
           f"{100 * v.min():+.2f}% to {100 * v.max():+.2f}%; lower in {int((v < 0).sum())}/{len(v)})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--models", default="gemma,nnx")
    p.add_argument("--schemes", default="W8A16,W4A16")
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    t0, c0 = time.perf_counter(), time.process_time()
    print(f"embed {args.embed}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; seeds "
          f"{args.first_seed}..{args.first_seed + args.seeds - 1}; load {os.getloadavg()[0]:.1f}", flush=True)
    for model in [m for m in args.models.split(",") if m]:
        for scheme in [s for s in args.schemes.split(",") if s]:
            stats = collections.Counter()
            rel, fq_rel = [], collections.defaultdict(list)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                fn = run_gemma if model == "gemma" else run_nnx
                e_o, e_q, fq = fn(args, seed, scheme, stats)
                rel.append(e_o / e_q - 1)
                for k in ("ours", "sym"):
                    fq_rel[k].append(fq[k] / fq["qwix"] - 1)
                fq_rel["sym/ours"].append(fq["sym"] / fq["ours"] - 1)
                print(f"{model} {scheme} seed {seed}: rel-L2 ours {e_o:.6g} qwix {e_q:.6g} ({100 * rel[-1]:+.2f}%); "
                      f"fake-quant ours {fq['ours']:.6g} qwix {fq['qwix']:.6g} sym {fq['sym']:.6g}", flush=True)
            print(f"== {model} {scheme}, {args.seeds} seeds: ours / qwix - 1 = {_summary(rel)}")
            print(f"   fake quant, our codes / qwix's - 1 = {_summary(fq_rel['ours'])}")
            print(f"   fake quant, symmetric-clipped codes / qwix's - 1 = {_summary(fq_rel['sym'])}")
            print(f"   fake quant, symmetric-clipped codes / ours - 1 = {_summary(fq_rel['sym/ours'])}")
            pairs = sorted(((k, v) for k, v in stats.items() if k.startswith("code ours")), key=lambda kv: -kv[1])
            print(f"   weights compared {stats['weights']} (+{stats['weights other grouping']} grouped differently "
                  f"by qwix), elements {stats['elements']}, scales differing {stats['scale diff']}, codes differing "
                  f"{stats['code diff']} ({100 * stats['code diff'] / max(1, stats['elements']):.3f}%): "
                  + ", ".join(f"{k[5:]}: {v}" for k, v in pairs[:6]), flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU; load "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
