"""Benchmark: packed-weight qmatmul (Pallas/Triton) vs dense bf16 jnp.dot vs the XLA dequantize+dot path.

For each linear shape [K, N] (Llama-2-7B's 4096x4096, 4096x11008, 11008x4096, and 8192x8192), each M and
each format, in the same run: the dense bf16 `jnp.dot`, `qformats.dispatch.xla_qdot` (dequantize inside
jit, then dot) on the storage layout, and `kernels_pallas.qmatmul` on the prepared layout. Reports time per
call, speedup over dense and over XLA, and achieved bandwidth = (weight bytes + x bytes + y bytes) / time,
also as a fraction of the bandwidth the dense path reaches at the same M.

Timing: one jitted function runs R calls back to back (R chosen so that a launch holds >= ~0.3 ms of
estimated work, 8..128 calls), cycling over enough copies of the weight (>= 128 MB in all) and of x that
the weights cannot be served from the 50 MB L2; 4 launches are queued without a sync (host dispatch
overlaps device work) and the median over repeats of total / (4 R) is reported. M runs in the order
1, 16, 256, 64, 4 over all shapes, so a time budget drops the rows furthest from the issue's goals.

Usage (GPU): python bench/kernels.py --json OUT.json --md OUT.md [--budget-s 300] [--quick]
Prints the table; `--append BENCHMARKS.md` appends the markdown section there.
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
from kernels_pallas import BlockSizes, default_block_sizes, prepare, qmatmul  # noqa: E402

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 8192)]
MS = [1, 4, 16, 64, 256]
FORMATS = ["FP8_E4M3", "FP6_E3M2", "FP6_E2M3", "FP5_E2M2", "MXFP4A16", "NVFP4A16", "W4A16"]
# issue #5 goals at M = 1 (speedup over dense bf16); FP6 also >= 2x at M = 16.
GOALS = {"FP8_E4M3": 1.85, "FP6_E3M2": 2.4, "FP6_E2M3": 2.4, "FP5_E2M2": 2.8, "FP5_E3M1": 2.8,
         "MXFP4A16": 3.4, "NVFP4A16": 3.4}
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new rows after this")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-calls", type=int, default=MAX_CALLS, help="cap on R (calls per launch)")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA dequantize+dot path")
    ap.add_argument("--tune", action="store_true",
                    help="also try other tilings (M <= 16: dot and GEMV forms x split_k 1..16 x num_warps 2/4; else block_m x "
                         "num_warps) and keep the fastest")
    ap.add_argument("--layouts", default="128x64",
                    help="prepare layouts block_k x block_n to try, e.g. 128x64,256x64,128x128 (fastest kept)")
    ap.add_argument("--probe", action="store_true",
                    help="also time the kernel without its decode (wrong values; loads + dots only): "
                         "if that is much faster, the decode's ALU work is the bound")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--append", default=None, help="append the markdown section to this file")
    ap.add_argument("--quick", action="store_true", help="one shape, M in {1, 16}, three formats")
    a = ap.parse_args(argv)
    if a.quick:
        a.shapes, a.ms, a.formats = "4096x4096", "1,16", "FP6_E3M2,MXFP4A16,NVFP4A16"
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    names = a.formats.split(",")
    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",")]
    dev = jax.devices()[0]
    backend = jax.default_backend()
    t_start = time.time()
    rows, skipped = [], []
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": getattr(dev, "device_kind", str(dev)), "backend": backend, "jax": jax.__version__}
    print(json.dumps(header), flush=True)
    if backend != "gpu":
        print("WARNING: not on a GPU; qmatmul runs interpreted and the numbers mean nothing", flush=True)
    rng = np.random.default_rng(0)

    def flush():
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"header": header, "rows": rows, "skipped": skipped}, f, indent=1)

    prepared = {}
    for (k, n) in shapes:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        ent = {"dense": _copies(w, max(2, -(-COPY_BYTES // (k * n * 2))))}
        for name in names:
            q = qformats.quantize(w, qformats.presets[name].weights, axis=0)
            pws = {lay: prepare(q, block_k=lay[0], block_n=lay[1]) for lay in layouts}
            ent[name] = (q, {lay: _copies(pw, max(2, -(-COPY_BYTES // pw.nbytes))) for lay, pw in pws.items()},
                         None if a.no_xla else _copies(q, max(2, -(-COPY_BYTES // q.nbytes))))
        prepared[(k, n)] = ent
        jax.block_until_ready(ent)
    print(f"prepared {len(shapes)} shapes x {len(names)} formats in {time.time() - t_start:.1f} s", flush=True)

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
                                    .astype(x.dtype), ent["dense"], xs, est, a.reps,
                                    max_calls=a.max_calls)
            bw_dense = (dense_bytes + io_bytes) / t_dense
            print(f"[{k}x{n} M={m}] dense bf16 {t_dense * 1e6:8.2f} us  {bw_dense / 1e9:7.1f} GB/s  (R={r})",
                  flush=True)
            for name in names:
                if time.time() - t_start > a.budget_s:
                    skipped.append(f"{k}x{n} M={m} {name}")
                    continue
                t_row = time.time()
                q, pw_copies, qc = ent[name]
                row = {"K": k, "N": n, "M": m, "format": name, "scheme": q.scheme.describe(),
                       "dense_us": t_dense * 1e6, "dense_GBps": bw_dense / 1e9}
                try:
                    best = None
                    for lay, pws in pw_copies.items():
                        pw = pws[0]
                        wbytes = pw.nbytes
                        est_q = (wbytes + io_bytes) / HBM_BYTES_PER_S
                        bs0 = default_block_sizes(m, pw.meta)
                        cands = [bs0]
                        if a.tune and m <= 16:
                            tiles = pw.meta.K_pad // pw.meta.block_k
                            bms = [16] + [b for b in (1, 2, 4, 8) if b >= m][:1]  # dot and GEMV forms
                            cands += [BlockSizes(bm, None, sk, nw, 3) for bm in bms for sk in (1, 2, 4, 8, 16)
                                      for nw in (2, 4) if sk <= tiles]
                        elif a.tune:
                            cands += [dataclasses.replace(bs0, block_m=bm, num_warps=nw)
                                      for bm in (32, 64, 128) for nw in (4, 8) if bm <= max(16, m)]
                        for bs in cands:
                            if best is not None and time.time() - t_start > a.budget_s:
                                break
                            t_k, r = time_calls(lambda x, p, bs=bs: qmatmul(x, p, interpret=backend != "gpu",
                                                                           block_sizes=bs), pws, xs, est_q, a.reps,
                                                max_calls=a.max_calls)
                            if best is None or t_k < best[0]:
                                best = (t_k, bs, lay, wbytes)
                    t_k, bs, lay, wbytes = best
                    if a.probe and backend == "gpu":
                        from kernels_pallas.qmatmul import _qmatmul_2d_gpu
                        pws = pw_copies[lay]

                        def nodec(x, p, bs=bs):
                            xp = jnp.pad(x, ((0, 0), (0, p.meta.K_pad - x.shape[1]))) if p.meta.K_pad != k else x
                            return _qmatmul_2d_gpu(xp, p, bs=bs, interpret=False, probe="no_decode")
                        t_nd, _ = time_calls(nodec, pws, xs, (wbytes + io_bytes) / HBM_BYTES_PER_S, a.reps,
                                             max_calls=a.max_calls)
                        row["no_decode_us"] = t_nd * 1e6
                    row.update(weight_bytes=wbytes, kernel_us=t_k * 1e6, kernel_GBps=(wbytes + io_bytes) / t_k / 1e9,
                               speedup_vs_dense=t_dense / t_k, bw_frac_of_dense=(wbytes + io_bytes) / t_k / bw_dense,
                               block_sizes=dataclasses.asdict(bs), layout=f"bk{lay[0]}bn{lay[1]}")
                except Exception as e:  # keep going: one failing format must not lose the others' numbers
                    row["kernel_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if qc is not None:
                    try:
                        est_x = (q.nbytes + io_bytes) / HBM_BYTES_PER_S
                        t_x, _ = time_calls(xla_qdot, qc, xs, est_x, a.reps, max_calls=a.max_calls)
                        row.update(xla_us=t_x * 1e6)
                        if "kernel_us" in row:
                            row["speedup_vs_xla"] = t_x * 1e6 / row["kernel_us"]
                    except Exception as e:
                        row["xla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["row_s"] = round(time.time() - t_row, 2)  # compile + timing wall time of this row
                rows.append(row)
                flush()
                print(_fmt_row(row), flush=True)
    flush()
    md = to_markdown(header, rows, skipped)
    print(md)
    for path in filter(None, (a.md, a.append)):
        with open(path, "a" if path == a.append else "w") as f:
            f.write(md + "\n")
    return 0


def _fmt_row(r) -> str:
    if "kernel_us" not in r:
        return f"  {r['format']:<10} kernel FAILED: {r.get('kernel_error')}"
    xla = f"xla {r['xla_us']:8.2f} us ({r['speedup_vs_xla']:.2f}x)" if "xla_us" in r else "xla -"
    if "no_decode_us" in r:
        xla += f"  [no decode: {r['no_decode_us']:.2f} us]"
    return (f"  {r['format']:<10} kernel {r['kernel_us']:8.2f} us {r['kernel_GBps']:7.1f} GB/s "
            f"{r['speedup_vs_dense']:5.2f}x dense ({100 * r['bw_frac_of_dense']:5.1f}% of its BW)  {xla}  "
            f"{r['layout']} bs={tuple(r['block_sizes'].values())}  ({r.get('row_s', 0):.1f} s)")


def to_markdown(header, rows, skipped) -> str:
    out = [f"## Kernels: packed qmatmul vs dense bf16 ({header['device']}, jax {header['jax']}, {header['date']})",
           "", "Time per call (us), speedup over dense bf16 `jnp.dot` and over the XLA dequantize+dot path, "
           "achieved bandwidth ((weights + x + y) bytes / time) and its fraction of the dense path's. "
           "Generated by `bench/kernels.py`.", "",
           "| K x N | M | format | weights MB | dense us | kernel us | xla us | vs dense | vs xla | GB/s | % dense BW | goal "
           "| tiling (layout; bm, split, warps, stages) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["K"], r["N"], r["M"], r["format"])):
        goal = GOALS.get(r["format"]) if r["M"] == 1 else (2.0 if r["M"] == 16 and r["format"].startswith("FP6")
                                                          else None)
        if "kernel_us" in r:
            b = r["block_sizes"]
            met = "" if goal is None else (f"{goal}x {'met' if r['speedup_vs_dense'] >= goal else 'missed'}")
            out.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['format']} | {r['weight_bytes'] / 1e6:.1f} | "
                       f"{r['dense_us']:.2f} | {r['kernel_us']:.2f} | {r.get('xla_us', float('nan')):.2f} | "
                       f"{r['speedup_vs_dense']:.2f}x | {r.get('speedup_vs_xla', float('nan')):.2f}x | "
                       f"{r['kernel_GBps']:.0f} | {100 * r['bw_frac_of_dense']:.0f}% | {met} | {r['layout']}; "
                       f"{b['block_m']}, {b['split_k']}, {b['num_warps']}, {b['num_stages']}"
                       + (f"; no-decode probe {r['no_decode_us']:.2f} us" if "no_decode_us" in r else "") + " |")
        else:
            out.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['format']} | | {r['dense_us']:.2f} | FAILED | | | | "
                       f"| | | {r.get('kernel_error', '')[:80]} |")
    if skipped:
        out += ["", f"Not run (time budget): {', '.join(skipped)}"]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
