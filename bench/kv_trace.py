"""Where the FP8 KV-cache perplexity gaps against llm-compressor 0.14 come from: per layer, scales and cached states.

  nice python bench/kv_trace.py [--src /tmp/smollm2-dense] [--rows W4A16:g64+fp8,W4A16:g64+fp8:head] [--work DIR]

The calibration ids, the evaluation windows and both calibrations are bench/kv_w4a4_ppl.py's (16 numpy docstrings
cut to 128 tokens, one batch; pydoc_data.topics, 4 windows x 512 tokens; ours `calibrate_decoder(weight_search="rtn",
propagate="float", kv_cache=...)`, theirs `oneshot` with QuantizationModifier and kv_cache_scheme observer
`static_minmax`). For every row and layer it compares, on the first evaluation window:

  scale   our k_scale / v_scale against the live model's (relative difference, max over heads);
  formula `qformats.kv_cache.fake_quantize_kv(their states, their scale)` against what their QuantizedKVCache
          returned for them (elements that differ: 0 means the quantizer is the same function);
  codes   the fp8 codes of our uint8 cache (every layer reading the quantized cache of the layers below, as theirs)
          against the codes of their states under their scale (fraction of elements whose code differs);
  cached  our dequantized cache against the keys / values their attention read (max |a - b| / max |b|);

and the perplexity of our model: as calibrated, with their k_scale / v_scale swapped in, and with our own scales
times 1 +- 1e-6 (perturbations of the size of float32 rounding: how sensitive the fp8-cache perplexity is), next to
theirs (live). If the formula agrees exactly, the scales agree to float32 rounding and perturbations of that size
move the perplexity as much as the gap, the gap is float order, not a definition.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from torch_ppl import TORCH_PPL_SOURCE, oneshot_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

THEIRS = r'''
import json, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, windows_path, ids_path, out_dir, rows, seq_len = sys.argv[1:7]
torch.manual_seed(0)
windows = torch.from_numpy(np.load(windows_path).astype(np.int64))
ids = json.load(open(ids_path))
res = {}
for row in rows.split(","):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    base, _, kv = row.partition("+")
    name, _, g = base.partition(":g")
    scheme = preset_name_to_scheme(name, ["Linear"])
    if g:
        scheme.weights.group_size = int(g)
    kv_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False,
                               strategy="attn_head" if kv == "fp8:head" else "tensor", observer="static_minmax")
    recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], kv_cache_scheme=kv_args)
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=int(seq_len), num_calibration_samples=len(ids),
            batch_size=len(ids))
    ppl, tokens = torch_perplexity(model, windows)
    res[row] = {"ppl": ppl, "tokens": tokens}
    arrays, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        arrays[f"k_scale.{i}"] = attn.k_scale.detach().float().numpy()
        arrays[f"v_scale.{i}"] = attn.v_scale.detach().float().numpy()

        def hook(mod, args, kwargs, out, i=i):
            arrays[f"k_in.{i}"] = args[0].detach().numpy().copy()
            arrays[f"v_in.{i}"] = args[1].detach().numpy().copy()
            arrays[f"k_out.{i}"] = out[0].detach().numpy().copy()
            arrays[f"v_out.{i}"] = out[1].detach().numpy().copy()
        hooks.append(attn.kv_cache.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(windows[:1], use_cache=False)
    for h in hooks:
        h.remove()
    np.savez(f"{out_dir}/theirs-{row.replace(':', '_').replace('+', '__')}.npz", **arrays)
    print(row, res[row], file=sys.stderr, flush=True)
    json.dump(res, open(f"{out_dir}/theirs.json", "w"))
    del model
'''


def compare(src: Path, row: str, ids, windows, theirs: dict, arrays) -> list:
    """Our calibration of `row`, compared layer by layer with their arrays; returns the report lines."""
    import jax.numpy as jnp
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.evaluation.perplexity import perplexity
    from qformats.kv_cache import dequantize_kv, fake_quantize_kv, parse_kv_cache, quantize_kv
    from qformats.models.decoder import enable_kv_cache_quantization, kv_cache_scheme
    from qformats.models.decoder.calibration import calibrate_decoder

    base, _, kv = row.partition("+")
    model, _, _ = load_causal_lm(src, tokenizer=False)
    calibrate_decoder(model, [np.asarray(x, np.int32) for x in ids], base, weight_search="rtn", propagate="float",
                      kv_cache=parse_kv_cache(kv))
    ours_ppl = perplexity(model, windows)["ppl"]
    # our cache on the first window, in the quantized regime (each layer reads the fp8 keys / values of the layers
    # below, as theirs does): the uint8 codes under our scales
    w0 = jnp.asarray(windows[:1], jnp.int32)
    _, cache = nnx.jit(lambda m, x: m(x, m.init_cache(1, x.shape[1])))(model, w0)
    n = model.config.num_layers
    lines = [f"### {row}", "", "| layer | k_scale rel. diff | v_scale rel. diff | formula: elements differing (K, V) "
             "| K codes differing | V codes differing | cached K max rel. diff | cached V max rel. diff |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst = {"scale": 0.0, "formula": 0, "codes": 0.0, "cached": 0.0}
    for i in range(n):
        a = model.model.layers[i].self_attn
        ours_s = [np.asarray(a.k_scale.get_value(), np.float32), np.asarray(a.v_scale.get_value(), np.float32)]
        their_s = [arrays[f"k_scale.{i}"].reshape(ours_s[0].shape), arrays[f"v_scale.{i}"].reshape(ours_s[1].shape)]
        srel = [float(np.max(np.abs(o / t - 1))) for o, t in zip(ours_s, their_s)]
        formula, codes, cached = [], [], []
        for j, (name, ours_c) in enumerate((("k", cache.keys[i]), ("v", cache.values[i]))):
            tin, tout = arrays[f"{name}_in.{i}"], arrays[f"{name}_out.{i}"]
            fq = np.asarray(fake_quantize_kv(jnp.asarray(tin), jnp.asarray(their_s[j])))
            formula.append(int(np.sum(fq != tout)))
            tc = np.asarray(quantize_kv(jnp.asarray(tin), jnp.asarray(their_s[j])))
            oc = np.asarray(ours_c)
            codes.append(float(np.mean(oc != tc)))
            ox = np.asarray(dequantize_kv(jnp.asarray(oc), jnp.asarray(ours_s[j])))
            cached.append(float(np.max(np.abs(ox - tout)) / np.max(np.abs(tout))))
        worst["scale"] = max(worst["scale"], *srel)
        worst["formula"] += sum(formula)
        worst["codes"] = max(worst["codes"], *codes)
        worst["cached"] = max(worst["cached"], *cached)
        lines.append(f"| {i} | {srel[0]:.2e} | {srel[1]:.2e} | {formula[0]}, {formula[1]} | {codes[0]:.2e} | "
                     f"{codes[1]:.2e} | {cached[0]:.2e} | {cached[1]:.2e} |")
    scheme = kv_cache_scheme(model)
    shape = scheme.scale_shape(model.config.num_kv_heads)
    ours_scales = [(np.asarray(a.k_scale.get_value()), np.asarray(a.v_scale.get_value()))
                   for a in (layer.self_attn for layer in model.model.layers)]
    variants = {"their k_scale / v_scale": [(arrays[f"k_scale.{i}"].reshape(shape), arrays[f"v_scale.{i}"].reshape(shape))
                                            for i in range(n)]}
    for f in (1 + 1e-6, 1 - 1e-6):  # float32-rounding-sized perturbations of our own scales: the sensitivity
        variants[f"our scales x (1 {'+' if f > 1 else '-'} 1e-6)"] = [
            (np.asarray(k * np.float32(f), np.float32), np.asarray(v * np.float32(f), np.float32))
            for k, v in ours_scales]
    t = theirs[row]["ppl"]
    ppl_cells = [f"ours {ours_ppl:.4f} ({(ours_ppl / t - 1) * 100:+.3f}%)"]
    for label, scales in variants.items():
        enable_kv_cache_quantization(model, scheme, scales)
        p = perplexity(model, windows)["ppl"]
        ppl_cells.append(f"ours with {label} {p:.4f} ({(p / t - 1) * 100:+.3f}%)")
        print(row, label, p, file=sys.stderr, flush=True)
    lines += ["", f"Perplexity: {'; '.join(ppl_cells)}; theirs (live) {t:.4f}. Worst over layers: scale "
                  f"{worst['scale']:.2e}, codes differing {worst['codes']:.2e}, cached values {worst['cached']:.2e}; "
                  f"formula mismatches in total: {worst['formula']}.", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/tmp/smollm2-dense")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--rows", default="W4A16:g64+fp8,W4A16:g64+fp8:head")
    ap.add_argument("--oneshot-python", default="/work/lcvenv/bin/python")
    ap.add_argument("--work", default=None)
    ap.add_argument("--reuse", action="store_true", help="use the llm-compressor arrays already in --work")
    a = ap.parse_args(argv)

    from calibrate_lm import calibration_lines
    from llm_ppl import document_text

    from converters.pipelines.causal_lm import load_tokenizer
    from converters.evaluation.perplexity import encode_text, token_windows

    src = Path(a.src)
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-kv-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(src)
    ids = [x[:a.seq_len] for x in (tok.encode(t).ids for t in calibration_lines(8 * a.samples))
           if len(x) >= a.seq_len][:a.samples]
    (work / "ids.json").write_text(json.dumps(ids))
    windows = token_windows(encode_text(tok, document_text()), 512, a.max_windows)
    np.save(work / "windows.npy", windows)
    rows = [r for r in a.rows.split(",") if r]
    load0 = os.getloadavg()
    if not a.reuse:
        subprocess.run([a.oneshot_python, "-c", TORCH_PPL_SOURCE + THEIRS, str(src), str(work / "windows.npy"),
                        str(work / "ids.json"), str(work), ",".join(rows), str(a.seq_len)], env=oneshot_env(),
                       stdout=sys.stderr, check=True)
    theirs = json.loads((work / "theirs.json").read_text())
    lines = [f"Load average {load0[0]:.1f} at the start (bench/kv_trace.py).", ""]
    for row in rows:
        arrays = dict(np.load(work / f"theirs-{row.replace(':', '_').replace('+', '__')}.npz"))
        lines += compare(src, row, ids, windows, theirs, arrays)
        print("\n".join(lines), flush=True)
    (work / "trace.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
