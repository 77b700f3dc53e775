"""SmolLM2 GPTQ layer by layer: where qformats' calibrated codes and llm-compressor's `oneshot` codes part.

Both sides calibrate the same dense float32 SmolLM2 on the same token ids (`--ids`, a JSON list of lists, e.g. the
ids bench/calibrate_lm.py writes), W4A16 int4 groups of `--group`, GPTQ block 128, dampening 0.01, actorder static,
lm_head dense. llm-compressor runs in its own venv (`--llmc-python`) with `oneshot(..., batch_size=1)` (its default;
`--shuffle` for its default unseeded sample order, else its LengthAwareSampler: longest first), and this script's
torch side records, for the decoder layers in `--layers`: the input hidden states of each calibration sample (in
the order the sampler gave them, matched back by their token ids), each projection's Hessian as GPTQ receives it
(2 sum x x^T / #samples), the observer's scales (`weight_observer.get_qparams()`), the weight before GPTQ and
`quantize_weight`'s output. Our side runs `quantize_calibrated_lm` (the pipeline `qformats quantize --calibrate`
runs) with the same layers' inputs and Hessians recorded. Then, per layer:

- inputs: ||x_ours - x_theirs|| / ||x_theirs|| over the real tokens of every sample;
- Hessians: ||H_ours - H_theirs|| / ||H_theirs|| (theirs rescaled to E[x x^T]: * #samples / (2 tokens));
- scales: identical or not; codes: the fraction equal, from the two checkpoints (every layer);
- isolated: our `gptq_quantize` on *their* weight and Hessian (the modifier's inputs) against their output:
  the fraction of equal codes, so the algorithm's share is told apart from the inputs' share;
- objective (every projection): GPTQ's loss tr(dW^T H' dW) (H' the damped Hessian), each side on its own H, ours /
  theirs: a systematic difference between the two pipelines would show as a ratio away from 1 over many layers,
  where the codes themselves part by error feedback from layer 1 on.

    python bench/gptq_layerwise.py --src DIR --ids IDS.json --work DIR [--layers 0,1,2,15,29] [--shuffle]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


# ---- torch side (llm-compressor venv) ---------------------------------------------------------------------------
def torch_side(src: str, ids_file: str, out: str, layers, group: int, shuffle: bool) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import llmcompressor.modifiers.gptq.base as gbase
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    ids = json.load(open(ids_file))
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    names = {m: n for n, m in model.named_modules()}
    dump = {}
    order = []

    def embed_hook(mod, args):
        if len(order) < len(ids):
            order.append(args[0][0].tolist())
    model.model.embed_tokens.register_forward_pre_hook(embed_hook)
    seen = {i: [] for i in layers}

    def layer_hook(i):
        def hook(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if len(seen[i]) < len(ids):
                seen[i].append(x[0].detach().float().numpy().copy())
        return hook
    for i in layers:
        model.model.layers[i].register_forward_pre_hook(layer_hook(i), with_kwargs=True)

    orig_prepare, orig_quantize = gbase.prepare_batch, gbase.quantize_weight
    current = []
    errors = {}  # every module: the loss quantize_weight returns, 1/2 sum ((w - q) / d)^2

    def prepare_batch(batch, batch_qparams, hessians_by_module, num_samples_by_module):
        current[:] = [names[m] for m in batch]
        nsamp = [float(num_samples_by_module[m]) for m in batch]
        r = orig_prepare(batch, batch_qparams, hessians_by_module, num_samples_by_module)
        current.append(nsamp)
        return r

    def quantize_weight(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize=128,
                        percdamp=0.01):
        *mods, nsamp = current
        keep = [(j, n) for j, n in enumerate(mods) if int(n.split(".")[2]) in layers]
        saved = {n: (weights[j].clone(), hessians[j].clone(), scale[j].clone()) for j, n in keep}
        q, losses, fb = orig_quantize(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize,
                                      percdamp)
        for j, n in enumerate(mods):
            errors[n] = float(losses[j])
        for j, n in keep:
            w, h, s = saved[n]
            dump[n] = {"w": w.numpy(), "h": h.numpy(), "scale": s.float().numpy(), "q": q[j].float().numpy(),
                       "nsamples": nsamp[j]}
        return q, losses, fb
    gbase.prepare_batch, gbase.quantize_weight = prepare_batch, quantize_weight

    w4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                         strategy="group", group_size=group))
    recipe = GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head"], block_size=128, dampening_frac=0.01)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=512, num_calibration_samples=len(ids),
            shuffle_calibration_samples=shuffle)
    print(f"oneshot {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    model.save_pretrained(os.path.join(out, "theirs"), save_compressed=True)
    idx = {json.dumps(x): k for k, x in enumerate(ids)}
    perm = [idx[json.dumps(o)] for o in order]
    arrays = {"order": np.array(perm)}
    for i in layers:
        for k, x in zip(perm, seen[i]):
            arrays[f"x{i}_{k}"] = x
    for n, e in errors.items():
        arrays[f"{n}:error"] = np.float64(e)
    for n, d in dump.items():
        for key, v in d.items():
            arrays[f"{n}:{key}"] = np.asarray(v)
    np.savez(os.path.join(out, "theirs_dump.npz"), **arrays)


# ---- our side ---------------------------------------------------------------------------------------------------
def our_side(src: Path, text: Path, tokens: int, out: Path, layers, group: int) -> dict:
    import qformats.models.decoder.calibration as cal
    from converters.pipelines.calibrate import quantize_calibrated_lm

    import jax.numpy as jnp

    from qformats.quantize import dequantize

    inputs, hs, objective = {}, {}, {}
    orig_cd, orig_qg = cal.calibrate_decoder, cal.quantize_group
    state = {"layer": -1}

    def capture(layer, index, xs, valid, layer_inputs):
        state["layer"] = index
        if index in layers:
            inputs[index] = [(np.asarray(x), np.asarray(v)) for x, v in zip(xs, valid)]

    def calibrate_decoder(*args, **kw):
        assert kw.get("transform") is None
        kw["transform"] = capture
        return orig_cd(*args, **kw)

    def quantize_group(kernels, schemes, h, *args, **kw):
        if state["layer"] in layers and h is not None:
            hs[(state["layer"], next(iter(kernels)))] = np.asarray(h)
        got = orig_qg(kernels, schemes, h, *args, **kw)
        if h is not None:  # tr(dW^T H' dW), H' = H + 0.01 mean(diag H) I: GPTQ's objective on its damped H
            hd = np.asarray(h, np.float64)
            hd = hd + 0.01 * np.mean(np.diag(hd)) * np.eye(hd.shape[0])
            for r, (q, _) in got.items():
                dw = np.asarray(dequantize(q, jnp.float32), np.float64) - np.asarray(kernels[r], np.float64)
                objective[(state["layer"], r)] = float(np.sum(dw * (hd @ dw)))
        return got

    cal.calibrate_decoder, cal.quantize_group = calibrate_decoder, quantize_group
    try:
        info = quantize_calibrated_lm(str(src), str(out / "ours"), f"W4A16:g{group}", str(text), seq_len=512,
                                      calibration_tokens=tokens, seed=None, overwrite=True)
    finally:
        cal.calibrate_decoder, cal.quantize_group = orig_cd, orig_qg
    return {"inputs": inputs, "h": hs, "info": info, "objective": objective}


def _codes(ck, name):
    """int4 codes [out, in] of module `name` from a compressed-tensors pack-quantized checkpoint (eight per int32)."""
    p = ck.get_tensor(f"{name}.weight_packed").view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    return ((p[..., None] >> shifts) & 0xF).reshape(p.shape[0], -1).astype(np.int8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--layers", default="0,1,2,15,29")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--torch-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-theirs", action="store_true", help="reuse WORK/theirs*")
    a = ap.parse_args()
    layers = [int(x) for x in a.layers.split(",")]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.torch_side:
        torch_side(a.src, a.ids, a.work, layers, a.group, a.shuffle)
        return
    if not a.skip_theirs:
        cmd = [a.llmc_python, os.path.abspath(__file__), "--torch-side", "--src", a.src, "--ids", a.ids, "--work",
               a.work, "--layers", a.layers, "--group", str(a.group)] + (["--shuffle"] if a.shuffle else [])
        subprocess.run(cmd, check=True, env={**os.environ, "LOGURU_LEVEL": "WARNING", "OMP_WAIT_POLICY": "PASSIVE"})
    ids = json.load(open(a.ids))
    text = work / "calib.txt"
    from converters.pipelines.causal_lm import load_tokenizer
    tok = load_tokenizer(Path(a.src))
    lines = [tok.decode(x) for x in ids]
    if [tok.encode(t).ids for t in lines] != ids:
        raise SystemExit("the ids do not round-trip through the tokenizer's text: pass ids from a text file")
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokens = sum(len(x) for x in ids)
    ours = our_side(Path(a.src), text, tokens, work, layers, a.group)
    th = np.load(work / "theirs_dump.npz")

    import jax.numpy as jnp
    from safetensors import safe_open

    from qformats import QuantScheme, quantize
    from qformats.algorithms.gptq import gptq_quantize

    scheme = QuantScheme("int4", "group", group_size=a.group)
    from qformats.algorithms.sequential import pack_batches
    b = pack_batches([np.asarray(x, np.int32) for x in ids], tokens_per_batch=2048, bucket=32)  # calibrate_decoder's
    key = {json.dumps(list(x)): k for k, x in enumerate(ids)}
    where = {}  # sample -> (batch, row, first column, length)
    for bi, (bid, bseg) in enumerate(zip(b.ids, b.segments)):
        for r in range(bid.shape[0]):
            for g in range(int(bseg[r].max()) + 1):
                cols = np.flatnonzero(bseg[r] == g)
                where[key[json.dumps(bid[r, cols].tolist())]] = (bi, r, int(cols[0]), cols.size)
    nsamples = len(ids)
    o_ck = safe_open(str(work / "ours" / "model.safetensors"), "np")
    t_ck = safe_open(str(work / "theirs" / "model.safetensors"), "np")
    n_layers = sum(1 for k in t_ck.keys() if k.endswith("self_attn.q_proj.weight_packed"))
    rows = []
    for i in range(n_layers):
        mods = [f"model.layers.{i}.{p}" for p in PROJ]
        eq = [float(np.mean(_codes(o_ck, m) == _codes(t_ck, m))) for m in mods]
        same_s = all(np.array_equal(o_ck.get_tensor(f"{m}.weight_scale"), t_ck.get_tensor(f"{m}.weight_scale"))
                     for m in mods)
        cells = ["", "", "", ""]
        if i in layers:
            num = den = 0.0
            for k in range(nsamples):
                bi, r, c, n = where[k]
                xo = ours["inputs"][i][bi][0][r, c:c + n]
                xt = th[f"x{i}_{k}"]
                num += float(np.sum((xo.astype(np.float64) - xt) ** 2))
                den += float(np.sum(xt.astype(np.float64) ** 2))
            cells[0] = f"{np.sqrt(num / den):.2e}"
            hd, iso = [], []
            for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
                m = f"model.layers.{i}.{p}"
                ht = th[f"{m}:h"] * float(th[f"{m}:nsamples"]) / (2.0 * tokens)
                ho = ours["h"][(i, p.replace(".", "/"))]
                hd.append(f"{np.linalg.norm(ho - ht) / np.linalg.norm(ht):.1e}")
            for p in PROJ:
                m = f"model.layers.{i}.{p}"
                w = th[f"{m}:w"]  # [out, in]
                q = gptq_quantize(jnp.asarray(w.T), scheme, jnp.asarray(th[f"{m}:h"]), actorder="static")
                ref = quantize(jnp.asarray(th[f"{m}:q"].T), scheme, 0, scale=q.scale)
                iso.append(float(np.mean(np.asarray(q.element_codes()) == np.asarray(ref.element_codes()))))
            cells[1] = " / ".join(hd)
            cells[3] = " ".join(f"{v:.4f}" for v in iso)
        cells[2] = "yes" if same_s else "NO"
        row = (f"| {i} | {cells[0]} | {cells[1]} | {cells[2]} | {' '.join(f'{v:.4f}' for v in eq)} | {cells[3]} |")
        print(row, flush=True)
        rows.append(row)
    (work / "layerwise.md").write_text("\n".join(rows) + "\n")
    # GPTQ's objective, each side on its own H (after layer 0 the H differ as the inputs do): llm-compressor's
    # loss 1/2 sum ((w - q) / d)^2 = 1/2 tr(dW H' dW^T) (d: the diagonal of H'^-1's Cholesky factor) on its H =
    # 2 sum x x^T / #samples; ours tr(dW^T H' dW) on H = sum x x^T / tokens: scaled by tokens / #samples
    ratios, lines = [], ["", "| layer | " + " | ".join(PROJ) + " | all |", "| --- |" + " ---: |" * (len(PROJ) + 1)]
    for i in range(n_layers):
        o = [ours["objective"][(i, p.replace(".", "/"))] * tokens / nsamples for p in PROJ]
        t = [float(th[f"model.layers.{i}.{p}:error"]) for p in PROJ]
        ratios += [x / y for x, y in zip(o, t)]
        lines.append(f"| {i} | " + " | ".join(f"{x / y:.4f}" for x, y in zip(o, t)) + f" | {sum(o) / sum(t):.4f} |")
    r = np.log(np.array(ratios))
    lines += ["", f"GPTQ objective, ours / theirs over {r.size} projections: geometric mean {np.exp(r.mean()):.4f} "
                  f"(standard error of the mean log {r.std(ddof=1) / np.sqrt(r.size):.4f}), median "
                  f"{np.exp(np.median(r)):.4f}, ours above theirs in {int((r > 0).sum())}; layer 0 (the same H up to "
                  f"summation order): {' '.join(f'{x:.5f}' for x in np.exp(r[:len(PROJ)]))}"]
    print("\n".join(lines))
    with open(work / "layerwise.md", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
