"""`qformats eval`: fidelity of quantized all-MiniLM-L6-v2 (Flax NNX) against torch sentence-transformers.

For each scheme, every Linear of the Flax MiniLM (pooler included) is quantized with `qformats.nn`
(round-to-nearest; with --calibrated also the MSE clipping search and GPTQ), the sentences are embedded, and
the mean / min cosine against the torch fp32 sentence-transformers embeddings is reported with the
bytes of the Linear weights. Without torch the reference is the dense JAX model (and it says so).

Scheme names are presets (`qformats.presets`), "dense", or a preset with the suffix ":w" for its weight
scheme alone (e.g. "FP8_BLOCK:w": block-quantized weights, float activations). Positional SRC arguments
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

# Weight-only schemes matching the reference table, in its order.
DEFAULT_SCHEMES = ("dense", "W8A16", "FP8_E4M3", "FP8_BLOCK:w", "MXFP8A16", "FP6_E2M3", "FP6_E3M2", "FP5_E2M2",
                   "NVFP4A16", "MXFP4A16", "W4A16_ASYM", "W4A16")


def resolve(name: str):
    """Scheme name → SchemeSet (None for "dense"); "NAME:w" keeps only the preset's weight scheme."""
    from qformats import SchemeSet, presets

    if name.lower() == "dense":
        return None
    base, _, suffix = name.partition(":")
    ss = presets[base]
    if suffix:
        if suffix.lower() != "w":
            raise ValueError(f"scheme {name!r}: the only suffix is ':w' (weights only), got {suffix!r}")
        return SchemeSet(f"{ss.name}:w", weights=ss.weights)
    return ss


def linear_weight_bytes(model) -> int:
    """Bytes of every Linear kernel (packed QArray storage for quantized ones), biases excluded."""
    from flax import nnx

    from qformats.nn import QLinear

    total = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, QLinear):
            total += m.weight_nbytes
        elif isinstance(m, nnx.Linear):
            total += int(m.kernel.get_value().nbytes)
    return total


def _cosines(emb: np.ndarray, ref: np.ndarray) -> np.ndarray:
    a, b = np.asarray(emb, np.float64), np.asarray(ref, np.float64)
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def evaluate_one(name: str, sentences: Sequence[str], reference: np.ndarray, *, tokenizer=None,
                 calibration=None, weight_search: Optional[str] = None, batch_size: int = 32) -> dict:
    """One scheme on a fresh MiniLM → {"mean_cos", "min_cos", "bytes"} against `reference` embeddings.

    `calibration` (tokenized batches) gives static activation scales and the MSE search its H = E[x x^T].
    """
    from examples import minilm
    from qformats.nn import Rule, quantize_model

    tok = tokenizer or minilm.Tokenizer()
    ss = resolve(name)
    model = minilm.load_minilm()
    if ss is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # static activation schemes without data run dynamic (documented)
            quantize_model(model, [Rule(".*", ss)], calibration_data=calibration, weight_search=weight_search)
    cos = _cosines(minilm.encode_sentences(model, tok, sentences, batch_size), reference)
    return {"mean_cos": float(cos.mean()), "min_cos": float(cos.min()), "bytes": linear_weight_bytes(model)}


def evaluate(schemes: Sequence[str], sentences: Sequence[str], *, calibrated: bool = False,
             reference: Optional[np.ndarray] = None, batch_size: int = 32, log=None,
             calibration_sentences: Optional[Sequence[str]] = None,
             searches: Sequence[str] = ("mse", "gptq")) -> Dict[str, dict]:
    """scheme (and "scheme+mse", "scheme+gptq" when calibrated) → {"mean_cos", "min_cos", "bytes"} vs
    `reference` (default: torch sentence-transformers, else the dense JAX model).

    Calibrated variants, one per weight search in `searches` ("mse": clipping search weighted by the
    layer inputs' second moments; "gptq": GPTQ with H = E[x x^T]; "mse+gptq"), with static activation
    scales, calibrated on `calibration_sentences` (default: the evaluation sentences themselves; a
    held-out half gives the same gains, see the tests' notes). quantize_model keeps a search only where
    it beats round-to-nearest on the calibration batches (`compare_rtn`).
    """
    from examples import minilm

    tok = minilm.Tokenizer()
    if reference is None:
        reference = minilm.torch_reference_embeddings(sentences, batch_size=batch_size)
        if reference is None:
            if log:
                log("torch / sentence-transformers not installed: reference = dense JAX model")
            reference = minilm.encode_sentences(minilm.load_minilm(), tok, sentences, batch_size)
    calib = None
    if calibrated:
        cs = list(calibration_sentences) if calibration_sentences else list(sentences)
        calib = [tok(cs[i:i + batch_size]) for i in range(0, len(cs), batch_size)]
    results: Dict[str, dict] = {}
    variants = [(s, None) for s in schemes]
    if calibrated:
        variants += [(s, w) for w in searches for s in schemes if s.lower() != "dense"]
    for name, search in variants:
        t0 = time.perf_counter()
        key = name if search is None else f"{name}+{search}"
        results[key] = evaluate_one(name, sentences, reference, tokenizer=tok,
                                    calibration=calib if search else None, weight_search=search,
                                    batch_size=batch_size)
        if log:
            log(f"  {key}: {time.perf_counter() - t0:.1f}s")
    return results


def load_checkpoint(src) -> "object":
    """The Flax MiniLM with the tensors of a compressed-tensors (or dense) checkpoint of all-MiniLM-L6-v2.

    `converters.flax_io.load_compressed` with MiniLM's name table (`minilm.torch_to_flax`): quantized Linear
    weights become packed QLinear layers, dense tensors overwrite the packaged weights, unknown tensors raise
    CheckpointError.
    """
    from converters.flax_io import load_compressed
    from examples import minilm

    model = minilm.load_minilm()
    return load_compressed(src, model, minilm.torch_to_flax(model.config, with_pooler=True),
                           ignore=minilm.IGNORED_TENSORS)


def save_checkpoint(model, dst, *, overwrite: bool = False):
    """Write a (quantized) Flax MiniLM as a compressed-tensors checkpoint under HF tensor names
    (`converters.flax_io.save_compressed`; the packaged config.json gets the quantization_config and the
    tokenizer files are copied)."""
    from converters.flax_io import save_compressed
    from examples import minilm

    table = minilm.torch_to_flax(model.config, with_pooler=model.pooler is not None)
    return save_compressed(model, dst, table, copy_from=minilm.model_dir(), overwrite=overwrite)


def evaluate_checkpoint(src, sentences, reference, *, batch_size: int = 32) -> dict:
    """A compressed-tensors checkpoint of the model → {"mean_cos", "min_cos", "bytes"} vs `reference`."""
    from examples import minilm

    model = load_checkpoint(src)
    cos = _cosines(minilm.encode_sentences(model, minilm.Tokenizer(), sentences, batch_size), reference)
    return {"mean_cos": float(cos.mean()), "min_cos": float(cos.min()), "bytes": linear_weight_bytes(model)}


def format_table(results: Dict[str, dict], reference_name: str) -> str:
    dense = results.get("dense", {}).get("bytes")
    lines = [f"reference: {reference_name}",
             f"{'scheme':<20} {'mean_cos':>9} {'min_cos':>9} {'weight MB':>10} {'vs dense':>9}"]
    for k, r in results.items():
        ratio = f"{dense / r['bytes']:.2f}x" if dense else ""
        lines.append(f"{k:<20} {r['mean_cos']:9.5f} {r['min_cos']:9.5f} {r['bytes'] / 1e6:10.3f} {ratio:>9}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="qformats eval", description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="*", help="compressed-tensors checkpoints of all-MiniLM-L6-v2 to evaluate too "
                                          "(e.g. written by `qformats quantize`)")
    p.add_argument("--sentences", help="text file, one sentence a line (default: the shipped set)")
    p.add_argument("--schemes", default=None,
                   help="comma-separated: dense, preset names, NAME:w for weights only (default: the issue's "
                        "weight-only table; with SRC given: dense)")
    p.add_argument("--json", action="store_true", help="print one JSON object scheme → metrics")
    p.add_argument("--calibrated", action="store_true",
                   help="also report each scheme calibrated on the sentences: static activation scales and "
                        "each weight search of --search")
    p.add_argument("--search", default="mse,gptq",
                   help="comma-separated weight searches for --calibrated: mse, gptq, mse+gptq (default: mse,gptq)")
    p.add_argument("--calibration", metavar="FILE",
                   help="sentences to calibrate on for --calibrated (default: the evaluation sentences)")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from examples import minilm
    from qformats.errors import QFormatsError

    def read_lines(flag, name):
        path = Path(name)
        if not path.is_file():
            print(f"qformats eval: {flag} {path}: no such file", file=sys.stderr)
            return None
        lines = [s.strip() for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]
        if not lines:
            print(f"qformats eval: {flag} {path}: the file holds no sentences", file=sys.stderr)
            return None
        return lines

    sentences = read_lines("--sentences", args.sentences) if args.sentences else minilm.default_sentences()
    calibration = read_lines("--calibration", args.calibration) if args.calibration else None
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
    except (QFormatsError, ValueError) as e:
        print(f"qformats eval: {e}", file=sys.stderr)
        return 2
    searches = [w.strip() for w in args.search.split(",") if w.strip()]
    from examples.calibrate import SEARCHES
    bad = [w for w in searches if w not in SEARCHES or w == "rtn"]
    if bad or not searches:
        print(f"qformats eval: --search {args.search!r}: expected a comma-separated list of mse, gptq, mse+gptq",
              file=sys.stderr)
        return 2
    ref = minilm.torch_reference_embeddings(sentences, batch_size=args.batch_size)
    ref_name = f"torch sentence-transformers fp32 ({len(sentences)} sentences)"
    if ref is None:
        ref_name = f"dense JAX model ({len(sentences)} sentences) — torch not installed"
        print("qformats eval: torch / sentence-transformers not installed; the reference is the dense JAX "
              "model", file=sys.stderr)
        ref = minilm.encode_sentences(minilm.load_minilm(), minilm.Tokenizer(), sentences, args.batch_size)
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


if __name__ == "__main__":
    sys.exit(main())
