"""Calibration FLOPs on SmolLM2: llm-compressor's `oneshot` counted (FlopCounterMode), both sides from the shapes.

Runs llm-compressor 0.14's `oneshot` (its own venv, --llmc-python) for a recipe of bench/calibrate_lm.py on the
first --layers decoder layers of SmolLM2 (the same calibration token ids), under torch's `FlopCounterMode`
(every aten matmul / addmm / bmm / attention op it dispatches, counted from the operand shapes), and prints a
table beside a count from the shapes of what each pipeline does per layer:

    forward pass         2 * N * (d * (d_q + 2 d_kv + d_q) + 3 * d * d_ff)  + attention 4 * sum_s T_s^2 * d_q
    Hessians (theirs)    2 * N * sum over the 7 projections of K_p^2          (one H per Linear, from its hooks)
    Hessians (ours)      2 * N' * (d^2 + d_q^2 + d^2 + d_ff^2)               (one H per input: q/k/v, o, gate/up, down)

N = real tokens; N' = tokens including our padding (<= 12.5% more: `make_batches(max_padding=0.125)`). Both
pipelines run the forward pass twice per layer (calibration, then propagation of the quantized outputs); ours
drops down_proj's product from the calibration pass (2 * N' * d_ff * d: only the discarded output needs it). The
"from the shapes" rows are for the GPTQ recipe (--recipe gptq); the counted row is whatever the recipe runs.
The counts give the floor of each side's time on a machine of known peak GEMM speed (bench/gemm_cpu.py).

    python bench/calib_flops.py [--recipe gptq] [--layers 4] [--src DIR] [--work DIR]
        [--llmc-python /work/lcvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate_lm import THEIRS, write_calibration  # noqa: E402

sys.path.pop(0)

COUNT = r"""
import json, llmcompressor
from torch.utils.flop_counter import FlopCounterMode
_oneshot = llmcompressor.oneshot
def _counted(**kw):
    with FlopCounterMode(display=False) as m:
        out = _oneshot(**kw)
    counts = m.get_flop_counts()["Global"]
    mods = {k: int(sum(v.values())) for k, v in m.get_flop_counts().items() if k != "Global"}
    print("FLOPS " + json.dumps({"total": m.get_total_flops(), "by_op": {str(k): int(v) for k, v in counts.items()},
                                 "by_module": mods}))
    return out
llmcompressor.oneshot = _counted
"""


def shape_counts(cfg: dict, lengths, padded_tokens: int):
    """Per-layer FLOPs from the shapes (module docstring): forward, Hessians of theirs and of ours."""
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    dq, dkv, dff = heads * hd, kv * hd, cfg["intermediate_size"]
    n = sum(lengths)
    fwd = 2 * n * (d * (dq + 2 * dkv) + dq * d + 3 * d * dff) + 4 * sum(t * t for t in lengths) * dq
    theirs_h = 2 * n * (3 * d * d + dq * dq + 2 * d * d + dff * dff)
    ours_h = 2 * padded_tokens * (d * d + dq * dq + d * d + dff * dff)
    return {"forward": fwd, "hessians_theirs": theirs_h, "hessians_ours": ours_h, "down": 2 * padded_tokens * dff * d}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", choices=("gptq", "awq", "smoothquant-gptq"), default="gptq")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--src", default=None, help="a dense SmolLM2 HF directory (default: converted from the GGUF)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--llmc-python", default="/work/lcvenv/bin/python")
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    work = Path(a.work or tempfile.mkdtemp(prefix="qformats-calib-flops-"))
    work.mkdir(parents=True, exist_ok=True)
    from converters.evaluation.embedded import smollm2_gguf
    from converters.formats.gguf_convert import convert_gguf
    from qformats.algorithms.sequential import make_batches

    src = Path(a.src) if a.src else work / "smollm2-f32"
    if not src.exists():
        convert_gguf(smollm2_gguf(), src)
    cut = work / f"cut{a.layers}"  # the first --layers layers: the same files, a config that stops there
    cut.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = a.layers
    (cut / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name != "config.json" and not (cut / f.name).exists():
            (cut / f.name).symlink_to(f.resolve())
    _, ids, total = write_calibration(src, work, a.samples, a.seq_len, "ids.json")
    import numpy as np

    batches = make_batches([np.asarray(x) for x in ids], tokens_per_batch=2048, bucket=32, max_padding=0.125)
    padded = sum(b.size for b in batches.ids)
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([a.llmc_python, "-c", COUNT + THEIRS, str(cut), str(work / "out"), str(work / "ids.json"),
                        str(a.seq_len), "64", a.recipe], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"llm-compressor failed: {r.stderr[-3000:]}")
    counted = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("FLOPS "))[6:])
    per = shape_counts(cfg, [len(x) for x in ids], padded)
    g = 1e9
    theirs_model = a.layers * (2 * per["forward"] + per["hessians_theirs"])
    ours_model = a.layers * (2 * per["forward"] * padded / total - per["down"] + per["hessians_ours"])
    print(f"### Calibration FLOPs, SmolLM2 first {a.layers} layers, {a.recipe}: {len(ids)} samples, {total} tokens "
          f"({padded} with our padding)\n")
    print("| | GFLOP (the first layers) | GFLOP per layer |\n| --- | ---: | ---: |")
    head = counted["by_module"].get("Linear", 0)  # the lm_head (a bare Linear at the top): run in both passes
    print(f"| llm-compressor oneshot, counted (FlopCounterMode) | {counted['total'] / g:.1f} | "
          f"{counted['total'] / g / a.layers:.1f} |")
    print(f"| of which lm_head (counted; run by both passes of the last subgraph) | {head / g:.1f} | — |")
    print(f"| of which the decoder layers (counted) | {(counted['total'] - head) / g:.1f} | "
          f"{(counted['total'] - head) / g / a.layers:.1f} |")
    if a.recipe == "gptq":
        print(f"| llm-compressor, from the shapes: 2 forward passes + 7 Hessians | {theirs_model / g:.1f} | "
              f"{theirs_model / g / a.layers:.1f} |")
        print(f"| qformats, from the shapes: 2 forward passes (less down_proj's product in the first) + 4 "
              f"Hessians, padded batches | {ours_model / g:.1f} | {ours_model / g / a.layers:.1f} |")
    print("\ncounted by op (GFLOP): " + ", ".join(f"{k} {v / g:.1f}" for k, v in
                                                 sorted(counted["by_op"].items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
