"""SmolLM2-135M perplexity with an FP8 KV cache and with NVFP4 W4A4: qformats vs llm-compressor 0.14's live model.

  flock /tmp/qformats-bench.lock python bench/kv_w4a4_ppl.py [--src /tmp/smollm2-dense] [--samples 32]
      [--seq-len 128] [--max-windows 4] [--rows W4A16:g64,W4A16:g64+fp8,...] [--oneshot-python /work/lcvenv/bin/python]

Rows: a weight scheme, optionally "+fp8" (static KV-cache scale per tensor) or "+fp8:head" (per KV head): by default
W4A16:g64, NVFP4A16 (each without KV-cache quantization, per tensor and per head) and NVFP4 (W4A4: NVFP4 weights and
activations, static per-tensor input global scale calibrated from data, dynamic local fp8 group scales).

Model: the dense float32 SmolLM2-135M-Instruct HF directory (bench/llm_ppl.py converts it from the embedded GGUF).
Calibration: the first --samples docstrings of numpy's public callables (bench/calibrate_lm.py's
`calibration_lines`) that have at least --seq-len tokens, each cut to exactly --seq-len, the same token ids on both
sides, in one batch (llm-compressor's batch_size = all samples: no padding, whose positions its observers would
count). Evaluation: bench/llm_ppl.py's protocol (pydoc_data.topics,
non-overlapping windows of 512 tokens, the first --max-windows, each run alone, float32).

Ours: `qformats.models.decoder.calibration.calibrate_decoder(weight_search="rtn", propagate="float", kv_cache=...)` on
those samples (llm-compressor's QuantizationModifier order: every pass in float, input ranges of each projection
and KV ranges observed on the float model; fused q/k/v and gate/up NVFP4 weight global scales shared), written
with `converters.pipelines.causal_lm.save_causal_lm`, reloaded with `load_causal_lm` and evaluated with
`converters.evaluation.perplexity` (the KV quantization runs inside attention, fp8 codes dequantized).

Theirs (a subprocess in the llm-compressor venv): transformers' float32 model, `oneshot` with
QuantizationModifier(config_groups={preset scheme}, ignore=["lm_head"], kv_cache_scheme=FP8 args) on the
pre-tokenized calibration ids, then the *live* model's logits on the same windows. Not the reloaded checkpoint:
transformers does not simulate the KV-cache quantization on reload (a kv_cache_scheme checkpoint gives the ppl of
the same model without it). The KV args carry observer "static_minmax" (max |x| over every calibration token,
what qformats computes); llm-compressor's own default for kv_cache_scheme is the moving-average "minmax"
(averaging constant 0.01 over shuffled samples), which is not reproducible across sample orders; --their-kv-observer
minmax measures it instead.

Also printed: the bytes of a KV cache for 1 sequence of 2048 tokens (float32, bfloat16, fp8 static, fp8 dynamic).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch_ppl import TORCH_PPL_SOURCE, oneshot_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ROWS = "W4A16:g64,W4A16:g64+fp8,W4A16:g64+fp8:head,NVFP4A16,NVFP4A16+fp8,NVFP4A16+fp8:head,NVFP4"

THEIRS = r'''
import json, math, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, windows_path, ids_path, out_path, rows, seq_len, observer = sys.argv[1:8]
torch.manual_seed(0)
windows = torch.from_numpy(np.load(windows_path).astype(np.int64))
ids = json.load(open(ids_path))
out = {}
for row in rows.split(","):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    base, _, kv = row.partition("+")
    name, _, g = base.partition(":g")
    scheme = preset_name_to_scheme(name, ["Linear"])
    if g:
        scheme.weights.group_size = int(g)
    kv_args = None
    if kv:
        kv_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False,
                                   strategy="attn_head" if kv == "fp8:head" else "tensor", observer=observer)
    recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], kv_cache_scheme=kv_args)
    if kv or scheme.input_activations is not None:
        ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
        oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=int(seq_len), num_calibration_samples=len(ids),
                batch_size=len(ids))
    else:
        oneshot(model=model, recipe=recipe)
    ppl, tokens = torch_perplexity(model, windows)
    out[row] = {"ppl": ppl, "tokens": tokens}
    print(row, out[row], file=sys.stderr, flush=True)
    json.dump(out, open(out_path, "w"))
'''


def cache_bytes(src: Path, length: int = 2048) -> dict:
    """`KVCache.nbytes` of an empty cache for one sequence of `length` tokens of the model at `src`: float32,
    bfloat16, fp8 static (uint8 codes), fp8 dynamic (codes + a float32 scale per position)."""
    import jax.numpy as jnp
    from flax import nnx

    from qformats.kv_cache import KVCacheScheme
    from qformats.models.decoder import CausalLM, DecoderConfig, enable_kv_cache_quantization

    cfg = DecoderConfig.from_hf(json.loads((src / "config.json").read_text()))
    out = {}
    for name, dtype, kv in (("float32", jnp.float32, None), ("bfloat16", jnp.bfloat16, None),
                            ("fp8 static", jnp.float32, KVCacheScheme("tensor")),
                            ("fp8 dynamic", jnp.float32, KVCacheScheme("tensor", dynamic=True))):
        m = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
        if kv is not None:
            one = jnp.ones(kv.scale_shape(cfg.num_kv_heads), jnp.float32)
            enable_kv_cache_quantization(m, kv, None if kv.dynamic else [(one, one)] * cfg.num_layers)
        out[name] = m.init_cache(1, length, dtype=None if kv is not None else dtype).nbytes
    return out


def ours(src: Path, row: str, ids, windows, work: Path) -> dict:
    """Calibrate (rtn, float propagation), save, reload, perplexity."""
    from converters.pipelines.causal_lm import load_causal_lm, save_causal_lm
    from converters.evaluation.perplexity import perplexity
    from qformats.kv_cache import parse_kv_cache
    from qformats.models.decoder.calibration import calibrate_decoder
    from qformats.nn import param_bytes

    base, _, kv = row.partition("+")
    t0 = time.perf_counter()
    model, hf, _ = load_causal_lm(src, tokenizer=False)
    calibrate_decoder(model, [np.asarray(x, np.int32) for x in ids], base, weight_search="rtn", propagate="float",
                      kv_cache=parse_kv_cache(kv) if kv else None)
    dst = work / row.replace(":", "_").replace("+", "__")
    if dst.exists():
        shutil.rmtree(dst)
    save_causal_lm(model, dst, hf, ignore=[] if model.lm_head is None else ["lm_head"])
    del model
    again, _, _ = load_causal_lm(dst, tokenizer=False)
    r = perplexity(again, windows)
    return {"ppl": r["ppl"], "tokens": r["tokens"], "bytes": param_bytes(again), "s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/tmp/smollm2-dense")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--oneshot-python", default="/work/lcvenv/bin/python", help="'' for our side only")
    ap.add_argument("--their-kv-observer", default="static_minmax", choices=("static_minmax", "minmax"))
    ap.add_argument("--work", default=None)
    a = ap.parse_args(argv)

    from calibrate_lm import calibration_lines
    from llm_ppl import document_text

    from converters.pipelines.causal_lm import load_tokenizer
    from converters.evaluation.perplexity import encode_text, token_windows

    src = Path(a.src)
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-kv-w4a4-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(src)
    # samples of exactly seq_len tokens, all in one batch on both sides: no padding for llm-compressor's observers
    # to see (they observe every position of a padded batch) and one calibration pass per layer
    ids = [x[:a.seq_len] for x in (tok.encode(t).ids for t in calibration_lines(8 * a.samples))
           if len(x) >= a.seq_len][:a.samples]
    if len(ids) < a.samples:
        raise SystemExit(f"only {len(ids)} calibration docstrings have {a.seq_len} tokens")
    (work / "ids.json").write_text(json.dumps(ids))
    windows = token_windows(encode_text(tok, document_text()), 512, a.max_windows)
    np.save(work / "windows.npy", windows)
    rows = [r for r in a.rows.split(",") if r]
    load0 = os.getloadavg()
    print(f"calibration: {len(ids)} samples, {sum(map(len, ids))} tokens; windows {windows.shape}; load {load0}",
          file=sys.stderr)

    proc, theirs_out = None, work / "theirs.json"
    if a.oneshot_python:
        env = oneshot_env()
        proc = subprocess.Popen([a.oneshot_python, "-c", TORCH_PPL_SOURCE + THEIRS, str(src), str(work / "windows.npy"),
                                 str(work / "ids.json"), str(theirs_out), ",".join(rows), str(a.seq_len),
                                 a.their_kv_observer], env=env, stdout=sys.stderr)
    from converters.evaluation.perplexity import perplexity
    from converters.pipelines.causal_lm import load_causal_lm

    dense, _, _ = load_causal_lm(src, tokenizer=False)
    got = {"dense": {"ppl": perplexity(dense, windows)["ppl"]}}
    del dense
    print("dense", got["dense"], file=sys.stderr, flush=True)
    for row in rows:
        got[row] = ours(src, row, ids, windows, work)
        print(row, got[row], file=sys.stderr, flush=True)
    theirs = {}
    if proc is not None:
        if proc.wait() != 0:
            print(f"llm-compressor side failed (exit {proc.returncode})", file=sys.stderr)
        if theirs_out.exists():
            theirs = json.loads(theirs_out.read_text())
    load1 = os.getloadavg()
    cb = cache_bytes(src)

    lines = [f"Calibration: {len(ids)} numpy docstrings, {sum(map(len, ids))} tokens (cut at {a.seq_len}), the same "
             f"ids on both sides; perplexity on pydoc_data.topics, {windows.shape[0]} windows x 512 tokens, float32; "
             f"dense {got['dense']['ppl']:.4f}. llm-compressor KV observer: {a.their_kv_observer}. Load average "
             f"{load0[0]:.1f} before, {load1[0]:.1f} after.", "",
             "| scheme | KV cache | param MB (ours) | ppl qformats (saved, reloaded) | ppl llm-compressor 0.14 "
             "(live model after oneshot) | difference |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        base, _, kv = row.partition("+")
        o, t = got[row], theirs.get(row)
        kvd = {"": "bf16/f32 (none)", "fp8": "fp8, per tensor", "fp8:head": "fp8, per head"}[kv]
        tp = "-" if t is None else f"{t['ppl']:.4f}"
        d = "-" if t is None else f"{(o['ppl'] / t['ppl'] - 1) * 100:+.3f}%"
        lines.append(f"| {base} | {kvd} | {o['bytes'] / 1e6:.1f} | {o['ppl']:.4f} | {tp} | {d} |")
    lines += ["", "KV cache of one 2048-token sequence (30 layers, 3 KV heads x 64): "
              + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in cb.items())
              + f" (fp8 / bf16 = {cb['fp8 static'] / cb['bfloat16']:.3f}, fp8 / f32 = "
                f"{cb['fp8 static'] / cb['float32']:.3f}).", ""]
    print("\n".join(lines))
    (work / "table.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
