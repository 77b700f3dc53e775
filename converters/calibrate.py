"""Calibrated quantization of the embedded all-MiniLM-L6-v2 to a compressed-tensors checkpoint (GPTQ / MSE).

`qformats quantize DST --scheme W4A16 --calibrate [FILE] [--weight-search mse+gptq]` lands here: the Flax MiniLM
(`qformats.models.minilm`, real weights from `converters.embedded`) runs the calibration sentences once through
`qformats.nn.quantize_model` (static activation scales, per-layer H = E[x x^T], then the weight search: GPTQ on
MSE-searched scales by default), and the packed model is written with `converters.embedded.save_checkpoint` under
the HF tensor names, next to the packaged tokenizer and sentence-transformers files. The result is an ordinary
compressed-tensors checkpoint: GPTQ changes the codes, not the format (transformers / vLLM load a W4A16 GPTQ
checkpoint like an RTN one).

A data-free checkpoint of any HF model needs no Flax model (`converters.quantize_checkpoint`); calibration
does, and this package ships one, MiniLM's.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

from converters import embedded
from converters.evaluate import resolve
from qformats.errors import CheckpointError, ModelError
from qformats.nn import Rule, quantize_model, quantized_layers
from qformats.nn.weight_search import RTN, WEIGHT_SEARCHES

__all__ = ["DEFAULT_WEIGHT_SEARCH", "quantize_calibrated"]

DEFAULT_WEIGHT_SEARCH = "mse+gptq"  # the best held-out fidelity measured (BENCHMARKS.md)


def quantize_calibrated(dst, scheme: str, *, sentences: Optional[Sequence[str]] = None,
                        weight_search: str = DEFAULT_WEIGHT_SEARCH, batch_size: int = 32, overwrite: bool = False,
                        log: Callable[[str], None] = lambda m: None) -> dict:
    """Quantize MiniLM's Linear layers (pooler included) with `scheme`, calibrated on `sentences` (default: the
    shipped set), and write the checkpoint to `dst`. Returns {"layers", "searched", "seconds", "path"}.

    weight_search: "rtn" (round-to-nearest weights; calibration still sets static activation scales),
    "mse", "gptq" or "mse+gptq" (see `qformats.nn.quantize_model`).

    Raises:
      SchemeError: unknown scheme. ModelError: the scheme does not fit a layer. CheckpointError: dst exists
        (without overwrite) or cannot be written; nothing is left half-written.
    """
    if weight_search not in WEIGHT_SEARCHES:
        raise ModelError(f"weight_search must be one of {WEIGHT_SEARCHES}, got {weight_search!r}")
    ss = resolve(scheme)
    if ss is None:
        raise ModelError("scheme 'dense' quantizes nothing; pick a preset such as W4A16")
    if Path(dst).exists() and not overwrite:  # fail before the calibration work, not after
        raise CheckpointError(f"{dst}: already exists (pass overwrite=True / --overwrite to replace it)")
    sentences = list(sentences) if sentences is not None else embedded.default_sentences()
    if not sentences:
        raise ModelError("calibration needs at least one sentence")
    t0 = time.perf_counter()
    tok = embedded.Tokenizer()
    batches = [tok(sentences[i:i + batch_size]) for i in range(0, len(sentences), batch_size)]
    model = embedded.load_minilm()
    log(f"calibrating all-MiniLM-L6-v2 on {len(sentences)} sentences ({len(batches)} batches), "
        f"{ss.name}, weights: {weight_search}")
    logger = logging.getLogger("qformats")
    handler = _LogTo(log)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rule matches every Linear; nothing to warn about here
            quantize_model(model, [Rule(".*", ss)], calibration_data=batches, weight_search=weight_search)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    layers = quantized_layers(model)
    searched = sum(1 for m in layers.values() if m.weight_method != RTN)
    log(f"quantized {len(layers)} Linear layers in {time.perf_counter() - t0:.1f} s "
        f"({searched} with {weight_search}, {len(layers) - searched} round-to-nearest)")
    embedded.save_checkpoint(model, dst, overwrite=overwrite)
    log(f"wrote {dst}")
    return {"layers": len(layers), "searched": searched, "seconds": time.perf_counter() - t0, "path": str(dst)}


class _LogTo(logging.Handler):
    """Forwards the INFO records of the `qformats` logger to a `log(str)` callable."""

    def __init__(self, fn):
        super().__init__(logging.INFO)
        self.fn = fn

    def emit(self, record):
        self.fn(record.getMessage())
