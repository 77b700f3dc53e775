"""Byte-for-byte comparison of `qformats quantize` with llm-compressor's real `oneshot` on the same weights.

  python bench/oneshot_parity.py --oneshot-python VENV/bin/python [--layers 1] [--schemes ...]

llm-compressor pins compressed-tensors 0.19, so it lives in a separate venv (`pip install torch==2.13.0
llmcompressor`); this script runs it there in a subprocess, on a TinyLlama-shaped random bf16 checkpoint
(bench/checkpoint.py's builder), and compares every tensor of the two outputs: names, dtypes, shapes, bytes.
Prints one line per scheme; exit status 1 when any tensor differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DATA_FREE = "FP8_DYNAMIC,FP8_BLOCK,W8A8,W8A16,W4A16,W4A16_ASYM,W3A16,NVFP4A16,MXFP4A16,MXFP8A16"


def _tensors(d: Path):
    from converters.formats.safetensors_io import open_checkpoint
    with open_checkpoint(d) as ck:
        return {k: np.array(ck.get(k)) for k in ck.keys()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oneshot-python", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--schemes", default=DATA_FREE)
    a = ap.parse_args(argv)
    import checkpoint as bc  # bench/checkpoint.py
    work = Path(tempfile.mkdtemp(prefix="qformats-oneshot-"))
    src = work / "src"
    bc.build(src, a.layers)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    failed = 0
    for s in a.schemes.split(","):
        ours, theirs = work / f"q-{s}", work / f"os-{s}"
        subprocess.run([sys.executable, "-m", "converters.cli", "quantize", str(src), str(ours), "--scheme", s,
                        "--quiet"], check=True, env=dict(env, PYTHONPATH=str(ROOT)))
        subprocess.run([a.oneshot_python, "-c", bc.ONESHOT, str(src), str(theirs), s], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        x, y = _tensors(ours), _tensors(theirs)
        diff = sorted(set(x) ^ set(y))
        bad = [k for k in sorted(set(x) & set(y))
               if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes()]
        ok = not diff and not bad
        failed += not ok
        print(f"{s:12s} {'byte-identical' if ok else 'DIFFERS'}: {len(x)} tensors"
              + (f"; names only on one side: {diff[:4]}" if diff else "")
              + (f"; differing: {bad[:4]}" if bad else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
