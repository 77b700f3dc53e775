"""Greedy decode throughput (tokens/s) of the library decoder (qformats.models.decoder), dense vs schemes, beside
transformers' `generate` on the same weights, all float32.

Usage: python bench/decode.py [--model smollm2-135m|tiny] [--batch 1] [--prompt 128] [--new 128] [--repeat 3]
                              [--schemes W4A16:g64,...] [--no-transformers] [--append]

Weights are random (a transformers LlamaForCausalLM initialised with seed 0, loaded into the Flax model through
`load_hf_tensors`), at the shape of SmolLM2-135M (30 layers, d=576, 9 query / 3 KV heads, SwiGLU 1536, vocab
49152, tied embeddings) or a tiny one. Schemes are quantized round-to-nearest by `quantization_rules` (lm_head
dense); `NAME:gN` sets the weight group size (128 does not divide 576). Times the whole jit `generate` (prefill +
loop of decode steps) after a warm-up call, best of N; tokens/s counts generated tokens (batch x new);
transformers' `generate(do_sample=False, min_new_tokens=new)` is timed the same way. Parameter bytes are those of
`nnx.state(model, nnx.Param)`. Prints a markdown table; --append also appends it to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

# Run from anywhere: put the repo root on sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from qformats.models.decoder import CausalLM, DecoderConfig, load_hf_tensors, quantization_rules  # noqa: E402
from qformats.models.generate import generate  # noqa: E402
from qformats.nn import param_bytes, quantize_model  # noqa: E402
from qformats.presets import presets  # noqa: E402

SCHEMES = ["W8A16:g64", "W4A16:g64", "NVFP4A16", "MXFP4A16", "FP8_DYNAMIC"]
MODELS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False),
}


def scheme_set(name: str):
    """A preset name, optionally with ':gN' (weight group size N)."""
    base, _, group = name.partition(":g")
    ss = presets[base]
    if not group:
        return ss
    return dataclasses.replace(ss, name=name, weights=dataclasses.replace(ss.weights, group_size=int(group)))


def _time(fn, repeat):
    t = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best, first, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--no-transformers", action="store_true", help="skip timing transformers' generate")
    p.add_argument("--append", action="store_true")
    args = p.parse_args(argv)

    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODELS[args.model])).eval()
    tensors = {k: v.numpy() for k, v in hf.state_dict().items()}
    cfg = DecoderConfig.from_hf(hf.config.to_dict())
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.prompt)).astype(np.int32)

    rows, ref_tokens = [], None
    for name in ["dense"] + [s for s in args.schemes.split(",") if s]:
        model = load_hf_tensors(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), tensors)
        if name != "dense":
            quantize_model(model, quantization_rules(scheme_set(name)))
        best, first, toks = _time(lambda: jax.block_until_ready(generate(model, prompt, args.new)), args.repeat)
        toks = np.asarray(toks)
        ref_tokens = toks if ref_tokens is None else ref_tokens
        rows.append((name, param_bytes(model), args.batch * args.new / best, first, float((toks == ref_tokens).mean())))
        del model

    hf_tps = None
    if not args.no_transformers:
        ids = torch.tensor(prompt, dtype=torch.long)

        def run():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                   min_new_tokens=args.new, do_sample=False, pad_token_id=0)

        best, _, out = _time(run, args.repeat)
        hf_tps = args.batch * args.new / best
        agree = float((out[:, args.prompt:].numpy() == ref_tokens).mean())
        hf_bytes = sum(t.numel() * t.element_size() for t in hf.parameters())
        rows.append((f"transformers {transformers.__version__} (torch {torch.__version__}, "
                     f"{torch.get_num_threads()} threads)", hf_bytes, hf_tps, float("nan"), agree))

    c = cfg
    dense_tps = rows[0][2]
    lines = [f"### Decode, {args.model} shape (random weights): {c.num_layers}L d{c.hidden_size} GQA "
             f"{c.num_heads}/{c.num_kv_heads} ffn{c.intermediate_size} vocab{c.vocab_size}"
             f"{' tied' if c.tie_word_embeddings else ''}, float32, batch {args.batch}, prompt {args.prompt}, "
             f"{args.new} new tokens ({platform.machine()}, {os.cpu_count()} CPUs, {jax.default_backend()}, "
             f"jax {jax.__version__})",
             "",
             "| model | param MB | tokens/s | vs our dense | vs transformers | first call s | greedy tokens = dense |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, nbytes, tps, first, agree in rows:
        vs_hf = f"{tps / hf_tps:.2f}x" if hf_tps else "-"
        first_s = "-" if first != first else f"{first:.1f}"
        lines.append(f"| {name} | {nbytes / 1e6:.1f} | {tps:.1f} | {tps / dense_tps:.2f}x | {vs_hf} | {first_s} | "
                     f"{agree:.0%} |")
    out = "\n".join(lines)
    print(out)
    if args.append:
        with open(os.path.join(_HERE, "..", "BENCHMARKS.md"), "a") as f:
            f.write("\n" + out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
