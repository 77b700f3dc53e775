"""AWQ parity: `qformats.algorithms.awq` against llm-compressor 0.14's AWQModifier (+ round-to-nearest QuantizationModifier).

(a) A small random llama (transformers, float32, outlier channels in its norms, num_kv_heads = num_heads so all four
mappings apply), 8x64 random token ids on both sides. llm-compressor runs `oneshot` with [AWQModifier(n_grid=20,
duo_scaling=True), QuantizationModifier(W4A16 group)] and its smoothed float weights are dumped; here the same ids
go through `qformats.models.decoder.calibration.awq_transform` inside `calibrate_decoder` (rtn, float propagation, as their pipeline runs
this recipe; AWQ's pinning of cached batches, which a CPU-only torch cannot do, is skipped: it moves no value).
Reported per mapping: our grid point, theirs (the grid point whose scales are nearest to the scales
their weights imply), the max relative difference of the scales; per smoothed tensor: the max relative
difference; and the fraction of identical 4-bit codes (their compressed checkpoint vs ours).

The SmolLM2-135M side by side (W4A16:g64 AWQ + RTN: perplexity, time, memory against llm-compressor's oneshot on
the same tokens) is `python bench/calibrate_lm.py --recipe awq`.

    python bench/awq_parity.py [--work DIR] [--llmc-python /work/lcvenv/bin/python]
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

THEIRS = r'''
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file
from llmcompressor.pipelines.cache import IntermediatesCache
# AWQ pins its cached batches for faster host->GPU copies; a CPU-only torch cannot pin ("Cannot access accelerator
# device"): pinning moves no value, so it is skipped here
IntermediatesCache.pin_memory = lambda self, batch_index: None
src, dst, ids_file, group, dump = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
if dump != "-":  # its per-mapping grid-search summary (initial and best error), logged at DEBUG level
    from loguru import logger
    logger.add(dump + ".log", level="DEBUG", filter=lambda r: "AWQ grid search for" in r["message"],
               format="{message}")
ids = json.load(open(ids_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                          strategy="group", group_size=group))
LOSSES = []  # every grid point's loss, in order (mapping by mapping)
_loss = AWQModifier._compute_loss
AWQModifier._compute_loss = lambda self, a, b: LOSSES.append(_loss(self, a, b)) or LOSSES[-1]
recipe = [AWQModifier(n_grid=20, duo_scaling=True),
          QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]
t0 = time.perf_counter()
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=max(len(x) for x in ids),
        num_calibration_samples=len(ids), shuffle_calibration_samples=False)
t = time.perf_counter() - t0
if dump != "-":
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
               if k.startswith("model.layers.") and k.endswith("weight")}, dump)
    json.dump(LOSSES, open(dump + ".losses.json", "w"))
model.save_pretrained(dst, save_compressed=True)
print(json.dumps({"oneshot_s": t, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def _env():
    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _theirs(py, src, dst, ids_file, group, dump="-"):
    r = subprocess.run([py, "-c", THEIRS, str(src), str(dst), str(ids_file), str(group), str(dump)], env=_env(),
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"llm-compressor failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def part_a(a, work: Path) -> list:
    """Small random llama: scales, smoothed weights and codes, ours vs theirs."""
    from converters.pipelines.causal_lm import load_causal_lm
    from converters.formats.safetensors_io import open_checkpoint
    from qformats.algorithms.awq import candidate_scales, grid, weight_means
    from qformats.models.decoder.calibration import awq_transform, calibrate_decoder
    from qformats.nn import quantized_layers, resolve_scheme

    group = 32
    scheme = f"W4A16:g{group}"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from smoothquant_parity import save_outlier_llama

    save_outlier_llama(work / "src", kv_heads=4)
    ids = np.random.default_rng(0).integers(0, 512, (8, 64)).tolist()
    (work / "ids.json").write_text(json.dumps(ids))
    _theirs(a.llmc_python, work / "src", work / "theirs", work / "ids.json", group, work / "theirs_float.safetensors")

    orig, _, _ = load_causal_lm(work / "src", tokenizer=False)
    model, _, _ = load_causal_lm(work / "src", tokenizer=False)
    rec = []
    floats = {}

    def transform(layer, i, xs, valid, li):
        awq_transform(scheme, record=rec)(layer, i, xs, valid, li)
        for p in PROJ:
            a_, b_ = p.split(".")
            floats[f"model.layers.{i}.{p}.weight"] = np.asarray(getattr(getattr(layer, a_), b_).kernel.get_value()).T
        for n in ("input_layernorm", "post_attention_layernorm"):
            floats[f"model.layers.{i}.{n}.weight"] = np.asarray(getattr(layer, n).weight.get_value())

    calibrate_decoder(model, [np.asarray(x, np.int32) for x in ids], scheme, weight_search="rtn", propagate="float",
                      transform=transform)
    ws = resolve_scheme(scheme).weights
    points = grid(20, True)
    rows = [f"## bench/awq_parity.py (a) — AWQ (n_grid 20, duo scaling) + RTN {scheme}, qformats vs llm-compressor "
            f"0.14 (small random llama: 2 layers, hidden 128, 4 heads = 4 KV heads; 8x64 tokens)", "",
            "| layer | mapping | ours: grid point, initial / best error | theirs: grid point (nearest), initial / best "
            "error | our error at their point / our best | grid errors max rel. diff | scales max rel. diff |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    import re

    logged = {}
    log_file = work / "theirs_float.safetensors.log"
    for line in (log_file.read_text().splitlines() if log_file.exists() else []):
        mt = re.match(r"AWQ grid search for (\S+): initial error = (\S+), best error = (\S+),", line)
        if mt:
            logged[mt.group(1)] = (float(mt.group(2)), float(mt.group(3)))
    lf = work / "theirs_float.safetensors.losses.json"
    their_losses = json.loads(lf.read_text()) if lf.exists() else []
    with open_checkpoint(work / "theirs_float.safetensors") as th:
        for n_r, r in enumerate(rec):
            tl = np.asarray(their_losses[n_r * len(points):(n_r + 1) * len(points)])
            dl = float(np.max(np.abs(np.asarray(r["errors"]) / tl - 1))) if tl.size == len(points) else float("nan")
            i, sm, bal = r["layer"], r["smooth"], r["balances"]
            b0 = bal[0].replace("/", ".")
            o = np.asarray(getattr(getattr(orig.model.layers[i], b0.split(".")[0]), b0.split(".")[1]).kernel.get_value()).T
            t = np.asarray(th.get(f"model.layers.{i}.{b0}.weight"), np.float32)
            s_theirs = np.abs(t).max(axis=0) / np.abs(o).max(axis=0)  # W * s: column j scaled by s_j
            rel = float(np.max(np.abs(r["scales"] - s_theirs) / np.abs(s_theirs)))
            kernels = [getattr(getattr(orig.model.layers[i], b.split("/")[0]), b.split("/")[1]).kernel.get_value()
                       for b in bal]
            wm = weight_means(kernels, ws)
            near = min(points, key=lambda p: float(np.max(np.abs(candidate_scales(r["x_mean"], wm, *p) - s_theirs)
                                                          / s_theirs)))
            ti, tb = logged.get(f"model.layers.{i}.{sm.replace('/', '.')}", (float("nan"), float("nan")))
            at = r["errors"][points.index(near)] / r["best_error"]
            rows.append(f"| {i} | {sm} -> {', '.join(b.split('/')[1] for b in bal)} | r={r['ratio']:.4f} "
                        f"{'duo' if r['duo'] else 'plain'}, {r['initial_error']:.4e} / {r['best_error']:.4e} | "
                        f"r={near[0]:.4f} {'duo' if near[1] else 'plain'}, {ti:.4e} / {tb:.4e} | {at:.6f} | "
                        f"{dl:.2e} | {rel:.2e} |")
        rows += ["", "| smoothed tensor | max relative difference |", "| --- | --- |"]
        worst = 0.0
        for name, ours in floats.items():
            theirs = np.asarray(th.get(name), np.float32)
            rel = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
            worst = max(worst, rel)
            rows.append(f"| {name} | {rel:.2e} |")
    theirs_q, _, _ = load_causal_lm(work / "theirs", tokenizer=False)
    qa, qb = quantized_layers(model), quantized_layers(theirs_q)
    same = total = 0
    for p in qa:
        x, y = np.asarray(qa[p].kernel.get_value().codes), np.asarray(qb[p].kernel.get_value().codes)
        same += int(np.sum(x == y))
        total += x.size
    rows += ["", f"Largest relative difference over the smoothed tensors: {worst:.2e}; packed code words identical: "
             f"{same}/{total} ({100 * same / total:.2f}%).", ""]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llmc-python", default="/work/lcvenv/bin/python")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-awq-"))
    work.mkdir(parents=True, exist_ok=True)
    print("\n".join(part_a(a, work)))


if __name__ == "__main__":
    main()
