"""CPU throughput of jit `quantize` (GB/s of input) vs compressed-tensors' torch path, same matrix, same run.

Usage: python bench/core.py [--size 4096] [--repeat 5] [--markdown]
The reference for each scheme: compressed-tensors' min/max observer math (calculate_qparams /
generate_gparam) + its `quantize` (the path llm-compressor runs on CPU), timed on the same data. FP6_E3M2 has
no compressed-tensors preset; its reference is torch per-channel absmax + torchao's f32_to_f6_e3m2_unpacked.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from qformats import presets, quantize

SCHEMES = ["FP8_DYNAMIC", "W4A16", "NVFP4A16", "MXFP4A16", "FP6_E3M2"]


def _best(fn, repeat):
    fn()  # warm-up / compile
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _ours(x, name):
    scheme = presets[name].weights

    def run():
        q = quantize(x, scheme, axis=-1)
        jax.block_until_ready((q.codes, q.scale))
    return run


def _reference(w, name):
    import torch
    from compressed_tensors.quantization.lifecycle.forward import quantize as ctq
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    if name == "FP6_E3M2":
        from torchao.prototype.custom_fp_utils import _f32_to_floatx_unpacked

        def run():
            s = w.abs().amax(1, keepdim=True).float() / 28.0
            _f32_to_floatx_unpacked((w.float() / s).clamp(-28, 28), 3, 2)
        return run
    args = PRESET_SCHEMES[name]["weights"]

    def run():
        with torch.no_grad():
            if args.strategy == "channel":
                s, z = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
                g = None
            else:
                wg = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
                g = generate_gparam(w.amin(), w.amax()) if args.strategy == "tensor_group" else None
                s, z = calculate_qparams(wg.amin(-1), wg.amax(-1), args, global_scale=g)
            ctq(w, s, None, args, global_scale=g)
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads()))
    n = args.size
    rng = np.random.default_rng(0)
    base = (rng.standard_normal((n, n)) * 0.05).astype(np.float32)
    print(f"# bench/core.py  {n}x{n}  jax {jax.__version__} on {jax.default_backend()}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
    print("| scheme | dtype | qformats ms | qformats GB/s | compressed-tensors ms | ct GB/s | speedup |")
    print("|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        x = jnp.asarray(base).astype(dtype)
        w = torch.from_numpy(base).to(getattr(torch, dtype))
        gb = n * n * jnp.dtype(dtype).itemsize / 1e9
        for name in SCHEMES:
            t_ours = _best(_ours(x, name), args.repeat)
            t_ref = _best(_reference(w, name), args.repeat)
            print(f"| {name} | {dtype} | {t_ours * 1e3:.1f} | {gb / t_ours:.2f} | {t_ref * 1e3:.1f} | "
                  f"{gb / t_ref:.2f} | {t_ref / t_ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
