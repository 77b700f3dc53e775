"""Calibrated quantization of the embedded all-MiniLM-L6-v2 to a compressed-tensors checkpoint (GPTQ / MSE).

`qformats quantize DST --scheme W4A16 --calibrate [FILE] [--weight-search mse+gptq]` lands here: the Flax MiniLM
(`examples.minilm`, real weights) runs the calibration sentences once through `qformats.nn.quantize_model`
(static activation scales, per-layer H = E[x x^T], then the weight search: GPTQ on MSE-searched scales
by default), and the packed model is written with `converters.flax_io.save_compressed` under the HF
tensor names, next to the packaged tokenizer and sentence-transformers files. The result is an ordinary compressed-tensors checkpoint:
GPTQ changes the codes, not the format (transformers / vLLM load a W4A16 GPTQ checkpoint like an RTN one).

A data-free checkpoint of any HF model needs no Flax model (`converters.quantize_checkpoint`); calibration
does, and this package ships one, MiniLM's.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

SEARCHES = ("rtn", "mse", "gptq", "mse+gptq")  # "rtn" + qformats.nn's weight searches (a test keeps them equal)


def quantize_calibrated(dst, scheme: str, *, sentences: Optional[Sequence[str]] = None, weight_search: str = "mse+gptq",
                        batch_size: int = 32, overwrite: bool = False,
                        log: Callable[[str], None] = lambda m: None) -> dict:
    """Quantize MiniLM's Linear layers (pooler included) with `scheme`, calibrated on `sentences` (default: the
    shipped set), and write the checkpoint to `dst`. Returns {"layers", "searched", "seconds", "path"}.

    weight_search: "rtn" (round-to-nearest weights; calibration still sets static activation scales),
    "mse", "gptq" or "mse+gptq" (see `qformats.nn.quantize_model`).

    Raises:
      SchemeError: unknown scheme. ModelError: the scheme does not fit a layer. CheckpointError: dst exists
        (without overwrite) or cannot be written; nothing is left half-written.
    """
    from examples import eval as ev
    from examples import minilm
    from qformats.errors import ModelError
    from qformats.nn import Rule, quantize_model, quantized_layers

    if weight_search not in SEARCHES:
        raise ModelError(f"weight_search must be one of {SEARCHES}, got {weight_search!r}")
    ss = ev.resolve(scheme)
    if ss is None:
        raise ModelError("scheme 'dense' quantizes nothing; pick a preset such as W4A16")
    if Path(dst).exists() and not overwrite:  # fail before the calibration work, not after
        from qformats.errors import CheckpointError
        raise CheckpointError(f"{dst}: already exists (pass overwrite=True / --overwrite to replace it)")
    sentences = list(sentences) if sentences is not None else minilm.default_sentences()
    if not sentences:
        raise ModelError("calibration needs at least one sentence")
    t0 = time.perf_counter()
    tok = minilm.Tokenizer()
    batches = [tok(sentences[i:i + batch_size]) for i in range(0, len(sentences), batch_size)]
    model = minilm.load_minilm()
    log(f"calibrating all-MiniLM-L6-v2 on {len(sentences)} sentences ({len(batches)} batches), "
        f"{ss.name}, weights: {weight_search}")
    search = None if weight_search == "rtn" else weight_search
    logger = logging.getLogger("qformats")
    handler = _LogTo(log)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rule matches every Linear; nothing to warn about here
            quantize_model(model, [Rule(".*", ss)], calibration_data=batches, weight_search=search)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    layers = quantized_layers(model)
    searched = sum(1 for m in layers.values() if m.weight_method != "rtn")
    log(f"quantized {len(layers)} Linear layers in {time.perf_counter() - t0:.1f} s "
        f"({searched} with {weight_search}, {len(layers) - searched} round-to-nearest)")
    ev.save_checkpoint(model, dst, overwrite=overwrite)
    log(f"wrote {dst}")
    return {"layers": len(layers), "searched": searched, "seconds": time.perf_counter() - t0, "path": str(dst)}


class _LogTo(logging.Handler):
    def __init__(self, fn):
        super().__init__(logging.INFO)
        self.fn = fn

    def emit(self, record):
        self.fn(record.getMessage())
