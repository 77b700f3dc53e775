"""Calibrated GPTQ of a tiny Qwen3-MoE against llm-compressor 0.14: time, peak RSS and the codes' agreement.

Both sides quantize the same dense checkpoint (`bench/gptq_llmc_moe_fixture.py`'s tiny Qwen3-MoE: 2 sparse layers,
8 experts of 32, top-2) with W4A16 int4 groups of 32, GPTQ block 128, dampening 0.01, actorder static, every expert
calibrated on every token (llm-compressor's `moe_calibrate_all_experts=True`, ours `moe_statistics="all"`), on the
same token ids. Each side runs in its own process (wall time and peak RSS of that process, imports and compilations
included): llm-compressor's `oneshot` in its venv, ours `load_causal_lm` + `calibrate_decoder`. The table gives the
fraction of int4 codes equal per projection kind and layer (scales are equal: round-to-nearest's).

    python bench/moe_calibration.py [--samples varied|single] [--llmc-python /work/oneshot/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gptq_llmc_moe_fixture as gen  # noqa: E402

OURS = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[4])
import gptq_llmc_moe_fixture as gen
sys.path.insert(0, sys.argv[5])
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[5]) / "tests" / "qformats" / "models" / "decoder"))
from test_moe_gptq_llmc import ours_codes
samples = np.split(np.load(sys.argv[2]), np.cumsum(np.load(sys.argv[3]))[:-1])
ours = ours_codes(gen, sys.argv[1], samples)
np.savez(sys.argv[6], **{k + ".codes": v[0] for k, v in ours.items()})
"""


def _run(cmd, env, cwd):
    """(wall seconds, peak RSS MiB) of a child process run to completion (os.wait4's rusage)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    if status:
        sys.stderr.write(err.decode(errors="replace")[-3000:])
        raise SystemExit(f"{cmd[0]} failed")
    return time.perf_counter() - t, ru.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--samples", choices=("varied", "single"), default="varied")
    a = ap.parse_args()
    tensors = gen.tiny_qwen3_moe()
    samples = gen.tiny_samples(a.samples)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        src = gen.write_checkpoint(d / "tiny", tensors)
        (d / "ids.json").write_text(json.dumps([s.tolist() for s in samples]))
        np.save(d / "ids.npy", np.concatenate(samples))
        np.save(d / "lengths.npy", np.array([len(s) for s in samples]))
        env = {**os.environ, "LOGURU_LEVEL": "WARNING", "PYTHONPATH": ""}
        t_l, rss_l = _run([a.llmc_python, "-c", gen.THEIRS, str(src), str(d / "ids.json"), str(d / "theirs.npz"),
                           str(gen.GROUP)], env, d)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        t_o, rss_o = _run([sys.executable, "-c", OURS, str(src), str(d / "ids.npy"), str(d / "lengths.npy"),
                           str(ROOT / "bench"), str(ROOT), str(d / "ours.npz")], env, d)
        theirs, ours = dict(np.load(d / "theirs.npz")), dict(np.load(d / "ours.npz"))
    rows = {}
    for name in gen.modules():
        layer = name.split(".")[2]
        kind = name.rsplit(".", 1)[1] if ".experts." in name else name.split(".", 3)[3]
        kind = ("experts " if ".experts." in name else "") + kind
        eq = float(np.mean(ours[name + ".codes"] == theirs[name + ".codes"]))
        rows.setdefault((layer, kind), []).append(eq)
    tokens = sum(len(s) for s in samples)
    print(f"tiny Qwen3-MoE (2 layers, 8 experts of 32, top-2), {len(samples)} samples / {tokens} tokens "
          f"({a.samples}), W4A16 g{gen.GROUP} GPTQ, every expert on every token")
    print("| | wall s | peak RSS MiB | ratio (time) |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| llm-compressor 0.14 oneshot | {t_l:.1f} | {rss_l:.0f} | 1.00x |")
    print(f"| ours calibrate_decoder | {t_o:.1f} | {rss_o:.0f} | {t_o / t_l:.2f}x |")
    print()
    print("| layer | projection | codes equal to llm-compressor's (min / mean over modules) |")
    print("| --- | --- | ---: |")
    for (layer, kind), v in rows.items():
        print(f"| {layer} | {kind} | {min(v):.4f} / {np.mean(v):.4f} |")
    allv = [x for v in rows.values() for x in v]
    print(f"| all | all {len(allv)} | {min(allv):.4f} / {np.mean(allv):.4f} |")


if __name__ == "__main__":
    main()
