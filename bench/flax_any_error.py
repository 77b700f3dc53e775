"""Integer weight error of qformats vs qwix on the third-party-style Flax models, over many seeds, and its cause.

Usage: python bench/flax_any_error.py [--seeds 16] [--first-seed 0] [--models gemma,nnx] [--schemes W8A16,W4A16]
       [--embed 512] [--hidden 2048] [--layers 4] [--vocab 8192] [--per-weight]

For each seed (the models' random weights; the same tokens), each model of bench/flax_any.py and each scheme
(W8A16 / W4A16 against qwix 0.1.8 int8 / int4, tile 128, PtqProvider; the tied embedding float on both sides):
- rel-L2 error of the logits against the float model, of qformats' packed model and of qwix's quantized model
  (each tool's own forward);
- the same float model run on dequantized weights ("fake quant", one forward for each set), so that the code
  difference is seen without the two tools' matmul paths: `ours` (our codes and scales), `qwix` (qwix's codes and
  scales), `sym` (our codes clipped to the symmetric range +-qmax: the group's negative extreme, at -(qmax +
  0.5) steps, rounded to -qmax instead of qmin), `qscale` (our rounding, half to even and clipped to
  [-qmax - 1, qmax], of w * (1 / s) with qwix's scale s: our quantization with qwix's arithmetic substituted);
- bit for bit: the scales (each tool's per-element scale, in the param's layout; largest difference in ulps) and
  the codes, where both tools group the same elements (qwix groups Gemma's attn_vec einsum over both contracted
  axes: counted apart), the (ours, qwix) code pairs where they differ, `qscale`'s codes against qwix's, and
  compressed-tensors' codes (llm-compressor's min-max observer + `calculate_qparams` + `quantize` on each weight
  as the [N, K] Linear weight its matmul contracts) against ours;
- with `--per-weight`, for each weight (its stacked layers / Gemma's layer_i together): the fake-quant error with
  our codes at that weight only (qwix's elsewhere) relative to all-qwix; the mean weight error per group of 128
  in units of the group's scale, sum(q * s - w) / mean(s) / (elements / 128) (each group's extreme errs by
  -s / 2 when it rounds to qmin or clips to qmax); the weight's input activations x (float model) as the mean over
  features of (feature mean / rms of x); and the layer's output error x @ err split into the part from the input's
  feature means, |mean(x) @ err|, and the centred rest, |(x - mean(x)) @ err|, ours / qwix.
Prints per-seed rows, then mean, standard deviation, standard error and range of the relative difference
err_ours / err_qwix - 1 (and of the fake-quant variants against qwix's, and of `sym` against ours) over the seeds.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
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
        ulp = np.abs(os_.view(np.int32).astype(np.int64) - qs.view(np.int32).astype(np.int64))
        stats["scale max ulp"] = max(stats["scale max ulp"], int(ulp.max()))
        d = oc != qc
        stats["code diff"] += int(d.sum())
        for a, b in zip(oc[d].astype(int).tolist(), qc[d].astype(int).tolist()):
            stats[f"code ours {a} qwix {b}"] += 1


def _matrix(mw, a):
    """A param-layout array (stacked axes first) as the matrices its matmuls contract: [*stacked, K, N]."""
    ns = len(mw.stacked)
    a = np.transpose(np.asarray(a), tuple(range(ns)) + tuple(ns + p for p in mw.perm))
    return a.reshape(mw.stacked + (mw.k, -1))


def _ct_codes(scheme, mw, w):
    """compressed-tensors' codes of the float param `w` as llm-compressor quantizes a Linear weight [N, K] (its
    min-max observer, `calculate_qparams`, `quantize`), in our [*stacked, K, N] matrix layout."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = PRESET_SCHEMES[scheme]["weights"]
    m = _matrix(mw, w)
    out = np.empty(m.shape, np.float32)
    for idx in np.ndindex(*mw.stacked):
        wt = torch.from_numpy(np.ascontiguousarray(m[idx].T))  # [N, K]
        wg = wt.unflatten(-1, (wt.shape[-1] // args.group_size, args.group_size))
        sc, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
        out[idx] = ct_quantize(wt, sc, None, args).float().numpy().T
    return out


def _fake(codes, scale, lo=None):
    c = codes if lo is None else np.maximum(codes, lo)
    return jnp.asarray((c * scale).astype(np.float32))


def _variants(w, o, q, qmax):
    """Fake-quant weights (param layout) of one weight: ours, qwix's, `sym` (ours clipped to +-qmax) and `qscale`
    (our rounding, round half to even and clip to [-qmax - 1, qmax], of w * (1 / s) with qwix's scale s: XLA runs
    qwix's w / broadcast(s) as that product)."""
    (oc, os_), (qc, qs) = o, q
    qsc = np.clip(np.rint(np.asarray(w, np.float32) * (np.float32(1) / qs)), -qmax - 1, qmax)
    return {"ours": _fake(oc, os_), "qwix": _fake(qc, qs), "sym": _fake(oc, os_, lo=-qmax), "qscale": _fake(qsc, qs),
            "qscale codes": qsc}


def _analyse(scheme, entries, fake_rel, stats, per, per_weight):
    """Shared analysis of one (model, scheme, seed). `entries`: [(name, ours MatmulWeight, qwix aux, float param,
    [input activations of each stacked layer or of the weight])]; `fake_rel(dict name -> weight)`: rel-L2 of the
    float model run with those weights in place of the named ones. Returns {variant: rel-L2}; per-name figures are
    accumulated into `per` (ablation: ours at that name only, qwix's elsewhere; mean error per group in units of
    the scale; mean / zero-mean input parts of |x @ err|)."""
    qt, qmax = QWIX[scheme]
    _compare([(mw, aux) for _, mw, aux, _, _ in entries], stats)
    var = {}
    for name, mw, aux, w, _ in entries:
        o, q = _ours_elems(mw), _qwix_elems(aux)
        var[name] = _variants(w, o, q, qmax)
        stats["qscale code diff vs qwix"] += int(np.sum(var[name]["qscale codes"] != q[0]))
        ct = _ct_codes(scheme, mw, w)
        stats["ct code diff vs ours"] += int(np.sum(ct != _matrix(mw, o[0])))
        stats["ct elements"] += ct.size
    fq = {v: fake_rel({n: var[n][v] for n in var}) for v in ("ours", "qwix", "sym", "qscale")}
    gs = 128
    for name, mw, aux, w, xs in (entries if per_weight else []):
        key = re.sub(r"layer_\d+", "layer_*", name)
        r = per.setdefault(key, collections.defaultdict(float))
        r["ablation"] += fake_rel({n: var[n]["ours" if n == name else "qwix"] for n in var}) / fq["qwix"] - 1
        r["n"] += 1
        for tool, (c, s) in (("ours", _ours_elems(mw)), ("qwix", _qwix_elems(aux))):
            err = c * s - np.asarray(w, np.float32)
            r[f"bias {tool}"] += float(err.sum() / s.sum()) * gs
            dm = _matrix(mw, err).reshape((-1, mw.k, _matrix(mw, err).shape[-1]))
            for li, x in enumerate(xs):
                x = np.asarray(x, np.float32).reshape(-1, mw.k)
                xm = x.mean(0, keepdims=True)
                r[f"mean part {tool}"] += float(np.sum((np.broadcast_to(xm, x.shape) @ dm[li]) ** 2))
                r[f"centred part {tool}"] += float(np.sum(((x - xm) @ dm[li]) ** 2))
                if tool == "ours":
                    r["x mean/rms"] += float(xm.mean() / np.sqrt(np.mean(x ** 2))) / len(xs)
    return fq


def run_gemma(args, seed, scheme, stats, per):
    import flax.linen as nn
    import qwix
    from gemma_style import Einsum

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
    inputs = {}

    def grab(next_fun, a, kw, ctx):  # the input x of each gemma Einsum (its param's path)
        if ctx.method_name == "__call__" and isinstance(ctx.module, Einsum):
            inputs["/".join(ctx.module.scope.path + (ctx.module.weight_name,))] = a[1]
        return next_fun(*a, **kw)

    with nn.intercept_methods(grab):
        model.apply(params, tokens)
    is_mw = lambda v: isinstance(v, MatmulWeight)  # noqa: E731
    keyname = lambda k: "/".join(getattr(p, "key", str(p)) for p in k)  # noqa: E731
    flat_o = {keyname(k): v for k, v in jax.tree_util.tree_leaves_with_path(qp["params"], is_leaf=is_mw)}
    is_q = lambda v: hasattr(v, "array")  # noqa: E731
    flat_q = {keyname(k): v for k, v in jax.tree_util.tree_leaves_with_path(qq, is_leaf=is_q)}
    flat_w = {keyname(k): v for k, v in jax.tree_util.tree_leaves_with_path(params["params"])}
    entries = [(k, v, flat_q[k], flat_w[k], [inputs[k]]) for k, v in flat_o.items() if is_mw(v)]

    def fake_rel(new):
        tree = {k: new.get(k, v) for k, v in flat_o.items()}
        fparams = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params["params"]),
                                               [tree[keyname(k)] for k, _ in jax.tree_util.tree_leaves_with_path(
                                                   params["params"])])
        return _rel(apply({"params": fparams}, tokens), ref)

    return e_ours, e_qwix, _analyse(scheme, entries, fake_rel, stats, per, args.per_weight)


def _nnx_inputs(model, tokens):
    """{param path: [input of each stacked layer]} of NnxCustom's matmul weights (its forward, block by block)."""
    gd, st = nnx.split(model.blocks)
    x = model.embed[...][tokens]
    out = collections.defaultdict(list)
    for i in range(jax.tree.leaves(st)[0].shape[0]):
        b = nnx.merge(gd, jax.tree.map(lambda a: a[i], st))
        out["blocks/q/w"].append(x)
        h = jnp.tanh(b.q("btd,ndh->btnh", x)).reshape(x.shape[:2] + (-1,))
        out["blocks/o/kernel"].append(h)
        x = x + b.o(h)
        out["blocks/up/kernel"].append(x)
        u = jax.nn.gelu(b.up(x))
        out["blocks/down/kernel"].append(u)
        x = x + b.down(u)
    out["proj/kernel"].append(x)
    return out


def run_nnx(args, seed, scheme, stats, per):
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
                q=v, stacked=tuple(v.codes.shape[:-2]), shape=tuple(v.shape), perm=(0, 1), k=v.shape[0])
    flt = make()
    xs = _nnx_inputs(flt, tokens)
    entries = [(p, mw, qaux[p], nnx_traced.variable_at(flt, p).get_value(), xs[p]) for p, mw in mws.items()]

    def fake_rel(new):
        fm = make()
        for p, a in new.items():
            nnx_traced.variable_at(fm, p).set_value(a)
        return _rel(fwd(fm, tokens), ref)

    return e_ours, e_qwix, _analyse(scheme, entries, fake_rel, stats, per, args.per_weight)


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
    p.add_argument("--per-weight", action="store_true", help="per-weight ablation, bias and input-mean split")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    t0, c0 = time.perf_counter(), time.process_time()
    print(f"embed {args.embed}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; seeds "
          f"{args.first_seed}..{args.first_seed + args.seeds - 1}; load {os.getloadavg()[0]:.1f}", flush=True)
    for model in [m for m in args.models.split(",") if m]:
        for scheme in [s for s in args.schemes.split(",") if s]:
            stats, per = collections.Counter(), {}
            rel, fq_rel = [], collections.defaultdict(list)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                fn = run_gemma if model == "gemma" else run_nnx
                e_o, e_q, fq = fn(args, seed, scheme, stats, per)
                rel.append(e_o / e_q - 1)
                for k in ("ours", "sym", "qscale"):
                    fq_rel[k].append(fq[k] / fq["qwix"] - 1)
                fq_rel["sym/ours"].append(fq["sym"] / fq["ours"] - 1)
                print(f"{model} {scheme} seed {seed}: rel-L2 ours {e_o:.6g} qwix {e_q:.6g} ({100 * rel[-1]:+.2f}%); "
                      f"fake-quant ours {fq['ours']:.6g} qwix {fq['qwix']:.6g} sym {fq['sym']:.6g} qscale "
                      f"{fq['qscale']:.6g}", flush=True)
            print(f"== {model} {scheme}, {args.seeds} seeds: ours / qwix - 1 = {_summary(rel)}")
            print(f"   fake quant, our codes / qwix's - 1 = {_summary(fq_rel['ours'])}")
            print(f"   fake quant, our rounding with qwix's scale / qwix's - 1 = {_summary(fq_rel['qscale'])}")
            print(f"   fake quant, symmetric-clipped codes / qwix's - 1 = {_summary(fq_rel['sym'])}")
            print(f"   fake quant, symmetric-clipped codes / ours - 1 = {_summary(fq_rel['sym/ours'])}")
            pairs = sorted(((k, v) for k, v in stats.items() if k.startswith("code ours")), key=lambda kv: -kv[1])
            print(f"   weights compared {stats['weights']} (+{stats['weights other grouping']} grouped differently "
                  f"by qwix), elements {stats['elements']}, scales differing {stats['scale diff']} (at most "
                  f"{stats['scale max ulp']} ulp), codes differing {stats['code diff']} "
                  f"({100 * stats['code diff'] / max(1, stats['elements']):.3f}%): "
                  + ", ".join(f"{k[5:]}: {v}" for k, v in pairs[:6]), flush=True)
            print(f"   codes of our rounding with qwix's scale differing from qwix's: "
                  f"{stats['qscale code diff vs qwix']}; compressed-tensors' codes differing from ours: {stats['ct code diff vs ours']} of "
                  f"{stats['ct elements']}")
            if per:
                print("   per weight (mean over seeds and layers): fake quant with ours only there / qwix's - 1 | mean "
                      "error per group of 128, in scales, ours / qwix | input feature mean / rms | |mean(x) @ err|, "
                      "|(x - mean(x)) @ err|: ours / qwix")
            for key, r in per.items():
                n = r["n"]
                print(f"     {key:32s} {100 * r['ablation'] / n:+.2f}% | {r['bias ours'] / n:+.3f} / "
                      f"{r['bias qwix'] / n:+.3f} | {r['x mean/rms'] / n:+.3f} | "
                      f"{math.sqrt(r['mean part ours'] / r['mean part qwix']):.4f}, "
                      f"{math.sqrt(r['centred part ours'] / r['centred part qwix']):.4f}", flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU; load "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
