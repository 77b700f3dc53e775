"""`qformats eval`: fidelity of quantized all-MiniLM-L6-v2 (Flax NNX) against torch sentence-transformers.

For each scheme, every Linear of the Flax MiniLM (pooler included) is quantized with `qformats.nn`
(round-to-nearest; with --calibrated also the MSE clipping search and GPTQ), the sentences are embedded, and
the mean / min cosine against the torch fp32 sentence-transformers embeddings is reported with the
bytes of the Linear weights. Without torch the reference is the dense JAX model (and it says so).

Scheme names are presets (`qformats.presets`), "dense", or a preset with the suffix ":w" for its weight
scheme alone (e.g. "FP8_BLOCK:w": block-quantized weights, float activations) and/or ":gN" for weight groups
of N columns (e.g. "W4A16:g64"; `qformats.presets.parse_scheme`). Positional SRC arguments
are compressed-tensors checkpoints of the model (read by `converters`), evaluated the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
from flax import nnx

from converters.evaluation import embedded
from qformats import SchemeSet
from qformats.presets import parse_scheme
from qformats.errors import QFormatsError
from qformats.models import minilm
from qformats.nn import QLinear, Rule, quantize_model
from qformats.algorithms.weight_search import RTN, WEIGHT_SEARCHES

__all__ = ["DEFAULT_SCHEMES", "SEARCHES", "resolve", "linear_weight_bytes", "cosines", "evaluate_one", "evaluate",
           "evaluate_checkpoint", "format_table", "build_parser", "main"]

# The weight-only table `qformats eval` prints by default: dense, then 8 bits down to 4 (BENCHMARKS.md, "Embedding
# fidelity (MiniLM held out)").
DEFAULT_SCHEMES = ("dense", "W8A16", "FP8_E4M3", "FP8_BLOCK:w", "MXFP8A16", "FP6_E2M3", "FP6_E3M2", "FP5_E2M2",
                   "NVFP4A16", "MXFP4A16", "W4A16_ASYM", "W4A16")

# The calibrated weight searches --search takes: qformats.nn's WEIGHT_SEARCHES except round-to-nearest,
# which every scheme is reported with anyway.
SEARCHES = tuple(s for s in WEIGHT_SEARCHES if s != RTN)


def resolve(name: str) -> Optional[SchemeSet]:
    """Scheme string → SchemeSet (None for "dense"): `qformats.presets.parse_scheme` ("NAME", "NAME:w" for the
    weights alone, "NAME:gN" for weight groups of N, combinable).

    Raises:
      SchemeError: an unknown preset or suffix (see parse_scheme).
    """
    if name.strip().lower() == "dense":
        return None
    return parse_scheme(name)


def linear_weight_bytes(model: nnx.Module) -> int:
    """Σ bytes of every Linear kernel (packed QArray storage for quantized ones), biases excluded."""
    total = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, QLinear):
            total += m.weight_nbytes
        elif isinstance(m, nnx.Linear):
            total += int(m.kernel.get_value().nbytes)
    return total


def cosines(emb: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity in float64: cos_i = <a_i, b_i> / (‖a_i‖ ‖b_i‖)."""
    a, b = np.asarray(emb, np.float64), np.asarray(ref, np.float64)
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _metrics(model, sentences, reference, tokenizer, batch_size) -> dict:
    cos = cosines(minilm.encode_sentences(model, tokenizer, sentences, batch_size), reference)
    return {"mean_cos": float(cos.mean()), "min_cos": float(cos.min()), "bytes": linear_weight_bytes(model)}


def evaluate_one(name: str, sentences: Sequence[str], reference: np.ndarray, *, tokenizer=None,
                 calibration=None, weight_search: str = RTN, batch_size: int = 32,
                 dampening_frac: float = embedded.GPTQ_DAMPENING) -> dict:
    """One scheme on a fresh MiniLM → {"mean_cos", "min_cos", "bytes"} against `reference` embeddings
    (mean / min over sentences of the cosine, Σ bytes of the Linear weights).

    `calibration` (tokenized batches) gives static activation scales and the weight search its inputs'
    moments; `weight_search` is one of qformats.nn's WEIGHT_SEARCHES (default "rtn": round-to-nearest);
    `dampening_frac`: GPTQ's (default `embedded.GPTQ_DAMPENING`).
    """
    tok = tokenizer or embedded.Tokenizer()
    ss = resolve(name)
    model = embedded.load_minilm()
    if ss is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # static activation schemes without data run dynamic (documented)
            quantize_model(model, [Rule(".*", ss)], calibration_data=calibration, weight_search=weight_search,
                           dampening_frac=dampening_frac)
    return _metrics(model, sentences, reference, tok, batch_size)


def evaluate(schemes: Sequence[str], sentences: Sequence[str], *, calibrated: bool = False,
             reference: Optional[np.ndarray] = None, batch_size: int = 32, log=None,
             calibration_sentences: Optional[Sequence[str]] = None,
             searches: Sequence[str] = ("mse", "gptq")) -> Dict[str, dict]:
    """scheme (and "scheme+mse", "scheme+gptq" when calibrated) → {"mean_cos", "min_cos", "bytes"} vs
    `reference` (default: torch sentence-transformers, else the dense JAX model).

    Calibrated variants, one per weight search in `searches` ("mse": clipping search weighted by the
    layer inputs' second moments; "gptq": GPTQ with H = E[x x^T]; "mse+gptq"), with static activation
    scales, calibrated on `calibration_sentences` (default: the evaluation sentences themselves, which
    overstates the gain: pass a disjoint set for a quality figure, e.g. `embedded.heldout_sentences`; see
    BENCHMARKS.md, "Embedding fidelity (MiniLM held out)"), batched without padding rows
    (`embedded.calibration_batches`). quantize_model keeps a search only where it beats round-to-nearest on the
    calibration batches (`compare_rtn`).
    """
    tok = embedded.Tokenizer()
    if reference is None:
        reference = embedded.torch_reference_embeddings(sentences, batch_size=batch_size)
        if reference is None:
            if log:
                log("torch / sentence-transformers not installed: reference = dense JAX model")
            reference = minilm.encode_sentences(embedded.load_minilm(), tok, sentences, batch_size)
    calib = None
    if calibrated:
        cs = list(calibration_sentences) if calibration_sentences else list(sentences)
        calib = embedded.calibration_batches(tok, cs, batch_size)  # no padding rows in H
    results: Dict[str, dict] = {}
    variants = [(s, RTN) for s in schemes]
    if calibrated:
        variants += [(s, w) for w in searches for s in schemes if s.lower() != "dense"]
    for name, search in variants:
        t0 = time.perf_counter()
        key = name if search == RTN else f"{name}+{search}"
        results[key] = evaluate_one(name, sentences, reference, tokenizer=tok,
                                    calibration=None if search == RTN else calib, weight_search=search,
                                    batch_size=batch_size)
        if log:
            log(f"  {key}: {time.perf_counter() - t0:.1f}s")
    return results


def evaluate_checkpoint(src, sentences, reference, *, batch_size: int = 32) -> dict:
    """A compressed-tensors checkpoint of the model (`embedded.load_checkpoint`) → {"mean_cos", "min_cos",
    "bytes"} vs `reference`."""
    model = embedded.load_checkpoint(src)
    return _metrics(model, sentences, reference, embedded.Tokenizer(), batch_size)


def format_table(results: Dict[str, dict], reference_name: str) -> str:
    """The text table of `qformats eval`: scheme, mean/min cosine, weight MB, dense bytes / bytes."""
    dense = results.get("dense", {}).get("bytes")
    lines = [f"reference: {reference_name}",
             f"{'scheme':<20} {'mean_cos':>9} {'min_cos':>9} {'weight MB':>10} {'vs dense':>9}"]
    for k, r in results.items():
        ratio = f"{dense / r['bytes']:.2f}x" if dense else ""
        lines.append(f"{k:<20} {r['mean_cos']:9.5f} {r['min_cos']:9.5f} {r['bytes'] / 1e6:10.3f} {ratio:>9}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `qformats eval` for the MiniLM embedding fidelity."""
    p = argparse.ArgumentParser(prog="qformats eval", description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="*", help="compressed-tensors checkpoints of all-MiniLM-L6-v2 to evaluate too "
                                          "(e.g. written by `qformats quantize`)")
    p.add_argument("--sentences", help="text file, one sentence a line (default: the shipped set)")
    p.add_argument("--schemes", default=None,
                   help="comma-separated: dense, preset names, NAME:w for weights only, NAME:gN for weight groups of N (default: the weight-only "
                        f"table {', '.join(DEFAULT_SCHEMES)}; with SRC given: dense)")
    p.add_argument("--json", action="store_true", help="print one JSON object scheme → metrics")
    p.add_argument("--calibrated", action="store_true",
                   help="also report each scheme calibrated on the sentences: static activation scales and "
                        "each weight search of --search")
    p.add_argument("--search", default="mse,gptq",
                   help=f"comma-separated weight searches for --calibrated: {', '.join(SEARCHES)} (default: mse,gptq)")
    p.add_argument("--calibration", metavar="FILE",
                   help="sentences to calibrate on for --calibrated (default: the evaluation sentences)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per jit call (default 32)")
    return p


def _read_lines(flag: str, name: str) -> Optional[List[str]]:
    path = Path(name)
    if not path.is_file():
        print(f"qformats eval: {flag} {path}: no such file", file=sys.stderr)
        return None
    lines = [s.strip() for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]
    if not lines:
        print(f"qformats eval: {flag} {path}: the file holds no sentences", file=sys.stderr)
        return None
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    """`qformats eval [SRC ...] [options]`; returns the exit status (0 ok, 2 usage, 1 failure)."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    sentences = _read_lines("--sentences", args.sentences) if args.sentences else embedded.default_sentences()
    calibration = _read_lines("--calibration", args.calibration) if args.calibration else None
    if sentences is None or (args.calibration and calibration is None):
        return 2
    if args.schemes is None:
        args.schemes = "dense" if args.src else ",".join(DEFAULT_SCHEMES)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    for src in args.src:
        if not Path(src).exists():
            print(f"qformats eval: {src}: no such checkpoint", file=sys.stderr)
            return 2
    try:
        for s in schemes:
            resolve(s)
    except QFormatsError as e:
        print(f"qformats eval: {e}", file=sys.stderr)
        return 2
    searches = [w.strip() for w in args.search.split(",") if w.strip()]
    if not searches or any(w not in SEARCHES for w in searches):
        print(f"qformats eval: --search {args.search!r}: expected a comma-separated list of {', '.join(SEARCHES)}",
              file=sys.stderr)
        return 2
    ref = embedded.torch_reference_embeddings(sentences, batch_size=args.batch_size)
    ref_name = f"torch sentence-transformers fp32 ({len(sentences)} sentences)"
    if ref is None:
        ref_name = f"dense JAX model ({len(sentences)} sentences) — torch not installed"
        print("qformats eval: torch / sentence-transformers not installed; the reference is the dense JAX "
              "model", file=sys.stderr)
        ref = minilm.encode_sentences(embedded.load_minilm(), embedded.Tokenizer(), sentences, args.batch_size)
    results = evaluate(schemes, sentences, calibrated=args.calibrated, reference=ref, batch_size=args.batch_size,
                       log=None if args.json else (lambda m: print(m, file=sys.stderr)),
                       calibration_sentences=calibration, searches=searches)
    for src in args.src:
        try:
            results[str(src)] = evaluate_checkpoint(src, sentences, ref, batch_size=args.batch_size)
        except QFormatsError as e:
            print(f"qformats eval: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(results, indent=None, sort_keys=False))
    else:
        print(format_table(results, ref_name))
    return 0
