"""Bits per weight of every GGUF block type kept packed (`converters.formats.gguf_packed`) against the file's own.

Usage: python bench/gguf_bits.py [--rows 64] [--cols 1024] [--out /tmp/gguf_bits.gguf] [--time] [--repeat 5]

Writes one small GGUF file with `gguf.GGUFWriter` holding an [rows, cols] tensor of each type of
`gguf_packed.PACKED_TYPES` (gguf's own quantizer where it has one, random blocks with finite float16 super-scales
elsewhere), reads it back with `gguf.GGUFReader`, and prints, per type, the file's bits per weight (8 x its bytes /
weights), the packed QArray's (8 x `QArray.nbytes` / weights: codes + scales + offsets as held in memory), their ratio,
and whether `dequantize` equals `gguf.quants.dequantize` bit for bit. `--time` adds the one-row packed matmul
(`qformats.dispatch.xla_qdot`, jit: the fused GEMV `packed_dot` for 4- and 8-bit weights, else dequantize + dot) against the dense float32 dot of the dequantized weight in the same run (best of
--repeat rounds of 20 calls, interleaved), and IQ4_NL / IQ4_XS once more as int8 table values (their compressed-tensors
form, `gguf_ct_qarray`: the storage before the table format).
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
    a = p.parse_args(argv)
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
    """(xla_qdot ms: the fused GEMV for 4- / 8-bit weights, else dequantize + dot; dense dot ms) for one activation row, best of `repeat` rounds of 20 calls each, interleaved."""
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
            t0 = time.perf_counter()
            for _ in range(20):
                y = f(*args)
            y.block_until_ready()
            best[i] = min(best[i], (time.perf_counter() - t0) / 20 * 1e3)
    return best[0], best[1]

if __name__ == "__main__":
    main()
