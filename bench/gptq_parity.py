"""GPTQ parity: qformats.algorithms.gptq.gptq_quantize against llm-compressor's `quantize_weight`, same W, X, H.

Two processes exchange .npz files in a temporary directory: this script, run with the project's venv,
draws W ([K, N], Flax layout), calibration inputs X and H = X^T X / T, then runs itself under the
llm-compressor venv (`--torch-side DIR`, default interpreter /tmp/llmc/bin/python, or $LLMC_PYTHON), which
computes llm-compressor's own Hessian (`accumulate_hessian`: 2 sum x x^T / #batches), its weight observer
qparams (`memoryless_minmax`) and `quantize_weight` on the torch layout W^T [N, K], with the weight
args' `actorder` set to --actorder (default none: column order; "static" is GPTQModifier's default,
"weight" its alias in compressed-tensors). Back here: gptq_quantize(W, scheme, H, actorder=...);
llm-compressor's dequantized output is re-quantized with its own scales to codes. Reported per case: scales
identical (bitwise), fraction of identical codes, output error ||X W - X Wq||^2 / ||X W||^2 of
llm-compressor, ours and RTN (and, with --actorder, ours in column order).

    python bench/gptq_parity.py [--shapes 384x1536,1536x384] [--tokens 4096] [--actorder static]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

LLMC_PYTHON = os.environ.get("LLMC_PYTHON", "/tmp/llmc/bin/python")

# case name -> (compressed-tensors preset for the weights, override of its args, qformats scheme spec, dtype)
CASES = {
    "W4A16 (int4 g128)": ("W4A16", {}, "W4A16", "float32"),
    "W4A16_ASYM": ("W4A16_ASYM", {}, "W4A16_ASYM", "float32"),
    "W8A16 (int8 g128)": ("W8A16", {}, "W8A16", "float32"),
    "W8A8 (int8 channel)": ("W8A8", {}, "W8A8", "float32"),
    "int4 g32": ("W4A16", {"group_size": 32}, ("int4", 32), "float32"),
    "FP8_DYNAMIC (fp8 channel)": ("FP8_DYNAMIC", {}, "FP8_DYNAMIC", "float32"),
    "FP8 (fp8 tensor)": ("FP8", {}, "FP8", "float32"),
    "FP8_BLOCK": ("FP8_BLOCK", {}, "FP8_BLOCK", "float32"),
    "NVFP4A16": ("NVFP4A16", {}, "NVFP4A16", "float32"),
    "MXFP4A16": ("MXFP4A16", {}, "MXFP4A16", "float32"),
    "MXFP8A16": ("MXFP8A16", {}, "MXFP8A16", "float32"),
    "W4A16 bf16 weights": ("W4A16", {}, "W4A16", "bfloat16"),
    "W4A16 dead inputs": ("W4A16", {}, "W4A16", "float32"),
}


def _draw(k: int, n: int, tokens: int, seed: int, dead: bool):
    """W like a trained kernel (row-scaled normal), X with correlated features and a few outlier channels."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.04 * rng.uniform(0.5, 1.5, (1, n))).astype(np.float32)
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    feat_scale = np.exp(rng.standard_normal(k) * 0.5).astype(np.float32)
    feat_scale[rng.choice(k, max(1, k // 64), replace=False)] *= 8.0  # outlier input channels
    x = (rng.standard_normal((tokens, k)).astype(np.float32) @ (np.eye(k, dtype=np.float32) + 0.7 * mix))
    x = x * feat_scale
    if dead:
        x[:, rng.choice(k, max(1, k // 16), replace=False)] = 0.0
    return w, x.astype(np.float32)


# ---- torch side (llm-compressor venv; no jax / qformats there) ---------------------------------------------
def torch_side(d: str) -> None:
    # bench/ is sys.path[0] when this file runs as a script, and bench/kernels.py would shadow the `kernels`
    # package that transformers probes for
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian
    from llmcompressor.observers import Observer

    meta = np.load(os.path.join(d, "meta.npz"), allow_pickle=True)
    block_size, damp = int(meta["block_size"]), float(meta["damp"])
    actorder = None if str(meta["actorder"]) == "none" else str(meta["actorder"])
    for tag in meta["tags"]:
        tag = str(tag)
        inp = np.load(os.path.join(d, f"in_{tag}.npz"), allow_pickle=True)
        preset, override, dtype = str(inp["preset"]), inp["override"].item(), str(inp["dtype"])
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        lin = torch.nn.Linear(inp["w"].shape[0], inp["w"].shape[1], bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(inp["w"].T.copy()).to(tdt))  # [N, K]; bf16 exact (drawn as bf16)
        lin = lin.to(tdt)
        args = preset_name_to_scheme(preset, ["Linear"]).weights.model_copy(update={"actorder": actorder, **override})
        x = torch.from_numpy(inp["x"]).to(tdt)
        hess = make_empty_hessian(lin)
        ns = torch.zeros(())
        for chunk in torch.split(x, 512):  # as calibration batches of 512 tokens
            hess, ns = accumulate_hessian(chunk[None], lin, hess, ns)
        obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
        obs(lin.weight)
        qp = obs.get_qparams()
        gs = None if qp["global_scale"] is None else qp["global_scale"].reshape(-1)[:1]
        wt = lin.weight.detach().to(torch.float32)[None].clone()
        t0 = time.perf_counter()
        q, loss, fallback = quantize_weight(wt, (hess / ns)[None].clone(), qp["scale"][None], qp["zero_point"][None],
                                            gs, args, blocksize=block_size, percdamp=damp)
        dt = time.perf_counter() - t0
        out = {"q": q[0].to(tdt).float().numpy(), "scale": qp["scale"].float().numpy(), "seconds": dt,
               "fallback": bool(fallback[0])}
        if not args.symmetric:
            out["zero_point"] = qp["zero_point"].to(torch.int32).numpy()
        if gs is not None:
            out["global_scale"] = gs.float().numpy()
        np.savez(os.path.join(d, f"out_{tag}.npz"), **out)


# ---- project side ---------------------------------------------------------------------------------------------
def _scheme(spec):
    from qformats import QuantScheme, presets
    if isinstance(spec, tuple):
        fmt, g = spec
        return QuantScheme(fmt, "group", group_size=g, scale_format="input")
    return presets[spec].weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="384x1536,1536x384", help="comma-separated KxN (Flax kernel [K, N])")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--actorder", default="none", choices=["none", "static", "weight"],
                    help="activation order on both sides (llm-compressor's GPTQModifier default: static)")
    ap.add_argument("--torch-side", metavar="DIR", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_side:
        torch_side(a.torch_side)
        return

    import jax
    import jax.numpy as jnp
    from qformats import quantize
    from qformats.algorithms.gptq import gptq_quantize

    names = [c for c in CASES if not a.cases or c in a.cases.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tags, inputs = [], {}
        for si, (k, n) in enumerate(shapes):
            for ci, name in enumerate(names):
                preset, override, spec, dtype = CASES[name]
                w, x = _draw(k, n, a.tokens, seed=1000 * si + ci, dead="dead" in name)
                if dtype == "bfloat16":
                    w = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
                    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
                tag = f"{si}_{ci}"
                tags.append(tag)
                inputs[tag] = (name, k, n, spec, dtype, w, x)
                np.savez(os.path.join(d, f"in_{tag}.npz"), w=w, x=x, preset=preset, dtype=dtype,
                         override=np.array(override, dtype=object))
        np.savez(os.path.join(d, "meta.npz"), tags=np.array(tags), block_size=a.block_size, damp=a.damp,
                 actorder=a.actorder)
        t0 = time.perf_counter()
        subprocess.run([LLMC_PYTHON, os.path.abspath(__file__), "--torch-side", d], check=True,
                       env={**os.environ, "LOGURU_LEVEL": "ERROR"})
        print(f"llm-compressor side: {time.perf_counter() - t0:.1f}s in all", file=sys.stderr)

        actorder = None if a.actorder == "none" else a.actorder
        extra = " out err ours, column order |" if actorder else ""
        print(f"actorder={actorder}")
        print("| shape KxN | case | scales identical | codes identical | out err llm-compressor | out err ours "
              f"| out err RTN |{extra} ours / llmc | time llmc | time ours (warm) |")
        print("| --- " * (11 if actorder else 10) + "|")
        for tag in tags:
            name, k, n, spec, dtype, w, x = inputs[tag]
            ref = np.load(os.path.join(d, f"out_{tag}.npz"))
            scheme = _scheme(spec)
            wj = jnp.asarray(w, dtype)
            xt = x.astype(np.float64)
            h = jnp.asarray(x.T @ x / x.shape[0], jnp.float32)
            kw = dict(block_size=a.block_size, dampening_frac=a.damp, actorder=actorder)
            ours = gptq_quantize(wj, scheme, h, **kw)
            jax.block_until_ready(ours.codes)
            t0 = time.perf_counter()
            ours = gptq_quantize(wj, scheme, h, **kw)
            jax.block_until_ready(ours.codes)
            t_ours = time.perf_counter() - t0
            rtn = quantize(wj, scheme, 0)
            plain = None
            if actorder:
                plain = gptq_quantize(wj, scheme, h, block_size=a.block_size, dampening_frac=a.damp)
                dg = np.diagonal(np.asarray(h))
                dg = dg[dg != 0]
                if len(np.unique(dg)) < len(dg):  # torch's argsort is not stable: tied inputs may be ordered apart
                    name += f" ({len(dg) - len(np.unique(dg))} tied diag(H) entries)"
            _row(k, n, name, scheme, dtype, w, xt, ref, ours, rtn, t_ours, plain)
            if "dead" in name:
                # dead inputs get H[k, k] = 1, which makes the dampening depend on H's scale: with
                # llm-compressor's normalisation (2 sum x x^T / #batches of 512 tokens) the result is its own
                hl = jnp.asarray(x.T @ x * (2.0 / -(-x.shape[0] // 512)), jnp.float32)
                ours = gptq_quantize(wj, scheme, hl, **kw)
                if actorder:
                    plain = gptq_quantize(wj, scheme, hl, block_size=a.block_size, dampening_frac=a.damp)
                _row(k, n, name + ", H scaled as llm-compressor", scheme, dtype, w, xt, ref, ours, rtn, t_ours,
                     plain)


def _row(k, n, name, scheme, dtype, w, xt, ref, ours, rtn, t_ours, plain=None):
    import jax.numpy as jnp
    from qformats import dequantize, quantize
    same_scale = np.array_equal(np.asarray(ours.scale_values(jnp.float32)).reshape(ref["scale"].shape),
                                ref["scale"])
    if "zero_point" in ref:
        same_scale &= np.array_equal(np.asarray(ours.zero_point, np.int32), ref["zero_point"])
    # llm-compressor's output re-quantized with our (identical) scales, as compressed-tensors compresses it
    qref = quantize(jnp.asarray(ref["q"].T, dtype), scheme, 0, scale=ours.scale,
                    zero_point=ours.zero_point, global_scale=ours.global_scale)
    roundtrip_ok = np.array_equal(np.asarray(dequantize(qref, jnp.float32)), ref["q"].T)
    codes = np.mean(np.asarray(qref.element_codes()) == np.asarray(ours.element_codes()))
    y = xt @ w.astype(np.float64)

    def err(wq):
        return float(np.sum((y - xt @ np.asarray(wq, np.float64)) ** 2) / np.sum(y ** 2))

    e_ref, e_ours = err(ref["q"].T), err(dequantize(ours, jnp.float32))
    e_rtn = err(dequantize(rtn, jnp.float32))
    extra = "" if plain is None else f" {err(dequantize(plain, jnp.float32)):.4e} |"
    flag = "" if roundtrip_ok else " (llmc output not on our grid!)"
    flag += " (llmc RTN fallback)" if bool(ref["fallback"]) else ""
    print(f"| {k}x{n} | {name}{flag} | {'yes' if same_scale else 'NO'} | {codes:.4%} | {e_ref:.4e} | "
          f"{e_ours:.4e} | {e_rtn:.4e} |{extra} {e_ours / e_ref:.4f} | {float(ref['seconds']):.2f}s | "
          f"{t_ours:.2f}s |", flush=True)


if __name__ == "__main__":
    main()
