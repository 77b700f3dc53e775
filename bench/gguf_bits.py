"""Bits per weight of every GGUF block type kept packed (`converters.formats.gguf_packed`) against the file's own.

Usage: python bench/gguf_bits.py [--rows 64] [--cols 1024] [--out /tmp/gguf_bits.gguf] [--time] [--repeat 5]
                                 [--variants]

Writes one small GGUF file with `gguf.GGUFWriter` holding an [rows, cols] tensor of each type of
`gguf_packed.PACKED_TYPES` (gguf's own quantizer where it has one, random blocks with finite float16 super-scales
elsewhere), reads it back with `gguf.GGUFReader`, and prints, per type, the file's bits per weight (8 x its bytes /
weights), the packed QArray's (8 x `QArray.nbytes` / weights: codes + scales + offsets as held in memory), their ratio,
and whether `dequantize` equals `gguf.quants.dequantize` bit for bit. `--time` adds the one-row packed matmul
(`qformats.dispatch.xla_qdot`, jit: the fused GEMV `packed_dot` for 4- and 8-bit weights, else dequantize + dot) against the dense float32 dot of the dequantized weight in the same run (process CPU ms, best of
--repeat rounds of 20 calls, interleaved), and IQ4_NL / IQ4_XS once more as int8 table values (their compressed-tensors
form, `gguf_ct_qarray`: the storage before the table format).

`--variants` times, instead, other forms of the one-row product for the int group types with a float scale d and
offset m (Q4_0 / Q4_1 / Q8_0, [rows, cols] = [N, K]), each against `packed_dot` (the fused GEMV that ships, per weight
(d q + m) x) in the same run (process CPU time, best of --repeat interleaved rounds), and prints each one's largest error relative to the float64 product of the dequantized
weight. All but the last regroup the same exact sum, y[n] = sum_g (d[n, g] P[n, g] + m[n, g] S[g]) with
P[n, g] = sum_{i in g} q[n, i] x[i] and S[g] = sum_{i in g} x[i] (S shared by every n):
  - "offset by group sums": the fused GEMV with per weight d q only, plus the [N, G] x [G] GEMV of m and S;
  - "P by a GEMV per group": P[:, g] one fused GEMV of g's codes (as float32) per group;
  - "P by a batched dot": one dot_general batched over the groups;
  - "P by a reduce": sum over i of q x as an elementwise product and a reduce;
  - "int8 x int8 -> int32 (llama.cpp's numerics)": x quantized per group to int8 (absmax / 127, llama.cpp's Q8_0
    activations: not the default numerics), P an int32 batched dot of int8 codes and int8 activations, then scaled.
4-bit codes are taken nibble by nibble (low nibbles against x's even elements, high against its odd ones), as
`packed_dot` takes them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# byte offsets of each block's float16 d (and dmin / m), as gguf.quants' readers take them
_F16 = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
        "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}


def _tensor(gguf, t, rows, cols, rng):
    qt = gguf.GGMLQuantizationType[t]
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt)
    except NotImplementedError:
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
        if t == "MXFP4":
            raw[:, 0] = rng.integers(120, 128, raw.shape[0], dtype=np.uint8)
        for at in _F16[t]:
            raw[:, at:at + 2] = rng.uniform(1e-4, 1e-2, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return raw.reshape(rows, -1)


def main(argv=None) -> None:
    import gguf

    from converters.formats.gguf_packed import PACKED_TYPES, gguf_qarray
    from qformats import dequantize

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--out", default=None, help="the GGUF file to write (default: a temporary one)")
    p.add_argument("--time", action="store_true", help="time packed_dot against the dense dot")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--variants", action="store_true", help="time per-group forms of the GEMV against packed_dot")
    a = p.parse_args(argv)
    if a.variants:
        return _variants(a.rows, a.cols, a.repeat)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.out or os.path.join(tmp, "bits.gguf")
        w = gguf.GGUFWriter(path, "llama")
        for t in PACKED_TYPES:
            w.add_tensor(f"{t.lower()}.weight", _tensor(gguf, t, a.rows, a.cols, rng), raw_dtype=gguf.GGMLQuantizationType[t])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        r = gguf.GGUFReader(path)
        head = "| GGML type | element format | file bits / weight | packed QArray bits / weight | ratio | bit-exact |"
        print(head + (" packed GEMV ms | dense dot ms | packed vs dense |" if a.time else ""))
        print("| --- | --- | ---: | ---: | ---: | --- |" + (" ---: | ---: | ---: |" if a.time else ""))
        for tensor in r.tensors:
            t = tensor.tensor_type.name
            raw = np.asarray(tensor.data)
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            q = gguf_qarray(raw, t, (n, k), f"{path}: {tensor.name}")
            ref = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(n, k)
            exact = np.array_equal(np.asarray(dequantize(q)).T.view(np.uint32), ref.astype(np.float32).view(np.uint32))
            fb = 8 * raw.nbytes / (n * k)
            rows = [(t, q)]
            if a.time and t in ("IQ4_NL", "IQ4_XS"):
                from converters.pipelines.convert_quantized import gguf_ct_qarray

                rows.append((f"{t} as int8 values", gguf_ct_qarray(q)))
            for label, qa in rows:
                qb = 8 * qa.nbytes / (n * k)
                line = f"| {label} | {qa.scheme.format.name} | {fb:.4g} | {qb:.4g} | {qb / fb:.2f}x | {'yes' if exact else 'NO'} |"
                if a.time:
                    tp, td = _time(qa, a.repeat)
                    line += f" {tp:.3f} | {td:.3f} | {td / tp:.2f}x |"
                print(line, flush=True)


def _time(q, repeat: int):
    """(xla_qdot ms: the fused GEMV for 4- / 8-bit weights, else dequantize + dot; dense dot ms) for one activation
    row, process CPU time (steadier than wall time on a shared machine), best of `repeat` rounds of 20 calls each,
    interleaved."""
    import time

    import jax
    import jax.numpy as jnp

    from qformats import dequantize
    from qformats.dispatch import xla_qdot

    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, q.shape[0])).astype(np.float32))
    w = dequantize(q)
    fns = [(jax.jit(xla_qdot), (x, q)), (jax.jit(lambda x, w: x @ w), (x, w))]
    best = [float("inf")] * 2
    for f, args in fns:
        f(*args).block_until_ready()
    for _ in range(repeat):
        for i, (f, args) in enumerate(fns):
            t0 = time.process_time()
            for _ in range(20):
                y = f(*args)
            y.block_until_ready()
            best[i] = min(best[i], (time.process_time() - t0) / 20 * 1e3)
    return best[0], best[1]


def _group_parts(q):
    """[(codes' element values as float32 [N, G, L], j)] for the group int types: one entry (j = None: all of a
    group's L = g elements) for 8-bit codes, two for 4-bit (j = 0 / 1: the low / high nibbles, L = g / 2)."""
    import jax.numpy as jnp

    from qformats.qarray import element_values

    k, n = q.shape
    g = q.scheme.group_size
    if q.scheme.bits == 8:
        return [(element_values(q.codes, q.scheme.format).reshape(n, k // g, g), None)]
    return [(element_values((q.codes >> jnp.uint8(4 * j)) & jnp.uint8(15), q.scheme.format).reshape(n, k // g, g // 2), j)
            for j in range(2)]


def _group_x(x, q, j):
    """x's elements matching `_group_parts`' entry j, as [G, L]."""
    k = q.shape[0]
    g = q.scheme.group_size
    xg = x.reshape(k // g, g)
    return xg if j is None else xg[:, j::2]


def _finish(P, x, q):
    """y[n] = sum_g d[n, g] P[n, g] + m[n, g] S[g]."""
    import jax.numpy as jnp

    k = q.shape[0]
    g = q.scheme.group_size
    y = P * q.scale.astype(jnp.float32)
    if q.offset is not None:
        y = y + q.offset.astype(jnp.float32) * jnp.sum(x.reshape(k // g, g), -1)
    return jnp.sum(y, -1)


def _p_reduce(x, q):
    import jax.numpy as jnp

    return _finish(sum(jnp.sum(v * _group_x(x, q, j)[None], -1) for v, j in _group_parts(q)), x, q)


def _p_batched(x, q):
    import jax
    import jax.numpy as jnp

    dims = (((2,), (1,)), ((1,), (0,)))
    return _finish(sum(jax.lax.dot_general(v, _group_x(x, q, j), dims, preferred_element_type=jnp.float32).T
                       for v, j in _group_parts(q)), x, q)


def _p_gemv_per_group(x, q):
    import jax
    import jax.numpy as jnp

    dims = (((0,), (1,)), ((), ()))
    cols = []
    for gi in range(q.shape[0] // q.scheme.group_size):
        parts = [jax.lax.dot_general(_group_x(x, q, j)[gi], v[:, gi], dims) for v, j in _group_parts(q)]
        cols.append(parts[0] if len(parts) == 1 else jax.lax.dot_general(jnp.ones((2,)), jnp.stack(parts), (((0,), (0,)), ((), ()))))
    return _finish(jnp.stack(cols, 1), x, q)


def _int8(x, q):
    import jax
    import jax.numpy as jnp

    k = q.shape[0]
    g = q.scheme.group_size
    xg = x.reshape(k // g, g)
    dx = jnp.max(jnp.abs(xg), -1) / 127
    xq = jnp.round(xg / jnp.where(dx == 0, 1, dx)[:, None]).astype(jnp.int8).reshape(k)
    dims = (((2,), (1,)), ((1,), (0,)))
    P = sum(jax.lax.dot_general(v.astype(jnp.int8), _group_x(xq, q, j), dims, preferred_element_type=jnp.int32).T
            for v, j in _group_parts(q))
    return _finish(P.astype(jnp.float32) * dx, x, q)


def _offset_by_sums(x, q):
    """The fused GEMV with W = d q (`packed_dot` of q without its offset) + the GEMV of m [N, G] and S [G]."""
    import jax
    import jax.numpy as jnp

    from qformats.packed_dot import packed_dot

    y = packed_dot(x[None], q.replace(offset=None))[0]
    if q.offset is None:
        return y
    g = q.scheme.group_size
    sums = jnp.sum(x.reshape(-1, g), -1)
    return y + jax.lax.dot_general(sums, q.offset.astype(jnp.float32).T, (((0,), (0,)), ((), ())))


def _variants(rows: int, cols: int, repeat: int) -> None:
    import time

    import gguf
    import jax
    import jax.numpy as jnp

    from converters.formats.gguf_packed import gguf_qarray
    from qformats import dequantize
    from qformats.packed_dot import packed_dot

    forms = [("packed_dot (ships)", lambda x, q: packed_dot(x[None], q)[0]), ("offset by group sums", _offset_by_sums),
             ("P by a GEMV per group", _p_gemv_per_group), ("P by a batched dot", _p_batched),
             ("P by a reduce", _p_reduce), ("int8 x int8 -> int32 (llama.cpp's numerics)", _int8)]
    print(f"[N, K] = [{rows}, {cols}], one activation row, float32; process CPU ms per call, best of {repeat} rounds, "
          f"interleaved")
    print("| GGML type | form | ms | vs packed_dot | max error / max abs(y) |")
    print("| --- | --- | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for t in ("Q4_0", "Q4_1", "Q8_0"):
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType[t])
        q = gguf_qarray(raw, t, (rows, cols), t)
        x = jnp.asarray(rng.standard_normal(cols).astype(np.float32))
        ref = np.asarray(x, np.float64) @ np.asarray(dequantize(q), np.float64)
        kept = [(name, f) for name, f in forms if q.offset is not None or f is not _offset_by_sums]
        fns = [jax.jit(f) for _, f in kept]
        errs = [np.abs(np.asarray(f(x, q), np.float64) - ref).max() / np.abs(ref).max() for f in fns]
        n = max(3, int(2e7 // (rows * cols)))
        best = [float("inf")] * len(fns)
        for _ in range(repeat):
            for i, f in enumerate(fns):
                t0 = time.process_time()
                for _ in range(n):
                    y = f(x, q)
                y.block_until_ready()
                best[i] = min(best[i], (time.process_time() - t0) / n * 1e3)
        for (name, _), ms, err in zip(kept, best, errs):
            print(f"| {t} | {name} | {ms:.3f} | {ms / best[0]:.2f}x | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
