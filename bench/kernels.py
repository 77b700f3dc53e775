"""Benchmark: packed-weight qmatmul on Mosaic GPU and on Pallas Triton vs dense bf16 jnp.dot (cuBLAS) vs XLA.

For each linear shape [K, N] (Llama-2-7B's 4096x4096, 4096x11008, 11008x4096, and 8192x8192), each M and
each format, in the same run: the dense bf16 `jnp.dot`, `kernels_pallas.qmatmul_mgpu` (Mosaic GPU: TMA,
wgmma) on its prepared layout, `kernels_pallas.qmatmul` (Pallas Triton) on its prepared layout, and
optionally `qformats.dispatch.xla_qdot` (dequantize inside jit, then dot) on the storage layout. Reports
time per call, speedup over dense, and achieved bandwidth = (weight bytes + x bytes + y bytes) / time, also
as a fraction of the bandwidth the dense path reaches at the same M.

Timing: one jitted function runs R calls back to back (R chosen so that a launch holds >= ~0.3 ms of
estimated work, 8..128 calls), cycling over enough copies of the weight (>= 128 MB in all) and of x that
the weights cannot be served from the 50 MB L2; 4 launches are queued without a sync (host dispatch
overlaps device work) and the median over repeats of total / (4 R) is reported. M runs in the order
1, 16, 256, 64, 4 over all shapes, so a time budget drops the rows furthest from the issue's goals.

Usage (GPU): python bench/kernels.py --json OUT.json --md OUT.md [--budget-s 300] [--quick]
             [--backends mosaic,triton] [--xla] [--tune]
Prints the table (and writes it to --md): the figures of BENCHMARKS.md's section "Pallas kernels"; update that
section with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import qformats  # noqa: E402
from qformats.dispatch import xla_qdot  # noqa: E402

import kernels_pallas  # noqa: E402
from kernels_pallas import (BlockSizes, MgpuBlockSizes, default_block_sizes, default_mgpu_block_sizes,  # noqa: E402
                            mgpu_unsupported_reason, prepare, prepare_mgpu, qmatmul, qmatmul_mgpu,
                            unsupported_reason)

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 8192)]
MS = [1, 4, 16, 64, 256]
FORMATS = ["FP8_E4M3", "FP6_E3M2", "FP6_E2M3", "FP5_E2M2", "MXFP4A16", "NVFP4A16", "W4A16"]
# goals (speedup over dense bf16) at M = 1, held to M = 16; >= 0.9x dense at M = 256.
GOALS = {"FP8_E4M3": 1.85, "FP6_E3M2": 2.4, "FP6_E2M3": 2.4, "FP5_E2M2": 2.8, "FP5_E3M1": 2.8,
         "MXFP4A16": 3.4, "NVFP4A16": 3.4}
PREFILL_GOAL = 0.9
BACKENDS = ("mosaic", "triton")
HBM_BYTES_PER_S = 4.8e12
COPY_BYTES = 128 << 20  # > 2.5x the H200's 50 MB L2
MAX_CALLS = 128
M_ORDER = (1, 16, 256, 64, 4)  # when the time budget runs out, the rows of the goals come first


def _tree_bytes(t) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(t))


def _copies(t, n):
    return [t] + [jax.tree_util.tree_map(lambda a: a.copy(), t) for _ in range(n - 1)]


def time_calls(fn, ws, xs, est_s: float, reps: int, launches: int = 4, max_calls: int = None):
    """Seconds per fn(x, w) call. One jit runs R calls back to back, cycling over the copies ws and xs;
    `launches` launches are queued without a sync between them (host dispatch overlaps the device work of
    the previous launch), and the median over `reps` of total / (launches * R) is returned."""
    max_calls = max_calls or MAX_CALLS
    r = int(min(max_calls, max(min(8, max_calls), math.ceil(3e-4 / max(est_s, 1e-7)))))
    nw, nx = len(ws), len(xs)

    @jax.jit
    def many(ws, xs):
        return [fn(xs[i % nx], ws[i % nw]) for i in range(r)]

    jax.block_until_ready(many(ws, xs))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [many(ws, xs) for _ in range(launches)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / (r * launches))
        del outs
    return statistics.median(times), r


def _goal(fmt: str, m: int):
    if m <= 16:
        return GOALS.get(fmt)
    return PREFILL_GOAL if m >= 256 else None


def _candidates(backend, m, meta, tune):
    """The default tiling first; with --tune a few others."""
    if backend == "mosaic":
        bs0 = default_mgpu_block_sizes(m, meta)
        if not tune:
            return [bs0]
        tiles = meta.K_pad // meta.tile_k
        cands = [bs0] + [dataclasses.replace(bs0, split_k=sk) for sk in (1, 2, 4, 8)
                         if tiles % sk == 0 and sk != bs0.split_k]
        cands += [dataclasses.replace(bs0, lhs="smem"), dataclasses.replace(bs0, stages=max(1, bs0.stages // 2))]
        if m >= 64 and meta.N_pad % 128 == 0:
            cands.append(dataclasses.replace(bs0, compute_wgs=3 - bs0.compute_wgs))
        return cands
    bs0 = default_block_sizes(m, meta)
    if not tune:
        return [bs0]
    tiles = meta.K_pad // meta.block_k
    if m <= 16:
        bms = [16] + [b for b in (1, 2, 4, 8) if b >= m][:1]  # dot and GEMV forms
        return [bs0] + [BlockSizes(bm, None, sk, nw, 3) for bm in bms for sk in (1, 4, 16) for nw in (2, 4)
                        if sk <= tiles]
    return [bs0] + [dataclasses.replace(bs0, block_m=bm, num_warps=nw) for bm in (64, 128) for nw in (4, 8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--backends", default=",".join(BACKENDS), help="mosaic,triton (either or both)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new rows after this")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-calls", type=int, default=MAX_CALLS, help="cap on R (calls per launch)")
    ap.add_argument("--xla", action="store_true", help="also time the XLA dequantize+dot path")
    ap.add_argument("--tune", action="store_true", help="also try other tilings per backend and keep the fastest")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--quick", action="store_true", help="one shape, M in {1, 16}, three formats")
    a = ap.parse_args(argv)
    if a.quick:
        a.shapes, a.ms, a.formats = "4096x4096", "1,16", "FP6_E3M2,MXFP4A16,NVFP4A16"
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    names = a.formats.split(",")
    backends = [b for b in a.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"unknown backends {bad} (expected some of {BACKENDS})")
    dev = jax.devices()[0]
    backend = jax.default_backend()
    interp = backend != "gpu"
    t_start = time.time()
    rows, skipped = [], []
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": getattr(dev, "device_kind", str(dev)), "backend": backend, "jax": jax.__version__,
              "backends": backends}
    print(json.dumps(header), flush=True)
    if interp:
        print("WARNING: not on a GPU; the kernels run interpreted and the numbers mean nothing", flush=True)
    rng = np.random.default_rng(0)

    def flush():
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"header": header, "rows": rows, "skipped": skipped}, f, indent=1)

    layouts = {"mosaic": (mgpu_unsupported_reason, prepare_mgpu, qmatmul_mgpu),
               "triton": (unsupported_reason, prepare, qmatmul)}
    prepared = {}
    for (k, n) in shapes:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        ent = {"dense": _copies(w, max(2, -(-COPY_BYTES // (k * n * 2))))}
        for name in names:
            q = qformats.quantize(w, qformats.presets[name].weights, axis=0)
            per = {}
            for b in backends:
                why, prep, _ = layouts[b]
                if why(q) is None:
                    pw = prep(q)
                    per[b] = _copies(pw, max(2, -(-COPY_BYTES // pw.nbytes)))
                else:
                    per[b] = why(q)
            ent[name] = (q, per, _copies(q, max(2, -(-COPY_BYTES // q.nbytes))) if a.xla else None)
        prepared[(k, n)] = ent
        jax.block_until_ready(ent)
    print(f"prepared {len(shapes)} shapes x {len(names)} formats x {backends} in {time.time() - t_start:.1f} s",
          flush=True)

    for m in sorted(ms, key=lambda v: M_ORDER.index(v) if v in M_ORDER else len(M_ORDER) + v):
        for (k, n) in shapes:
            ent = prepared[(k, n)]
            if time.time() - t_start > a.budget_s:
                skipped.append(f"{k}x{n} M={m} (all)")
                continue
            dense_bytes = k * n * 2
            xs = [jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16) for _ in range(4)]
            io_bytes = m * k * 2 + m * n * 2
            est = (dense_bytes + io_bytes) / HBM_BYTES_PER_S
            t_dense, r = time_calls(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                                    .astype(x.dtype), ent["dense"], xs, est, a.reps, max_calls=a.max_calls)
            bw_dense = (dense_bytes + io_bytes) / t_dense
            print(f"[{k}x{n} M={m}] dense bf16 {t_dense * 1e6:8.2f} us  {bw_dense / 1e9:7.1f} GB/s  (R={r})",
                  flush=True)
            for name in names:
                if time.time() - t_start > a.budget_s:
                    skipped.append(f"{k}x{n} M={m} {name}")
                    continue
                t_row = time.time()
                q, per, qc = ent[name]
                row = {"K": k, "N": n, "M": m, "format": name, "scheme": q.scheme.describe(),
                       "dense_us": t_dense * 1e6, "dense_GBps": bw_dense / 1e9}
                for b in backends:
                    if isinstance(per[b], str):
                        row[b] = {"unsupported": per[b]}
                        continue
                    fn = layouts[b][2]
                    try:
                        pws = per[b]
                        wbytes = pws[0].nbytes
                        est_q = (wbytes + io_bytes) / HBM_BYTES_PER_S
                        best = None
                        for bs in _candidates(b, m, pws[0].meta, a.tune):
                            if best is not None and time.time() - t_start > a.budget_s:
                                break
                            try:
                                t_k, _ = time_calls(lambda x, p, bs=bs, fn=fn: fn(x, p, interpret=interp,
                                                                                   block_sizes=bs),
                                                    pws, xs, est_q, a.reps, max_calls=a.max_calls)
                            except Exception as e:  # a tiling that fails must not hide the others
                                if best is None and bs is _candidates(b, m, pws[0].meta, False)[0]:
                                    raise
                                print(f"    {b} {bs}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                                continue
                            if best is None or t_k < best[0]:
                                best = (t_k, bs)
                        t_k, bs = best
                        row[b] = {"us": t_k * 1e6, "weight_bytes": wbytes, "GBps": (wbytes + io_bytes) / t_k / 1e9,
                                  "speedup_vs_dense": t_dense / t_k,
                                  "bw_frac_of_dense": (wbytes + io_bytes) / t_k / bw_dense,
                                  "block_sizes": dataclasses.asdict(bs)}
                    except Exception as e:  # keep going: one failing backend must not lose the others' numbers
                        row[b] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if qc is not None:
                    try:
                        est_x = (q.nbytes + io_bytes) / HBM_BYTES_PER_S
                        t_x, _ = time_calls(xla_qdot, qc, xs, est_x, a.reps, max_calls=a.max_calls)
                        row["xla_us"] = t_x * 1e6
                    except Exception as e:
                        row["xla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["row_s"] = round(time.time() - t_row, 2)  # compile + timing wall time of this row
                rows.append(row)
                flush()
                print(_fmt_row(row, backends), flush=True)
    flush()
    md = to_markdown(header, rows, skipped, backends)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    return 0


def _cell(r, b) -> str:
    c = r.get(b, {})
    if "us" in c:
        return f"{c['us']:.2f} ({c['speedup_vs_dense']:.2f}x)"
    if "unsupported" in c:
        return "n/a"
    return "FAILED" if "error" in c else "-"


def _fmt_row(r, backends) -> str:
    parts = [f"  {r['format']:<10}"]
    for b in backends:
        c = r.get(b, {})
        if "us" in c:
            parts.append(f"{b} {c['us']:8.2f} us {c['GBps']:7.1f} GB/s {c['speedup_vs_dense']:5.2f}x dense "
                         f"bs={tuple(c['block_sizes'].values())}")
        else:
            parts.append(f"{b} {'n/a: ' + c['unsupported'] if 'unsupported' in c else 'FAILED: ' + c.get('error', '')}")
    if "xla_us" in r:
        parts.append(f"xla {r['xla_us']:8.2f} us")
    return " | ".join(parts) + f"  ({r.get('row_s', 0):.1f} s)"


def to_markdown(header, rows, skipped, backends) -> str:
    out = [f"## Kernels: packed qmatmul ({', '.join(backends)}) vs dense bf16 ({header['device']}, jax {header['jax']}, "
           f"{header['date']})", "",
           "Time per call (us) and speedup over dense bf16 `jnp.dot` per backend; GB/s and % of the dense path's "
           "bandwidth for the faster backend; goal: the issue's speedup over dense (M <= 16: the format's M = 1 "
           "goal held; M = 256: 0.9x). Generated by `bench/kernels.py`.", "",
           "| K x N | M | format | weights MB | dense us | " + " | ".join(f"{b} us (vs dense)" for b in backends)
           + " | xla us | GB/s | % dense BW | goal | tiling of the faster |",
           "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in backends) + " | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["K"], r["N"], r["M"], r["format"])):
        ok = [(r[b]["us"], b) for b in backends if "us" in r.get(b, {})]
        fast = min(ok)[1] if ok else None
        best = r[fast] if ok else {}
        goal = _goal(r["format"], r["M"])
        met = "" if goal is None or not best else \
            f"{goal}x {'met' if best['speedup_vs_dense'] >= goal else 'missed'} ({fast})"
        errs = "; ".join(f"{b}: {r[b]['error'][:60]}" for b in backends if "error" in r.get(b, {}))
        mb = f"{best['weight_bytes'] / 1e6:.1f}" if best else ""
        bw = f"{best['GBps']:.0f} | {100 * best['bw_frac_of_dense']:.0f}%" if best else " | "
        tiling = str(tuple(best["block_sizes"].values())) if best else ""
        cells = " | ".join(_cell(r, b) for b in backends)
        out.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['format']} | {mb} | {r['dense_us']:.2f} | {cells} | "
                   f"{r.get('xla_us', float('nan')):.2f} | {bw} | {met} | {tiling}{' ' + errs if errs else ''} |")
    if skipped:
        out += ["", f"Not run (time budget): {', '.join(skipped)}"]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
